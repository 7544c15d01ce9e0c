"""What every layout shares: the fill-level distribution, one replicated batch (`Replication`: which features go where,
the mask, which outputs mean what) and the small device tables both layouts' masks read (docs/DESIGN.md, "Sequence
replication", "Simulated fill levels")."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from ...errors import ConfigError
from ...pdm import Attend
from ..attention import Backend, MaskMod, TwoPartPlan, make_attend
from ..block_sparsity import ShapeMasks, StepRows


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


def shape_masks(layout, T: int, uniform_fill: Callable[[int], torch.Tensor], device: torch.device) -> ShapeMasks:
    """The layout's mask over one unpadded sequence at each uniform fill level (spd_lightning/training/block_sparsity.py)."""
    full_length = torch.full((1,), T, device=device)

    def per_fill(a: int) -> MaskMod:
        return layout.replicate(full_length, T, uniform_fill(a)).mask_mod

    return ShapeMasks((layout.name, layout.geometry, T), layout.geometry.n, T, per_fill)
