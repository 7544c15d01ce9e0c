"""The training-budget curve from stored rows (`bench_paper.py curve`): a table per temperature, the plot of
theoretical speedup (draft cost charged) against loss tokens with 95 % intervals, and one sentence per budget
saying whether the paper's ratios hold (SPD n = 8 >= 2x PPSD n = 8 and >= 1.25x EAGLE-3) and whether the
intervals decide it. Nothing is decoded here: rerunning it after more rows arrive redraws everything."""

from __future__ import annotations

import argparse
import json
import os
import shlex

from inference.evaluation.costs import GPU_LABEL
from inference.evaluation.intervals import overlap
from inference.evaluation.tables import fmt, fmt_ci, fmt_spread, markdown_table, pyplot, rates, save

from .budget import read_reached
from .curve import budgets, curve_eval_command, curve_of, curve_train_command, eval_dir, states_command
from .tables import write_region

PAPER_RATIOS = {"PPSD": 2.0, "EAGLE-3": 1.25}  # SPD n = 8 over each, draft cost charged (the paper's claim)
COSTS = {"S": "r measured on this CPU", "S_gpu": "the GPU r from the paper's times"}


def load_points(args: argparse.Namespace) -> list[dict]:
    """One point per (drafter, budget, T, k): the pooled row of every set, with the loss tokens the drafter had
    seen when saved; EAGLE-3 gives one point per k."""
    curve, points = curve_of(args), []
    for name in [*curve.runs, *curve.eagle3]:
        reached = read_reached(f"{args.root}/{name}/budgets")
        for budget in budgets(args):
            path = f"{eval_dir(args, name, budget)}/eval.json"
            if budget not in reached or not os.path.isfile(path):
                continue
            with open(path) as f:
                report = json.load(f)
            where = {"name": name, "budget": budget, **reached[budget]}
            for row in report["results"]:
                if row["set"] == "overall":
                    label = f"{row['mode'].upper()} n={row['n']} L_s={row['L_s']}"
                    points.append({**where, **row, "label": label, "family": row["mode"].upper()})
            for row in report["eagle3_results"]:
                if row["set"] == "overall":
                    points.append({**where, **row, "label": f"EAGLE-3 k={row['k']}", "family": "EAGLE-3"})
    return points


def curve_table(points: list[dict], temperature: float) -> list[str]:
    head = ["drafter", "budget", "loss tokens", "step", "alpha [95 %]", "tokens per forward [95 %]"]
    head += ["r (min-max, repeats)", "S, CPU r [95 %]", GPU_LABEL, "S at GPU r [95 %]", "wall-clock (CPU) [95 %]"]
    head.append("accept by fill / position")
    rows = []
    for p in sorted((p for p in points if p["temperature"] == temperature), key=lambda p: (p["label"], p["budget"])):
        ci = p.get("ci") or {}
        rows.append(
            [p["label"], f"{p['budget']:,}", f"{p['loss_tokens']:,}", str(p["step"])]
            + [fmt_ci(p["alpha"], ci.get("alpha"), 3), fmt_ci(p["S0"], ci.get("S0")), fmt_spread(p)]
            + [fmt_ci(p["S"], ci.get("S")), fmt(p["r_gpu"], 3), fmt_ci(p["S_gpu"], ci.get("S_gpu"))]
            + [
                fmt_ci(p["wall_clock_speedup"], ci.get("wall_clock_speedup")),
                rates(p.get("accept_by_fill") or p.get("accept_by_position")),
            ]
        )
    return markdown_table(head, rows)


def best_eagle3(points: list[dict], budget: int, temperature: float, key: str) -> dict | None:
    """EAGLE-3's best k at a budget and temperature by the speedup `key` (S or S_gpu)."""
    rows = [p for p in points if p["family"] == "EAGLE-3" and p["budget"] == budget and p["temperature"] == temperature]
    rows = [p for p in rows if p.get(key) is not None]
    return max(rows, key=lambda p: p[key]) if rows else None


def lines(points: list[dict], temperature: float, key: str) -> dict[str, list[dict]]:
    """One line per method: each PDM drafter, and EAGLE-3 at its best k per budget."""
    out: dict[str, list[dict]] = {}
    at_t = [p for p in points if p["temperature"] == temperature]
    for p in at_t:
        if p["family"] != "EAGLE-3":
            out.setdefault(p["label"], []).append(p)
    for budget in sorted({p["budget"] for p in at_t}):
        best = best_eagle3(points, budget, temperature, key)
        if best is not None:
            out.setdefault("EAGLE-3 (best k)", []).append(best)
    return {label: sorted(ps, key=lambda p: p["loss_tokens"]) for label, ps in out.items()}


