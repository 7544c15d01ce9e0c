"""Top-1 agreement per group (depth or fill level), shared by `SPDModule` and the staircase callback, and the
validation metrics of `SPDModule`.

torchmetrics without Lightning, so `callbacks/` and `inference/` may import it cheaply.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torchmetrics

from ..fill_chain import measured_prediction

if TYPE_CHECKING:
    from .distill import EveryFill, ViewAgreement


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


class ValidationMetrics(torch.nn.Module):
    """`SPDModule`'s validation: the loss copy's KL, agreement and `teacher_top1_outside_vd`, and agreement per depth
    (every copy), under the rotating fills of `validation_fill`; agreement and what greedy decoding would accept per
    fill, each fill measured on every sequence (`update_every_fill`), with the refill chain's prediction from the
    latter (spd_lightning/fill_chain.py). A submodule, so Lightning moves its states."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n
        self.loss, self.agree, self.outside = (torchmetrics.MeanMetric() for _ in range(3))
        self.agree_depth, self.agree_fill = GroupedAgreement(n + 1), GroupedAgreement(n + 1)
        self.accept_fill = GroupedAgreement(n + 1)  # agreement whose teacher top-1 is inside V_d

    def update(self, view: ViewAgreement) -> None:
        loss = view.loss
        self.agree_depth.update(view.agree, view.depth)
        self.loss.update(loss.kl)
        self.agree.update(loss.agree().float())
        self.outside.update(loss.outside_vd.float())

    def update_every_fill(self, drafts: EveryFill) -> None:
        self.agree_fill.update(*drafts.by_fill(drafts.agree))
        self.accept_fill.update(*drafts.by_fill(drafts.accepted))

    def compute(self) -> dict[str, torch.Tensor | float]:
        """`val/*` values: the same keys on every rank (`compute` synchronizes across them); a mean over no loss
        token (NaN) is left out."""
        values = {}
        for name, metric in (("loss", self.loss), ("agree", self.agree), ("teacher_top1_outside_vd", self.outside)):
            value = metric.compute()
            if torch.isfinite(value):
                values[f"val/{name}"] = value
        for prefix, metric in (("depth", self.agree_depth), ("fill", self.agree_fill)):
            values.update({f"val/agree_{prefix}{group}": value for group, value in metric.compute().items()})
        accept_by_fill = self.accept_fill.compute()
        predicted = measured_prediction(accept_by_fill, self.n)
        if predicted is not None:  # `val/accept_p`: per judged draft
            values.update({f"val/accept_fill{k}": v for k, v in accept_by_fill.items()})
            values["val/accept_p"], values["val/predicted_n_alpha"] = predicted
        return values

    def reset(self) -> None:
        # `validate` runs under inference mode; states reset there would be inference tensors that the
        # no-grad validation inside a later `fit` may not update in place.
        with torch.inference_mode(False):
            for metric in (self.loss, self.agree, self.outside, self.agree_depth, self.agree_fill, self.accept_fill):
                metric.reset()
