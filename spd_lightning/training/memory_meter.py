"""Peak memory of a code region on any device: the CUDA allocator's statistics where there are some, and on
CPU (which has none) the bytes of tensor storages alive at once, counted by a dispatch mode.

`spd_lightning.estimate` is checked against this meter on CPU training steps, and the GPU check reads the
same interface on CUDA. The CPU count covers every tensor an op creates inside the region (forward,
autograd's saved tensors, backward, optimizer state) plus the storages given as `baseline`; it ignores
allocator fragmentation and caching, which the CUDA numbers include.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorBytes(TorchDispatchMode):
    """`with LiveTensorBytes(baseline) as meter: ...` then `meter.peak`: the most bytes of distinct tensor
    storages alive at once during the region (storages shared by views are counted once)."""

    def __init__(self, baseline: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._refs: dict[int, list[int]] = {}  # storage data_ptr -> [tracked tensors alive, nbytes]
        for tensor in baseline:
            self._track(tensor)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0:
            return
        entry = self._refs.get(key)
        if entry is None:
            entry = self._refs[key] = [0, nbytes]
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        weakref.finalize(tensor, self._release, key)

    def _release(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self._refs[key]


class PeakMemory:
    """`with PeakMemory(device, baseline) as m: ...` then `m.peak_bytes`: CUDA's `max_memory_allocated` on a
    CUDA device (baseline: whatever is allocated already), `LiveTensorBytes` elsewhere."""

    def __init__(self, device: torch.device | str, baseline: Iterable[torch.Tensor] = ()):
        self.device = torch.device(device)
        self._baseline = list(baseline)
        self._meter: LiveTensorBytes | None = None
        self.peak_bytes = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._meter = LiveTensorBytes(self._baseline).__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        else:
            self._meter.__exit__(*exc)
            self.peak_bytes = self._meter.peak
