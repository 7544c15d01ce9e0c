"""Training throughput: tokens/s and peak memory of one PDM training step, target forward shown apart.

    python scripts/bench_train_step.py --target artifacts/bench_target --layouts depth type --seq-lens 512 2048 \\
        --batch-size 2 --steps 4 --json runs/bench/train_step.json --markdown

    # before/after: every shape runs in the tree at --baseline (a checkout of an older commit), then in this one,
    # alternately, --rounds times; medians of the timed steps
    mkdir /tmp/base && git archive 56474bf | tar -x -C /tmp/base
    python scripts/bench_train_step.py --random-target --baseline /tmp/base --layouts depth type --ns 4 8 \\
        --num-layers 1 3 --seq-lens 512 1024 2048 --batch-size 1 --steps 4 --json runs/bench/eff.json --markdown

Each configuration (layout, n, L_s, T) runs in its own process (so its peak RSS is its own) through a real Lightning
`Trainer` and `SPDModule.training_step` (target forward, replication, PDM forward, KL, backward, AdamW step) on
random token batches of `batch-size x T` whose every token is a loss token. The first step is warm-up; the rest
give the median step time, wall-clock and CPU (`time.process_time`: on a shared machine the CPU time of a
one-thread step is the robust comparison; wall time counts the waits for a core). The frozen target's forward (`Target.anchor_states`, no grad) is timed separately
inside the step; "PDM" is the rest of the step. FLOPs per token: the warm-up step counted by
`torch.utils.flop_counter.FlopCounterMode` (matmuls and SDPA; the two-part path's staircase products are
elementwise and not counted), target forward included. Memory: the process's peak RSS (`ru_maxrss`) and its growth over
the RSS just before the first step. CPU only: the attention backend is the CPU one `auto` picks (dense below
4,096 replicated positions, two-part above). `--random-target` trains against a random-init target of the
benchmark target's architecture (`spd_lightning.tiny_target`: Qwen3.5, 8 layers, width 160, 4,096 ids), built
in a temporary directory: a step's time does not depend on the weights.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def random_target(out_dir: str) -> str:
    """A random-init target with the benchmark target's architecture (docs/BENCHMARKS.md), saved to `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM

    from spd_lightning.tiny_target import tiny_model_config

    torch.manual_seed(0)
    config = tiny_model_config("qwen3_5", 4096, 160, 8, eos_token_id=4095, pad_token_id=0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out_dir)
    return out_dir


def step_timer():
    """A callback timing every training step and, inside it, the frozen target's forward; the warm-up step's
    FLOPs (target forward, PDM forward and backward: `torch.utils.flop_counter`, matmuls and attention) too."""
    from lightning.pytorch.callbacks import Callback
    from torch.utils.flop_counter import FlopCounterMode

    class StepTimer(Callback):
        def __init__(self):
            self.step_s, self.cpu_s, self.target_s, self.rss_before, self.replicated_len = [], [], [], None, None

        def on_train_start(self, trainer, module):
            forward, replicate = module.target.anchor_states, module.layout.replicate

            def timed(*args, **kwargs):
                start = time.perf_counter()
                out = forward(*args, **kwargs)
                self.target_s.append(time.perf_counter() - start)
                return out

            def recorded(*args, **kwargs):
                rep = replicate(*args, **kwargs)
                self.replicated_len = rep.seq_len
                return rep

            module.target.anchor_states, module.layout.replicate = timed, recorded
            self.rss_before = _rss_mb()

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == 0:  # the warm-up step (not timed) counts the step's FLOPs
                self.counter = FlopCounterMode(display=False)
                self.counter.__enter__()
            self.start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.step_s.append(time.perf_counter() - self.start)
            self.cpu_s.append(time.process_time() - self.cpu_start)
            if batch_idx == 0:
                self.counter.__exit__(None, None, None)
                self.flops = self.counter.get_total_flops()

    return StepTimer()


