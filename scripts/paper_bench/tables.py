"""The benchmark's tables and plots, generated from each run's train.json and eval/eval.json into the suite's
marked region of docs/BENCHMARKS.md."""

from __future__ import annotations

import argparse
import json
import os
import shlex

from inference.evaluation import costs
from inference.evaluation.tables import fmt, fmt_ci, fmt_spread, grouped_bars, markdown_table, pyplot, rates, save

from .curves import plot_curves
from .registry import EAGLE3_EVAL_K, EAGLE3_RUNS, Run
from .runner import eagle3_eval_command


def load_runs(args: argparse.Namespace) -> dict[str, tuple[dict, dict]]:
    """(train.json, eval.json) of every run of the suite that has both, in the suite's order."""
    runs = {}
    for name in args.runs:
        train_file, eval_file = f"{args.root}/{name}/train.json", f"{args.root}/{name}/eval/eval.json"
        if os.path.isfile(train_file) and os.path.isfile(eval_file):
            with open(train_file) as f, open(eval_file) as g:
                runs[name] = (json.load(f), json.load(g))
    return runs


def result_row(report: dict, set_name: str, temperature: float) -> dict:
    return next(r for r in report["results"] if r["set"] == set_name and r["temperature"] == temperature)


def set_names(report: dict) -> list[str]:
    return list(dict.fromkeys(r["set"] for r in report["results"] if r["set"] != "overall"))


def adjusted(report: dict, row: dict) -> float | None:
    """The speedup that charges the measured draft cost the way the run's mode pays it (inference/evaluation/costs.py;
    a row from before the cost model has no `S`: its own mode's formula at its pooled r)."""
    if "S" in row:
        return row["S"]
    return row["S_spd"] if report["mode"] == "spd" else row["S_post"]


def at_gpu_r(report: dict, row: dict) -> float | None:
    """The speedup at the GPU r of the paper's times for this run's L_s (from alpha alone, so older rows have it)."""
    if row.get("alpha") is None:
        return None
    return float(costs.pdm_speedup(report["mode"], report["n"], row["alpha"], costs.gpu_r(report["L_s"])))


def eagle3_at_gpu_r(row: dict) -> float | None:
    if row.get("tau") is None:
        return None
    return float(costs.s_eagle3(row["tau"], row["k"], costs.gpu_r(1), costs.GPU_VERIFY_RATIO))


def with_ci(row: dict, key: str, value: float | None) -> str:
    """A value with its interval; `(no CI)` marks a row evaluated before intervals existed."""
    if "ci" not in row:
        return f"{fmt(value, 2)} (no CI)" if value is not None else "-"
    return fmt_ci(value, row["ci"].get(key))


def table(runs: dict[str, tuple[dict, dict]], names: list[str], suite: dict[str, Run]) -> str:
    sets = set_names(runs[names[0]][1])
    head = [
        "run",
        "mode",
        "n",
        "L_s",
        "layout",
        "anchors",
        "steps",
        "val agree",
        *(f"alpha {s}" for s in sets),
        "alpha T=0",
        "n*alpha",
        "r",
        "S adj. T=0 [95 %]",
        "S at GPU r T=0",
        "alpha T=1",
        "S adj. T=1 [95 %]",
        "accept by depth T=0",
        "train min",
    ]
    rows = []
    for name in names:
        trained, report = runs[name]
        greedy, sampled = result_row(report, "overall", 0.0), result_row(report, "overall", 1.0)
        rows.append(
            [
                name,
                report["mode"],
                str(report["n"]),
                str(report["L_s"]),
                suite[name].layout,
                suite[name].anchors,
                str(trained.get("steps", "-")),
                fmt(trained.get("val/agree")),
                *(fmt(result_row(report, s, 0.0)["alpha"]) for s in sets),
                fmt(greedy["alpha"]),
                fmt(greedy["S0"], 2),
                fmt_spread(greedy),
                with_ci(greedy, "S", adjusted(report, greedy)),
                fmt(at_gpu_r(report, greedy), 2),
                fmt(sampled["alpha"]),
                with_ci(sampled, "S", adjusted(report, sampled)),
                rates(greedy.get("accept_by_depth")),
                fmt(trained["minutes"], 1),
            ]
        )
    return "\n".join(markdown_table(head, rows))


def eagle3_cell(row: dict) -> str:
    """S_eagle3 with its interval; a row from before the cost model charged r = T_draft_step / T_verify and no
    verify cost, which flatters EAGLE-3: marked `(old r)`."""
    if "verify_ratio" not in row:
        return f"{fmt(row['S_eagle3'], 2)} (old r)"
    return with_ci(row, "S", row["S_eagle3"])


def evaluated_with(args: argparse.Namespace, report: dict) -> argparse.Namespace:
    """`args` with the prompt sets, limit, length and k the report was evaluated with (its command, not the defaults)."""
    paths = dict.fromkeys(r["path"] for r in report["eagle3_results"] if r["path"])
    limits = {"limit": report["limit"], "max_new_tokens": report["max_new_tokens"]}
    limits["eagle3_k"] = [str(k) for k in report["k"]] if report.get("k") else EAGLE3_EVAL_K
    return argparse.Namespace(**{**vars(args), "sets": dict(enumerate(paths)), **limits})


