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

Files: replication.py (the fill distribution and a replicated batch, shared), depth_copies.py and type_blocks.py (each
layout and its mask).
"""

from __future__ import annotations

from typing import Literal

from ...errors import ConfigError
from ...geometry import Geometry
from .depth_copies import DepthLayout, DepthMask
from .replication import FillDistribution, Replication, index_table, to_device_async
from .type_blocks import TypeLayout, TypeMask

LayoutName = Literal["depth", "type"]
__all__ = [
    "DepthLayout",
    "DepthMask",
    "FillDistribution",
    "LayoutName",
    "Replication",
    "TypeLayout",
    "TypeMask",
    "build_layout",
    "index_table",
    "to_device_async",
]


def build_layout(name: LayoutName, geometry: Geometry, fill: FillDistribution = FillDistribution()):
    if name == "depth":
        return DepthLayout(geometry, fill)
    if name == "type":
        return TypeLayout(geometry, fill)
    raise ConfigError(f"unknown layout {name!r}: use 'depth' (exact) or 'type' (the paper's)")
