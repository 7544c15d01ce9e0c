"""The paper's experiments (Tables 2-4, layout and anchor ablations) on the benchmark tiny target.

    python scripts/bench_paper.py train all --jobs 2        # fit every drafter (configs/bench_tiny.yaml + overrides)
    python scripts/bench_paper.py eval all --jobs 2         # python -m inference.eval on GSM8K, HumanEval, ShareGPT
    python scripts/bench_paper.py table --out docs/BENCHMARKS.md --png docs/paper_tables.png
    python scripts/bench_paper.py alphas                    # {"n,L_s": alpha} of the SPD runs for inference.plan
    python scripts/bench_paper.py plancheck                 # inference.plan vs the real n+1-process pipeline
    python scripts/bench_paper.py repetition                # how repetitive the target's greedy output is
    python scripts/bench_paper.py train all --suite deep    # the same on the 16-layer target (configs/bench_deep.yaml)

Every run is an ordinary `python -m spd_lightning fit` / `python -m inference.eval` command; this script
only names the runs, prints each command before running it (so the docs can quote it), runs up to
`--jobs` of them at once with `--threads` torch threads each, and gathers the numbers. Each run writes
under `ROOT/NAME/` (`--root`, default `runs/bench`): `checkpoints/last.ckpt`, `logs/` (CSV metrics),
`train.json` (the command, wall time, final validation agreement) and `eval/eval.json`.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import glob
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from inference import cli  # noqa: E402
from inference.evaluation.repetition import repeated_kgrams  # noqa: E402
from inference.evaluation.tables import fmt, grouped_bars, markdown_table, pyplot, save  # noqa: E402
from spd_lightning.errors import UserError  # noqa: E402
from spd_lightning.geometry import MODES  # noqa: E402

SETS = {
    "gsm8k": "../shared/data/gsm8k_question.jsonl",
    "humaneval": "../shared/data/humaneval_question.jsonl",
    "sharegpt": "runs/bench/sharegpt.jsonl",
}


class BenchError(UserError):
    """A bad argument or a failed run; one line."""


class Run(NamedTuple):
    n: int
    L_s: int
    mode: str  # a key of spd_lightning.geometry.MODES
    layout: str = "depth"
    anchors: str = "n_scaled"
    # Equal wall-clock: (reference, twin) trains this run for the steps the reference took times the reference's
    # minutes over the twin's (the twin is this run's configuration trained for equal steps).
    wall_of: tuple[str, str] | None = None


# The base run is spd_n4_L1 (the config as written).
TINY_RUNS = {
    "spd_n2_L3": Run(2, 3, "spd"),
    "spd_n4_L1": Run(4, 1, "spd"),
    "spd_n8_L1": Run(8, 1, "spd"),
    "ppsd_n2_L3": Run(2, 3, "ppsd"),
    "ppsd_n4_L1": Run(4, 1, "ppsd"),
    "ppsd_n8_L1": Run(8, 1, "ppsd"),
    "spd_n4_L2": Run(4, 2, "spd"),
    "spd_n4_L3": Run(4, 3, "spd"),
    "spd_n4_L4": Run(4, 4, "spd"),
    "post_n4_L1": Run(4, 1, "post_step"),
    "type_n4_L1": Run(4, 1, "spd", layout="type"),
    "quarters_n4_L1": Run(4, 1, "spd", anchors="quarters"),
}
TINY_TABLES = {
    "Table 2 shape: SPD vs PPSD across n (L_s = max(1, L/n - 1) with L = 8)": [
        "spd_n2_L3",
        "spd_n4_L1",
        "spd_n8_L1",
        "ppsd_n2_L3",
        "ppsd_n4_L1",
        "ppsd_n8_L1",
    ],
    "Table 3 shape: PDM depth L_s at n = 4": ["spd_n4_L1", "spd_n4_L2", "spd_n4_L3", "spd_n4_L4"],
    "Table 4 shape: pre-step vs post-step drafting at n = 4, L_s = 1": ["spd_n4_L1", "post_n4_L1"],
    "Training layout: depth vs type at n = 4, L_s = 1, equal steps": ["spd_n4_L1", "type_n4_L1"],
    "Anchor presets at n = 4, L_s = 1": ["spd_n4_L1", "quarters_n4_L1"],
}

# The deeper (16-layer) target: L_s = 3 everywhere (the paper's configuration); the base run is spd_n4_L3.
DEEP_RUNS = {
    "spd_n2_L3": Run(2, 3, "spd"),
    "spd_n4_L3": Run(4, 3, "spd"),
    "spd_n8_L3": Run(8, 3, "spd"),
    "ppsd_n2_L3": Run(2, 3, "ppsd"),
    "ppsd_n4_L3": Run(4, 3, "ppsd"),
    "ppsd_n8_L3": Run(8, 3, "ppsd"),
    "type_n4_L3": Run(4, 3, "spd", layout="type"),
    "type_n8_L3": Run(8, 3, "spd", layout="type"),
    "type_n4_L3_wall": Run(4, 3, "spd", layout="type", wall_of=("spd_n4_L3", "type_n4_L3")),
    "type_n8_L3_wall": Run(8, 3, "spd", layout="type", wall_of=("spd_n8_L3", "type_n8_L3")),
}
DEEP_TABLES = {
    "Table 2 shape on the 16-layer target: SPD vs PPSD across n (L_s = 3)": [
        "spd_n2_L3",
        "spd_n4_L3",
        "spd_n8_L3",
        "ppsd_n2_L3",
        "ppsd_n4_L3",
        "ppsd_n8_L3",
    ],
    "Training layout at L_s = 3: depth vs type, equal steps": ["spd_n4_L3", "type_n4_L3", "spd_n8_L3", "type_n8_L3"],
    "Training layout at L_s = 3: depth vs type, equal wall-clock": [
        "spd_n4_L3",
        "type_n4_L3_wall",
        "spd_n8_L3",
        "type_n8_L3_wall",
    ],
}


class Suite(NamedTuple):
    """A target and the drafters trained on it: defaults for --config/--root/--target/--calibration/--checks and
    the marked region of the docs its tables replace."""

    config: str
    root: str
    target: str
    runs: dict[str, Run]
    tables: dict[str, list[str]]
    region: str
    calibration: str
    checks: list[str]


SUITES = {
    "tiny": Suite(
        "configs/bench_tiny.yaml",
        "runs/bench",
        "artifacts/bench_target",
        TINY_RUNS,
        TINY_TABLES,
        "paper-tables",
        "spd_n4_L1",
        ["spd_n4_L3", "spd_n2_L3"],
    ),
    "deep": Suite(
        "configs/bench_deep.yaml",
        "runs/bench_deep",
        "artifacts/deep_target",
        DEEP_RUNS,
        DEEP_TABLES,
        "deep-tables",
        "spd_n4_L3",
        ["spd_n2_L3", "spd_n8_L3"],
    ),
}


# EAGLE-3 baseline runs (docs/EAGLE3.md): name -> TTT steps. Trained on the same data, trainer and steps as
# the config's PDM (its model section swapped for the EAGLE-3 drafter's), evaluated at each of EAGLE3_EVAL_K.
EAGLE3_RUNS = {"eagle3_k7": 7}
EAGLE3_EVAL_K = ("3", "5", "7")


def eagle3_train_command(name: str, args: argparse.Namespace) -> list[str]:
    """`fit` on the `--config` with the EAGLE-3 module (`--model Eagle3Module` keeps the options both drafters take:
    the target and the optimizer settings) and without the staircase callback (it decodes a PDM)."""
    out = f"{args.root}/{name}"
    return ["python", "-m", "spd_lightning", "fit", "--config", args.config, "--model", "Eagle3Module"] + [
        *("--model.ttt_steps", str(EAGLE3_RUNS[name]), "--trainer.callbacks", "[]"),
        *("--trainer.default_root_dir", out, "--trainer.logger.init_args.save_dir", out),
        *("--checkpoint.dirpath", f"{out}/checkpoints"),
        *shlex.split(args.extra),
    ]


def eagle3_eval_command(name: str, args: argparse.Namespace) -> list[str]:
    """Chain decoding at each k of EAGLE3_EVAL_K, T = 0 and 1, beside AR in the same run, into NAME/eval."""
    return ["python", "-m", "inference.eval", "--ckpt", f"{args.root}/{name}/checkpoints/last.ckpt"] + [
        *("--k", *EAGLE3_EVAL_K, "--prompts", *args.sets.values(), "--limit", str(args.limit)),
        *("--max-new-tokens", str(args.max_new_tokens), "--temperatures", "0", "1", "--no-progress"),
        *("--out", f"{args.root}/{name}/eval"),
    ]


def train_command(name: str, args: argparse.Namespace) -> list[str]:
    if name in EAGLE3_RUNS:
        return eagle3_train_command(name, args)
    run = args.runs[name]
    schedule, features = MODES[run.mode]
    out = f"{args.root}/{name}"
    steps = []
    if run.wall_of:  # max_epochs off: the step count, not the epoch cap, ends the run
        steps = ["--trainer.max_steps", str(wall_clock_steps(run, args)), "--trainer.max_epochs", "-1"]
    return [
        "python",
        "-m",
        "spd_lightning",
        "fit",
        "--config",
        args.config,
        "--model.n",
        str(run.n),
        "--model.num_layers",
        str(run.L_s),
        "--model.schedule",
        schedule,
        "--model.features",
        features,
        "--model.layout",
        run.layout,
        "--model.anchors",
        run.anchors,
        "--trainer.default_root_dir",
        out,
        "--trainer.logger.init_args.save_dir",
        out,
        "--checkpoint.dirpath",
        f"{out}/checkpoints",
        *steps,
        *shlex.split(args.extra),
    ]


def wall_clock_steps(run: Run, args: argparse.Namespace) -> int:
    """The steps that take as long as the reference run's: its steps times its time per step over this layout's.
    Times per step are the CPU seconds `scripts/bench_train_step.py` measured (`--step-times`: robust on a shared
    machine), else the minutes per step of the reference and the equal-steps twin as they trained."""
    records = {}
    for name in run.wall_of:
        try:
            with open(f"{args.root}/{name}/train.json") as f:
                records[name] = json.load(f)
        except OSError:
            raise BenchError(f"train {name} first: its wall-clock time sets this run's steps") from None
    reference, twin = (records[name] for name in run.wall_of)
    if not args.step_times:
        return round(reference["minutes"] / (twin["minutes"] / twin["steps"]))
    with open(args.step_times) as f:
        cpu = {(r["layout"], r["n"], r["L_s"]): r["cpu_s"] for r in json.load(f)}
    ref_run = args.runs[run.wall_of[0]]
    try:
        ratio = cpu[(ref_run.layout, ref_run.n, ref_run.L_s)] / cpu[(run.layout, run.n, run.L_s)]
    except KeyError as e:
        raise BenchError(f"--step-times {args.step_times} has no row for (layout, n, L_s) = {e}") from None
    return round(reference["steps"] * ratio)


def eval_command(name: str, args: argparse.Namespace, pipeline: bool = False) -> list[str]:
    """The simulator at T = 0 and 1 into NAME/eval, or (`pipeline`) the n+1 gloo processes, greedy, into pipeline/NAME."""
    if name in EAGLE3_RUNS:
        return eagle3_eval_command(name, args)
    out, mode = (
        (f"{args.root}/pipeline/{name}", ["0"]) if pipeline else (f"{args.root}/{name}/eval", ["0", "1", "--simulate"])
    )
    return [
        "python",
        "-m",
        "inference.eval",
        "--ckpt",
        f"{args.root}/{name}/checkpoints/last.ckpt",
        "--prompts",
        *args.sets.values(),
        "--limit",
        str(args.limit),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--temperatures",
        *mode,
        "--no-progress",
        "--out",
        out,
    ]


def _run(name: str, command: list[str], threads: int, log: str) -> tuple[int, float]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), WANDB_MODE="offline")
    print(f"[{name}] {shlex.join(command)}", flush=True)
    start = time.time()
    os.makedirs(os.path.dirname(log), exist_ok=True)
    with open(log, "w") as f:
        code = subprocess.run([sys.executable, *command[1:]], env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    minutes = (time.time() - start) / 60
    print(f"[{name}] exit {code} after {minutes:.1f} min (log: {log})", flush=True)
    return code, minutes


def train(name: str, args: argparse.Namespace) -> int:
    command = train_command(name, args)
    code, minutes = _run(name, command, args.threads, f"{args.root}/{name}/train.log")
    record = {
        "name": name,
        "command": shlex.join(command),
        "exit": code,
        "minutes": round(minutes, 2),
        "threads": args.threads,
        "jobs": args.jobs,
        "date": datetime.date.today().isoformat(),
        **final_metrics(f"{args.root}/{name}"),
    }
    with open(f"{args.root}/{name}/train.json", "w") as f:
        json.dump(record, f, indent=1)
    return code


def final_metrics(run_dir: str) -> dict:
    """Steps, last validation agreement and loss from the run's CSV metrics (any logger save_dir under the run)."""
    out: dict = {}
    for path in sorted(glob.glob(f"{run_dir}/**/metrics.csv", recursive=True), key=os.path.getmtime)[-1:]:
        with open(path) as f:
            for row in csv.DictReader(f):
                if row.get("train/loss"):  # logged at step index s after s + 1 optimizer steps
                    out["steps"] = max(out.get("steps", 0), int(row["step"]) + 1)
                elif row.get("step"):  # validation at the end: logged at the optimizer steps done
                    out["steps"] = max(out.get("steps", 0), int(row["step"]))
                for key in ("val/agree", "val/loss"):
                    if row.get(key):
                        out[key] = float(row[key])
    return out


