"""The planner's EAGLE-3 rows: its predicted speedup per k beside SPD's (`python -m inference.plan --times eval.json`
of an eval with EAGLE-3 rows, whose `plan_inputs_eagle3` this reads).

On one GPU each round drafts k tokens serially and verifies them in one target forward over k + 1 positions: its
time `round(k) = k * T_draft_step + T_verify(k)` and the speedup `costs.s_eagle3` (docs/DESIGN.md, "Speedup
formulas"), with `tau` the tokens per target forward the eval measured. The table puts EAGLE-3's best k beside SPD's best
prediction at each n (SPD needs n GPUs with the PDM sharing stage 1's, n + 1 with its own).
"""

from __future__ import annotations

from inference.evaluation import costs
from inference.evaluation.tables import markdown_table
from spd_lightning.errors import UsageError


def eagle3_rows(inputs: list[dict], t_full: float | None, path: str) -> list[dict]:
    """EAGLE-3's predicted speedup per k from its measured draft-step and verify costs over `t_full` seconds (`--t-full`)
    or, when None, each row's own `T_full_s`: the AR baseline its times were measured against (eager under
    `--compile`, where SPD's is compiled); `inputs`: the `plan_inputs_eagle3` of the eval.json at `path`, checked
    first (a hand-edited file): each row a dict whose k is an integer >= 1 and whose times and tokens per forward
    are numbers > 0 (or absent), one line naming the value otherwise."""
    fix = "rerun inference.eval --eagle3 to write it again"
    if not isinstance(inputs, list) or not all(isinstance(p, dict) for p in inputs):
        raise UsageError(f"{path}: plan_inputs_eagle3 must be a list of rows, one per k: {fix}")
    for i, p in enumerate(inputs):
        where = f"{path}: plan_inputs_eagle3[{i}]"
        if costs.measured_value(p.get("k"), f"{where}.k", fix, integer=True) is None:
            raise UsageError(f"{where} has no k: {fix}")
        for key in ("alpha", "T_full_s", "T_draft_step_s", "T_verify_s"):
            costs.measured_value(p.get(key), f"{where}.{key}", fix)
    rows = []
    for p in inputs:
        full = t_full or p["T_full_s"]
        if None in (full, p["alpha"], p["T_draft_step_s"], p["T_verify_s"]):
            raise UsageError(f"EAGLE-3 k={p['k']}: the eval report lacks a measured time; rerun inference.eval")
        rows.append(
            {
                "k": p["k"],
                "tokens_per_forward": p["alpha"],
                "draft_step": p["T_draft_step_s"],
                "verify": p["T_verify_s"],
                "round": p["k"] * p["T_draft_step_s"] + p["T_verify_s"],
                "speedup": costs.s_eagle3(p["alpha"], p["k"], p["T_draft_step_s"] / full, p["T_verify_s"] / full),
            }
        )
    return rows


def eagle3_markdown(rows: list[dict], spd_rows: list[dict]) -> str:
    head = ["k", "tokens per target forward", "draft step (s)", "verify (s)", "round (s)", "predicted speedup"]
    cells = [
        [str(r["k"]), f"{r['tokens_per_forward']:.3f}", f"{r['draft_step']:.4g}", f"{r['verify']:.4g}"]
        + [f"{r['round']:.4g}", f"{r['speedup']:.2f}"]
        for r in rows
    ]
    best = max(rows, key=lambda r: r["speedup"])
    lines = ["EAGLE-3 on 1 GPU (measured draft and verify costs)", "", *markdown_table(head, cells), ""]
    for n in sorted({r["n"] for r in spd_rows}):
        spd = max((r for r in spd_rows if r["n"] == n), key=lambda r: r["speedup"])
        lines.append(
            f"n={n} (SPD on {n} GPUs, {n + 1} with its own PDM GPU): SPD {spd['speedup']:.2f}x (L_s={spd['L_s']}) "
            f"vs EAGLE-3 {best['speedup']:.2f}x (k={best['k']}, 1 GPU)"
        )
    return "\n".join(lines) + "\n"
