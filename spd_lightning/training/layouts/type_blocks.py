"""The `type` layout (the paper's; exact for `L_s = 1`): one block per aggregation type a view uses, one fill per
step, and its structural mask (docs/DESIGN.md, "Sequence replication")."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch

from ...geometry import Geometry
from ..attention import MaskMod, TwoPartPlan
from ..block_sparsity import ShapeMasks
from .replication import FillDistribution, Replication, index_table, shape_masks, to_device_async


@dataclass
class TypeRows:
    """What the `type` mask needs of each query row (tensors broadcast over the query indices).

    `time`: the row's position; `fill`: the step's fill level; `real`: not padding; `inflight_index`: the in-flight
    index `jq` its block stands for; keys nearer than `stair_width` come from the staircase blocks, keys at distance
    `>= stair_width` from the deepest block, up to position `cutoff` (-1: none).
    """

    time: torch.Tensor
    fill: torch.Tensor
    real: torch.Tensor
    inflight_index: torch.Tensor
    stair_width: torch.Tensor
    cutoff: torch.Tensor


class TypeLayout:
    """One block per aggregation type (the paper's layout, docs/DESIGN.md, "Sequence replication").

    Block `beta` stands for a token at in-flight index `jq(beta)` (the first index whose depth has that
    type; under the pre-step schedule that is `d(tau)`). Query `(beta, t)` sees key `(beta_k, T)` iff
    `T <= t` and `beta_k` is the block of in-flight index `min(n, jq + t - T)`; keys with `t - T >= a` use
    the deepest block. For the loss block (`jq = 0`) this is exactly `V(t)` when `L_s = 1`.
    """

    name = "type"

    def __init__(self, geometry: Geometry, fill: FillDistribution = FillDistribution()):
        self.geometry, self.fill_dist = geometry, fill
        n = geometry.n
        type_of_j = [geometry.type_of(geometry.inflight_depth(j)) for j in range(n)] + [geometry.type_of(n)]
        self.copy_types = sorted(set(type_of_j))  # blocks: only the types some view actually uses
        self.block_of_j = [self.copy_types.index(tau) for j, tau in enumerate(type_of_j)]
        self.jq = [self.block_of_j.index(beta) for beta in range(len(self.copy_types))]
        self.copy_depths = [geometry.inflight_depth(j) if j < n else n for j in self.jq]
        self.deepest = len(self.copy_types) - 1
        self.first_deep_j = self.block_of_j.index(self.deepest)

    def shape_masks(self, T: int, device: torch.device) -> ShapeMasks:
        return shape_masks(self, T, lambda a: torch.full((1,), a, device=device), device)

    def draw_fill(self, batch: int, length: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """One fill level for the whole step, repeated per sample."""
        return self.fill_dist.sample(self.geometry.n, (1,), generator).expand(batch).clone()

    def validation_fill(self, batch: int, length: int, offset: int = 0) -> torch.Tensor:
        """Every fill level in turn over the samples (`a(b) = (b + offset) mod n + 1`; the mask takes one fill per
        sample): validation measures each fill whenever it sees at least `n` samples."""
        return (torch.arange(batch) + offset) % self.geometry.n + 1

    def replicate(self, lengths: torch.Tensor, length: int, fill: torch.Tensor) -> Replication:
        T, device = length, lengths.device
        fill = to_device_async(fill, device)
        B, m = lengths.shape[0], len(self.copy_types)
        mask = TypeMask(
            n=self.geometry.n,
            length=T,
            lengths=lengths,
            fill=fill,
            block_of_j=tuple(self.block_of_j),
            jq=tuple(self.jq),
            first_deep_j=self.first_deep_j,
            block_table=index_table(tuple(self.block_of_j), device),
            jq_table=index_table(tuple(self.jq), device),
        )
        real = torch.arange(T, device=device)[None, :] < lengths[:, None]
        return Replication(
            batch=B,
            length=T,
            copy_types=self.copy_types,
            copy_depths=self.copy_depths,
            loss_copy=self.block_of_j[0],
            mask_mod=mask.mask_mod,
            plan_fn=mask.plan,
            active=[real] * m,
            fill=[fill[:, None].expand(B, T)] * m,
            shape=self.shape_masks(T, device),
            lengths=lengths,
            device=device,
        )


@dataclass(frozen=True, kw_only=True)
class TypeMask:
    """The `type` layout's structural mask of one batch (`TypeLayout`): per-row quantities (`rows`), the
    predicate (`attends`, as FlexAttention's `mask_mod`) and the two-part factorization of the first rows
    (`plan`). `fill[b]` is the step's fill level, `block_of_j[j]` the block of in-flight index `j`, `jq[beta]` the
    index block `beta` stands for, `first_deep_j` the first index in the deepest block."""

    n: int
    length: int
    lengths: torch.Tensor
    fill: torch.Tensor
    block_of_j: tuple[int, ...]
    jq: tuple[int, ...]
    first_deep_j: int
    block_table: torch.Tensor  # block_of_j and jq on the device, made once (`index_table`)
    jq_table: torch.Tensor

    def _args(self) -> tuple:
        deepest = len(self.jq) - 1  # a Python int: from a tensor's shape it would be symbolic under dynamic=True
        return (
            self.n,
            self.length,
            self.lengths,
            self.fill,
            self.block_table,
            self.jq_table,
            self.first_deep_j,
            deepest,
        )

    def rows(self, b, q) -> TypeRows:
        return _type_rows(*self._args(), b, q)

    def attends(self, b, h, q, kv) -> torch.Tensor:
        """Whether query `q` of sample `b` attends to key `kv` (index tensors that broadcast)."""
        return _type_attends(*self._args(), b, q, kv)

    @cached_property
    def mask_mod(self) -> MaskMod:
        """`attends` as the plain function FlexAttention requires, closing over the tensors themselves."""
        args = self._args()

        def mask_mod(b, h, q, kv):
            return _type_attends(*args, b, q, kv)

        return mask_mod

    def plan(self, num_rows: int) -> TwoPartPlan:
        device, B, T = self.lengths.device, self.lengths.shape[0], self.length
        q, delta, slot_key = _type_grid(self.block_of_j, self.first_deep_j, T, num_rows, device)
        row = self.rows(torch.arange(B, device=device)[:, None], q[None])
        ok = row.real[..., None] & (delta < row.stair_width[..., None]) & (slot_key >= 0)
        stair = torch.where(ok, slot_key, -1)  # [B, R, W]
        stair[..., 0] = torch.where(row.real, stair[..., 0], q)  # padding: self only
        deepest = len(self.jq) - 1
        return TwoPartPlan(prefix_start=deepest * T, prefix_len=T, cutoff=row.cutoff.expand(B, -1), stair=stair)


def _type_rows(n, T, lengths, fill, block_table, jq_table, first_deep_j, deepest, b, q) -> TypeRows:
    t = q % T
    a, real, jq = fill[b], t < lengths[b], jq_table[q // T]
    delta0 = torch.minimum((first_deep_j - jq).clamp(min=0), a)
    cutoff = torch.where(real, t - delta0, -1)
    return TypeRows(time=t, fill=a, real=real, inflight_index=jq, stair_width=delta0, cutoff=cutoff)


def _type_attends(n, T, lengths, fill, block_table, jq_table, first_deep_j, deepest, b, q, kv) -> torch.Tensor:
    row = _type_rows(n, T, lengths, fill, block_table, jq_table, first_deep_j, deepest, b, q)
    kb, kt = kv // T, kv % T
    delta = row.time - kt
    staircase_block = block_table[(row.inflight_index + delta).clamp(0, n)]
    key_block = torch.where(delta < row.fill, staircase_block, deepest)
    return (row.real & (delta >= 0) & (kb == key_block)) | (~row.real & (kv == q))


@lru_cache(maxsize=16)
@torch.inference_mode(False)  # shared by training and validation (`index_table`)
def _type_grid(
    block_of_j: tuple[int, ...], first_deep_j: int, T: int, rows: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The shape-only part of a `type` plan for the first `rows` rows: the rows `q[R]`, the key distance `delta[W]`
    of each staircase slot and its key `(block of in-flight index jq + delta, t - delta)`, `[R, W]`, or -1 where
    `t - delta < 0`. Slots at or past the row's staircase width (fill) are cut per step."""
    q = torch.arange(rows, device=device)
    t, jq = q % T, torch.tensor([block_of_j.index(b) for b in range(max(block_of_j) + 1)], device=device)[q // T]
    delta = torch.arange(max(first_deep_j, 1), device=device)
    key_block = torch.tensor(block_of_j, device=device)[(jq[:, None] + delta).clamp(0, len(block_of_j) - 1)]
    kt = t[:, None] - delta
    return q, delta, torch.where(kt >= 0, key_block * T + kt, -1)
