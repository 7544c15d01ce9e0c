"""The decoder's one switch for timing: seconds per (rank, cycle, field), or nothing at all.

Off (the default) every `span` is a shared no-op context and nothing touches the device: the production
path has no timer and no device synchronization. On, host work (messages, the cycle's wall time) is timed
with `perf_counter`, and device work (a stage's layers, the PDM's draft, verification) on a GPU with CUDA
events, read once the prompt is done (`rows`), so timing adds no synchronization inside a cycle either;
on the CPU device work is host work. Row 0 collects prefill, row `k` the runner's cycle `k` (docs/DESIGN.md,
"One cycle over B slots", Timing), and `count` adds the slots that ran a real cycle in it (`result.py` says what
each field means and `summarize_timing` reports them).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext

import numpy as np
import torch

from inference.cycle.result import SLOTS, TIMING_FIELDS

_OFF = nullcontext()


class Profiler:
    def __init__(self, enabled: bool, device: torch.device):
        self.enabled = enabled
        self._events = enabled and device.type == "cuda"
        self.device = device
        self.cycle = 0
        self._rows = np.zeros((0, 0, TIMING_FIELDS))
        self._pending: list[tuple[Sequence[int], int, int, torch.cuda.Event, torch.cuda.Event]] = []

    def start(self, world_size: int, cycles: int) -> None:
        """New rows, room for `cycles` cycles to start with (row 0 is prefill; more grow as they come)."""
        self.cycle = 0
        if self.enabled:
            # numpy, not tensors: bookkeeping must not cost tensor ops on the critical path
            self._rows = np.zeros((world_size, cycles + 1, TIMING_FIELDS))
            self._pending.clear()

    def span(self, ranks: int | Sequence[int], field: int, device_work: bool = False):
        """Time the block into `field` of the current cycle of `ranks` (one rank or several)."""
        if not self.enabled:
            return _OFF
        if self.cycle >= self._rows.shape[1]:  # a workload of several requests: more cycles than one bounds
            self._rows = np.pad(self._rows, ((0, 0), (0, 2 * self.cycle + 1 - self._rows.shape[1]), (0, 0)))
        ranks = (ranks,) if isinstance(ranks, int) else tuple(ranks)
        return self._device_span(ranks, field) if device_work and self._events else self._host_span(ranks, field)

    def count(self, ranks: Sequence[int], slots: int) -> None:
        """`slots` slots ran a real cycle in the current cycle (a count, not seconds; every hosted rank's row)."""
        if self.enabled:
            self._rows[list(ranks), self.cycle, SLOTS] += slots

    @contextmanager
    def _host_span(self, ranks: Sequence[int], field: int) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self._rows[list(ranks), self.cycle, field] += time.perf_counter() - t0

    @contextmanager
    def _device_span(self, ranks: Sequence[int], field: int) -> Iterator[None]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream = torch.cuda.current_stream(self.device)  # the work's device, which need not be the current one
        start.record(stream)
        yield
        end.record(stream)
        self._pending.append((ranks, self.cycle, field, start, end))

    @property
    def rows(self) -> np.ndarray:
        """`[world, cycles + 1, TIMING_FIELDS]` seconds (all zero when off); waits for timed device work."""
        if self._pending:
            self._pending[-1][4].synchronize()
            for ranks, cycle, field, start, end in self._pending:
                self._rows[list(ranks), cycle, field] += start.elapsed_time(end) / 1e3
            self._pending.clear()
        return self._rows
