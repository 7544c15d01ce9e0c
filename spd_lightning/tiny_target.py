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
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shlex
import shutil
import sys
import time
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from .data.formats import normalize_conversation
from .data.sharegpt import load_embedded_sharegpt
from .errors import UserError

ENDOFTEXT, IM_START, IM_END, THINK, END_THINK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"
REPORT_FILE = "tiny_target.json"
WARMUP_FRACTION = 0.05
# The default budget: the demo's target. About 4 minutes on the 2-core dev box when idle (356 steps took 4.0 min
# there, docs/BENCHMARKS.md); a step count, not minutes, so that every machine builds the same target.
DEFAULT_STEPS = 360
# What the build report records and `rebuild_command` repeats, in the order of `build_tiny_target`'s arguments.
SETTINGS = ("arch", "minutes", "seed", "max_steps", "hidden_size", "num_layers", "vocab_size", "seq_len", "batch_size",
            "lr", "max_conversations", "threads")  # fmt: skip
log = logging.getLogger(__name__)
ARCHS = ("qwen3_5", "qwen3")


class TinyTargetError(UserError):
    """Impossible tiny-target settings; the one-line message names the value and the fix."""


# Qwen2's pre-tokenizer split: contractions, letter runs (with one leading symbol), single digits,
# punctuation runs, newline runs, spaces.
QWEN_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen3's template without tool calls: replies after the last user query show their think block (empty
# when there is no reasoning), earlier replies do not; `enable_thinking=False` pre-fills an empty block.
QWEN3_CHAT_TEMPLATE = """\
{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1, found=false) %}
{%- for message in messages[::-1] %}
    {%- if not ns.found and message.role == 'user' %}
        {%- set ns.found = true %}{%- set ns.last_query_index = messages|length - 1 - loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning_content = message.reasoning_content if message.reasoning_content is string else '' %}
        {%- if not reasoning_content and '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""


# -- tokenizer -------------------------------------------------------------------------------------
def train_chat_tokenizer(texts: Iterable[str], vocab_size: int = 4096, show_progress: bool = True):
    """A byte-level BPE chat tokenizer with Qwen's special tokens and template, as a `PreTrainedTokenizerFast`."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    special = [ENDOFTEXT, IM_START, IM_END]
    thinking = [THINK, END_THINK]
    if vocab_size < 256 + len(special) + len(thinking):
        raise TinyTargetError(
            f"vocab_size={vocab_size}: a byte-level BPE needs at least 261 ids (256 bytes + 5 chat tokens)"
        )
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(thinking),
        min_frequency=2,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    backend.train_from_iterator(texts, trainer)
    # Like Qwen3, the think markers are single tokens but not special: decoding keeps them.
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in thinking])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        chat_template=QWEN3_CHAT_TEMPLATE,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )


# -- model -----------------------------------------------------------------------------------------
def tiny_model_config(
    arch: str, vocab_size: int, hidden_size: int, num_layers: int, eos_token_id: int, pad_token_id: int
):
    """A Qwen3.5 (hybrid: 3 Gated DeltaNet layers per full-attention layer) or dense Qwen3 config."""
    from transformers import Qwen3_5TextConfig, Qwen3Config

    if arch not in ARCHS:
        raise TinyTargetError(f"arch={arch!r}: use one of {ARCHS}")
    if hidden_size < 16 or hidden_size % 8:
        raise TinyTargetError(f"hidden_size={hidden_size}: use a multiple of 8, at least 16")
    head_dim = 32 if hidden_size >= 128 else 8
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=(hidden_size * 12 // 5) // 8 * 8,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
    )
    if arch == "qwen3":
        return Qwen3Config(**common)
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]
    if "full_attention" not in layer_types:
        layer_types[-1] = "full_attention"  # a hybrid target must exercise both cache kinds
    return Qwen3_5TextConfig(
        **common,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=layer_types,
    )


