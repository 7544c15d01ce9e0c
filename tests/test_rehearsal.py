"""Rehearse every shipped config on CPU, as a user runs it: `python -m spd_lightning fit --config configs/X.yaml`.

The target is a random-init model of the config's REAL architecture (`spd_lightning/archs/*.json`: layer count,
hybrid layer pattern, head counts and dims, vocabulary, rope settings) at hidden size 32, saved as an HF directory
with a small chat tokenizer. Everything the config sets about the drafter runs as shipped (anchors, n, L_s, V_d,
layout, schedule, lr schedule, checkpointing, callbacks); only what a CPU cannot afford is overridden on the command
line: the accelerator, precision and device count, the target's dtype (float32: a bfloat16 depthwise conv1d, the
Gated DeltaNet layers' short convolution, takes about 30 ms on this CPU against 0.3 in float32, which made the
bfloat16 run 45 s against 19; tests/test_checkpointing.py fits a bfloat16 target), the data (a few short local
chats, padded to 16 instead of 128 tokens: T = 32), batch size, loader workers, logger, and the step / validation /
checkpoint intervals and the staircase callback's sizes (2 steps, one 4-token decode). Two training steps, a
validation, `export`, and a simulator decode of the exported drafter that must equal autoregressive decoding. A
config that cannot run fails here.

The 9B config (hybrid Gated DeltaNet target) runs in the default suite; the 4B and 8B ones, ~30 s and ~15 s on
the shared 2-core machine, under `-m slow`.
"""

import json
import os

import pytest
import torch
from kit import REPO

from spd_lightning import cli
from spd_lightning.archs import load_arch, random_target

# the shipped staircase callback, on one held-out prompt of 8 tokens (it runs at the end of every fit)
STAIRCASE_AT_THE_END = (
    "[{class_path: callbacks.StaircaseEvaluation, init_args: {every_n_steps: 2000, num_prompts: 1, max_new_tokens: 4}}]"
)
CONFIG_ARCHS = {"qwen35_9b.yaml": "qwen3.5-9b", "qwen35_4b.yaml": "qwen3.5-4b", "qwen3_8b.yaml": "qwen3-8b"}


@pytest.fixture(scope="module")
def chat_tokenizer():
    from spd_lightning.tiny_target import sharegpt_conversations, train_chat_tokenizer

    return train_chat_tokenizer(
        (m["content"] for c in sharegpt_conversations(200) for m in c), vocab_size=512, show_progress=False
    )


@pytest.fixture(scope="module")
def short_chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    records = [
        {
            "messages": [
                {"role": "user", "content": f"What is {i} plus {i}?"},
                {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."},
            ]
        }
        for i in range(12)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture
def ddp_in_process():
    """The shipped `strategy: ddp` runs a one-process group in this process (single-threaded, as conftest set the
    session: Lightning's DDP takes the thread count from OMP_NUM_THREADS): it is closed afterwards, and the variables
    it exported (MASTER_PORT, ...) are restored, so later tests that start processes do not inherit a port that is
    still taken."""
    environment = dict(os.environ)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(environment)


def save_real_arch_target(arch: str, tokenizer, out_dir: str) -> str:
    """Random weights, the real architecture at hidden size 32; token ids from the small tokenizer."""
    ids = {
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "bos_token_id": None,
        "pad_token_id": tokenizer.pad_token_id,
    }
    model = random_target(arch, hidden_size=32, logit_scale=8.0, **ids)
    model.generation_config.eos_token_id, model.generation_config.bos_token_id = ids["eos_token_id"], None
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def run_main(args: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(args)
    assert exit_.value.code == 0


def shipped(config: str) -> dict:
    """The shipped config file as written."""
    return cli.read_config_file(os.path.join(REPO, "configs", config))


@pytest.mark.parametrize(
    "config",
    [
        pytest.param("qwen35_9b.yaml"),
        pytest.param("qwen35_4b.yaml", marks=pytest.mark.slow),
        pytest.param("qwen3_8b.yaml", marks=pytest.mark.slow),
    ],
)
def test_shipped_config_trains_validates_exports_and_decodes(
    config, chat_tokenizer, short_chats, tmp_path, ddp_in_process
):
    from inference import decode

    arch = CONFIG_ARCHS[config]
    target = save_real_arch_target(arch, chat_tokenizer, str(tmp_path / "target"))
    assert shipped(config)["model"]["target"] == load_arch(arch)["hub_id"]  # the architecture the config names
    ckpt_dir = tmp_path / "ckpt"
    run_main(
        [
            "fit",
            "--config",
            os.path.join(REPO, "configs", config),
            "--model.target",
            target,
            "--model.target_dtype",
            "float32",
            "--trainer.accelerator",
            "cpu",
            "--trainer.devices",
            "1",
            "--trainer.precision",
            "32-true",
            "--trainer.logger",
            "false",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.max_steps",
            "2",
            "--trainer.val_check_interval",
            "2",
            "--trainer.limit_val_batches",
            "1",
            "--trainer.num_sanity_val_steps",
            "0",
            "--trainer.default_root_dir",
            str(tmp_path),
            "--data.sources",
            f"[{{path: {short_chats}}}]",
            "--data.val_size",
            "2",
            "--data.batch_size",
            "1",
            "--data.num_workers",
            "0",
            "--data.cache_dir",
            str(tmp_path / "cache"),
            "--data.pad_to_multiple_of",
            "16",
            "--checkpoint.dirpath",
            str(ckpt_dir),
            "--checkpoint.every_n_train_steps",
            "2",
            "--trainer.callbacks",
            STAIRCASE_AT_THE_END,
        ]
    )

    ckpt = torch.load(ckpt_dir / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 2
    assert all(key.startswith("pdm.") for key in ckpt["state_dict"])  # the frozen target is never checkpointed
    spec = ckpt["spd_drafter"]
    model = shipped(config)["model"]
    assert (spec["geometry"]["n"], spec["pdm"]["num_layers"]) == (model["n"], model["num_layers"])

    drafter = cli.export(["--ckpt", str(ckpt_dir / "last.ckpt"), "--out", str(tmp_path / "drafter")])
    report = tmp_path / "decode.json"
    code = decode.main(
        [
            "--ckpt",
            drafter,
            "--target",
            target,
            "--prompt",
            "What is 3 plus 3?",
            "--simulate",
            "--max-new-tokens",
            "6",
            "--check-lossless",
            "--json",
            str(report),
        ]
    )
    assert code == 0  # 3 would mean the pipelined decode differed from autoregressive decoding
