"""What the ranks of the distributed decoder tell their launcher, and who is to blame when they fail.

Every rank reports through one queue (`launch`; from another node than node 0 through `nodes`): its pid
as it starts, each cycle's verified tokens when streaming, each result, and the error that ends it. The
launcher's `Inbox` drains that queue on a thread while the elastic agent watches the processes; when they
fail, `failure_message` names the rank that caused it from these reports and the agent's exit codes.
"""

from __future__ import annotations

import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from inference.cycle.pipeline import role_name
from inference.cycle.result import DecodeResult
from inference.processes.job import DecodeJob
from inference.processes.nodes import Joined, Refused

DRAIN_POLL_S = 0.1  # how often the drain thread checks whether it is closed (a report wakes it at once)


class Started(NamedTuple):
    rank: int
    pid: int


class Finished(NamedTuple):
    index: int  # the prompt
    result: DecodeResult  # pickled as it is, also over the connection from another node


class Streamed(NamedTuple):
    index: int  # the prompt
    tokens: list[int]  # verified in one cycle


class Failed(NamedTuple):
    rank: int
    message: str  # "Type: first line"
    trace: str
    peer: int | None  # the rank it lost, for a `PeerError`
    user_error: bool


class Inbox:
    """The launcher's side of the queue, drained by a thread while the agent watches the processes.

    The launcher only reads that queue, never writes to it (not even a stop sentinel): a rank killed while its
    feeder thread sends a report dies holding the queue's write lock, so a writer here would block forever, and
    with it this process's exit, which joins the feeder thread of every queue it wrote to. Reports from other
    nodes come in through `put` (`nodes.ReportListener`), not through the queue, for the same reason."""

    def __init__(
        self,
        messages,
        on_result: Callable[[int, DecodeResult], None] | None,
        on_start: Callable[[int, int], None] | None,
        on_tokens: Callable[[int, list[int]], None] | None = None,
    ):
        self.messages, self.on_result, self.on_start, self.on_tokens = messages, on_result, on_start, on_tokens
        self.pids: dict[int, int] = {}
        self.results: dict[int, DecodeResult] = {}
        self.failures: dict[int, Failed] = {}
        self.refusals: list[Refused] = []  # other nodes that will not join this pipeline, and why
        self.joined: set[int] = set()  # other nodes that will
        self._lock = threading.Lock()  # the drain thread and other nodes' listeners report concurrently
        self._answered = threading.Condition(self._lock)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._drain, name="spd-launch-inbox", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while True:
            try:
                message = self.messages.get(timeout=DRAIN_POLL_S)
            except queue.Empty:
                if self._closing.is_set():
                    return
                continue
            self.put(message)

    def put(self, message: Started | Streamed | Finished | Failed | Joined | Refused) -> None:
        """One report: from the queue, or from a rank on another node."""
        with self._lock:
            if isinstance(message, Started):
                self.pids[message.rank] = message.pid
                if self.on_start is not None:
                    self.on_start(message.rank, message.pid)
            elif isinstance(message, Streamed):
                if self.on_tokens is not None:
                    self.on_tokens(message.index, message.tokens)
            elif isinstance(message, Finished):
                self.results[message.index] = result = message.result
                if self.on_result is not None:
                    self.on_result(message.index, result)
            elif isinstance(message, Joined):
                self.joined.add(message.node_rank)
                self._answered.notify_all()
            elif isinstance(message, Refused):
                self.refusals.append(message)
                self._answered.notify_all()
            else:
                self.failures.setdefault(message.rank, message)

    def close(self, wait_s: float = 5.0) -> None:
        """Every report the ranks made is in (they have all exited by now): the queue is drained until empty."""
        self._closing.set()
        self._thread.join(wait_s)

    def pid_list(self) -> tuple[int, ...]:
        return tuple(self.pids[r] for r in sorted(self.pids))

    def await_nodes(self, others: int, timeout_s: float) -> str | None:
        """Node 0 before its ranks start: wait until the `others` other nodes have joined this pipeline (None), one
        refused, or `timeout_s` passed (why not, in a line)."""
        deadline = time.monotonic() + timeout_s
        with self._answered:
            while len(self.joined) < others and not self.refusals:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = others - len(self.joined)
                    return f"{missing} other node(s) did not answer within --timeout {timeout_s:g} s"
                self._answered.wait(left)
        return "; ".join(f"node {r.node_rank} did not join: {r.reason}" for r in self.refusals) or None


def blamed_report(failed: dict[int, int], reports: dict[int, Failed]) -> Failed | None:
    """The report of the rank that caused the failure, when that rank reported one (see `failure_message`)."""
    rank, code = min(failed.items())
    if code < 0 or rank not in reports:
        return None
    own = [r for r in reports.values() if r.peer is None]
    return own[0] if own else reports[rank]


def failure_message(job: DecodeJob, failed: dict[int, int], reports: dict[int, Failed]) -> str:
    """Names the rank that caused the failure: the one the agent saw die when it was killed by a signal or
    exited without a report (it died abruptly); else one that reported an error of its own; else, when every
    report is a lost peer (`PeerError`), the rank at the end of the chain of blamed peers: the one that
    went silent (e.g. stalled) while the others, directly or through blocked peers, waited on it."""
    n = job.n
    rank, code = min(failed.items())
    report = blamed_report(failed, reports)
    if code < 0:
        head = f"rank {rank} ({role_name(rank, n)}) was killed by signal {-code}"
        if code == -signal.SIGABRT and job.device.startswith("cuda"):  # how NCCL ends a rank (runtime/nccl_backend.py)
            head += " (NCCL's watchdog ends a rank whose message failed or timed out: a peer may have stalled)"
    elif report is None:
        head = f"rank {rank} ({role_name(rank, n)}) exited with code {code} without reporting an error"
    else:
        rank = report.rank
        head = f"rank {rank} ({role_name(rank, n)}) failed: {report.message}"
        silent = _end_of_blame(report, reports)
        if silent is not None:
            head = f"rank {silent} ({role_name(silent, n)}) stopped responding: {head}"
        head += f"\n{report.trace}" if job.debug else ""
    others = [role_name(q, n) for q in sorted({*failed, *reports}) if q != rank]
    return head + (f" (then also: {', '.join(others)})" if others else "") + "; every rank was stopped"


def _end_of_blame(report: Failed, reports: dict[int, Failed]) -> int | None:
    """Follow lost peers from `report` through the ranks that reported one; the first that did not report."""
    chain, peer = {report.rank}, report.peer
    while peer is not None and peer not in chain and peer in reports:
        chain.add(peer)
        peer = reports[peer].peer
    return peer if peer is not None and peer not in reports else None
