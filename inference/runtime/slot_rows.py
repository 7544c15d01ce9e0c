"""Per-slot values on the device without a host-to-device copy, and the batch buckets of the batched step
(docs/DESIGN.md, "One cycle over B slots": "No host sync per step" and "Batch buckets"; `HostTable` in "The
critical path": "The draft is batched tensor work").

The batched decoder's schedule runs on the host, one `SlotSequence` per slot; its forwards read per-slot values on
the device: the position each row runs, which rows run a real token, where each slot's PDM segment starts and
where its newest position lies. Building them as `torch.tensor(host_list)` each cycle would be a host-to-device
copy per cycle (a sync on a GPU, which the hot path must not have). So `RowSets` makes the mask of any set of rows
by a device-to-device copy, `DeviceInts` keeps a `[B]` vector written on the device only, `HostTable` sends a
table the host writes in full in ONE copy (a fixed number of ops for any B, where per-slot writes would grow with
it), and `batch_bucket` runs a step over a power of two of rows, one compiled graph per bucket.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

CHUNK = 8  # rows per mask table: 2**8 subsets


def batch_bucket(rows: int, slots: int) -> int:
    """The rows a step over `rows` leading slots runs: the next power of two, at most `slots`."""
    if not 0 < rows <= slots:
        raise ValueError(f"a step over {rows} rows of {slots} slots: rows must be in 1..{slots}")
    return min(slots, 1 << (rows - 1).bit_length())


def leading(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """The leading `rows` rows of a per-slot tensor: the tensor itself when that is all of them (batch 1, a full
    bucket), as a step asks for many and each view is an op."""
    return tensor if rows == tensor.shape[0] else tensor[:rows]


def mark_static(*tensors: torch.Tensor) -> None:
    """Fixed addresses for a CUDA graph: tensors a compiled step reads or writes in place."""
    for tensor in tensors:
        torch._dynamo.mark_static_address(tensor)


class RowSets:
    """Device masks of host sets of rows (`write`), from tables of every subset of a chunk of rows."""

    def __init__(self, rows: int, device: torch.device):
        self.rows, self.width = rows, min(rows, CHUNK)
        codes = torch.arange(2**self.width, device=device)[:, None]
        self.table = (codes.bitwise_right_shift(torch.arange(self.width, device=device)) & 1).bool()

    def mask(self) -> torch.Tensor:
        """A mask buffer for `write` (allocated once by its owner)."""
        return torch.zeros(self.rows, dtype=torch.bool, device=self.table.device)

    def write(self, members: Iterable[int], out: torch.Tensor) -> torch.Tensor:
        """`out[b]` = b in `members`, written device to device."""
        members = set(members)
        for start in range(0, self.rows, self.width):
            width = min(self.width, self.rows - start)
            code = sum(1 << (b - start) for b in members if start <= b < start + width)
            out[start : start + width].copy_(self.table[code, :width])
        return out


class DeviceInts:
    """A `[B]` long vector on the device (`device`) and its host mirror (`host`), written only on the device."""

    def __init__(self, rows: int, device: torch.device):
        self.host = [0] * rows
        self.device = torch.zeros(rows, dtype=torch.long, device=device)
        mark_static(self.device)

    def set(self, row: int, value: int) -> None:
        """Row `row` to `value`, by `fill_` (a kernel argument: no host memory copied)."""
        if value != self.host[row]:
            self.device[row].fill_(value)
            self.host[row] = value

    def add_one(self, members: Iterable[int], mask: torch.Tensor | int) -> None:
        """Rows `members` move by one: their device mask `mask`, of any leading length, or every one of the leading
        `mask` rows."""
        if isinstance(mask, int):
            leading(self.device, mask).add_(1)
        else:
            leading(self.device, mask.shape[0]).add_(mask)
        for b in members:
            self.host[b] += 1


class HostTable:
    """A `[rows, columns]` int64 table: the host fills `host` (a NumPy view: no torch op per entry) and
    `upload` copies the leading rows to `device` in one copy, asynchronous from pinned memory on a GPU. Before
    the host writes again it waits for the previous copy to have read the table (`writable`), which it has long
    done by the next step."""

    def __init__(self, rows: int, columns: int, device: torch.device):
        pinned = device.type == "cuda"
        self._host = torch.zeros(rows, columns, dtype=torch.long, pin_memory=pinned)
        self.host = self._host.numpy()
        self.device = torch.zeros(rows, columns, dtype=torch.long, device=device)
        self._copied = torch.cuda.Event() if pinned else None
        self._device = device
        mark_static(self.device)

    def writable(self):
        """The host table, once the last upload has read it."""
        if self._copied is not None:
            self._copied.synchronize()
        return self.host

    def upload(self, rows: int) -> torch.Tensor:
        """The leading `rows` rows on the device."""
        device = leading(self.device, rows)
        device.copy_(leading(self._host, rows), non_blocking=True)
        if self._copied is not None:  # on the stream of the copy: `device`'s, not the current device's
            self._copied.record(torch.cuda.current_stream(self._device))
        return device
