"""Sequence replication for training (docs/DESIGN.md, "Sequence replication", "Simulated fill levels", "The structural mask"): one forward covers the drafting view of every time.

At inference the PDM drafts `x_{t+1}` from the staircase view `V(t)` (spd_lightning/geometry.py). Training
replicates the sequence so that ONE forward computes the last-position output of `V(t)` for every `t`:

- `layout: depth` (exact for any `L_s`): `n+1` copies. Copy `c < n`, position `i` is `x_i` as the `c`-th
  newest in-flight token of the view of drafting time `t = i + c` (features of depth `inflight_depth(c)`);
  copy `n` is the verified sequence (depth `n`). Fill `a(t)` is drawn per drafting time.
- `layout: type` (the paper's; exact for `L_s = 1`): one block per aggregation type that a view uses.
  Fill is drawn once per step.

Each layout states its mask once, as per-row quantities (`DepthRows`, `TypeRows`) from which both the FlexAttention-style
predicate and the two-part factorization are read (spd_lightning/training/attention.py). Every replicated token
keeps RoPE position `i`.

The loss copy is copy 0 in both layouts (its type is the smallest), the first `T` rows of the replicated
sequence: the training step asks the PDM for those rows' outputs only (`body(outputs=T)`), so the last layer
computes the other copies' keys and values and nothing else. The two-part plan of a step depends on the batch
only through the fill levels and lengths; its index grids (which key each staircase slot of a row names) depend
on the shape alone and are cached per `(layout, T, rows, device)` (`_depth_grid`, `_type_grid`, bounded LRU).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Literal

import torch

from ..errors import ConfigError
from ..geometry import Geometry
from ..pdm import Attend
from .attention import Backend, MaskMod, TwoPartPlan, make_attend
from .block_sparsity import ShapeMasks, StepRows

LayoutName = Literal["depth", "type"]


@dataclass(frozen=True)
class FillDistribution:
    """Distribution of the fill level `a` in `1..n`: `a = n` with probability `full_prob`, otherwise uniform
    over `1..n-1`; or explicit `probs` for `a = 1..n` (normalized), which overrides `full_prob`."""

    full_prob: float = 0.5
    probs: Sequence[float] | None = None

    def probabilities(self, n: int) -> torch.Tensor:
        return _fill_probabilities(self.full_prob, None if self.probs is None else tuple(self.probs), n).clone()

    def sample(self, n: int, shape: Sequence[int], generator: torch.Generator | None = None) -> torch.Tensor:
        """Draws on the host (a CPU generator: the same draws on any device); the probabilities are built once."""
        p = _fill_probabilities(self.full_prob, None if self.probs is None else tuple(self.probs), n)
        draws = torch.multinomial(p, int(torch.Size(shape).numel()), replacement=True, generator=generator)
        return (draws + 1).view(*shape)


@lru_cache(maxsize=8)
@torch.inference_mode(False)  # shared by training and validation (`index_table`)
def _fill_probabilities(full_prob: float, probs: tuple[float, ...] | None, n: int) -> torch.Tensor:
    """`FillDistribution.probabilities`, cached: a step draws from it without making a tensor from Python data."""
    if probs is not None:
        p = torch.tensor([float(x) for x in probs], dtype=torch.float64)
        if p.numel() != n or (p < 0).any() or not (0 < p.sum() < float("inf")):  # NaN fails the comparison too
            raise ConfigError(
                f"fill_probs={list(probs)} must be {n} non-negative finite weights for a = 1..n={n} with a positive sum"
            )
        return p / p.sum()
    if not 0.0 <= full_prob <= 1.0:
        raise ConfigError(f"fill_full_prob={full_prob} must lie in [0, 1]")
    if n == 1:
        return torch.ones(1, dtype=torch.float64)
    rest = (1.0 - full_prob) / (n - 1)
    return torch.tensor([rest] * (n - 1) + [full_prob], dtype=torch.float64)


def to_device_async(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without a sync: through pinned memory, asynchronously (a no-op on CPU)."""
    if tensor.device == device:
        return tensor
    if tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


