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
    """A request on its way to the decoder (picklable, typed): what the backend's queue holds, until it joins a
    slot as the decoder's `Request`."""

    request_id: int
    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling
    seed: int


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
    eos: frozenset[int],
    on_tokens: Callable[[int, list[int]], None] | None,
    stop: Callable[[int], bool] | None,
    on_result: Callable[[QueuedRequest, DecodeResult, SlotSequence], None],
) -> None:
    """Serve until `take` returns STOP and the slots in flight have finished (see the module docstring).
    `take(free, idle)`: the requests to join now; the hooks of each (None: none) get its id first:
    `on_tokens(id, tokens)`, `stop(id)`; `on_result(queued, result, seq)` as each sequence ends."""
    joined: dict[int, tuple[QueuedRequest, SlotSequence]] = {}
    stopping = False
    while not stopping or runner.busy:
        if not stopping and runner.free_slots:
            taken = take(len(runner.free_slots), not runner.busy)
            if taken == STOP:
                stopping = True
            else:
                for q in taken:
                    hooks = [None if hook is None else partial(hook, q.request_id) for hook in (on_tokens, stop)]
                    slot = runner.join(Request(q.prompt, q.max_new_tokens, eos, q.sampling, q.seed, *hooks))
                    joined[slot] = (q, runner.slots[slot])
        for slot, result in runner.step():
            queued, seq = joined.pop(slot)
            on_result(queued, result, seq)
    runner.run([])  # takes any verdict still owed and completes every send before the ranks leave