def measure(target: str, layout: str, n: int, num_layers: int, seq_len: int, batch_size: int, steps: int, threads: int):
    """One (layout, n, L_s, T) configuration, in this process."""
    import lightning as L
    import torch

    from spd_lightning.testing import RandomChats
    from spd_lightning.training.attention import resolve_backend
    from spd_lightning.training.module import SPDModule

    torch.set_num_threads(threads)
    torch.manual_seed(0)

    module = SPDModule(target, target_dtype="float32", n=n, layout=layout, num_layers=num_layers, lr=1e-4)
    timer = step_timer()
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
    vocab = module.target_config.vocab_size  # every token a loss token, no padding
    trainer.fit(module, datamodule=RandomChats(vocab, seq_len, batch_size, steps, min(2048, vocab), loss_from=0.0))
    step, fwd = statistics.median(timer.step_s[1:]), statistics.median(timer.target_s[1:])
    tokens = batch_size * seq_len
    return {
        "layout": layout,
        "T": seq_len,
        "batch_size": batch_size,
        "n": n,
        "L_s": num_layers,
        "threads": threads,
        "replicated_len": timer.replicated_len,
        "backend": resolve_backend("auto", torch.device("cpu"), timer.replicated_len),
        "step_s": step,
        "steps_s": timer.step_s[1:],
        "cpu_s": statistics.median(timer.cpu_s[1:]),
        "steps_cpu_s": timer.cpu_s[1:],
        "target_forward_s": fwd,
        "pdm_s": step - fwd,
        "tokens_per_s": tokens / step,
        "gflop_per_token": timer.flops / tokens / 1e9,
        "pdm_tokens_per_s": tokens / (step - fwd),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_before_step_mb": timer.rss_before,
    }


