"""The server's persistent pipeline: n + 1 ranks that load their weights once and serve request after request.

`RankBackend` launches the ranks once (`inference.processes.launch.launch` with a request queue, on a launcher
thread) and hands them each request through that queue. Rank 0 takes the requests from the queue and broadcasts
them over the process group, so every rank decodes the same prompts with the same sampling and seeds; while no
request comes it broadcasts a keep-alive every `IDLE_TICK_S`, so an idle pipeline never reaches the
process-group timeout. The verifier's rank streams each cycle's tokens and each result back through the
launcher's report queue, and `SlotBackend` routes them to the engine thread that waits for that request. When a
rank dies the launcher stops the others and names the rank; every request in flight fails with that message
(HTTP 503 each) and the engine starts a fresh pipeline.

The rank work, `serve_requests`, runs the `PipelineRunner` over `--max-batch` B slots (1 included) fed by the
queue at step boundaries (`slot_feed.feed_slots`).

A request the engine gives up on (its client disconnected, or a stop string ended it: the engine's
`on_tokens` raises) is cancelled inside the ranks: the backend writes its id into a ring of recent cancels in
shared memory (`RequestChannel.cancel`), the verifier's rank reads that once per cycle (the runner's `stop`),
and its next verdict is STOP, which ends that decode on every rank at the same cycle. The verifier's rank
records the cycle it saw the cancel at and the cycle it stopped at (`last_cancel`). A verifier on another node
gets each cancel from node 0's report listener instead (`nodes.RemoteRequestChannel`), which the cancel
notifies (`subscribe`).

Once every rank has loaded its weights and met the others, rank 0 marks the pipeline ready (`/ready`). One
runner with B slots serves every sampling setting (memory: docs/SERVING.md, "One node").
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist

from inference.cycle.nccl_rules import control_group
from inference.cycle.result import DecodeResult
from inference.cycle.slots import SlotSequence
from inference.processes.job import DecodeJob
from inference.processes.launch import launch, start_method
from inference.processes.nodes import RemoteRequestChannel
from inference.processes.roles import build_runner
from inference.serving.inflight import SlotBackend
from inference.serving.slot_feed import QueuedRequest, feed_slots, waiting

log = logging.getLogger(__name__)
REPORT_WAIT_S = 1.0  # how long a cancelled result waits for its verifier's report from another node


class CancelReport(NamedTuple):
    """A cancelled request as the verifier's rank saw it: the cycle at which it read the cancel, and the
    cycle its decode stopped at (K)."""

    request_id: int
    seen_cycle: int
    stop_cycle: int


class RequestChannel:
    """What the server shares with its ranks: the FIFO of `QueuedRequest`s (rank 0 reads it) and, in shared
    memory, the ids of the requests cancelled lately (a ring of `ring` ids: longer than the requests that can be
    in flight, so none is overwritten before the verifier reads it) and the verifier's report of the last
    cancellation. Passed to the rank processes when they start (`launch(request_channel=...)`)."""

    def __init__(self, context, ring: int = 16):
        self.queue = context.Queue()
        self._cancels = context.RawArray("q", [-1] * ring)  # the ids of the requests to stop
        self._written = context.RawValue("q", 0)  # cancels written so far (the next goes to this % ring)
        self._report = context.RawArray("q", [-1, -1, -1])  # CancelReport of the last cancelled decode
        self.ready = context.RawValue("b", 0)  # rank 0 sets it to 1 once every rank has loaded
        self._subscribers: list[Callable[[int], None]] = []  # in the server's process: other nodes' listener
        self._lock = threading.Lock()  # the engine's threads cancel concurrently

    def __getstate__(self) -> dict:  # the ranks get the shared memory, not the server's hooks
        return {k: v for k, v in self.__dict__.items() if k not in ("_subscribers", "_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _subscribers=[], _lock=threading.Lock())

    def subscribe(self, on_cancel: Callable[[int], None]) -> None:
        self._subscribers.append(on_cancel)

    def unsubscribe(self, on_cancel: Callable[[int], None]) -> None:
        if on_cancel in self._subscribers:
            self._subscribers.remove(on_cancel)

    def put(self, item) -> None:
        self.queue.put(item)

    def get(self, block: bool = True, timeout: float | None = None):
        return self.queue.get(block, timeout)

    def cancel(self, request_id: int) -> None:
        with self._lock:
            written = self._written.value
            self._cancels[written % len(self._cancels)] = request_id
            self._written.value = written + 1
        for on_cancel in self._subscribers:
            on_cancel(request_id)

    def recent_cancels(self) -> list[int]:
        """The ids in the ring, oldest first: what a verifier on another node gets when it starts watching."""
        written, ring = self._written.value, len(self._cancels)
        return [self._cancels[i % ring] for i in range(max(0, written - ring), written)]

    def cancelled(self, request_id: int) -> bool:
        """One read of shared memory: what the verifier's rank polls once per cycle for each request."""
        return request_id in self._cancels[:]

    def record(self, report: CancelReport) -> None:
        self._report[:] = list(report)

    def last_cancel(self) -> CancelReport:
        return CancelReport(*self._report[:])

    def close(self) -> None:
        """What is still queued was for ranks that have stopped: dropped, not waited on. With no rank reading,
        requests over the pipe's room (64 KiB) would block the queue's feeder thread forever, and this close (a
        restart, the server's exit) with it."""
        self.queue.cancel_join_thread()
        self.queue.close()


