"""The planner per batch size: tokens/s in total and per request at B = 1, 2, 4, 8, predicted from
measured stage and draft step times at each B (`python -m inference.plan --batch-times batch_times.json`, the JSON
of `scripts/bench_batch.py --json`).

Every slot runs its own batch-1 schedule (docs/DESIGN.md, "One cycle over B slots"), so a sequence emits `alpha`
tokens per cycle at any B (its N / K, measured; `--batch-alpha` overrides it) and what B changes is the cycle:

    stage(B)      the slowest stage's step over B rows (measured)
    draft(B)      the PDM's draft over B rows (measured)
    cycle(B)      = max(stage(B), draft(B)) + overhead(B)     (pre-step: drafting overlaps the stages)
                  = stage(B) + draft(B) + overhead(B)          (--schedule post_step)
    per request   = alpha / cycle(B)   tokens/s of one sequence
    total         = B * alpha / cycle(B)

`overhead(B)` is each rank's share of a step's host work beyond the forwards (verify, schedule, messages), as the
bench infers it from its one-process steps. The measured columns are this machine's prediction for the pipeline
on n ranks of its kind. On a GPU a one-token stage step is bound by reading the weights, so its cost stays about
flat in B until B approaches the GPU's FLOPs-to-bandwidth ratio (a B-row matmul does B flops per weight byte in
bf16; an H100 has about 990 TFLOP/s over 3.35 TB/s, ~300: inferred from its datasheet, not measured): the
weight-bound reading keeps every B at the first B's cycle, so the total grows as B and per request stays at the
first B's. Both readings are predictions.
"""

from __future__ import annotations

import math

from inference.evaluation import costs
from inference.evaluation.tables import markdown_table
from spd_lightning.errors import UsageError


def batch_rows(report: dict, alpha: float | None, schedule: str, path: str) -> list[dict]:
    """The predicted tokens/s at each measured B, and its weight-bound (GPU) reading, from the rows of a
    `bench_batch.py --json` report (each checked first: B >= 1, its stage times, draft and alpha)."""
    rows = report.get("rows") if isinstance(report, dict) else None
    if not isinstance(rows, list) or not rows:
        raise UsageError(f"{path}: no rows (expected the JSON of scripts/bench_batch.py --json)")
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("B"), int) or row["B"] < 1:
            raise UsageError(f"{path}: rows[{i}] has no batch size B >= 1")
        times = [*(row.get("stage_s") or []), row.get("draft_s")]
        if not row.get("stage_s") or not all(isinstance(t, (int, float)) and math.isfinite(t) and t > 0 for t in times):
            raise UsageError(
                f"{path}: rows[{i}] (B={row['B']}) lacks positive stage_s/draft_s times: rerun bench_batch.py with "
                f"requests >= B so that full-bucket steps were timed"
            )
    if alpha is not None and not 0 < alpha <= 1:
        raise UsageError(f"--batch-alpha={alpha} must be in (0, 1] (alpha = N / K)")
    out, first = [], None
    for row in sorted(rows, key=lambda r: r["B"]):
        B, a = row["B"], alpha if alpha is not None else row.get("alpha")
        if not isinstance(a, (int, float)) or not 0 < a <= 1:
            raise UsageError(f"{path}: B={B} has no alpha in (0, 1]: pass --batch-alpha")
        fix = "rerun bench_batch.py to write it again"
        overhead = costs.measured_value(row.get("overhead_s"), f"{path}: B={B} overhead_s", fix, zero_ok=True)
        stage, draft, overhead = max(row["stage_s"]), row["draft_s"], overhead or 0.0
        cycle = costs.cycle(stage, draft, overhead, schedule)
        first = first if first is not None else cycle  # the first (smallest) B's cycle
        out.append(
            {
                "B": B,
                "alpha": a,
                "stage_s": stage,
                "draft_s": draft,
                "overhead_s": overhead,
                "cycle_s": cycle,
                "cycle_vs_first": cycle / first,
                "per_request_tok_s": a / cycle,
                "total_tok_s": B * a / cycle,
                "weight_bound_per_request_tok_s": a / first,
                "weight_bound_total_tok_s": B * a / first,
            }
        )
    return out


def batch_markdown(report: dict, rows: list[dict], schedule: str) -> str:
    ms = ("stage", "draft", "overhead", "cycle")  # the times, in milliseconds
    head = ["B", "alpha", *(f"{k} (ms)" for k in ms), f"cycle / B={rows[0]['B']}", "tok/s per request", "tok/s total"]
    head += ["GPU weight-bound: per request", "GPU weight-bound: total"]
    cells = [
        [str(r["B"]), f"{r['alpha']:.3f}"]
        + [f"{1e3 * r[f'{k}_s']:.3f}" for k in ms]
        + [f"{r['cycle_vs_first']:.2f}", f"{r['per_request_tok_s']:.1f}", f"{r['total_tok_s']:.1f}"]
        + [f"{r['weight_bound_per_request_tok_s']:.1f}", f"{r['weight_bound_total_tok_s']:.1f}"]
        for r in rows
    ]
    source = ", ".join(str(report[k]) for k in ("command", "machine", "date") if report.get(k))
    title = f"Batched decoding per B ({schedule}; predicted from measured step times{': ' + source if source else ''})"
    note = (
        "Predictions: the measured columns are the pipeline on n ranks of the measuring machine; the weight-bound "
        f"columns keep every B at the B={rows[0]['B']} cycle, as a GPU's one-token stage step reads its weights once "
        "for all B rows."
    )
    return "\n".join([title, "", *markdown_table(head, cells), "", note]) + "\n"