def plot_curve(points: list[dict], path: str) -> None:
    temperatures = sorted({p["temperature"] for p in points})
    fig, axes = pyplot().subplots(len(temperatures), 2, figsize=(12, 4.2 * len(temperatures)), squeeze=False)
    for row, temperature in enumerate(temperatures):
        for col, (key, what) in enumerate(COSTS.items()):
            ax = axes[row][col]
            for label, ps in lines(points, temperature, key).items():
                xs, ys = [p["loss_tokens"] for p in ps], [p[key] for p in ps]
                cis = [(p.get("ci") or {}).get(key) or [p[key], p[key]] for p in ps]
                err = [[y - c[0] for y, c in zip(ys, cis)], [c[1] - y for y, c in zip(ys, cis)]]
                ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=label)
            ax.set_xscale("log")
            ax.axhline(1.0, color="gray", lw=0.8, ls="--")
            ax.set_xlabel("loss tokens trained")
            ax.set_ylabel("theoretical speedup over AR")
            ax.set_title(f"T={temperature:g}, draft cost at {what} (95 % intervals)", fontsize=9)
            ax.legend(fontsize=7)
    save(fig, path)


def _scaled(interval: list[float] | None, factor: float) -> list[float] | None:
    return None if interval is None else [factor * interval[0], factor * interval[1]]


def verdict(spd: dict, other: dict, family: str, key: str) -> str:
    """One comparison: SPD's speedup against `family`'s times the paper's ratio, with what the intervals say."""
    need = PAPER_RATIOS[family]
    s, o = spd[key], other[key]
    ci_s, ci_o = (spd.get("ci") or {}).get(key), _scaled((other.get("ci") or {}).get(key), need)
    ratio = s / o if o else float("inf")
    holds = "holds" if ratio >= need else "does not hold"
    if ci_s is None or ci_o is None:
        decided = "no intervals stored"
    elif overlap(ci_s, ci_o):
        decided = f"SPD's interval overlaps {need:g} x {family}'s, so the 95 % intervals do not decide it"
    else:
        decided = f"SPD's interval and {need:g} x {family}'s do not overlap, so it is decided at 95 %"
    return (
        f"{spd['label']} {fmt_ci(s, ci_s)} vs {other['label']} {fmt_ci(o, (other.get('ci') or {}).get(key))}: "
        f"ratio {ratio:.2f}, the paper's >= {need:g}x {holds} ({decided})"
    )


def verdicts(points: list[dict], temperature: float, key: str) -> list[str]:
    """Per budget, every SPD drafter at PPSD's n (8 in the paper) against PPSD and EAGLE-3's best k, then the trend
    of each ratio over the budgets."""
    out, trend = [], {}
    for budget in sorted({p["budget"] for p in points}):
        at = [p for p in points if p["budget"] == budget and p["temperature"] == temperature and p.get(key)]
        ppsd = max((p for p in at if p["family"] == "PPSD"), key=lambda p: p["n"], default=None)
        n = ppsd["n"] if ppsd is not None else 8  # the paper's n = 8 (the tiny curve's PPSD has n = 4)
        spds = [p for p in at if p["family"] == "SPD" and p["n"] == n]
        rivals = {"PPSD": ppsd, "EAGLE-3": best_eagle3(points, budget, temperature, key)}
        for spd in spds:
            for family, other in rivals.items():
                if other is not None:
                    out.append(f"- {budget:,} loss-token budget: {verdict(spd, other, family, key)}.")
                    trend.setdefault((spd["label"], family), []).append(f"{spd[key] / other[key]:.2f}")
    for (label, family), ratios in trend.items():
        out.append(f"- Trend of {label} / {family} over the budgets: {' -> '.join(ratios)}.")
    return out or ["- No SPD row at PPSD's n with a rival at a common budget yet."]


def write_curve(args: argparse.Namespace) -> None:
    points = load_points(args)
    curve = curve_of(args)
    parts = [
        f"<!-- generated by `python scripts/bench_paper.py curve --suite {args.suite}`; do not edit by hand -->",
        "",
    ]
    for temperature in sorted({p["temperature"] for p in points}):
        parts += [f"#### T = {temperature:g}", "", *curve_table(points, temperature), ""]
        for key, what in COSTS.items():
            parts += [f"The paper's ratios at T = {temperature:g}, draft cost at {what}:", ""]
            parts += [*verdicts(points, temperature, key), ""]
    if not points:
        parts += ["(no drafter evaluated at a budget yet)", ""]
    names = [*curve.runs, *curve.eagle3]
    commands = [shlex.join(states_command(args))] + [
        shlex.join(curve_train_command(n, args, resume=False)) for n in names
    ]
    commands += [shlex.join(curve_eval_command(n, b, args)) for n in names for b in budgets(args)]
    parts += ["Commands (from the repository root; `bench_paper.py curve-*` runs them, resumably):", "", "```bash"]
    parts += [*commands, "```", ""]
    write_region(args.out, "\n".join(parts), f"{args.region}-curve")
    print(f"wrote {args.out} ({len(points)} curve rows)")
    if args.png and points:
        plot_curve(points, args.png)
        print(f"wrote {args.png}")