def serve_requests(
    job: DecodeJob,
    rank: int,
    device: torch.device,
    channel: RequestChannel | RemoteRequestChannel,
    report: Callable,
    on_tokens: Callable,
) -> None:
    """One rank's serving loop: load once, then `feed_slots` over `job.max_batch` slots until rank 0 reads None;
    the verifier's rank streams each slot's tokens, stops a cancelled one, and reports each result. `channel`:
    the server's, or on another node its `RemoteRequestChannel`."""
    runner = build_runner(job, rank, device)
    dist.barrier()  # every rank has loaded its weights
    if rank == 0:
        channel.ready.value = 1
    verifier, eos = rank == runner.verifier_rank, frozenset(job.eos_token_ids)
    hooks = (on_tokens, channel.cancelled) if verifier else (None, None)  # only the verifier streams and stops

    def take(free: int, idle: bool) -> list[QueuedRequest] | str:
        box = [waiting(channel, free, idle) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=control_group())  # host memory, never the NCCL group
        return box[0]

    def ended(queued: QueuedRequest, result: DecodeResult, seq: SlotSequence) -> None:
        if verifier:
            if result.stop_reason == "cancelled":
                channel.record(CancelReport(queued.request_id, seq.stop_seen, result.K))
            report(queued.request_id, result)

    feed_slots(runner, take, eos, *hooks, ended)


class RankBackend(SlotBackend):
    """The engine's backend over a persistent pipeline of n + 1 processes (see the module docstring);
    `in_flight`: the most requests the engine hands it at once (its slots and its queue)."""

    stopped = "the pipeline stopped"

    def __init__(self, job: DecodeJob, in_flight: int = 1):
        self.job = job
        self.channel = RequestChannel(mp.get_context(start_method(job)), ring=max(16, 4 * in_flight))
        self.last_cancel: CancelReport | None = None
        self.pids: dict[int, int] = {}
        super().__init__(self.channel, self.channel.cancel, self._launch, "spd-serve-launcher", job.max_batch)

    def _launch(self) -> None:
        """Until the ranks stop; a `LaunchError` names the rank that failed."""
        launch(
            self.job,
            on_result=partial(self.put, "result"),
            on_start=self.pids.__setitem__,
            on_tokens=partial(self.put, "tokens"),
            request_channel=self.channel,
            work=serve_requests,
        )

    def ready(self) -> bool:
        """Every rank has loaded and met the others (true from then on; `alive` says whether they still run)."""
        return bool(self.channel.ready.value)

    def _on_cancelled(self, request_id: int, result: DecodeResult) -> None:
        """Keep (and log) the verifier's report when the ranks stopped the request before its end. A verifier on
        another node sends the report and the result over two connections: the report may come a moment later."""
        self.last_cancel = None
        if result.stop_reason != "cancelled":
            return
        deadline = time.monotonic() + REPORT_WAIT_S
        while (report := self.channel.last_cancel()).request_id != request_id:
            if time.monotonic() >= deadline:
                return
            time.sleep(0.005)
        self.last_cancel = report
        log.info(
            "request %d cancelled at cycle %d, %d cycle(s) after the ranks saw it",
            request_id,
            report.stop_cycle,
            report.stop_cycle - report.seen_cycle,
        )

    def close(self) -> None:
        super().close()
        self.channel.close()
