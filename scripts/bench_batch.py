"""Batched decoding in the one-process simulator: tokens/s and the step cost of each stage and the draft
per batch size B = 1, 2, 4, 8.

The same requests (greedy, mixed prompt lengths) are decoded by `Simulator` at each batch size; each run
first checks every sequence against the first run (tokens and K). The stages run in sequence in one process,
so the wall clock measures what batching saves per cycle (one forward over B slots instead of B forwards), not
the pipeline's wall clock on n devices. What the planner needs (`python -m inference.plan --batch-times`) is
timed per call in process CPU time (the cost of a call on a shared machine, whatever else runs there; torch runs
`--threads` threads, 1 by default): every stage's step and the PDM's draft, keyed by the rows the call ran (its
batch bucket), and the whole step; a row of the JSON holds the means over the steps that ran the full bucket B.

    python scripts/bench_batch.py --requests 16 --max-new-tokens 48 --threads 1 --json batch_times.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen3_5", choices=["qwen3", "qwen3_5"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the per-B rows (with step times) here, for inference.plan")
    return parser.parse_args(argv)


class StepTimes:
    """Process CPU time of each call of the wrapped methods, keyed by (what, rows the call ran)."""

    def __init__(self):
        self.calls: dict[tuple[str, int], list[float]] = defaultdict(list)

    def wrap(self, owner, method: str, what: str, rows_of) -> None:
        call = getattr(owner, method)

        def timed(*args):
            rows, t0 = rows_of(*args), time.process_time()
            out = call(*args)
            self.calls[what, rows].append(time.process_time() - t0)
            return out

        setattr(owner, method, timed)

    def mean(self, what: str, rows: int) -> float | None:
        times = self.calls.get((what, rows))
        return statistics.fmean(times) if times else None

    def total(self, what: str, rows: int) -> float:
        return sum(self.calls.get((what, rows), []))


def instrument(simulator) -> StepTimes:
    """Time every stage step, the draft and the whole step of `simulator`, by the bucket they ran."""
    from inference.runtime.slot_rows import batch_bucket

    times = StepTimes()
    for s, stage in simulator.stages.items():
        times.wrap(stage, "step", f"stage{s}", lambda inputs, tokens: inputs.shape[0])
    times.wrap(simulator.drafter, "draft", "draft", lambda views, rows: rows)

    def live_bucket() -> int:
        live = [b for b, seq in enumerate(simulator.slots) if seq is not None and seq.step is not None]
        return batch_bucket(max(live) + 1, simulator.max_batch) if live else 0

    times.wrap(simulator, "step", "step", live_bucket)
    return times


def step_row(times: StepTimes, B: int, n: int) -> dict:
    """Means per call at bucket B; the overhead is each rank's share of what the steps spent outside the forwards
    (verify, schedule, messages), inferred from the totals (not every step runs every stage or drafts)."""
    stages = [times.mean(f"stage{s}", B) for s in range(1, n + 1)]
    steps = len(times.calls.get(("step", B), []))
    row = {"stage_s": stages, "draft_s": times.mean("draft", B), "step_s": times.mean("step", B), "steps_timed": steps}
    if steps:
        forwards = sum(times.total(what, B) for what in [*(f"stage{s}" for s in range(1, n + 1)), "draft"])
        row["overhead_s"] = max(0.0, times.total("step", B) - forwards) / steps / (n + 1)
    return row


def requests_of(args) -> list:
    from inference.cycle.slots import Request

    g = torch.Generator().manual_seed(0)
    lengths = [int(torch.randint(4, 40, (1,), generator=g)) for _ in range(args.requests)]
    return [Request(torch.randint(1, 90, (P,), generator=g).tolist(), args.max_new_tokens) for P in lengths]


def run(args) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from kit import make_tiny_model, random_pdm  # the test fixtures' random models

    from inference.cycle.simulator import Simulator
    from spd_lightning.geometry import Geometry
    from spd_lightning.target import Target

    target = Target(make_tiny_model(args.arch, num_layers=args.layers, hidden_size=args.hidden), "bench")
    geometry = Geometry.build(target.num_layers, args.n)
    pdm = random_pdm(target, geometry)
    requests = requests_of(args)
    rows, reference = [], None
    for B in args.batch:
        simulator = Simulator(target, pdm, geometry, max_batch=B)
        times = instrument(simulator)
        t0 = time.perf_counter()
        results = simulator.run(requests)
        wall = time.perf_counter() - t0
        outputs = [(r.tokens, r.K) for r in results]
        reference = reference or outputs
        if outputs != reference:
            raise SystemExit(f"B={B}: a sequence differs from its B={args.batch[0]} decode")
        tokens = sum(r.N for r in results)
        rows.append(
            {
                "B": B,
                "tokens": tokens,
                "wall_s": round(wall, 3),
                "tok_s": round(tokens / wall, 1),
                "per_request_tok_s": round(statistics.median(r.N / (r.prefill_s + r.decode_s) for r in results), 1),
                "cycles": simulator.cycles,
                "alpha": tokens / sum(r.K for r in results),  # tokens per cycle of one sequence
                **step_row(times, B, geometry.n),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return {
        "command": shlex.join(["python", "scripts/bench_batch.py", *sys.argv[1:]]),
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs, {platform.processor() or platform.machine()})",
        "date": datetime.date.today().isoformat(),
        "target": {"arch": args.arch, "layers": args.layers, "hidden": args.hidden},
        "n": geometry.n,
        "threads": args.threads,
        "step_clock": "process CPU time",
        "rows": rows,
    }


def markdown(report: dict) -> str:
    lines = [
        "| B | tokens | wall | tok/s total | tok/s per request (median) | cycles | stage step (ms, each) | draft (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        stages = ", ".join("-" if t is None else f"{1e3 * t:.2f}" for t in r["stage_s"])
        draft = "-" if r["draft_s"] is None else f"{1e3 * r['draft_s']:.2f}"
        lines.append(
            f"| {r['B']} | {r['tokens']} | {r['wall_s']} s | {r['tok_s']} | {r['per_request_tok_s']} | {r['cycles']} "
            f"| {stages} | {draft} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    report = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(markdown(report))


if __name__ == "__main__":
    main()
