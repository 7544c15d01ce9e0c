"""The `depth` layout (exact for any `L_s`): `n+1` copies, the fill drawn per drafting time, and its structural mask
(docs/DESIGN.md, "The structural mask"; the package docstring says what a copy stands for)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch

from ...geometry import Geometry
from ..attention import MaskMod, TwoPartPlan
from ..block_sparsity import ShapeMasks
from .replication import FillDistribution, Replication, shape_masks, to_device_async


@dataclass
class DepthRows:
    """What the `depth` mask needs of each query row (tensors broadcast over the query indices).

    `copy`: the row's copy; `time`: its drafting time `t = i + copy`; `active`: a view's token (not padding, and
    `copy < a(t)` or the verified copy); `cutoff`: the last copy-n position it reads (-1: none); the row reads
    copies `stair_lo..stair_hi-1` of the staircase at `(j, t - j)`.
    """

    copy: torch.Tensor
    time: torch.Tensor
    active: torch.Tensor
    cutoff: torch.Tensor
    stair_lo: torch.Tensor
    stair_hi: torch.Tensor


class DepthLayout:
    """`n+1` copies; the structural mask (docs/DESIGN.md, "The structural mask")."""

    name = "depth"

    def __init__(self, geometry: Geometry, fill: FillDistribution = FillDistribution()):
        self.geometry, self.fill_dist = geometry, fill
        n = geometry.n
        self.copy_depths = [geometry.inflight_depth(c) for c in range(n)] + [n]
        self.copy_types = [geometry.type_of(k) for k in self.copy_depths]

    def shape_masks(self, T: int, device: torch.device) -> ShapeMasks:
        n = self.geometry.n
        return shape_masks(self, T, lambda a: torch.full((1, T + n), a, device=device), device)

    def draw_fill(self, batch: int, length: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """`a(t)` for every drafting time a copy token can stand for: `t = i + c <= T - 1 + n`."""
        return self.fill_dist.sample(self.geometry.n, (batch, length + self.geometry.n), generator)

    def validation_fill(self, batch: int, length: int, offset: int = 0) -> torch.Tensor:
        """Every fill level in turn over the drafting times (`a(t) = (t + b + offset) mod n + 1`): validation
        measures each fill on about `1/n` of the outputs of every sequence, whatever the training draws."""
        t, b = torch.arange(length + self.geometry.n), torch.arange(batch)
        return (t[None, :] + b[:, None] + offset) % self.geometry.n + 1

    def replicate(self, lengths: torch.Tensor, length: int, fill: torch.Tensor) -> Replication:
        n, T, device = self.geometry.n, length, lengths.device
        fill = to_device_async(fill, device)
        mask = DepthMask(n=n, length=T, lengths=lengths, fill=fill)
        i = torch.arange(T, device=device)
        real = i[None, :] < lengths[:, None]
        return Replication(
            batch=lengths.shape[0],
            length=T,
            copy_types=self.copy_types,
            copy_depths=self.copy_depths,
            loss_copy=0,
            mask_mod=mask.mask_mod,
            plan_fn=mask.plan,
            active=[real & (c < fill[:, i + c]) for c in range(n)] + [real],
            fill=[fill[:, i + c] for c in range(n)] + [torch.full_like(fill[:, :T], n)],
            shape=self.shape_masks(T, device),
            lengths=lengths,
            device=device,
        )


@dataclass(frozen=True, kw_only=True)
class DepthMask:
    """The `depth` layout's structural mask of one batch (module docstring): its per-row quantities (`rows`), the
    predicate read from them (`attends`, as FlexAttention's `mask_mod`) and the two-part factorization of the
    first rows (`plan`). `fill[b, t]` is the fill level of drafting time `t`, `lengths[b]` the real tokens of
    sample `b`."""

    n: int
    length: int
    lengths: torch.Tensor
    fill: torch.Tensor

    def rows(self, b, q) -> DepthRows:
        return _depth_rows(self.n, self.length, self.lengths, self.fill, b, q)

    def attends(self, b, h, q, kv) -> torch.Tensor:
        """Whether query `q` of sample `b` attends to key `kv` (index tensors that broadcast)."""
        return _depth_attends(self.n, self.length, self.lengths, self.fill, b, q, kv)

    @cached_property
    def mask_mod(self) -> MaskMod:
        """`attends` as the plain function FlexAttention requires, closing over the tensors themselves (what
        dynamo compiles: CPU inductor fails on the same predicate read through attributes)."""
        n, T, lengths, fill = self.n, self.length, self.lengths, self.fill

        def mask_mod(b, h, q, kv):
            return _depth_attends(n, T, lengths, fill, b, q, kv)

        return mask_mod

    def plan(self, num_rows: int) -> TwoPartPlan:
        n, T, device, B = self.n, self.length, self.lengths.device, self.lengths.shape[0]
        q, slot_copy, slot_key = _depth_grid(n, T, num_rows, device)
        row = self.rows(torch.arange(B, device=device)[:, None], q[None])
        stair = torch.where(slot_copy < row.stair_hi[..., None], slot_key, -1)  # [B, R, W]
        stair[..., 0] = torch.where(row.active, stair[..., 0], q)  # inactive and padding: self only
        return TwoPartPlan(prefix_start=n * T, prefix_len=T, cutoff=row.cutoff.expand(B, -1), stair=stair)


def _depth_rows(n: int, T: int, lengths: torch.Tensor, fill: torch.Tensor, b, q) -> DepthRows:
    copy, pos = q // T, q % T
    t = pos + copy
    a = fill[b, t]
    real = pos < lengths[b]
    active = real & ((copy == n) | (copy < a))
    cutoff = torch.where(active, torch.where(copy == n, pos, t - a), -1)
    hi = torch.where(active & (copy < n), a, copy)
    return DepthRows(copy=copy, time=t, active=active, cutoff=cutoff, stair_lo=copy, stair_hi=hi)


def _depth_attends(n: int, T: int, lengths: torch.Tensor, fill: torch.Tensor, b, q, kv) -> torch.Tensor:
    row = _depth_rows(n, T, lengths, fill, b, q)
    kc, kp = kv // T, kv % T
    prefix = (kc == n) & (kp <= row.cutoff)
    stair = (kc >= row.stair_lo) & (kc < row.stair_hi) & (kp + kc == row.time)
    return prefix | stair | (~row.active & (kv == q))


@lru_cache(maxsize=16)
@torch.inference_mode(False)  # shared by training and validation (`index_table`)
def _depth_grid(n: int, T: int, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The shape-only part of a `depth` plan for the first `rows` rows: the rows `q[R]`; for staircase slot `w`
    of row `(c, i)` (time `t = i + c`) the copy `j = c + w` it reads, `[R, W]`, and its key `(j, t - j)`, or -1
    where `t - j < 0`. Slots at or past the row's fill are cut per step."""
    q = torch.arange(rows, device=device)
    copy, t = q // T, q % T + q // T
    slot_copy = copy[:, None] + torch.arange(max(n, 1), device=device)
    slot_key = torch.where(t[:, None] - slot_copy >= 0, slot_copy * T + t[:, None] - slot_copy, -1)
    return q, slot_copy, slot_key
