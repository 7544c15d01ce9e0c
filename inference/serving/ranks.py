"""The server's persistent pipeline: n + 1 ranks that load their weights once and serve request after request.

`RankBackend` launches the ranks once (`inference.processes.launch.launch` with a request queue, on a launcher thread) and
feeds them one request at a time; `serve_requests` is each rank's loop. Rank 0 takes the next request
from the queue and broadcasts it over the process group, so every rank decodes the same prompt with the
same sampling and seed; while no request comes it broadcasts a keep-alive every `IDLE_TICK_S`, so an idle
pipeline never reaches the process-group timeout. The verifier's rank streams each cycle's tokens and the
result back through the launcher's report queue. When a rank dies the launcher stops the others and
names the rank; the request in flight fails with that message (HTTP 503) and the engine starts a fresh
pipeline.

A request the engine gives up on (its client disconnected, or a stop string ended it: the engine's
`on_tokens` raises) is cancelled inside the ranks: the backend writes its id into shared memory
(`Requests.cancel`), the verifier's rank reads that once per cycle (`PipelineRunner.decode(stop=...)`), and
its next verdict is STOP, which ends the decode on every rank at the same cycle; the pipeline then takes
the next request. The verifier's rank records the cycle it saw the cancel at and the cycle it stopped at
(`last_cancel`). A verifier on another node gets each cancel from node 0's report listener instead
(`nodes.RequestsOnNodeZero`), which the cancel notifies (`subscribe`).

Memory is bounded by configuration, not by what clients send: a rank keeps one runner (and its caches) per
sampling setting for the `job.runners_kept` settings used most recently and drops the oldest beyond them.
Once every rank has loaded its weights and met the others, rank 0 marks the pipeline ready (`/ready`).
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from inference.backends import BackendFailure, Cancelled
from inference.cycle.result import DecodeResult
from inference.processes.job import DecodeJob
from inference.processes.launch import launch, start_method
from inference.processes.roles import Loaded, build_runner, load_role
from inference.sampling import Sampling
from spd_lightning.errors import first_line

log = logging.getLogger(__name__)
IDLE_TICK_S = 1.0
REPORT_WAIT_S = 1.0  # how long a cancelled result waits for its verifier's report from another node
STOP = "stop"


class CancelReport(NamedTuple):
    """A cancelled request as the verifier's rank saw it: the cycle at which it read the cancel, and the
    cycle its decode stopped at (K)."""

    request_id: int
    seen_cycle: int
    stop_cycle: int


class Requests:
    """What the server shares with its ranks: the FIFO of requests (rank 0 reads it) and, in shared memory,
    the id of the request to cancel and the verifier's report of the last cancellation. Passed to the rank
    processes when they start (`launch(requests=...)`)."""

    def __init__(self, context):
        self.queue = context.Queue()
        self._cancel = context.RawValue("q", -1)  # the id of the request to stop
        self._report = context.RawArray("q", [-1, -1, -1])  # CancelReport of the last cancelled decode
        self._ready = context.RawValue("b", 0)  # rank 0 sets it once every rank has loaded
        self._subscribers: list[Callable[[int], None]] = []  # in the server's process: other nodes' listener

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_subscribers": []}  # the ranks get the shared memory, not the server's hooks

    def subscribe(self, on_cancel: Callable[[int], None]) -> None:
        self._subscribers.append(on_cancel)

    def unsubscribe(self, on_cancel: Callable[[int], None]) -> None:
        if on_cancel in self._subscribers:
            self._subscribers.remove(on_cancel)

    def put(self, item) -> None:
        self.queue.put(item)

    def get(self, timeout: float):
        return self.queue.get(timeout=timeout)

    def cancel(self, request_id: int) -> None:
        self._cancel.value = request_id
        for on_cancel in self._subscribers:
            on_cancel(request_id)

    def mark_ready(self) -> None:
        self._ready.value = 1

    def is_ready(self) -> bool:
        return bool(self._ready.value)

    def current_cancel(self) -> int:
        return self._cancel.value

    def cancelled(self, request_id: int) -> bool:
        """One read of shared memory: what the verifier's rank polls once per cycle."""
        return self._cancel.value == request_id

    def record(self, report: CancelReport) -> None:
        self._report[:] = list(report)

    def last_cancel(self) -> CancelReport:
        return CancelReport(*self._report[:])

    def close(self) -> None:
        self.queue.close()
        self.queue.join_thread()


def serve_requests(
    job: DecodeJob, rank: int, device: torch.device, requests: Requests, report: Callable, on_tokens: Callable
) -> None:
    """One rank's serving loop: load once, then decode each broadcast request until rank 0 reads None."""
    loaded: Loaded = load_role(job, rank, device)
    runners = Runners(job.runners_kept, lambda sampling: build_runner(job, rank, device, loaded, sampling))
    dist.barrier()  # every rank has loaded its weights
    if rank == 0:
        requests.mark_ready()
    while (item := _next_request(rank, requests)) != STOP:
        if item is None:  # keep-alive
            continue
        request_id, prompt, max_new_tokens, sampling, seed = item
        runner = runners.get(Sampling(**sampling))
        reporting = rank == runner.verifier_rank
        for_request = (lambda tokens: on_tokens(request_id, tokens)) if reporting else None  # noqa: B023 - used in this iteration
        stop = (lambda: requests.cancelled(request_id)) if reporting else None  # noqa: B023 - used in this iteration
        result = runner.decode(prompt, max_new_tokens, frozenset(job.eos_token_ids), seed, for_request, stop)
        if reporting:
            if result.stop_reason == "cancelled":
                requests.record(CancelReport(request_id, runner.stop_seen, result.K))
            report(request_id, result)


