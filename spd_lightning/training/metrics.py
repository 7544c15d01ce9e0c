"""Top-1 agreement per group (depth or fill level), shared by `SPDModule` and the staircase callback.

A torchmetrics `Metric` without Lightning, so `callbacks/` and `inference/` may import it cheaply.
"""

from __future__ import annotations

import torch
import torchmetrics


class GroupedAgreement(torchmetrics.Metric):
    """Top-1 agreement per group; the counts are summed across processes (`dist_reduce_fx="sum"`)."""

    full_state_update = False

    def __init__(self, num_groups: int):
        super().__init__()
        self.add_state("correct", torch.zeros(num_groups, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("total", torch.zeros(num_groups, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, agree: torch.Tensor, group: torch.Tensor) -> None:
        self.correct += torch.bincount(group[agree], minlength=self.correct.numel())
        self.total += torch.bincount(group, minlength=self.total.numel())

    def compute(self) -> dict[int, float]:
        return {g: c / t for g, (c, t) in enumerate(zip(self.correct.tolist(), self.total.tolist())) if t > 0}
