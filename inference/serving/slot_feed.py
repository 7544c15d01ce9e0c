"""Continuous batching: the server's FIFO feeds the runner's free slots (docs/DESIGN.md, "One cycle over B
slots", its last paragraphs; docs/SERVING.md, "Batched serving").

`feed_slots` is the one loop, in every rank (`ranks.serve_requests`, where `take` is rank 0's read of the queue
broadcast to the others) and in this process (`batch_backend`): at every step boundary with a free slot it takes
the queued requests (`take(free, idle)`, at most `free`, FIFO order), joins each to a free slot, then runs one
step over every slot. The scheduling itself is the runner's (`PipelineRunner.join` and `step`).
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

from inference.cycle.pipeline import PipelineRunner
from inference.cycle.result import DecodeResult
from inference.cycle.slots import Request, SlotSequence
from inference.sampling import Sampling

STOP = "stop"  # what `take` returns once the server stops: the slots in flight finish, no request joins
IDLE_TICK_S = 1.0  # how long an idle pipeline waits for a request before its keep-alive


class QueuedRequest(NamedTuple):
    """A request on its way to the decoder (picklable, typed): what the backend's queue holds. `as_request`
    makes it the decoder's `Request` where it joins a slot."""

    request_id: int
    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling
    seed: int

    def as_request(
        self,
        eos: frozenset[int],
        on_tokens: Callable[[int, list[int]], None] | None,
        stop: Callable[[int], bool] | None,
    ) -> Request:
        """Its hooks (None: none) get this request's id first: `on_tokens(id, tokens)`, `stop(id)`."""
        on_tokens = None if on_tokens is None else partial(on_tokens, self.request_id)
        stop = None if stop is None else partial(stop, self.request_id)
        return Request(self.prompt, self.max_new_tokens, eos, self.sampling, self.seed, on_tokens=on_tokens, stop=stop)


def waiting(source, free: int, idle: bool) -> list[QueuedRequest] | str:
    """Up to `free` requests from `source` (a queue of `QueuedRequest`, None to stop: `get`, `put`),
    waiting up to IDLE_TICK_S for the first only when `idle` (no slot busy); STOP when the stop comes first."""
    taken: list[QueuedRequest] = []
    try:
        item = source.get(block=idle, timeout=IDLE_TICK_S)
        while item is not None:
            taken.append(item)
            if len(taken) == free:
                return taken
            item = source.get(block=False)
    except queue.Empty:
        return taken
    if taken:
        source.put(None)  # the stop comes after the requests before it: at the next boundary
        return taken
    return STOP


def feed_slots(
    runner: PipelineRunner,
    take: Callable[[int, bool], list[QueuedRequest] | str],
    start: Callable[[QueuedRequest], Request],
    on_result: Callable[[QueuedRequest, DecodeResult, SlotSequence], None],
) -> None:
    """Serve until `take` returns STOP and the slots in flight have finished (see the module docstring).
    `take(free, idle)`: the requests to join now; `start(queued)`: the decoder's request for it;
    `on_result(queued, result, seq)` as each sequence ends."""
    joined: dict[int, tuple[QueuedRequest, SlotSequence]] = {}
    stopping = False
    while not stopping or runner.busy:
        if not stopping and runner.free_slots:
            taken = take(len(runner.free_slots), not runner.busy)
            if taken == STOP:
                stopping = True
            else:
                for queued in taken:
                    slot = runner.join(start(queued))
                    joined[slot] = (queued, runner.slots[slot])
        for slot, result in runner.step():
            queued, seq = joined.pop(slot)
            on_result(queued, result, seq)
    runner.run([])  # takes any verdict still owed and completes every send before the ranks leave
