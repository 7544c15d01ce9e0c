"""Checks beside the tables: the planner against the real n+1-process pipeline (`plancheck`) and how repetitive
the target's own greedy output is (`repetition`)."""

from __future__ import annotations

import argparse
import json
import os

from inference.evaluation.repetition import repeated_share
from inference.evaluation.tables import fmt

from .registry import BenchError
from .runner import eval_command, run_logged
from .tables import result_row


def plan_check(args: argparse.Namespace) -> None:
    """The planner against the real pipeline: run n+1 gloo processes for the calibration drafter and the
    checks (greedy, the eval's prompts), predict every check from the calibration's times alone (the draft
    cost per PDM layer from the calibration and the first check with another L_s), and tabulate predicted vs
    measured."""
    calibration_name, names = args.calibration, [args.calibration, *args.checks]
    reports = {}
    for name in names:
        out = f"{args.root}/pipeline/{name}"
        if run_logged(name, eval_command(name, args, pipeline=True), args.threads, f"{out}.log")[0] != 0:
            raise BenchError(f"the pipeline evaluation of {name} failed (see {out}.log)")
        with open(f"{out}/eval.json") as f:
            reports[name] = json.load(f)
    greedy = {name: result_row(r, "overall", 0.0) for name, r in reports.items()}
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
    if run_logged("plan", command, args.threads, f"{args.root}/pipeline/plan.log")[0] != 0:
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
    """How repetitive the target's own greedy output is on the eval prompts (docs/DESIGN.md, "Real parts, offline": repetition flatters
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
        if run_logged("repetition", command, args.threads, out + ".log")[0] != 0:
            raise BenchError(f"AR decoding failed (see {out}.log)")
        with open(out) as f:
            outputs = [p["tokens"] for p in json.load(f)["prompts"]]
        share = fmt(repeated_share(outputs), 2)
        lines.append(f"| {os.path.basename(path)} | {len(outputs)} | {sum(len(t) for t in outputs)} | {share} |")
    print("\n".join(lines))
