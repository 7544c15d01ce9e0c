"""The training-budget curve: SPD, PPSD and EAGLE-3 each trained once, saved at every loss-token budget, and every
saved drafter evaluated with intervals (docs/BENCHMARKS.md, "SmolLM2: speedup against training budget").

    python scripts/bench_paper.py curve-states --suite smollm2      # the target-state cache every PDM run reads
    python scripts/bench_paper.py curve-train all --suite smollm2   # one fit per drafter, a checkpoint per budget
    python scripts/bench_paper.py curve-eval all --suite smollm2    # inference.eval of every (drafter, budget)
    python scripts/bench_paper.py curve --suite smollm2             # tables, plot and verdicts from stored rows

`curve-eval` and `curve` take `--limit`, `--max-new-tokens` and `--temperatures` for a cheaper protocol (each has
folders of its own, `eval_dir`): on a 2-core CPU the curve's own, 40 prompts a set x 128 tokens x T = 0 and 1, takes
hours per drafter and budget (docs/BENCHMARKS.md, "SmolLM2: speedup against training budget").

Every step resumes: `prepare --states` keeps the shards it wrote, a fit restarts from its `last.ckpt` (the
budget callback's count is in it) and stops as soon as its last budget is saved (a finished one is skipped), and
an (drafter, budget) pair whose `eval_B/eval.json` exists is not evaluated again. The PDM drafters train from one
state cache (`fit --data.states`); EAGLE-3 trains online on the same data (the cache serves PDM configs only).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex

from spd_lightning.geometry import MODES, Geometry

from .budget import budget_path, read_reached
from .registry import BenchError, Curve
from .runner import run_logged


def curve_of(args: argparse.Namespace) -> Curve:
    if args.curve is None:
        raise BenchError(f"suite {args.suite!r} has no training-budget curve: use --suite smollm2 or tiny")
    return args.curve


def curve_names(args: argparse.Namespace) -> list[str]:
    curve = curve_of(args)
    return [*curve.runs, *curve.eagle3]


def budgets(args: argparse.Namespace) -> tuple[int, ...]:
    return tuple(args.budgets) if args.budgets else curve_of(args).budgets


def states_dir(args: argparse.Namespace) -> str:
    return f"{args.root}/states"


def _target(args: argparse.Namespace) -> str:
    """The target the runs train on: `--model.target` in `--extra`, else the suite's."""
    extra = shlex.split(args.extra)
    return extra[extra.index("--model.target") + 1] if "--model.target" in extra else args.target


def state_layers(args: argparse.Namespace) -> list[int]:
    """Every hidden state a PDM run of the curve reads (its anchors) and the final-norm state L."""
    from inference.evaluation.plan import target_shape

    L, _ = target_shape(_target(args))
    layers = {L}
    for run in curve_of(args).runs.values():
        schedule, features = MODES[run.mode]
        layers |= set(Geometry.build(L, run.n, anchors=run.anchors, schedule=schedule, features=features).anchors)
    return sorted(layers)


def states_command(args: argparse.Namespace) -> list[str]:
    layers = [str(b) for b in state_layers(args)]
    serves = curve_of(args).also_serves
    return ["python", "-m", "spd_lightning", "prepare", "--config", args.config, "--states", states_dir(args)] + [
        *(["--states-configs", *serves] if serves else []),
        "--states-layers",
        *layers,
        *shlex.split(args.extra),
    ]


def max_steps(args: argparse.Namespace) -> int:
    """Steps that surely reach the last budget (the callback stops the run there): the suite's estimate of loss
    tokens per step, with a quarter to spare; the learning-rate schedule decays over these steps."""
    return max(1, round(1.25 * max(budgets(args)) / args.tokens_per_step))


def _budget_callback(out: str, args: argparse.Namespace) -> list[str]:
    spec = {"class_path": "paper_bench.budget.BudgetCheckpoints"}
    spec["init_args"] = {"budgets": list(budgets(args)), "dirpath": f"{out}/budgets"}
    return [f"--trainer.callbacks+={json.dumps(spec)}"]