class Runners:
    """At most `kept` runners, one per sampling setting, the least recently used dropped first."""

    def __init__(self, kept: int, build: Callable[[Sampling], object]):
        self.kept, self.build = kept, build
        self._runners: OrderedDict[Sampling, object] = OrderedDict()

    def get(self, sampling: Sampling):
        if sampling in self._runners:
            self._runners.move_to_end(sampling)
        else:
            if len(self._runners) >= self.kept:
                while len(self._runners) >= self.kept:
                    self._runners.popitem(last=False)
                gc.collect()  # a runner holds reference cycles: free its caches now, not at some later collection
            self._runners[sampling] = self.build(sampling)
        return self._runners[sampling]


def _next_request(rank: int, requests):
    box = [None]
    if rank == 0:
        try:
            item = requests.get(timeout=IDLE_TICK_S)
            box[0] = STOP if item is None else item
        except queue.Empty:
            pass
    dist.broadcast_object_list(box, src=0)
    return box[0]


class RankBackend:
    """The engine's backend over a persistent pipeline of n + 1 processes (see the module docstring)."""

    def __init__(self, job: DecodeJob):
        self.job = job
        self.requests = Requests(mp.get_context(start_method(job)))
        self._events: queue.Queue = queue.Queue()
        self._next_id = 0
        self._current: tuple[int, object] | None = None  # the request decoding now: its id and its hook
        self.last_cancel: CancelReport | None = None
        self.pids: dict[int, int] = {}
        self.failure = "the pipeline is not running"
        self._launcher = threading.Thread(target=self._launch, name="spd-serve-launcher", daemon=True)
        self._launcher.start()

    def _launch(self) -> None:
        try:
            launch(
                self.job,
                on_result=lambda i, r: self._events.put(("result", i, r)),
                on_start=lambda rank, pid: self.pids.__setitem__(rank, pid),
                on_tokens=lambda i, tokens: self._events.put(("tokens", i, tokens)),
                requests=self.requests,
                work=serve_requests,
            )
            self.failure = "the pipeline stopped"
        except Exception as e:  # noqa: BLE001 - LaunchError names the rank; anything else is reported as is
            self.failure = first_line(e)
        self._events.put(("ended", None, self.failure))

    def alive(self) -> bool:
        return self._launcher.is_alive()

    def ready(self) -> bool:
        """Every rank has loaded and met the others (true from then on; `alive` says whether they still run)."""
        return self.requests.is_ready()

    def cancel(self, on_tokens) -> None:
        """From any thread: stop the decode whose hook is `on_tokens` at the ranks' next verdict (a cancel that
        comes after that decode has ended cannot reach the next one)."""
        current = self._current
        if current is not None and current[1] is on_tokens:
            self._events.put(("cancel", current[0], None))  # wakes `generate`, which tells the ranks at once

    def generate(self, prompt_ids, max_new_tokens, sampling: Sampling, seed, on_tokens) -> DecodeResult:
        if not self._launcher.is_alive():
            raise BackendFailure(self.failure)
        request_id, self._next_id = self._next_id, self._next_id + 1
        self._current = (request_id, on_tokens)
        try:
            self.requests.put((request_id, list(prompt_ids), max_new_tokens, sampling.to_dict(), seed))
            return self._follow(request_id, on_tokens)
        finally:
            self._current = None

    def _follow(self, request_id: int, on_tokens) -> DecodeResult:
        cancelled = None
        while True:
            kind, index, value = self._events.get()
            if kind == "ended":
                raise BackendFailure(value)
            if index != request_id:
                continue  # a cancelled request's late events
            if kind == "result":
                if cancelled is not None:
                    self._cancelled(request_id, value)
                    raise cancelled
                return value
            if cancelled is not None:
                continue
            try:
                if kind == "cancel":
                    raise Cancelled
                on_tokens(value)
            except Exception as e:  # noqa: BLE001 - Cancelled / StopString: the ranks stop at their next verdict
                cancelled = e
                self.requests.cancel(request_id)

    def _cancelled(self, request_id: int, result: DecodeResult) -> None:
        """Keep (and log) the verifier's report when the ranks stopped the request before its end. A verifier on
        another node sends the report and the result over two connections: the report may come a moment later."""
        report = self.requests.last_cancel()
        deadline = time.monotonic() + REPORT_WAIT_S
        while result.stop_reason == "cancelled" and report.request_id != request_id and time.monotonic() < deadline:
            time.sleep(0.005)
            report = self.requests.last_cancel()
        self.last_cancel = report if result.stop_reason == "cancelled" and report.request_id == request_id else None
        if self.last_cancel is not None:
            log.info(
                "request %d cancelled at cycle %d, %d cycle(s) after the ranks saw it",
                request_id,
                report.stop_cycle,
                report.stop_cycle - report.seen_cycle,
            )

    def close(self) -> None:
        if self._launcher.is_alive():
            self.requests.put(None)
            self._launcher.join(30)
        self.requests.close()
