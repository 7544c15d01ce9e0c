"""Running the benchmark: each drafter is an ordinary `fit` / `inference.eval` command, printed before it runs,
logged to ROOT/NAME/*.log; `train.json` records the command, wall time and final validation numbers."""

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

from spd_lightning.geometry import MODES

from .registry import EAGLE3_EVAL_K, EAGLE3_RUNS, BenchError, Run


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
    """Chain decoding at each k of EAGLE3_EVAL_K (or `args.eagle3_k`: the k a stored report was evaluated at), T = 0
    and 1, beside AR in the same run, into NAME/eval."""
    return ["python", "-m", "inference.eval", "--ckpt", f"{args.root}/{name}/checkpoints/last.ckpt"] + [
        *(
            "--k",
            *getattr(args, "eagle3_k", EAGLE3_EVAL_K),
            "--prompts",
            *args.sets.values(),
            "--limit",
            str(args.limit),
        ),
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


def run_logged(name: str, command: list[str], threads: int, log: str, env: dict | None = None) -> tuple[int, float]:
    env = dict(
        os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), WANDB_MODE="offline", **(env or {})
    )
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
    code, minutes = run_logged(name, command, args.threads, f"{args.root}/{name}/train.log")
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
    return run_logged(name, eval_command(name, args), args.threads, f"{args.root}/{name}/eval.log")[0]