def curve_train_command(name: str, args: argparse.Namespace, resume: bool = True) -> list[str]:
    """`fit` of one drafter of the curve; `resume`: from its `last.ckpt` when it has one."""
    curve, out = curve_of(args), f"{args.root}/{name}"
    command = ["python", "-m", "spd_lightning", "fit", "--config", args.config]
    if name in curve.eagle3:
        command += [
            "--model",
            "Eagle3Module",
            "--model.ttt_steps",
            str(curve.eagle3[name]),
            "--trainer.callbacks",
            "[]",
        ]
    else:
        run = curve.runs[name]
        schedule, features = MODES[run.mode]
        command += [
            *("--model.n", str(run.n), "--model.num_layers", str(run.L_s), "--model.schedule", schedule),
            *("--model.features", features, "--model.layout", run.layout, "--model.anchors", run.anchors),
            *("--data.states", states_dir(args)),
        ]
    command += [
        *("--trainer.max_steps", str(max_steps(args)), "--trainer.max_epochs", "-1"),
        *("--trainer.default_root_dir", out, "--trainer.logger.init_args.save_dir", out),
        *("--checkpoint.dirpath", f"{out}/checkpoints"),
        *_budget_callback(out, args),
        *shlex.split(args.extra),
    ]
    last = f"{out}/checkpoints/last.ckpt"
    return command + (["--ckpt_path", last] if resume and os.path.isfile(last) else [])


def curve_eval_command(name: str, budget: int, args: argparse.Namespace) -> list[str]:
    """The drafter saved at `budget`, beside AR in one process: the simulator for a PDM, chain decoding at every
    k of the curve for EAGLE-3; at the curve's temperatures (T = 0 and 1) unless `--temperatures` says others."""
    curve = curve_of(args)
    command = ["python", "-m", "inference.eval", "--ckpt", budget_path(f"{args.root}/{name}/budgets", budget)]
    command += ["--prompts", *args.sets.values(), "--limit", str(args.limit)]
    temperatures = [f"{t:g}" for t in args.temperatures]
    command += ["--max-new-tokens", str(args.max_new_tokens), "--temperatures", *temperatures, "--no-progress"]
    command += ["--k", *map(str, curve.ks)] if name in curve.eagle3 else ["--simulate"]
    return command + ["--out", eval_dir(args, name, budget)]


def eval_dir(args: argparse.Namespace, name: str, budget: int) -> str:
    """`eval_BUDGET` under the curve's protocol; another one (`--limit`, `--max-new-tokens`, `--temperatures`) has
    a folder of its own, `eval_BUDGET_LIMITxTOKENS_TEMPERATURES` (e.g. `eval_200000_14x64_T0`), so that rows of two
    protocols never mix and each skips only what it evaluated itself."""
    curve, out = curve_of(args), f"{args.root}/{name}/eval_{budget}"
    protocol = (args.limit, args.max_new_tokens, tuple(args.temperatures))
    if protocol == (curve.limit, curve.max_new_tokens, curve.temperatures):
        return out
    return f"{out}_{args.limit}x{args.max_new_tokens}_T{'-'.join(f'{t:g}' for t in args.temperatures)}"


def curve_states(args: argparse.Namespace) -> int:
    return run_logged("states", states_command(args), args.threads, f"{states_dir(args)}.log")[0]


def curve_train(name: str, args: argparse.Namespace) -> int:
    out = f"{args.root}/{name}"
    if set(budgets(args)) <= set(read_reached(f"{out}/budgets")):
        print(f"[{name}] every budget saved already ({out}/budgets)", flush=True)
        return 0
    env = {"PYTHONPATH": os.pathsep.join(p for p in (args.scripts, os.environ.get("PYTHONPATH")) if p)}
    code = run_logged(name, curve_train_command(name, args), args.threads, f"{out}/train.log", env)[0]
    missing = sorted(set(budgets(args)) - set(read_reached(f"{out}/budgets")))
    if code == 0 and missing:
        print(
            f"[{name}] max_steps {max_steps(args)} ended before budgets {missing}: the data has fewer loss tokens per "
            f"step than --tokens-per-step {args.tokens_per_step}; retrain with a lower value",
            flush=True,
        )
        return 1
    return code


def curve_eval(name: str, args: argparse.Namespace) -> int:
    """Every saved budget of the run not evaluated yet; a budget not reached is skipped with a line."""
    reached, code = read_reached(f"{args.root}/{name}/budgets"), 0
    for budget in budgets(args):
        out = eval_dir(args, name, budget)
        if os.path.isfile(f"{out}/eval.json"):
            continue
        if budget not in reached:
            print(f"[{name}] budget {budget} not reached yet: curve-train {name} first", flush=True)
            continue
        code = code or run_logged(name, curve_eval_command(name, budget, args), args.threads, f"{out}.log")[0]
    return code