def run_child(args, tree: str, layout: str, n: int, num_layers: int, T: int) -> dict:
    """One configuration in a fresh process that imports `spd_lightning` from `tree`."""
    child = [sys.executable, os.path.abspath(__file__), "--one", layout, str(n), str(num_layers), str(T)]
    for flag in ("target", "batch_size", "steps", "threads"):
        child += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(child, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode
        sys.exit(f"error: {layout} n={n} L_s={num_layers} T={T} ({tree}) failed: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def merged(runs: list[dict]) -> dict:
    """Several runs of one configuration as one row: medians of every timed step and of the peaks."""
    row = dict(runs[0])
    tokens = row["batch_size"] * row["T"]
    row["steps_s"] = [s for r in runs for s in r["steps_s"]]
    row["step_s"] = statistics.median(row["steps_s"])
    row["steps_cpu_s"] = [s for r in runs for s in r["steps_cpu_s"]]
    row["cpu_s"] = statistics.median(row["steps_cpu_s"])
    row["target_forward_s"] = statistics.median(r["target_forward_s"] for r in runs)
    row["pdm_s"] = row["step_s"] - row["target_forward_s"]
    row["tokens_per_s"], row["pdm_tokens_per_s"] = tokens / row["step_s"], tokens / row["pdm_s"]
    for key in ("peak_rss_mb", "rss_before_step_mb"):
        row[key] = statistics.median(r[key] for r in runs)
    return row


def measure_grid(args) -> list[dict]:
    """Every configuration, shortest T first; with `--baseline`, the baseline tree then this one, alternately,
    `--rounds` times. The rows so far are rewritten to `--json` after each configuration."""
    trees = [("before", args.baseline), ("after", REPO)] if args.baseline else [("this", REPO)]
    rows = []
    for T, n, num_layers, layout in itertools.product(args.seq_lens, args.ns, args.num_layers, args.layouts):
        runs = {label: [] for label, _ in trees}
        for _, (label, tree) in itertools.product(range(args.rounds), trees):
            runs[label].append(run_child(args, tree, layout, n, num_layers, T))
        for label, _ in trees:
            rows.append({**merged(runs[label]), "tree": label})
            r = rows[-1]
            print(
                f"{layout} n={n} L_s={num_layers} T={T} [{label}]: {r['tokens_per_s']:.0f} tokens/s, step "
                f"{r['step_s']:.2f} s (target {r['target_forward_s']:.2f} s), peak RSS {r['peak_rss_mb']:.0f} MB",
                flush=True,
            )
        if args.json:
            write_json(args.json, rows)
    return rows


def write_json(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


def markdown(rows: list[dict]) -> str:
    head = ["layout", "T", "batch", "n", "L_s", "replicated len", "attention", "step (s)", "target fwd (s)"]
    head += ["PDM fwd+bwd+opt (s)", "tokens/s (step)", "tokens/s (PDM only)", "peak RSS (MB)", "growth in step (MB)"]
    head += ["MFLOP/token"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["layout"], r["T"], r["batch_size"], r["n"], r["L_s"], r["replicated_len"], r["backend"]]
        cells += [f"{r[k]:.2f}" for k in ("step_s", "target_forward_s", "pdm_s")]
        cells += [f"{r[k]:.0f}" for k in ("tokens_per_s", "pdm_tokens_per_s", "peak_rss_mb")]
        cells += [f"{r['peak_rss_mb'] - r['rss_before_step_mb']:.0f}", f"{r['gflop_per_token'] * 1e3:.0f}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def comparison(rows: list[dict]) -> str:
    """Before/after side by side: one line per configuration."""
    head = ["layout", "n", "L_s", "T", "attention", "step before (s)", "step after (s)", "after / before"]
    head += ["CPU s/step before", "CPU s/step after", "after / before (CPU)"]
    head += ["tokens/s before", "tokens/s after", "peak RSS before (MB)", "peak RSS after (MB)"]
    head += ["growth before (MB)", "growth after (MB)", "MFLOP/token before", "MFLOP/token after"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    key = lambda r: (r["layout"], r["n"], r["L_s"], r["T"])  # noqa: E731
    after = {key(r): r for r in rows if r["tree"] == "after"}
    for b in (r for r in rows if r["tree"] == "before"):
        a = after[key(b)]
        cells = [*key(b)[:3], b["T"], a["backend"], f"{b['step_s']:.2f}", f"{a['step_s']:.2f}"]
        cells += [f"{a['step_s'] / b['step_s']:.2f}x", f"{b['cpu_s']:.2f}", f"{a['cpu_s']:.2f}"]
        cells += [f"{a['cpu_s'] / b['cpu_s']:.2f}x", f"{b['tokens_per_s']:.0f}", f"{a['tokens_per_s']:.0f}"]
        cells += [f"{b['peak_rss_mb']:.0f}", f"{a['peak_rss_mb']:.0f}"]
        cells += [f"{r['peak_rss_mb'] - r['rss_before_step_mb']:.0f}" for r in (b, a)]
        cells += [f"{r['gflop_per_token'] * 1e3:.0f}" for r in (b, a)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="artifacts/bench_target")
    p.add_argument("--random-target", action="store_true", help="a random-init target of the benchmark's shape")
    p.add_argument("--layouts", nargs="+", default=["depth", "type"])
    p.add_argument("--ns", type=int, nargs="+", default=[4], help="pipeline stages n")
    p.add_argument("--num-layers", type=int, nargs="+", default=[1], help="PDM layers L_s")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="steps per configuration; the first is warm-up")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--baseline", help="a checkout of the 'before' tree: each shape runs there, then here")
    p.add_argument("--rounds", type=int, default=1, help="processes per configuration (and tree)")
    p.add_argument("--json", help="write every row here")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p.add_argument("--one", nargs=4, metavar=("LAYOUT", "N", "L_S", "T"), help=argparse.SUPPRESS)  # the child
    args = p.parse_args(argv)
    if args.steps < 2:
        sys.exit("error: --steps must be >= 2 (the first step is warm-up)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.one:
        layout, n, num_layers, T = args.one[0], *map(int, args.one[1:])
        print(json.dumps(measure(args.target, layout, n, num_layers, T, args.batch_size, args.steps, args.threads)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.random_target:
            args.target = random_target(os.path.join(tmp, "target"))
        rows = measure_grid(args)
    if args.markdown:
        print(comparison(rows) if args.baseline else markdown(rows))


if __name__ == "__main__":
    main()
