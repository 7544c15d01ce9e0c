"""The in-process backend of `serve --simulate` (any `--max-batch B`): a `Simulator` of B slots fed by the server.

One driver thread owns the simulator and runs `slot_feed.feed_slots` over it, fed by this backend's FIFO; the
hand-over, the routing and the failures are `SlotBackend`'s. A cancelled request is stopped at its next verdict
(`Request.stop` reads the set of cancelled ids once per cycle).
"""

from __future__ import annotations

import logging
import queue
from functools import partial

from inference.cycle.result import DecodeResult
from inference.cycle.simulator import Simulator
from inference.cycle.slots import SlotSequence
from inference.serving.inflight import SlotBackend
from inference.serving.slot_feed import QueuedRequest, feed_slots, waiting
from inference.setup import Setup
from spd_lightning.export import load_drafter
from spd_lightning.geometry import Geometry
from spd_lightning.target import Target

log = logging.getLogger(__name__)


class BatchSimulatorBackend(SlotBackend):
    stopped = "the batched decoder stopped"

    def __init__(self, target: Target, pdm, geometry: Geometry, eos: list[int], max_batch: int, compile: bool = False):
        self.runner = Simulator(target, pdm, geometry, max_batch=max_batch, compile=compile)
        self.eos = frozenset(eos)
        self._cancelled: set[int] = set()
        super().__init__(queue.SimpleQueue(), self._cancelled.add, self._drive, "spd-batch-driver", max_batch)

    @classmethod
    def from_setup(cls, setup: Setup, device: str, max_batch: int, compile: bool = False) -> BatchSimulatorBackend:
        target = Target.load(setup.target_path, setup.dtype, device, setup.trust_remote_code)
        pdm = load_drafter(setup.ckpt, device, target.lm_head.weight)[0].to(target.model.dtype)
        return cls(target, pdm, setup.geometry, setup.eos, max_batch, compile)

    def _drive(self) -> None:
        on_tokens, cancelled = partial(self.put, "tokens"), self._cancelled.__contains__
        try:
            feed_slots(self.runner, self._take, self.eos, on_tokens, cancelled, self._ended)
        except Exception:
            log.exception("the batched decoder failed")
            raise

    def _take(self, free: int, idle: bool) -> list[QueuedRequest] | str:
        return waiting(self._queue, free, idle)

    def _ended(self, queued: QueuedRequest, result: DecodeResult, seq: SlotSequence) -> None:
        self._cancelled.discard(queued.request_id)
        self.put("result", queued.request_id, result)