def tiny_model(tokenizer, arch: str, hidden_size: int, num_layers: int, seed: int):
    """A freshly initialized (from `seed`) causal LM for `tokenizer`, ending generation at `<|im_end|>`."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    eos_id, pad_id = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        tiny_model_config(arch, len(tokenizer), hidden_size, num_layers, eos_id, pad_id)
    )
    model.config.eos_token_id, model.config.pad_token_id = eos_id, pad_id
    model.generation_config = GenerationConfig(eos_token_id=[eos_id, pad_id], pad_token_id=pad_id, do_sample=False)
    return model


# -- data ------------------------------------------------------------------------------------------
def sharegpt_conversations(max_conversations: int | None) -> list[list[dict[str, str]]]:
    records = load_embedded_sharegpt(max_conversations)
    conversations = [
        normalize_conversation(r["conversations"], "conversations", f"ShareGPT record {i}")
        for i, r in enumerate(records)
    ]
    return [c for c in conversations if c]


def token_blocks(tokenizer, conversations: Sequence[list[dict[str, str]]], block: int) -> Iterator[list[int]]:
    """Rendered conversations, each followed by `<|endoftext|>`, packed into `block`-token pieces, in order."""
    separator = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    pending: list[int] = []
    for start in range(0, len(conversations), 64):
        texts = [
            tokenizer.apply_chat_template(c, tokenize=False, enable_thinking=False)
            for c in conversations[start : start + 64]
        ]
        for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            pending.extend(ids)
            pending.append(separator)
            while len(pending) >= block:
                yield pending[:block]
                pending = pending[block:]


def training_batches(tokenizer, conversations, block: int, batch_size: int) -> Iterator[torch.Tensor]:
    """Endless `[batch_size, block]` batches: the conversations in order, again and again."""
    rows: list[list[int]] = []
    while True:
        pieces = 0
        for piece in token_blocks(tokenizer, conversations, block):
            pieces += 1
            rows.append(piece)
            if len(rows) == batch_size:
                yield torch.tensor(rows)
                rows = []
        if pieces == 0:
            raise TinyTargetError(
                f"the training conversations hold fewer than seq_len={block} tokens: lower seq_len "
                f"or read more conversations"
            )


@torch.no_grad()
def heldout_loss(model, blocks: torch.Tensor, batch_size: int) -> float:
    model.eval()
    losses = [model(input_ids=chunk, labels=chunk).loss.item() for chunk in blocks.split(batch_size)]
    model.train()
    return float(np.mean(losses))


def save_target_dir(model, tokenizer, report: dict, out_dir: str) -> None:
    """Write the HF directory next to `out_dir` and swap it in, so a reader never sees a half-written target."""
    staging, previous = out_dir.rstrip("/") + ".partial", out_dir.rstrip("/") + ".previous"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    with open(os.path.join(staging, REPORT_FILE), "w") as f:
        json.dump(report, f, indent=2)
    if os.path.exists(out_dir):
        shutil.rmtree(previous, ignore_errors=True)
        os.replace(out_dir, previous)
    os.replace(staging, out_dir)
    shutil.rmtree(previous, ignore_errors=True)


# -- the build -------------------------------------------------------------------------------------
def resolve_budget(minutes: float | None, max_steps: int | None) -> tuple[float | None, int | None]:
    """(minutes, max_steps): a step count by default (the same target on every machine); a wall-clock budget only
    when asked for, alone (the schedule then follows the clock) or as a cap on the steps."""
    if (minutes is not None and minutes <= 0) or (max_steps is not None and max_steps < 1):
        raise TinyTargetError(f"minutes={minutes}, max_steps={max_steps}: the budget must be positive")
    if minutes is None and max_steps is None:
        max_steps = DEFAULT_STEPS
    return minutes, max_steps


@contextlib.contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """torch's CPU threads set to `count` for the build, restored afterwards (None: torch's choice)."""
    previous = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def pretrain(
    model, batches: Iterator[torch.Tensor], lr: float, minutes: float | None, max_steps: int | None
) -> tuple[int, int, float]:
    """AdamW with warmup over the first 5% of the budget, then cosine decay to 10% of `lr`; returns (steps, tokens
    seen, minutes). The schedule follows budget fractions (steps when given, else the clock), because a wall-clock
    budget fixes no step count."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    budget_s = minutes * 60.0 if minutes is not None else math.inf
    model.train()
    step, tokens_seen, started = 0, 0, time.time()
    progress = tqdm(total=max_steps, desc="tiny_target", unit="step")
    for batch in batches:
        elapsed = time.time() - started
        done = step / max_steps if max_steps else elapsed / budget_s
        if done >= 1.0 or elapsed >= budget_s:
            break
        warm = min(1.0, max(done, 0.01) / WARMUP_FRACTION)
        for group in optimizer.param_groups:
            group["lr"] = lr * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * done)))
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += batch.numel()
        progress.update(1)
        progress.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tokens_seen / (time.time() - started):.0f}")
    progress.close()
    if max_steps and step < max_steps:
        log.warning("the %g-minute cap stopped training at step %d of %d", minutes, step, max_steps)
    return step, tokens_seen, (time.time() - started) / 60.0


