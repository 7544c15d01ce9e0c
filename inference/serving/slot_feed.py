"""Continuous batching (docs/SERVING.md, "Batched serving"): the server's FIFO feeds the runner's free slots.

`feed_slots` is the one loop, in the ranks (`ranks.serve_slots`) and in this process (`batch_backend`): at
every step boundary with a free slot it takes the requests waiting (`take(free, idle)`, at most `free`, FIFO
order; it waits for one only while no slot is busy), joins each to a free slot (its prefill and first token),
then runs one step over every slot; a sequence that ends (EOS, `max_new_tokens`, a cancel's STOP) frees its
slot for the next boundary. The scheduling itself is the runner's (`PipelineRunner.join` and `step`). So a request
waits only for a free slot, never for the other requests' whole decodes, and its first token comes with its
join, before the next step.

In the ranks every process runs this loop and `take` is rank 0's read of the queue broadcast to the others: the
slots are the same on every rank at a step boundary, so every rank asks at the same boundaries and joins the
same requests into the same slots.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import NamedTuple

from inference.cycle.pipeline import PipelineRunner
from inference.cycle.result import DecodeResult
from inference.cycle.slots import Request, SlotSequence
from inference.sampling import Sampling

STOP = "stop"  # what `take` returns once the server stops: the slots in flight finish, no request joins
IDLE_TICK_S = 1.0  # how long an idle pipeline waits for a request before its keep-alive


class Ask(NamedTuple):
    """One request as it travels to the decoder (picklable): what the backend's queue holds."""

    request_id: int
    prompt: list[int]
    max_new_tokens: int
    sampling: dict  # Sampling.to_dict()
    seed: int

    def request(
        self,
        eos: frozenset[int],
        on_tokens: Callable[[list[int]], None] | None,
        stop: Callable[[], bool] | None,
    ) -> Request:
        return Request(
            self.prompt, self.max_new_tokens, eos, Sampling(**self.sampling), self.seed, on_tokens=on_tokens, stop=stop
        )


def waiting(source, free: int, wait: float) -> list[Ask] | str:
    """Up to `free` requests from `source` (a queue of `Ask` tuples, None to stop: `get`, `get_nowait`, `put`),
    waiting up to `wait` seconds for the first; STOP when the stop comes first."""
    asks: list[Ask] = []
    try:
        item = source.get(timeout=wait) if wait else source.get_nowait()
        while item is not None:
            asks.append(Ask(*item))
            if len(asks) == free:
                return asks
            item = source.get_nowait()
    except queue.Empty:
        return asks
    if asks:
        source.put(None)  # the stop comes after the requests before it: at the next boundary
        return asks
    return STOP


def feed_slots(
    runner: PipelineRunner,
    take: Callable[[int, bool], list[Ask] | str],
    start: Callable[[Ask], Request],
    on_result: Callable[[Ask, DecodeResult, SlotSequence], None],
) -> None:
    """Serve until `take` returns STOP and the slots in flight have finished (see the module docstring).
    `take(free, idle)`: the requests to join now; `start(ask)`: its slot request; `on_result(ask, result, seq)`
    as each sequence ends."""
    joined: dict[int, tuple[Ask, SlotSequence]] = {}
    stopping = False
    while not stopping or runner.busy:
        if not stopping and runner.free_slots:
            asks = take(len(runner.free_slots), not runner.busy)
            if asks == STOP:
                stopping = True
            else:
                for ask in asks:
                    slot = runner.join(start(ask))
                    joined[slot] = (ask, runner.slots[slot])
        for slot, result in runner.step():
            ask, seq = joined.pop(slot)
            on_result(ask, result, seq)
    runner.run([])  # takes any verdict still owed and completes every send before the ranks leave
