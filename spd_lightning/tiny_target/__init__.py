"""Build the embedded default target: a tiny Qwen3.5-architecture chat model, entirely offline (docs/DESIGN.md, "Real parts, offline").

    python -m spd_lightning.tiny_target --out artifacts/tiny_target [--arch qwen3_5|qwen3] [--max-steps 360]
        [--minutes M] [--threads 2] [--seed 0]

1. A byte-level BPE tokenizer (`tokenizers`, Qwen2-style pre-tokenizer, ~4k ids) is trained on ShareGPT
   text, with Qwen's chat special tokens and a Qwen3-style chat template that honours
   `enable_thinking=False` (the generation prompt then carries an empty `<think>` block).
2. A tiny causal LM (`Qwen3_5ForCausalLM`: Gated DeltaNet + full attention, 3 linear layers per full one;
   or a dense `Qwen3ForCausalLM`) is pretrained on ShareGPT conversations rendered with that template,
   packed into fixed-length blocks, for a number of steps (or a wall-clock budget).
3. The result is an ordinary Hugging Face directory: every code path loads it through the Auto classes
   exactly like Qwen3.5-9B. `tiny_target.json` next to the weights records the held-out loss, tokens
   seen, parameters, minutes, and the command that rebuilds it.

Determinism: the data order and the initialization follow `--seed`, the budget is a step count (`--max-steps`,
default 360), so the same seed and `--threads` give the same weights (CPUs with different vector units may
still round differently). `--minutes` alone schedules by the clock instead: the step count then depends on the
machine and its load (the benchmark target is built that way, docs/BENCHMARKS.md).

Files: tokenizer.py, model.py, pretrain.py, build.py (the command and its report).
"""

from __future__ import annotations

from .build import DEFAULT_STEPS, REPORT_FILE, build_tiny_target, main, resolve_budget
from .model import ARCHS, tiny_model, tiny_model_config
from .pretrain import sharegpt_conversations
from .tokenizer import TinyTargetError, train_chat_tokenizer

__all__ = [
    "ARCHS",
    "DEFAULT_STEPS",
    "REPORT_FILE",
    "TinyTargetError",
    "build_tiny_target",
    "main",
    "resolve_budget",
    "sharegpt_conversations",
    "tiny_model",
    "tiny_model_config",
    "train_chat_tokenizer",
]
