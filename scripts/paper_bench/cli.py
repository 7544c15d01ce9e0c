"""The paper's experiments (Tables 2-4, layout and anchor ablations) on the benchmark targets.

    python scripts/bench_paper.py train all --jobs 2        # fit every drafter (configs/bench_tiny.yaml + overrides)
    python scripts/bench_paper.py eval all --jobs 2         # python -m inference.eval on GSM8K, HumanEval, ShareGPT
    python scripts/bench_paper.py table --out docs/BENCHMARKS.md --png docs/paper_tables.png
    python scripts/bench_paper.py alphas                    # {"n,L_s": alpha} of the SPD runs for inference.plan
    python scripts/bench_paper.py plancheck                 # inference.plan vs the real n+1-process pipeline
    python scripts/bench_paper.py repetition                # how repetitive the target's greedy output is
    python scripts/bench_paper.py train all --suite deep    # the same on the 16-layer target (configs/bench_deep.yaml)
    python scripts/bench_paper.py train all --suite smollm2 # SmolLM2-135M-Instruct (configs/bench_smollm2.yaml)
    python scripts/bench_paper.py curve-states --suite smollm2   # speedup against training budget, resumable:
    python scripts/bench_paper.py curve-train all --suite smollm2    # scripts/paper_bench/curve.py
    python scripts/bench_paper.py curve-eval all --suite smollm2
    python scripts/bench_paper.py curve --suite smollm2 --out docs/BENCHMARKS.md --png docs/smollm2_curve.png

Every run is an ordinary `python -m spd_lightning fit` / `python -m inference.eval` command; this script
only names the runs, prints each command before running it (so the docs can quote it), runs up to
`--jobs` of them at once with `--threads` torch threads each, and gathers the numbers. Each run writes
under `ROOT/NAME/` (`--root`, default `runs/bench`): `checkpoints/last.ckpt`, `logs/` (CSV metrics),
`train.json` (the command, wall time, final validation agreement) and `eval/eval.json`.
"""

from __future__ import annotations

import argparse
import os
import shlex
from concurrent.futures import ThreadPoolExecutor

from inference import cli

SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CURVE_ACTIONS = ["curve-states", "curve-train", "curve-eval", "curve"]

from .checks import plan_check, repetition
from .curve import curve_eval, curve_names, curve_states, curve_train
from .curve_report import write_curve
from .registry import EAGLE3_RUNS, SETS, SUITES, BenchError
from .runner import eval_command, evaluate, train, train_command
from .tables import write_alphas, write_tables


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = ["train", "eval", "table", "alphas", "plancheck", "repetition", "commands"]
    p.add_argument("action", choices=[*actions, *CURVE_ACTIONS])
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
    p.add_argument("--limit", type=int, help="eval: prompts per set (default 10; curve-eval: the curve's, 40)")
    p.add_argument("--max-new-tokens", type=int, help="eval: tokens per prompt (default 64; curve-eval: 128)")
    p.add_argument(
        "--temperatures", type=float, nargs="+", help="curve-eval, curve: sampling temperatures (default: the curve's)"
    )
    p.add_argument("--budgets", type=int, nargs="+", help="curve-*: loss-token budgets (default: the suite's)")
    p.add_argument("--tokens-per-step", type=int, help="curve-train: loss tokens per step, an estimate for max_steps")
    p.add_argument(
        "--out",
        help="table: markdown file; its text between the paper-tables markers is replaced when it "
        "has them (default docs/BENCHMARKS.md); alphas: json (default ROOT/alphas.json)",
    )
    p.add_argument(
        "--png", help="table, curve: plot output ('' for none; default docs/paper_tables.png, docs/SUITE_curve.png)"
    )
    p.add_argument("--target", help="repetition: the target to decode with (default: the suite's)")
    p.add_argument("--calibration", help="plancheck: the run whose measured times calibrate the planner")
    p.add_argument("--checks", nargs="+", help="plancheck: runs predicted and measured")
    p.add_argument("--debug", action="store_true", help="show tracebacks (also SPD_DEBUG=1)")
    args = p.parse_args(argv)
    suite = SUITES[args.suite]
    curve = args.action in CURVE_ACTIONS
    args.curve, args.scripts = suite.curve, SCRIPTS
    if curve and suite.curve is not None:
        defaults = {"limit": suite.curve.limit, "max_new_tokens": suite.curve.max_new_tokens}
        defaults |= {"tokens_per_step": suite.curve.tokens_per_step, "temperatures": suite.curve.temperatures}
    else:
        defaults = {"limit": 10, "max_new_tokens": 64, "tokens_per_step": None, "temperatures": None}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    root = args.root or suite.root
    default_sets = {**SETS, "sharegpt": f"{root}/sharegpt.jsonl"} if curve else SETS
    args.sets = dict(enumerate(args.sets)) if args.sets else default_sets
    for key in ("config", "root", "target", "calibration", "checks"):
        if getattr(args, key) is None:
            setattr(args, key, getattr(suite, key))
    args.runs, args.tables, args.region = suite.runs, suite.tables, suite.region
    everything = curve_names(args) if curve and args.curve is not None else list(args.runs)
    args.names = everything if args.names in ([], ["all"]) else args.names
    return args


def run(args: argparse.Namespace) -> None:
    if args.action in CURVE_ACTIONS:
        return run_curve(args)
    if args.temperatures is not None:
        raise BenchError(f"--temperatures goes with curve-eval and curve, not {args.action}: drop it")
    known = [*args.runs, *EAGLE3_RUNS]
    unknown = [n for n in [*args.names, args.calibration, *args.checks] if n not in known]
    if unknown:
        raise BenchError(f"unknown run {unknown[0]!r} in suite {args.suite!r}: choose from {', '.join(known)} or 'all'")
    if args.jobs < 1 or args.threads < 1:
        raise BenchError("--jobs and --threads must be >= 1")
    if args.action == "table":
        args.out = args.out or "docs/BENCHMARKS.md"
        args.png = "docs/paper_tables.png" if args.png is None else args.png
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


def run_curve(args: argparse.Namespace) -> None:
    known = curve_names(args)
    unknown = [n for n in args.names if n not in known]
    if unknown:
        raise BenchError(f"unknown curve run {unknown[0]!r} in suite {args.suite!r}: choose from {', '.join(known)}")
    if args.jobs < 1 or args.threads < 1 or (args.budgets and min(args.budgets) <= 0):
        raise BenchError("--jobs and --threads must be >= 1, --budgets > 0")
    if args.action == "curve":
        args.out = args.out or "docs/BENCHMARKS.md"
        args.png = f"docs/{args.suite}_curve.png" if args.png is None else args.png
        return write_curve(args)
    if args.action == "curve-states":
        if curve_states(args) != 0:
            raise BenchError(f"prepare --states failed (see {args.root}/states.log)")
        return
    work = curve_train if args.action == "curve-train" else curve_eval
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        codes = list(pool.map(lambda name: work(name, args), args.names))
    failed = [n for n, c in zip(args.names, codes) if c != 0]
    if failed:
        raise BenchError(f"{args.action} failed for {', '.join(failed)} (see {args.root}/NAME/*.log)")


def main(argv: list[str] | None = None) -> int:
    """Exit 0 when every step worked; 2 with one `error:` line for a bad argument or a failed run."""
    return cli.main(argv, parse_args, run, lambda _args, _result: 0)
