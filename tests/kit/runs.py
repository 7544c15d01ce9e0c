"""Runs of the repository's own code: the checkout's root, a script loaded in the test's process, the
staircase-evaluation callback of configs/tiny.yaml, what a CSV logger wrote, and child processes (a free local
port, the process tree read from /proc, a run whose hang fails the test)."""

import csv
import functools
import glob
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO_PROMPTS = os.path.join(REPO, "docs", "demo_prompts.jsonl")


@functools.cache
def load_script(name: str):
    """`scripts/NAME.py` as a module, once per session: its `main(argv)` then runs in the test's process, without
    the few seconds of CPU a fresh interpreter spends importing torch (the whole-script runs are `slow` tests)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def callback_args(every: int = 2, **extra) -> list[str]:
    init = {
        "every_n_steps": every,
        "num_prompts": 3,
        "max_new_tokens": 12,
        "prompts": DEMO_PROMPTS,
        "num_batches": 1,
        **extra,
    }
    # configs/tiny.yaml already has the callback: these override its settings.
    return [f"--trainer.callbacks.init_args.{k}={v}" for k, v in init.items()]


def csv_rows(root) -> list[dict]:
    [path] = glob.glob(os.path.join(str(root), "**", "metrics.csv"), recursive=True)
    with open(path) as f:
        return list(csv.DictReader(f))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parent_pid(pid) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def child_pids(pid: int) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and parent_pid(p) == pid]


def descendant_pids(pid: int) -> list[int]:
    children = child_pids(pid)
    return children + [d for c in children for d in descendant_pids(c)]


def pid_alive(pid: int) -> bool:
    """A process that exists and has not exited (a zombie only keeps its exit status)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def still_alive(pids, within_s: float) -> list[int]:
    """The processes of `pids` still alive after waiting up to `within_s` seconds for all of them to exit."""
    deadline = time.monotonic() + within_s
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if pid_alive(p)]


def run_unless_hung(args: list[str], timeout: float, hung: str, env: dict | None = None, merge_output: bool = False):
    """`python ARGS` from the checkout in a session of its own (so the ranks Lightning starts are in its group): a
    run still going after `timeout` seconds is killed whole and fails the test with `hung` and its last output."""
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_output else subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{hung} (a hang): {(err or out)[-3000:]}")
    return subprocess.CompletedProcess(args, proc.returncode, out, err)
