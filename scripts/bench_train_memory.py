"""Training memory on CPU: `spd_lightning.estimate` against the measured peak, and the teacher's V_d restriction.

    python scripts/bench_train_memory.py            # prints two markdown tables for docs/BENCHMARKS.md

1. Estimate vs measured: one training step (the second: AdamW's moments exist) of a random-init Qwen3.5-style
   target (hidden 128, vocab 2048, 4 layers) with an L_s=2 PDM, fp32 and bf16-mixed, dense attention, per
   layout and with or without activation checkpointing. Measured = the most bytes of tensor storages alive at once
   (`spd_lightning.training.memory_meter.LiveTensorBytes`), counting the target, the PDM and the optimizer state.
2. The teacher over V_d: extra peak bytes of turning bf16 target logits `[B, T, V]` into the fp32 restricted
   teacher of the loss positions, restricted after the upcast (before the fix) and before it (now).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from spd_lightning.estimate import Shape, estimate, target_config  # noqa: E402
from spd_lightning.testing import RandomChats  # noqa: E402 - the same random chat batches as the GPU check
from spd_lightning.training.memory_meter import LiveTensorBytes  # noqa: E402
from spd_lightning.training.module import SPDModule  # noqa: E402

MB = 1e6


class MeasureSecondStep(L.Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == 1:
            state = [t for s in trainer.optimizers[0].state.values() for t in s.values()]
            self.meter = LiveTensorBytes([*module.target.parameters(), *module.pdm.parameters(), *state]).__enter__()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == 1:
            self.meter.__exit__(None, None, None)
            self.peak = self.meter.peak


def estimate_rows(target_dir: str, length: int, batch: int, precision: str) -> list[str]:
    rows = [
        "| precision | layout | checkpointing | B x T | estimate MB | measured MB | error |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for layout in ("depth", "type"):
        for checkpointing in (False, True):
            module = SPDModule(
                target=target_dir,
                target_dtype="float32",
                n=2,
                num_layers=2,
                layout=layout,
                attention_backend="dense",
                activation_checkpointing=checkpointing,
                lr=1e-4,
            )
            callback = MeasureSecondStep()
            trainer = L.Trainer(
                accelerator="cpu",
                devices=1,
                max_steps=2,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                limit_val_batches=0,
                num_sanity_val_steps=0,
                callbacks=[callback],
                precision=precision,
            )
            trainer.fit(module, RandomChats(2048, length, batch, 2, 64))
            shape = Shape(batch, length, 64, precision, "ddp", "float32", checkpointing, "dense", dict(module.hparams))
            predicted = estimate(shape, target_config(target_dir))["total"]
            rows.append(
                f"| {precision} | {layout} | {'yes' if checkpointing else 'no'} | {batch} x {length} | "
                f"{predicted / MB:.2f} | {callback.peak / MB:.2f} | "
                f"{100 * (predicted - callback.peak) / callback.peak:+.0f}% |"
            )
    return rows


def teacher_rows(batch: int, length: int, vocab: int, draft_vocab: int) -> list[str]:
    logits = torch.randn(batch, length, vocab).to(torch.bfloat16)
    d2t = torch.randperm(vocab)[:draft_vocab].sort().values
    sel = torch.zeros(batch, length, dtype=torch.bool)
    sel[:, length // 2 :] = True  # the loss positions
    paths = {
        "restrict after the fp32 upcast (before)": lambda: logits[sel].float()[:, d2t],
        "restrict before any upcast (now)": lambda: logits.index_select(-1, d2t)[sel].float(),
    }
    rows = [
        f"| path (B={batch}, T={length}, V={vocab}, V_d={draft_vocab}, bf16 logits) | extra peak MB |",
        "| --- | --- |",
    ]
    for name, fn in paths.items():
        with LiveTensorBytes([logits, d2t, sel]) as meter:
            base = meter.current
            restricted = fn()
        assert restricted.shape == (int(sel.sum()), draft_vocab)
        rows.append(f"| {name} | {(meter.peak - base) / MB:.0f} |")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--teacher-length", type=int, default=512)
    p.add_argument("--precision", nargs="+", default=["32", "bf16-mixed"])
    opts = p.parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    config = Qwen3_5TextConfig(
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        full_attention_interval=2,
        max_position_embeddings=4096,
    )
    target_dir = os.path.join(tempfile.mkdtemp(prefix="bench_train_memory_"), "target")
    Qwen3_5ForCausalLM(config).save_pretrained(target_dir)
    for precision in opts.precision:
        print("\n".join(estimate_rows(target_dir, opts.length, opts.batch, precision)) + "\n")
    print("\n".join(teacher_rows(opts.batch, opts.teacher_length, 248320, 32000)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