@lru_cache(maxsize=32)
@torch.inference_mode(False)
def index_table(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A small constant index tensor on `device`, made once (per step it would be a host-to-device copy). Made outside
    inference mode: the first call may come from validation (the sanity check, under inference mode on NCCL), and a
    `type` mask_mod of every later training step closes over the table, which flex saves for the backward."""
    return torch.tensor(values, device=device)


@dataclass(kw_only=True)
class Replication:
    """One replicated batch: which features go where, the mask, and which outputs mean what.

    `copy_types[c]` is the aggregation type of copy (block) `c`; `copy_depths[c]` the depth of the newest
    token of the views that copy `c` computes (what its outputs are labelled by in metrics); `loss_copy`
    the copy whose outputs are the drafts; `active[c]` marks tokens of copy `c` whose output IS a view's
    output (`[B, T]`); `fill[c]` the fill level of that view per token (`[B, T]`). `plan_fn(R)` is the two-part
    plan of the first `R` query rows.
    """

    batch: int
    length: int
    copy_types: list[int]
    copy_depths: list[int]
    loss_copy: int
    mask_mod: MaskMod
    plan_fn: Callable[[int], TwoPartPlan]
    active: list[torch.Tensor]
    fill: list[torch.Tensor]
    shape: ShapeMasks  # what every step of this shape shares (the flex block structure)
    lengths: torch.Tensor  # [B] real tokens per sample
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def __post_init__(self):
        if self.loss_copy != 0:  # body(outputs=T) computes the FIRST T rows: the loss copy must be copy 0
            raise ValueError(f"the loss copy must be copy 0 (the first T rows), got {self.loss_copy}")

    @property
    def num_copies(self) -> int:
        return len(self.copy_types)

    @property
    def seq_len(self) -> int:
        return self.num_copies * self.length

    def positions(self) -> torch.Tensor:
        """RoPE positions `[B, S]`: every copy keeps its token's true position."""
        pos = torch.arange(self.length, device=self.device).repeat(self.num_copies)
        return pos.expand(self.batch, -1)

    def features(self, fuse, states: torch.Tensor) -> torch.Tensor:
        """`g[B, S, d]`: each distinct type is fused once and laid out in every copy that uses it."""
        by_type = {tau: fuse(states, tau) for tau in sorted(set(self.copy_types))}
        return torch.cat([by_type[tau] for tau in self.copy_types], dim=1)

    def plan(self, rows: int | None = None) -> TwoPartPlan:
        """The two-part plan of the first `rows` query rows (all when None)."""
        return self.plan_fn(self.seq_len if rows is None else rows)

    def attend(self, backend: Backend = "auto") -> Attend:
        return make_attend(
            backend, self.mask_mod, self.plan_fn, self.batch, self.seq_len, self.device, self.step_rows()
        )

    def step_rows(self) -> StepRows:
        """What the flex block mask needs of this step (spd_lightning/training/block_sparsity.py)."""
        return StepRows(self.shape, self.lengths, self.fill)

    def copy_slice(self, c: int) -> slice:
        return slice(c * self.length, (c + 1) * self.length)


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
        return _shape_masks(self, T, lambda a: torch.full((1, T + n), a, device=device), device)

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
        return _shape_masks(self, T, lambda a: torch.full((1,), a, device=device), device)

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


def _shape_masks(layout, T: int, uniform_fill: Callable[[int], torch.Tensor], device: torch.device) -> ShapeMasks:
    """The layout's mask over one unpadded sequence at each uniform fill level (spd_lightning/training/block_sparsity.py)."""
    full_length = torch.full((1,), T, device=device)

    def per_fill(a: int) -> MaskMod:
        return layout.replicate(full_length, T, uniform_fill(a)).mask_mod

    return ShapeMasks((layout.name, layout.geometry, T), layout.geometry.n, T, per_fill)


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


def build_layout(name: LayoutName, geometry: Geometry, fill: FillDistribution = FillDistribution()):
    if name == "depth":
        return DepthLayout(geometry, fill)
    if name == "type":
        return TypeLayout(geometry, fill)
    raise ConfigError(f"unknown layout {name!r}: use 'depth' (exact) or 'type' (the paper's)")
