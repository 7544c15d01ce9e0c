"""`python -m spd_lightning.tiny_target`: the build (tokenizer, model, pretraining), its budget, its report and the
HF directory it writes."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import time
from collections.abc import Sequence

import torch

from ..errors import UserError
from .model import ARCHS, tiny_model
from .pretrain import heldout_blocks_of, heldout_loss, pretrain, split_conversations, torch_threads, training_batches
from .tokenizer import TinyTargetError, train_chat_tokenizer

DESCRIPTION = "Build the embedded default target: a tiny Qwen3.5-architecture chat model, entirely offline"
REPORT_FILE = "tiny_target.json"
# The default budget: the demo's target. About 4 minutes on the 2-core dev box when idle (356 steps took 4.0 min
# there, docs/BENCHMARKS.md); a step count, not minutes, so that every machine builds the same target.
DEFAULT_STEPS = 360
# What the build report records and `rebuild_command` repeats, in the order of `build_tiny_target`'s arguments.
SETTINGS = ("arch", "minutes", "seed", "max_steps", "hidden_size", "num_layers", "vocab_size", "seq_len", "batch_size",
            "lr", "max_conversations", "threads")  # fmt: skip
log = logging.getLogger(__name__)


def resolve_budget(minutes: float | None, max_steps: int | None) -> tuple[float | None, int | None]:
    """(minutes, max_steps): a step count by default (the same target on every machine); a wall-clock budget only
    when asked for, alone (the schedule then follows the clock) or as a cap on the steps."""
    if (minutes is not None and minutes <= 0) or (max_steps is not None and max_steps < 1):
        raise TinyTargetError(f"minutes={minutes}, max_steps={max_steps}: the budget must be positive")
    if minutes is None and max_steps is None:
        max_steps = DEFAULT_STEPS
    return minutes, max_steps


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


def budget_text(minutes: float | None, max_steps: int | None) -> str:
    parts = [f"{max_steps} steps"] if max_steps else []
    return " / ".join(parts + ([f"{minutes:g} min"] if minutes else []))


def rebuild_command(out_dir: str, settings: dict) -> str:
    flags = "".join(f" --{key.replace('_', '-')} {value}" for key, value in settings.items() if value is not None)
    return f"python -m spd_lightning.tiny_target --out {shlex.quote(out_dir)}{flags}"


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m spd_lightning.tiny_target", description=DESCRIPTION)
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
