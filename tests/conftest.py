"""Shared fixtures: tiny in-process targets (no network, random weights, fixed seeds)."""

import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from spd_lightning.target import Target

TINY_VOCAB = 97


def make_tiny_model(arch: str, num_layers: int = 4, vocab_size: int = TINY_VOCAB, hidden_size: int = 32, seed: int = 0):
    """A random-init tiny causal LM of a supported family (qwen3_5 is hybrid linear + full attention)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3_5ForCausalLM,
        Qwen3_5TextConfig,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        eos_token_id=vocab_size - 1,
        pad_token_id=0,
    )
    if arch == "qwen3_5":
        cfg = Qwen3_5TextConfig(
            **common,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            full_attention_interval=2,
        )
        model = Qwen3_5ForCausalLM(cfg)
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        raise ValueError(arch)
    # Random init gives near-uniform logits; a larger output scale makes greedy decoding non-trivial.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model.eval()


@pytest.fixture(scope="session", params=["qwen3", "qwen3_5"])
def tiny_target(request) -> Target:
    return Target(make_tiny_model(request.param), f"tiny-{request.param}")


@pytest.fixture(scope="session")
def tiny_qwen35() -> Target:
    return Target(make_tiny_model("qwen3_5"), "tiny-qwen3_5")


@pytest.fixture(scope="session")
def tiny_qwen3() -> Target:
    return Target(make_tiny_model("qwen3"), "tiny-qwen3")


@pytest.fixture(scope="session")
def micro_target(tmp_path_factory) -> str:
    """A chat target made in seconds: a 512-id BPE tokenizer with the chat template and a 4-layer Qwen3.5."""
    from spd_lightning.tiny_target import build_tiny_target

    out = str(tmp_path_factory.mktemp("micro") / "target")
    build_tiny_target(
        out,
        max_steps=1,
        hidden_size=32,
        num_layers=4,
        vocab_size=512,
        seq_len=64,
        batch_size=2,
        max_conversations=200,
        tokenizer_conversations=200,
        heldout_conversations=4,
        heldout_blocks=2,
    )
    return out


def fit_args(target: str, root, *extra: str) -> list[str]:
    """configs/tiny.yaml shrunk to seconds: 2 stages, 12 chats, a few steps, no logger."""
    return [
        "--config",
        os.path.join(REPO, "configs", "tiny.yaml"),
        "--model.target",
        target,
        "--model.n",
        "2",
        "--data.sources",
        "[{path: sharegpt, max_samples: 100}]",
        "--data.max_length",
        "1024",
        "--data.draft_vocab_size",
        "256",
        "--data.batch_size",
        "2",
        "--data.val_size",
        "4",
        "--data.cache_dir",
        str(root / "cache"),
        "--trainer.logger",
        "false",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.enable_model_summary",
        "false",
        "--trainer.default_root_dir",
        str(root),
        "--checkpoint.dirpath",
        str(root / "ckpt"),
        *extra,
    ]
