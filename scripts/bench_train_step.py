"""Training throughput: tokens/s and peak memory of one PDM training step, target forward shown apart.

    python scripts/bench_train_step.py --target artifacts/bench_target --layouts depth type --seq-lens 512 2048 \\
        --batch-size 2 --steps 4 --json runs/bench/train_step.json --markdown

Each (layout, T) runs in its own process (so its peak RSS is its own) through a real Lightning `Trainer`
and `SPDModule.training_step` (target forward, replication, PDM forward, KL, backward, AdamW step) on
random token batches of `batch-size x T` whose every token is a loss token. The first step is warm-up;
the rest are averaged. The frozen target's forward (`Target.anchor_states`, no grad) is timed separately
inside the step; "PDM" is the rest of the step. Memory: the process's peak RSS (`ru_maxrss`) and its
growth over the RSS just before the first step. CPU only: the attention backend is the CPU one `auto`
picks (dense below 4,096 replicated positions, two-part above).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

N_STAGES, PDM_LAYERS = 4, 1


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(target: str, layout: str, seq_len: int, batch_size: int, steps: int, threads: int) -> dict:
    """One (layout, T) configuration, in this process."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback

    from spd_lightning.attention import resolve_backend
    from spd_lightning.module import SPDModule

    torch.set_num_threads(threads)
    torch.manual_seed(0)

    class RandomBatches(L.LightningDataModule):
        def __init__(self, vocab: int):
            super().__init__()
            self.d2t = torch.arange(min(2048, vocab))
            self.batches = [
                {
                    "input_ids": torch.randint(0, vocab, (batch_size, seq_len)),
                    "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long),
                    "loss_mask": torch.ones(batch_size, seq_len, dtype=torch.bool),
                }
                for _ in range(steps)
            ]

        def train_dataloader(self):
            return torch.utils.data.DataLoader(self.batches, batch_size=None)

    class StepTimer(Callback):
        def __init__(self):
            self.step_s, self.target_s, self.rss_before, self.replicated_len = [], [], None, None

        def on_train_start(self, trainer, module):
            forward = module.target.anchor_states

            def timed(*args, **kwargs):
                start = time.perf_counter()
                out = forward(*args, **kwargs)
                self.target_s.append(time.perf_counter() - start)
                return out

            module.target.anchor_states = timed
            replicate = module.layout.replicate

            def recorded(*args, **kwargs):
                rep = replicate(*args, **kwargs)
                self.replicated_len = rep.seq_len
                return rep

            module.layout.replicate = recorded
            self.rss_before = _rss_mb()

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.step_s.append(time.perf_counter() - self.start)

    module = SPDModule(target, target_dtype="float32", n=N_STAGES, layout=layout, num_layers=PDM_LAYERS, lr=1e-4)
    timer = StepTimer()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    trainer.fit(module, datamodule=RandomBatches(module.target_config.vocab_size))
    step = sum(timer.step_s[1:]) / (len(timer.step_s) - 1)
    fwd = sum(timer.target_s[1:]) / (len(timer.target_s) - 1)
    tokens = batch_size * seq_len
    return {
        "layout": layout,
        "T": seq_len,
        "batch_size": batch_size,
        "n": N_STAGES,
        "L_s": PDM_LAYERS,
        "threads": threads,
        "replicated_len": timer.replicated_len,
        "backend": resolve_backend("auto", torch.device("cpu"), timer.replicated_len),
        "step_s": step,
        "target_forward_s": fwd,
        "pdm_s": step - fwd,
        "tokens_per_s": tokens / step,
        "pdm_tokens_per_s": tokens / (step - fwd),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_before_step_mb": timer.rss_before,
    }


def markdown(rows: list[dict]) -> str:
    head = [
        "layout",
        "T",
        "batch",
        "replicated len",
        "attention",
        "step (s)",
        "target fwd (s)",
        "PDM fwd+bwd+opt (s)",
        "tokens/s (step)",
        "tokens/s (PDM only)",
        "peak RSS (MB)",
        "growth in step (MB)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(
            "| "
            + " | ".join(
                [
                    r["layout"],
                    str(r["T"]),
                    str(r["batch_size"]),
                    str(r["replicated_len"]),
                    str(r["backend"]),
                    f"{r['step_s']:.2f}",
                    f"{r['target_forward_s']:.2f}",
                    f"{r['pdm_s']:.2f}",
                    f"{r['tokens_per_s']:.0f}",
                    f"{r['pdm_tokens_per_s']:.0f}",
                    f"{r['peak_rss_mb']:.0f}",
                    f"{r['peak_rss_mb'] - r['rss_before_step_mb']:.0f}",
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="artifacts/bench_target")
    p.add_argument("--layouts", nargs="+", default=["depth", "type"])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="steps per configuration; the first is warm-up")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write every row here")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p.add_argument("--one", nargs=2, metavar=("LAYOUT", "T"), help=argparse.SUPPRESS)  # the per-config child
    args = p.parse_args(argv)
    if args.steps < 2:
        sys.exit("error: --steps must be >= 2 (the first step is warm-up)")
    if args.one:
        print(
            json.dumps(measure(args.target, args.one[0], int(args.one[1]), args.batch_size, args.steps, args.threads))
        )
        return
    rows = []
    for layout in args.layouts:
        for T in args.seq_lens:
            child = [
                sys.executable,
                __file__,
                "--one",
                layout,
                str(T),
                "--target",
                args.target,
                "--batch-size",
                str(args.batch_size),
                "--steps",
                str(args.steps),
                "--threads",
                str(args.threads),
            ]
            done = subprocess.run(child, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(
                    f"error: {layout} T={T} failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"
                )
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(
                f"{layout} T={T}: {rows[-1]['tokens_per_s']:.0f} tokens/s, step {rows[-1]['step_s']:.2f} s "
                f"(target {rows[-1]['target_forward_s']:.2f} s), peak RSS {rows[-1]['peak_rss_mb']:.0f} MB",
                flush=True,
            )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.markdown:
        print(markdown(rows))


if __name__ == "__main__":
    main()