def evaluate(name: str, args: argparse.Namespace) -> int:
    return _run(name, eval_command(name, args), args.threads, f"{args.root}/{name}/eval.log")[0]


def load_runs(args: argparse.Namespace) -> dict[str, tuple[dict, dict]]:
    """(train.json, eval.json) of every run of the suite that has both, in the suite's order."""
    runs = {}
    for name in args.runs:
        train_file, eval_file = f"{args.root}/{name}/train.json", f"{args.root}/{name}/eval/eval.json"
        if os.path.isfile(train_file) and os.path.isfile(eval_file):
            with open(train_file) as f, open(eval_file) as g:
                runs[name] = (json.load(f), json.load(g))
    return runs


def _result(report: dict, set_name: str, temperature: float) -> dict:
    return next(r for r in report["results"] if r["set"] == set_name and r["temperature"] == temperature)


def _sets(report: dict) -> list[str]:
    return list(dict.fromkeys(r["set"] for r in report["results"] if r["set"] != "overall"))


def adjusted(report: dict, row: dict) -> float | None:
    """The speedup that charges the measured draft cost the way the run's mode pays it (SPEC 6)."""
    return row["S_spd"] if report["mode"] == "spd" else row["S_post"]


def table(runs: dict[str, tuple[dict, dict]], names: list[str], suite: dict[str, Run]) -> str:
    sets = _sets(runs[names[0]][1])
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
        "S adj. T=0",
        "alpha T=1",
        "S adj. T=1",
        "train min",
    ]
    rows = []
    for name in names:
        trained, report = runs[name]
        greedy, sampled = _result(report, "overall", 0.0), _result(report, "overall", 1.0)
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
                *(fmt(_result(report, s, 0.0)["alpha"]) for s in sets),
                fmt(greedy["alpha"]),
                fmt(greedy["S0"], 2),
                fmt(greedy["r"]),
                fmt(adjusted(report, greedy), 2),
                fmt(sampled["alpha"]),
                fmt(adjusted(report, sampled), 2),
                fmt(trained["minutes"], 1),
            ]
        )
    return "\n".join(markdown_table(head, rows))


