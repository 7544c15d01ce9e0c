"""Test-only fault injection into the distributed decoder (tests/test_faults.py)."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

SLOW_STEP_S = 0.03


@dataclass(frozen=True)
class Fault:
    """`DecodeJob.fault = "RANK:POINT:COUNT:ACTION"` makes rank RANK fail the COUNT-th time it reaches POINT:
    `prefill`, `step` (any decode step) or `redo` (the step right after a rejection). ACTION: `exit`
    (os._exit(3), dies without a word), `kill` (SIGKILL to itself), `raise` (an exception, reported like any
    error), `stall` (sleeps forever, a silent peer) or `slow` (from then on sleeps `SLOW_STEP_S` at every such
    point: a pipeline slow enough that a decode outlasts a deadline)."""

    rank: int
    point: str
    count: int
    action: str

    @classmethod
    def parse(cls, spec: str) -> Fault:
        rank, point, count, action = spec.split(":")
        if point not in ("prefill", "step", "redo") or action not in ("exit", "kill", "raise", "stall", "slow"):
            raise ValueError(f"bad fault {spec!r}: want RANK:prefill|step|redo:COUNT:exit|kill|raise|stall|slow")
        return cls(int(rank), point, int(count), action)

    def hook(self) -> Callable[[str], None]:
        seen = Counter()

        def on_step(point: str) -> None:
            seen[point] += 1
            if point == "redo":
                seen["step"] += 1
            if point == self.point or (point, self.point) == ("redo", "step"):
                if seen[self.point] == self.count or (self.action == "slow" and seen[self.point] > self.count):
                    self.fire()

        return on_step

    def fire(self) -> None:
        if self.action == "exit":
            os._exit(3)
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.action == "slow":
            time.sleep(SLOW_STEP_S)
            return
        if self.action == "raise":
            raise RuntimeError(f"injected fault at {self.point} #{self.count}")
        while True:
            time.sleep(3600)


def step_hook(spec: str | None, rank: int) -> Callable[[str], None] | None:
    """The `PipelineRunner.on_step` hook of `rank` for the job's fault spec (None: no fault there)."""
    fault = Fault.parse(spec) if spec else None
    return fault.hook() if fault is not None and fault.rank == rank else None
