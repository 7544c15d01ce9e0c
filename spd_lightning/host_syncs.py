"""Count the host/device synchronizations a piece of code would make on a GPU.

`HostSyncCounter` is a context manager for tests and benchmarks. It watches every aten op (a
`TorchDispatchMode`) and, where the dispatcher cannot see a copy, the Python tensor methods (a
`TorchFunctionMode`), and records each event with its kind, the op and the call site (the innermost
frame outside torch and this file):

| kind | what | why the GPU waits |
|---|---|---|
| `lift_fresh` | `aten.lift_fresh`/`lift_fresh_copy`: a tensor made from Python data (`torch.tensor(list, device=...)`, `x[[0, 1]]`, `x[m] = 0.0`) | a host-to-device copy of pageable memory |
| `scalar_read` | `aten._local_scalar_dense`: `.item()`, `bool(t)`, `int(t)`, `float(t)` | the host reads a device value |
| `data_dependent_shape` | `nonzero`, `masked_select`, `unique`, `repeat_interleave` without `output_size`, boolean-mask indexing (`x[mask]`, `x[mask] = v`) | the output size lives on the device |
| `to_host` | copies to the host: `.cpu()`, `.tolist()`, `.numpy()`, `.to("cpu")` of a device tensor | the host waits for the copy |
| `to_device` | `.to(device)` / `.cuda()` of a host tensor (not a `non_blocking` copy from pinned memory) | a host-to-device copy per call |
| `fresh_index` | indexing with an index tensor made from Python data in the same region (or, on a GPU, an index that lives on the host) | the index is copied to the device first |

**On a GPU** (`device="cuda"`, the default when one is present) the copies are told by the devices of the
tensors the dispatcher sees (`_to_copy`, `copy_`), so a `.to(device)` of a tensor that already lives there
is not counted.

**On CPU** (`device="cpu"`, the test's choice) every tensor is a host tensor and a move is a no-op that
the dispatcher never sees, so what counts is the op the code asks for, as if the CPU were the device:
`.cpu()`, `.tolist()` and `.numpy()` and `.to("cpu")` with the literal string `"cpu"` count as `to_host`;
`.cuda()` and `.to(d)` with any other explicit device (a `torch.device`, another tensor) count as
`to_device`. A `.to(dtype)` is never counted. A hot path that keeps its tensors where they live and
builds its constants once per shape therefore shows 0 on CPU exactly when it would on a GPU.

    with HostSyncCounter(device="cpu") as syncs:
        module.training_step(batch, 0)
    assert syncs.total == 0, syncs.summary()
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

KINDS = ("lift_fresh", "scalar_read", "data_dependent_shape", "to_host", "to_device", "fresh_index")

_aten = torch.ops.aten
_LIFTS = {_aten.lift_fresh.default, _aten.lift_fresh_copy.default}
_SCALAR_READS = {_aten._local_scalar_dense.default}
_DATA_DEPENDENT = {
    _aten.nonzero.default,
    _aten.argwhere.default,
    _aten.masked_select.default,
    _aten._unique2.default,
    _aten.unique_dim.default,
    _aten.unique_consecutive.default,
}
_REPEAT_INTERLEAVE = {_aten.repeat_interleave.Tensor, _aten.repeat_interleave.self_Tensor}
_INDEXING = {
    _aten.index.Tensor,
    _aten.index_put.default,
    _aten.index_put_.default,
    _aten._index_put_impl_.default,
}
_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = os.path.abspath(__file__)


@dataclasses.dataclass(frozen=True)
class HostSync:
    kind: str
    op: str
    site: str  # "path:line in function", the innermost frame outside torch and this module


def _call_site() -> str:
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path != _THIS_FILE and not path.startswith(_TORCH_DIR) and "<frozen" not in path:
            return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "<unknown>"


class HostSyncCounter:
    """Records the host syncs made inside `with`; `counts`, `total`, `records`, `summary()`."""

    def __init__(self, device: str | torch.device | None = None) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.records: list[HostSync] = []
        self._fresh: dict[int, weakref.ref] = {}
        self._dispatch = _DispatchWatcher(self)
        self._function = _MoveWatcher(self) if self.device.type == "cpu" else None

    @property
    def counts(self) -> dict[str, int]:
        return dict(collections.Counter(r.kind for r in self.records))

    @property
    def total(self) -> int:
        return len(self.records)

    def summary(self) -> str:
        """One line per (kind, op, site) with its count: what an assertion message shows."""
        grouped = collections.Counter((r.kind, r.op, r.site) for r in self.records)
        lines = [f"{n}x {kind} ({op}) at {site}" for (kind, op, site), n in grouped.most_common()]
        return f"{self.total} host syncs" + "".join("\n  " + line for line in lines)

    def reset(self) -> None:
        self.records.clear()
        self._fresh.clear()

    def __enter__(self) -> HostSyncCounter:
        if self._function is not None:
            self._function.__enter__()
        self._dispatch.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._dispatch.__exit__(*exc)
        if self._function is not None:
            self._function.__exit__(*exc)

    def _record(self, kind: str, op: object) -> None:
        self.records.append(HostSync(kind, str(op), _call_site()))

    def _remember_fresh(self, tensor: torch.Tensor) -> None:
        self._fresh[id(tensor)] = weakref.ref(tensor)

    def _is_fresh(self, tensor: torch.Tensor) -> bool:
        ref = self._fresh.get(id(tensor))
        return ref is not None and ref() is tensor


def _index_kind(counter: HostSyncCounter, self_tensor: torch.Tensor, indices) -> str | None:
    present = [i for i in indices if isinstance(i, torch.Tensor)]
    if any(i.dtype in (torch.bool, torch.uint8) for i in present):
        return "data_dependent_shape"
    if any(counter._is_fresh(i) for i in present):
        return "fresh_index"
    if self_tensor.device.type != "cpu" and any(i.device.type == "cpu" for i in present):
        return "fresh_index"
    return None


def _asynchronous(args, kwargs) -> bool:
    """A non-blocking copy from pinned host memory: the host does not wait for it."""
    non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
    return bool(non_blocking) and args[1].device.type == "cpu" and args[1].is_pinned()


def _copy_kind(source: torch.device, target: torch.device | None) -> str | None:
    if target is None or source.type == target.type:
        return None
    return "to_host" if target.type == "cpu" else "to_device"


class _DispatchWatcher(TorchDispatchMode):
    # Higher-order ops (flex_attention, checkpoint) pass through here too; their inner aten ops are then seen.
    supports_higher_order_operators = True

    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = self._kind(func, args, kwargs)
        if kind is not None:
            self.counter._record(kind, func)
        out = func(*args, **kwargs)
        if func in _LIFTS:
            self.counter._remember_fresh(out)
        return out

    def _kind(self, func, args, kwargs) -> str | None:
        if func in _LIFTS:
            return "lift_fresh"
        if func in _SCALAR_READS:
            return "scalar_read"
        if func in _DATA_DEPENDENT:
            return "data_dependent_shape"
        if func in _REPEAT_INTERLEAVE and kwargs.get("output_size") is None:
            return "data_dependent_shape"
        if func in _INDEXING:
            return _index_kind(self.counter, args[0], args[1])
        if func is _aten._to_copy.default:
            target = kwargs.get("device")
            return _copy_kind(args[0].device, None if target is None else torch.device(target))
        if func is _aten.copy_.default:
            if _asynchronous(args, kwargs):
                return None
            return _copy_kind(args[1].device, args[0].device)
        return None


class _MoveWatcher(TorchFunctionMode):
    """On CPU: the moves the dispatcher never sees, told by the method the code calls."""

    _TO_HOST = {torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.numpy}

    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = self._kind(func, args, kwargs)
        if kind is not None:
            self.counter._record(kind, getattr(func, "__name__", func))
        return func(*args, **kwargs)

    def _kind(self, func, args, kwargs) -> str | None:
        if func in self._TO_HOST:
            return "to_host"
        if func is torch.Tensor.cuda:
            return "to_device"
        if func is torch.Tensor.to:
            device = torch._C._nn._parse_to(*args[1:], **kwargs)[0]
            if device is None:
                return None
            named_host = any(a == "cpu" for a in (*args[1:], kwargs.get("device")) if isinstance(a, str))
            return "to_host" if named_host else "to_device"
        return None