def eagle3_table(args: argparse.Namespace) -> list[str]:
    """The EAGLE-3 runs under --root, per k and T (pooled over the sets), and their commands: markdown lines,
    none when not run."""
    head = ["run", "k", "T", "steps", "val loss", "tokens per target forward", "tau", "r", "S_eagle3", "wall-clock"]
    rows, commands = [], []
    for name in EAGLE3_RUNS:
        try:
            with open(f"{args.root}/{name}/train.json") as f, open(f"{args.root}/{name}/eval/eval.json") as g:
                trained, report = json.load(f), json.load(g)
        except OSError:
            continue
        commands += [trained["command"], shlex.join(eagle3_eval_command(name, args))]
        for r in sorted(report["eagle3_results"], key=lambda r: (r["temperature"], r["k"])):
            if r["set"] == "overall":
                rows.append(
                    [name, str(r["k"]), f"{r['temperature']:g}", str(trained.get("steps", "-"))]
                    + [fmt(trained.get("val/loss"), 2), fmt(r["alpha"], 2), fmt(r["tau"], 2), fmt(r["r"])]
                    + [fmt(r["S_eagle3"], 2), fmt(r["wall_clock_speedup"], 2)]
                )
    if not rows:
        return []
    table = ["### EAGLE-3 on the same target, data and steps", "", *markdown_table(head, rows), ""]
    return table + ["```bash", *commands, "```", ""]