def split_conversations(max_conversations: int | None, heldout_conversations: int, seed: int):
    """(train, held-out) ShareGPT conversations, shuffled by `seed`."""
    conversations = sharegpt_conversations(max_conversations)
    if len(conversations) < 2:
        raise TinyTargetError(f"only {len(conversations)} usable ShareGPT conversations: raise max_conversations")
    order = np.random.default_rng(seed).permutation(len(conversations))
    heldout_count = min(heldout_conversations, len(conversations) // 5 or 1)
    return [conversations[i] for i in order[heldout_count:]], [conversations[i] for i in order[:heldout_count]]


def build_tiny_target(
    out_dir: str,
    arch: str = "qwen3_5",
    minutes: float | None = None,
    seed: int = 0,
    max_steps: int | None = None,
    hidden_size: int = 160,
    num_layers: int = 8,
    vocab_size: int = 4096,
    seq_len: int = 256,
    batch_size: int = 8,
    lr: float = 2e-3,
    max_conversations: int | None = None,
    tokenizer_conversations: int = 3000,
    heldout_conversations: int = 64,
    heldout_blocks: int = 32,
    num_threads: int | None = None,
) -> dict:
    """Train the tokenizer and the model, save both to `out_dir`, return (and write) the build report. Budget: see
    `resolve_budget`. `num_threads` sets torch's CPU threads for the build: the same seed, step count and thread
    count give the same weights; on a machine shared with other jobs, fewer threads than cores avoids the
    oversubscription that makes every step several times slower."""
    minutes, max_steps = resolve_budget(minutes, max_steps)
    values = (arch, minutes, seed, max_steps, hidden_size, num_layers, vocab_size, seq_len, batch_size, lr)
    settings = dict(zip(SETTINGS, (*values, max_conversations, num_threads)))
    with torch_threads(num_threads):
        started = time.time()
        train, heldout = split_conversations(max_conversations, heldout_conversations, seed)
        tokenizer = train_chat_tokenizer((m["content"] for c in train[:tokenizer_conversations] for m in c), vocab_size)
        heldout_tensor = heldout_blocks_of(tokenizer, heldout, seq_len, heldout_blocks)
        model = tiny_model(tokenizer, arch, hidden_size, num_layers, seed)
        budget = budget_text(minutes, max_steps)
        log.info(f"{type(model).__name__}, {model.num_parameters() / 1e6:.2f}M parameters; budget {budget}")
        batches = training_batches(tokenizer, train, seq_len, batch_size)
        steps, tokens_seen, train_minutes = pretrain(model, batches, lr, minutes, max_steps)
        report = {
            **settings, "model_class": type(model).__name__, "params": model.num_parameters(), "steps": steps,
            "tokens_seen": tokens_seen, "train_minutes": round(train_minutes, 3),
            "total_minutes": round((time.time() - started) / 60.0, 3),
            "heldout_loss": round(heldout_loss(model, heldout_tensor, batch_size), 4),
            "heldout_tokens": int(heldout_tensor.numel()), "conversations": len(train) + len(heldout),
            "torch_threads": torch.get_num_threads(), "rebuild_command": rebuild_command(out_dir, settings),
        }  # fmt: skip
    save_target_dir(model, tokenizer, report, out_dir)
    log.info(
        f"{steps} steps, {tokens_seen:,} tokens in {train_minutes:.2f} min; held-out loss "
        f"{report['heldout_loss']:.4f} over {report['heldout_tokens']:,} tokens; saved to {out_dir}"
    )
    return report


def heldout_blocks_of(tokenizer, heldout: list, seq_len: int, count: int) -> torch.Tensor:
    """The first `count` `seq_len`-token blocks of the held-out conversations."""
    rows = list(token_blocks(tokenizer, heldout, seq_len))[:count]
    if not rows:
        raise TinyTargetError(f"the {len(heldout)} held-out conversations give no {seq_len}-token block: lower seq_len")
    return torch.tensor(rows)


def budget_text(minutes: float | None, max_steps: int | None) -> str:
    parts = [f"{max_steps} steps"] if max_steps else []
    return " / ".join(parts + ([f"{minutes:g} min"] if minutes else []))


def rebuild_command(out_dir: str, settings: dict) -> str:
    flags = "".join(f" --{key.replace('_', '-')} {value}" for key, value in settings.items() if value is not None)
    return f"python -m spd_lightning.tiny_target --out {shlex.quote(out_dir)}{flags}"


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m spd_lightning.tiny_target", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", dest="out_dir", required=True, help="output directory (a Hugging Face model directory)"
    )
    parser.add_argument("--arch", choices=ARCHS, default="qwen3_5")
    parser.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="wall-clock budget: alone, the schedule follows the clock (the result depends on the "
        "machine); with --max-steps, a cap",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help=f"exact step count (default {DEFAULT_STEPS} when --minutes is not given): the same "
        f"target on every machine for the same seed and --threads",
    )
    parser.add_argument("--hidden-size", type=int, default=160)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--max-conversations", type=int, default=None, help="read only the first N ShareGPT records")
    parser.add_argument(
        "--threads", dest="num_threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="tiny_target: %(message)s")
    try:
        return build_tiny_target(**vars(args))  # every option is a parameter of the same name
    except UserError as e:
        parser.exit(e.exit_code, f"error: {e}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
