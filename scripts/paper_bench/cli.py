"""The paper's experiments (Tables 2-4, layout and anchor ablations) on the benchmark targets.

    python scripts/bench_paper.py train all --jobs 2        # fit every drafter (configs/bench_tiny.yaml + overrides)
    python scripts/bench_paper.py eval all --jobs 2         # python -m inference.eval on GSM8K, HumanEval, ShareGPT
    python scripts/bench_paper.py table --out docs/BENCHMARKS.md --png docs/paper_tables.png
    python scripts/bench_paper.py alphas                    # {"n,L_s": alpha} of the SPD runs for inference.plan
    python scripts/bench_paper.py plancheck                 # inference.plan vs the real n+1-process pipeline
    python scripts/bench_paper.py repetition                # how repetitive the target's greedy output is
    python scripts/bench_paper.py train all --suite deep    # the same on the 16-layer target (configs/bench_deep.yaml)
    python scripts/bench_paper.py train all --suite smollm2 # SmolLM2-135M-Instruct (configs/bench_smollm2.yaml)

Every run is an ordinary `python -m spd_lightning fit` / `python -m inference.eval` command; this script
only names the runs, prints each command before running it (so the docs can quote it), runs up to
`--jobs` of them at once with `--threads` torch threads each, and gathers the numbers. Each run writes
under `ROOT/NAME/` (`--root`, default `runs/bench`): `checkpoints/last.ckpt`, `logs/` (CSV metrics),
`train.json` (the command, wall time, final validation agreement) and `eval/eval.json`.
"""

from __future__ import annotations

import argparse
import shlex
from concurrent.futures import ThreadPoolExecutor

from inference import cli

from .checks import plan_check, repetition
from .registry import EAGLE3_RUNS, SETS, SUITES, BenchError
from .runner import eval_command, evaluate, train, train_command
from .tables import write_alphas, write_tables


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