def eagle3_table(args: argparse.Namespace) -> list[str]:
    """The EAGLE-3 runs under --root, per k and T (pooled over the sets), and their commands: markdown lines,
    none when not run."""
    head = ["run", "k", "T", "steps", "val loss", "tokens per target forward", "tau", "r", "S_eagle3 [95 %]"]
    head += ["S at GPU r", "wall-clock (CPU)"]
    head.append("accept by position")
    rows, commands = [], []
    for name in EAGLE3_RUNS:
        try:
            with open(f"{args.root}/{name}/train.json") as f, open(f"{args.root}/{name}/eval/eval.json") as g:
                trained, report = json.load(f), json.load(g)
        except OSError:
            continue
        commands += [trained["command"], shlex.join(eagle3_eval_command(name, evaluated_with(args, report)))]
        for r in sorted(report["eagle3_results"], key=lambda r: (r["temperature"], r["k"])):
            if r["set"] == "overall":
                rows.append(
                    [name, str(r["k"]), f"{r['temperature']:g}", str(trained.get("steps", "-"))]
                    + [fmt(trained.get("val/loss"), 2), fmt(r["alpha"], 2), fmt(r["tau"], 2), fmt(r["r"])]
                    + [eagle3_cell(r), fmt(eagle3_at_gpu_r(r), 2), fmt(r["wall_clock_speedup"], 2)]
                    + [rates(r.get("accept_by_position"))]
                )
    if not rows:
        return []
    table = ["### EAGLE-3 on the same target, data and steps", "", *markdown_table(head, rows), ""]
    return table + ["```bash", *commands, "```", ""]


def ar_line(runs: dict[str, tuple[dict, dict]]) -> str:
    """The AR baseline as every evaluation measured it (same target and prompts, one process)."""
    greedy = [result_row(report, "overall", 0.0) for _, report in runs.values()]
    ar_rates = [r["ar_decode_tokens_per_s"] for r in greedy]
    t_full = [r["T_full_s"] * 1e3 for r in greedy]
    return (
        f"AR baseline (speedup 1 by definition): {min(ar_rates):.1f}-{max(ar_rates):.1f} decode tok/s greedy, "
        f"T_full {min(t_full):.2f}-{max(t_full):.2f} ms per token, across the {len(runs)} evaluations."
    )


def write_tables(args: argparse.Namespace) -> None:
    runs = load_runs(args)
    parts = [
        f"<!-- generated by `python scripts/bench_paper.py table --suite {args.suite}`; do not edit by hand -->",
        "",
    ]
    for title, names in args.tables.items():
        present = [n for n in names if n in runs]
        missing = [n for n in names if n not in runs]
        parts += [f"### {title}", "", table(runs, present, args.runs) if present else "(no run finished)", ""]
        if missing:
            parts += [f"Not run: {', '.join(missing)}.", ""]
    parts += eagle3_table(args)
    if runs:
        parts += [ar_line(runs), "", "Commands (one per drafter, from the repository root):", "", "```bash"]
        parts += [trained["command"] for trained, _ in runs.values()]
        parts += ["```", ""]
    write_region(args.out, "\n".join(parts), args.region)
    print(f"wrote {args.out} ({len(runs)} runs)")
    if args.png and runs:
        plot(runs, args.png)
        curves = args.png.removesuffix(".png") + "_curves.png"
        drawn = plot_curves(args.root, [*args.runs, *EAGLE3_RUNS], curves)
        print(f"wrote {args.png} and {curves} ({len(drawn)} validation curves)")


def write_region(path: str, text: str, region: str) -> None:
    """Replace the text between the region's markers of an existing file, or write the whole file."""
    BEGIN, END = f"<!-- {region}:begin -->", f"<!-- {region}:end -->"
    body = f"{BEGIN}\n{text}\n{END}"
    if os.path.isfile(path):
        with open(path) as f:
            old = f.read()
        if BEGIN in old and END in old:
            body = old[: old.index(BEGIN)] + body + old[old.index(END) + len(END) :]
    with open(path, "w") as f:
        f.write(body)


def plot(runs: dict[str, tuple[dict, dict]], path: str) -> None:
    names = list(runs)
    reports = [runs[n][1] for n in names]
    fig, (ax1, ax2) = pyplot().subplots(1, 2, figsize=(13, 4.5))
    x = grouped_bars(ax1, [(s, [result_row(r, s, 0.0)["alpha"] for r in reports]) for s in set_names(reports[0])])
    ax1.set_xticks(x, names, rotation=45, ha="right", fontsize=8)
    ax1.set_title("step acceptance alpha = N / K (greedy)")
    ax1.legend(fontsize=8)
    for temperature, marker in ((0.0, "o"), (1.0, "s")):
        rows = [result_row(r, "overall", temperature) for r in reports]
        ax2.plot(x, [row["S0"] or 0.0 for row in rows], marker, ls="none", label=f"n*alpha, T={temperature:g}")
        ax2.plot(
            x,
            [adjusted(r, row) or 0.0 for r, row in zip(reports, rows)],
            marker,
            ls="none",
            mfc="none",
            label=f"draft-cost adjusted, T={temperature:g}",
        )
    ax2.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax2.set_xticks(x, names, rotation=45, ha="right", fontsize=8)
    ax2.set_title("speedup over AR (docs/DESIGN.md, 'Speedup formulas')")
    ax2.legend(fontsize=8)
    save(fig, path)


def write_alphas(args: argparse.Namespace) -> None:
    """Greedy overall alpha of the pre-step SPD runs as `{"n,L_s": alpha}`, for `inference.plan --alphas`."""
    runs = load_runs(args)
    alphas = {
        f"{r['n']},{r['L_s']}": result_row(r, "overall", 0.0)["alpha"]
        for name, (_, r) in runs.items()
        if args.runs[name][2:5] == ("spd", "depth", "n_scaled")
    }
    with open(args.out, "w") as f:
        json.dump(alphas, f, indent=1)
    print(f"wrote {args.out}: {alphas}")
