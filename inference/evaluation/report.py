"""`inference.eval`'s report as people read it: `eval.md` (the PDM drafters' table, then every method side by
side, on the footing `inference.eval`'s help describes) and `eval.png`, from the `eval.json` dict
(inference/evaluation/run.py).
"""

from __future__ import annotations

import json
import os

from inference import cli
from inference.evaluation.costs import GPU_LABEL
from inference.evaluation.tables import fmt, fmt_ci, fmt_spread, grouped_bars, markdown_table, pyplot, rates, save


def _spd_table(report: dict) -> list[str]:
    head = ["method", "set", "T", "prompts", "N", "K", "alpha [95 %]", "S0 = n*alpha [95 %]"]
    head += ["r (min-max, repeats)", "S_spd", "S_post/ppsd", "S own mode [95 %]", GPU_LABEL, "S at GPU r [95 %]"]
    head += ["tok/s", "AR tok/s", "wall-clock [95 %]", "accept by fill"]
    rows = [
        [
            r["method"],
            r["set"],
            f"{r['temperature']:g}",
            str(r["prompts"]),
            str(r["N"]),
            str(r["K"]),
            fmt_ci(r["alpha"], r["ci"]["alpha"], 3),
            fmt_ci(r["S0"], r["ci"]["S0"]),
            fmt_spread(r),
            fmt(r["S_spd"], 2),
            fmt(r["S_post"], 2),
            fmt_ci(r["S"], r["ci"]["S"]),
            fmt(r["r_gpu"], 3),
            fmt_ci(r["S_gpu"], r["ci"]["S_gpu"]),
            fmt(r["decode_tokens_per_s"], 1),
            fmt(r["ar_decode_tokens_per_s"], 1),
            fmt_ci(r["wall_clock_speedup"], r["ci"]["wall_clock_speedup"]),
            rates(r.get("accept_by_fill")),
        ]
        for r in report["results"]
    ]
    title = (
        f"PDM drafters: --ckpt mode={report['mode']} n={report['n']} L_s={report['L_s']} target={report['target']} "
        f"max_new_tokens={report['max_new_tokens']}{' (simulator: wall-clock is sequential)' if report['simulate'] else ''}"
    )
    return [title, "", *markdown_table(head, rows)]


def side_by_side(report: dict) -> list[dict]:
    """Every method's rows on one footing: tokens per target forward, theoretical and wall-clock speedup."""
    spd = list(report["results"])
    eagle3 = [{**r, "method": f"eagle3 k={r['k']}"} for r in report["eagle3_results"]]
    return sorted(spd + eagle3, key=lambda r: (r["temperature"], r["set"] == "overall", r["set"]))


def side_by_side_table(report: dict) -> list[str]:
    head = ["method", "set", "T", "prompts", "tokens per target forward [95 %]", "r (min-max, repeats)"]
    head += ["theoretical [95 %]", GPU_LABEL, "theoretical at GPU r [95 %]", "wall-clock (CPU) [95 %]"]
    rows = [
        [
            r["method"],
            r["set"],
            f"{r['temperature']:g}",
            str(r["prompts"]),
            fmt_ci(r["S0"], r["ci"]["S0"]),
            fmt_spread(r),
            fmt_ci(r["S"], r["ci"]["S"]),
            fmt(r["r_gpu"], 3),
            fmt_ci(r["S_gpu"], r["ci"]["S_gpu"]),
            fmt_ci(r["wall_clock_speedup"], r["ci"]["wall_clock_speedup"]),
        ]
        for r in side_by_side(report)
    ]
    eagle3 = f", EAGLE-3 drafter {report['eagle3_drafter']}" if report["eagle3_drafter"] else ""
    title = (
        "Side by side, speedups over AR measured in this run (tokens per target forward: n*alpha for SPD, "
        "N/K for EAGLE-3; theoretical: S_spd, S_post/S_ppsd, S_eagle3 = tau/(1 + k r + T_verify/T_full - 1), "
        f"r in units of this process's AR forward, inference/evaluation/costs.py){eagle3}"
    )
    return [title, "", *markdown_table(head, rows)]


def plot_side_by_side(report: dict, path: str) -> None:
    rows = side_by_side(report)
    labels = [f"{r['method']}\n{r['set']} T={r['temperature']:g}" for r in rows]
    fig, (ax1, ax2) = pyplot().subplots(1, 2, figsize=(max(8, 1.6 * len(rows)), 4))
    x = grouped_bars(ax1, [("tokens per target forward", [r["S0"] for r in rows])])
    ax1.set_xticks(x, labels, fontsize=6)
    ax1.set_title("tokens per target forward")
    keys = [("S", "theoretical"), ("S_gpu", "theoretical at GPU r"), ("wall_clock_speedup", "wall-clock (CPU)")]
    x = grouped_bars(ax2, [(label, [r[key] for r in rows]) for key, label in keys])
    ax2.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax2.set_xticks(x, labels, fontsize=6)
    ax2.set_title("speedup over AR, same run")
    ax2.legend(fontsize=8)
    save(fig, path)


def several_methods(report: dict) -> bool:
    return bool(report["eagle3_results"]) or len({r["drafter"] for r in report["results"]}) > 1


def markdown(report: dict) -> str:
    """The PDM drafters' table (when one was evaluated), then the side-by-side table of every method."""
    parts = []
    if report["results"]:
        parts += _spd_table(report)
    if several_methods(report):
        parts += ([""] if parts else []) + side_by_side_table(report)
    compiled = report.get("compiled", {})
    if report["eagle3_results"] and compiled.get("pdm") and not compiled.get("eagle3"):
        parts += [
            "",
            "EAGLE-3 ran eagerly (chain decoding has no compiled path), its times over an eager AR baseline's; the PDM "
            "drafters and their AR baseline ran compiled (`--compile`).",
        ]
    return "\n".join(parts) + "\n"


def plot(report: dict, path: str) -> None:
    if several_methods(report):
        return plot_side_by_side(report, path)
    rows = report["results"]
    labels = [f"{r['set']}\nT={r['temperature']:g}" for r in rows]
    fig, (ax1, ax2) = pyplot().subplots(1, 2, figsize=(max(8, 2.2 * len(rows)), 4))
    x = grouped_bars(ax1, [("alpha", [r["alpha"] for r in rows])])
    ax1.set_xticks(x, labels, fontsize=8)
    ax1.set_ylim(0, 1)
    ax1.set_title("alpha = N / K")
    keys = [("S0", "S0 = n*alpha"), ("S_spd", "S_spd"), ("S_post", "S_post/ppsd"), ("wall_clock_speedup", "wall-clock")]
    x = grouped_bars(ax2, [(label, [r[key] for r in rows]) for key, label in keys])
    ax2.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax2.set_xticks(x, labels, fontsize=8)
    ax2.set_title(f"speedup over AR (n={report['n']}, L_s={report['L_s']})")
    ax2.legend(fontsize=8)
    save(fig, path)


def write_outputs(report: dict, out: str) -> None:
    with cli.writing(out):
        with open(os.path.join(out, "eval.json"), "w") as f:
            json.dump(report, f, indent=1)
        with open(os.path.join(out, "eval.md"), "w") as f:
            f.write(markdown(report))
        plot(report, os.path.join(out, "eval.png"))