def ar_line(runs: dict[str, tuple[dict, dict]]) -> str:
    """The AR baseline as every evaluation measured it (same target and prompts, one process)."""
    greedy = [_result(report, "overall", 0.0) for _, report in runs.values()]
    rates = [r["ar_decode_tokens_per_s"] for r in greedy]
    t_full = [r["T_full_s"] * 1e3 for r in greedy]
    return (
        f"AR baseline (speedup 1 by definition): {min(rates):.1f}-{max(rates):.1f} decode tok/s greedy, "
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
        print(f"wrote {args.png}")


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
    x = grouped_bars(ax1, [(s, [_result(r, s, 0.0)["alpha"] for r in reports]) for s in _sets(reports[0])])
    ax1.set_xticks(x, names, rotation=45, ha="right", fontsize=8)
    ax1.set_title("step acceptance alpha = N / K (greedy)")
    ax1.legend(fontsize=8)
    for temperature, marker in ((0.0, "o"), (1.0, "s")):
        rows = [_result(r, "overall", temperature) for r in reports]
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
    ax2.set_title("speedup over AR (SPEC 6)")
    ax2.legend(fontsize=8)
    save(fig, path)


def write_alphas(args: argparse.Namespace) -> None:
    """Greedy overall alpha of the pre-step SPD runs as `{"n,L_s": alpha}`, for `inference.plan --alphas`."""
    runs = load_runs(args)
    alphas = {
        f"{r['n']},{r['L_s']}": _result(r, "overall", 0.0)["alpha"]
        for name, (_, r) in runs.items()
        if args.runs[name][2:5] == ("spd", "depth", "n_scaled")
    }
    with open(args.out, "w") as f:
        json.dump(alphas, f, indent=1)
    print(f"wrote {args.out}: {alphas}")


def plan_check(args: argparse.Namespace) -> None:
    """The planner against the real pipeline: run n+1 gloo processes for the calibration drafter and the
    checks (greedy, the eval's prompts), predict every check from the calibration's times alone (the draft
    cost per PDM layer from the calibration and the first check with another L_s), and tabulate predicted vs
    measured."""
    calibration_name, names = args.calibration, [args.calibration, *args.checks]
    reports = {}
    for name in names:
        out = f"{args.root}/pipeline/{name}"
        if _run(name, eval_command(name, args, pipeline=True), args.threads, f"{out}.log")[0] != 0:
            raise BenchError(f"the pipeline evaluation of {name} failed (see {out}.log)")
        with open(f"{out}/eval.json") as f:
            reports[name] = json.load(f)
    greedy = {name: _result(r, "overall", 0.0) for name, r in reports.items()}
    calibration = reports[calibration_name]
    d1, l1 = greedy[calibration_name]["T_draft_s"], calibration["L_s"]
    other = next((n for n in args.checks if reports[n]["L_s"] != l1), None)
    per_layer = (greedy[other]["T_draft_s"] - d1) / (reports[other]["L_s"] - l1) if other else d1 / l1
    draft_fixed = min(max(0.0, d1 - per_layer * l1), 0.99 * d1)
    command = [
        "python",
        "-m",
        "inference.plan",
        "--times",
        f"{args.root}/pipeline/{calibration_name}/eval.json",
        "--draft-fixed",
        f"{draft_fixed:.6f}",
        "--json",
        f"{args.root}/pipeline/plan.json",
        "--plot",
        f"{args.root}/pipeline/plan.png",
    ]
    command += [
        a for n in names for a in ("--alpha", f"{reports[n]['n']}:{reports[n]['L_s']}:{greedy[n]['alpha']:.6f}")
    ]
    if _run("plan", command, args.threads, f"{args.root}/pipeline/plan.log")[0] != 0:
        raise BenchError(f"inference.plan failed (see {args.root}/pipeline/plan.log)")
    with open(f"{args.root}/pipeline/plan.json") as f:
        predicted = {(r["n"], r["L_s"]): r for r in json.load(f)["rows"]}
    lines = [
        f"Calibration: {calibration_name} (T_full {greedy[calibration_name]['T_full_s'] * 1e3:.2f} ms, slowest stage "
        f"{greedy[calibration_name]['mean_slowest_stage_s'] * 1e3:.2f} ms, overhead "
        f"{calibration['plan_inputs']['overhead_s'] * 1e3:.2f} ms); draft {draft_fixed * 1e3:.2f} ms + "
        f"{per_layer * 1e3:.2f} ms per PDM layer.",
        "",
        "| run | n | L_s | alpha | predicted cycle (ms) | measured cycle (ms) | predicted speedup | measured speedup |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        row, r = predicted[(reports[name]["n"], reports[name]["L_s"])], greedy[name]
        lines.append(
            f"| {name}{' (calibration)' if name == calibration_name else ''} | {row['n']} | {row['L_s']} | "
            f"{row['alpha']:.3f} | {row['cycle'] * 1e3:.2f} | {r['mean_cycle_s'] * 1e3:.2f} | "
            f"{row['speedup']:.2f} | {r['wall_clock_speedup']:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    with open(f"{args.root}/pipeline/plan_check.md", "w") as f:
        f.write(text)
    print(text, end="")


def repetition(args: argparse.Namespace) -> None:
    """How repetitive the target's own greedy output is on the eval prompts (SPEC 8: repetition flatters
    every drafter): AR-decode the first `--limit` prompts of each set and count repeated 4-grams."""
    target = args.target
    lines = ["| set | prompts | tokens | share of tokens completing a repeated 4-gram |", "|---|---|---|---|"]
    for path in args.sets.values():
        subset = f"{args.root}/repetition/{os.path.basename(path)}"
        os.makedirs(os.path.dirname(subset), exist_ok=True)
        with open(path) as f, open(subset, "w") as g:
            g.writelines([line for line in f if line.strip()][: args.limit])
        out = subset + ".ar.json"
        command = [
            "python",
            "-m",
            "inference.decode",
            "--target",
            target,
            "--mode",
            "ar",
            "--prompts",
            subset,
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--json",
            out,
        ]
        if _run("repetition", command, args.threads, out + ".log")[0] != 0:
            raise BenchError(f"AR decoding failed (see {out}.log)")
        with open(out) as f:
            outputs = [p["tokens"] for p in json.load(f)["prompts"]]
        repeats, ends = (sum(x) for x in zip(*(repeated_kgrams(t) for t in outputs)))
        lines.append(
            f"| {os.path.basename(path)} | {len(outputs)} | {sum(len(t) for t in outputs)} | {repeats / max(ends, 1):.2f} |"
        )
    print("\n".join(lines))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["train", "eval", "table", "alphas", "plancheck", "repetition", "commands"])
    p.add_argument("names", nargs="*", help="run names or 'all' (each suite's names: --help of `commands`)")
    p.add_argument(
        "--suite", choices=SUITES, default="tiny", help="the target and its drafters (tiny: 8 layers, deep: 16)"
    )
    p.add_argument("--root", help="where the runs live (default: the suite's, runs/bench or runs/bench_deep)")
    p.add_argument("--config", help="train: the base config (default: the suite's)")
    p.add_argument(
        "--step-times", help="train: bench_train_step.py json whose CPU s/step set the equal wall-clock runs' steps"
    )
    p.add_argument("--extra", default="", help="train: more `fit` arguments for every run, one shell-quoted string")
    p.add_argument("--sets", nargs="+", help="eval: jsonl prompt sets (default: GSM8K, HumanEval, ShareGPT held-out)")
    p.add_argument("--jobs", type=int, default=1, help="runs at once")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--limit", type=int, default=10, help="eval: prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=64, help="eval: tokens per prompt")
    p.add_argument(
        "--out",
        help="table: markdown file; its text between the paper-tables markers is replaced when it "
        "has them (default docs/BENCHMARKS.md); alphas: json (default ROOT/alphas.json)",
    )
    p.add_argument("--png", default="docs/paper_tables.png", help="table: plot output ('' for none)")
    p.add_argument("--target", help="repetition: the target to decode with (default: the suite's)")
    p.add_argument("--calibration", help="plancheck: the run whose measured times calibrate the planner")
    p.add_argument("--checks", nargs="+", help="plancheck: runs predicted and measured")
    p.add_argument("--debug", action="store_true", help="show tracebacks (also SPD_DEBUG=1)")
    args = p.parse_args(argv)
    args.sets = dict(enumerate(args.sets)) if args.sets else SETS
    suite = SUITES[args.suite]
    for key in ("config", "root", "target", "calibration", "checks"):
        if getattr(args, key) is None:
            setattr(args, key, getattr(suite, key))
    args.runs, args.tables, args.region = suite.runs, suite.tables, suite.region
    args.names = list(args.runs) if args.names in ([], ["all"]) else args.names
    return args


def run(args: argparse.Namespace) -> None:
    known = [*args.runs, *EAGLE3_RUNS]
    unknown = [n for n in [*args.names, args.calibration, *args.checks] if n not in known]
    if unknown:
        raise BenchError(f"unknown run {unknown[0]!r} in suite {args.suite!r}: choose from {', '.join(known)} or 'all'")
    if args.jobs < 1 or args.threads < 1:
        raise BenchError("--jobs and --threads must be >= 1")
    if args.action == "table":
        args.out = args.out or "docs/BENCHMARKS.md"
        return write_tables(args)
    if args.action == "alphas":
        args.out = args.out or f"{args.root}/alphas.json"
        return write_alphas(args)
    if args.action == "repetition":
        return repetition(args)
    if args.action == "plancheck":
        return plan_check(args)
    if args.action == "commands":
        for name in args.names:
            print(shlex.join(train_command(name, args)))
            print(shlex.join(eval_command(name, args)))
        return
    work = train if args.action == "train" else evaluate
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        codes = list(pool.map(lambda name: work(name, args), args.names))
    failed = [n for n, c in zip(args.names, codes) if c != 0]
    if failed:
        raise BenchError(f"{args.action} failed for {', '.join(failed)} (see {args.root}/NAME/*.log)")


def main(argv: list[str] | None = None) -> int:
    """Exit 0 when every step worked; 2 with one `error:` line for a bad argument or a failed run."""
    return cli.main(argv, parse_args, run, lambda _args, _result: 0)


if __name__ == "__main__":
    sys.exit(main())
