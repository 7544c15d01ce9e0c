"""Shared fixtures: tiny in-process targets (no network, random weights, fixed seeds), built from `kit`."""

import json
import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("SPD_NCCL_RULES", "1")  # every transport the decoder builds holds to NCCL's rules (nccl_rules.py)
# One thread, in this process and every process a test starts: the models here are tiny, and OpenMP's threads only
# contend for the cores (six training test files took 107 s with torch's default of a thread per core, 29 s with one,
# on a busy 2-core machine).
os.environ["OMP_NUM_THREADS"] = "1"

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
from kit import chat_records, loss_target, make_tiny_model, saved_random_drafter
from torch._dynamo.utils import counters

from spd_lightning.target import Target
from spd_lightning.training import attention
from spd_lightning.training.module import set_recompile_limit

torch.set_num_threads(1)  # in case torch was imported before the variable above was set (a plugin)
# dynamo's recompile limit in a fresh process: a compiled decode step (`CompiledStep`) raises it process-wide, so a
# test that runs after one in the same process (a pytest-xdist worker) starts from this, as `fit` would.
FRESH_RECOMPILE_LIMIT = torch._dynamo.config.recompile_limit


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


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> str:
    """The tiny Qwen3.5 saved as an HF checkpoint directory (weights and config, no tokenizer)."""
    path = str(tmp_path_factory.mktemp("targets") / "tiny_qwen35")
    make_tiny_model("qwen3_5").save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def drafter_dir(tmp_path_factory) -> str:
    """The directory of a random n = 2 drafter for the saved tiny Qwen3.5 (the decoders and servers under test
    only read it: one copy for the session)."""
    return saved_random_drafter(tmp_path_factory)


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory) -> dict:
    """A saved tiny Qwen3.5 target with its own 300-id chat tokenizer, a local jsonl of 48 chats, a data cache."""
    from spd_lightning.tiny_target import train_chat_tokenizer

    root = tmp_path_factory.mktemp("resume")
    records = chat_records(48)
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenizer = train_chat_tokenizer(
        (t["value"] for r in records for t in r["conversations"]), vocab_size=300, show_progress=False
    )
    target = root / "target"
    make_tiny_model("qwen3_5", vocab_size=len(tokenizer)).save_pretrained(target)
    tokenizer.save_pretrained(target)
    return {"target": str(target), "data": str(data), "cache": str(root / "cache")}


@pytest.fixture(scope="session")
def loss_target_dir(tmp_path_factory) -> str:
    """The saved tiny Qwen3 that `kit.loss_batch` runs through (tests/test_loss.py computes its loss by hand)."""
    return loss_target(str(tmp_path_factory.mktemp("loss_target")))


@pytest.fixture
def limited_dynamo():
    """Dynamo reset, with the recompile limit `fit` sets (an error when hit); the old settings restored after."""
    limit, fail = torch._dynamo.config.recompile_limit, torch._dynamo.config.fail_on_recompile_limit_hit
    torch._dynamo.reset()
    counters.clear()
    torch._dynamo.config.recompile_limit = FRESH_RECOMPILE_LIMIT
    set_recompile_limit()
    yield
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit, torch._dynamo.config.fail_on_recompile_limit_hit = limit, fail


@pytest.fixture
def aot_eager_flex(monkeypatch, limited_dynamo):
    """Compiled flex with its backward on the CPU: `aot_eager` stands in for inductor (whose CPU flex template cannot
    compile every variant) and torch's refusal of flex's backward on the CPU (a device check in front of the same
    math the aot_eager graph runs) is lifted."""
    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)
    compiled = {
        "mask": torch.compile(flex_module.create_block_mask, dynamic=True, backend="aot_eager"),
        "flex": torch.compile(flex_module.flex_attention, dynamic=True, backend="aot_eager"),
    }
    monkeypatch.setattr(attention, "_COMPILED", compiled)  # what `compiled_flex` compiles, on another backend
