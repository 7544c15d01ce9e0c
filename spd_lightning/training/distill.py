"""What one replicated PDM forward yields and how a copy of it is distilled (docs/DESIGN.md, "Training").

`SPDModule._forward` runs the PDM once over the replicated batch (`ReplicatedForward`); `distill` turns one copy of
it into per-output KL, top-1 and fill (`Distilled`), which the training loss, validation and the staircase
evaluation all read. Fixed shapes throughout, no boolean indexing: a training step makes no host sync here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..pdm import PipelineDraftModule
from .layouts import Replication


def check_right_padded(attention_mask: torch.Tensor) -> None:
    if not bool((attention_mask[:, :-1] >= attention_mask[:, 1:]).all()):
        raise ValueError(
            "batches must be right-padded (attention_mask 1...1 0...0): the layouts read each "
            "sequence's length as attention_mask.sum(1)"
        )


@dataclass(frozen=True, kw_only=True)
class ReplicatedForward:
    """One replicated PDM forward of a batch (`SPDModule._forward`)."""

    rep: Replication
    pdm: PipelineDraftModule  # the PDM that ran (its head makes the drafts)
    hidden: torch.Tensor  # [B, T, d] (the loss copy only) or [B, S, d] (every copy)
    teacher: torch.Tensor  # [B, T, V_d] the target's logits over the draft vocabulary
    outside_vd: torch.Tensor | None  # [B, T] the full-vocabulary argmax lies outside V_d; None: not computed
    predicts_loss_token: torch.Tensor  # [B, T] output i drafts an assistant token x_{i+1}


@dataclass(frozen=True, kw_only=True)
class Distilled:
    """One copy's outputs, `[B, T]` each; only the `counted` ones (active, predicting a loss token) enter the loss."""

    kl: torch.Tensor
    counted: torch.Tensor
    student_top1: torch.Tensor
    teacher_top1: torch.Tensor
    fill: torch.Tensor
    outside_vd: torch.Tensor | None

    def agree(self) -> torch.Tensor:
        """The student's top-1 is the teacher's (over V_d)."""
        return self.student_top1.eq(self.teacher_top1)

    def accepted(self) -> torch.Tensor:
        """What greedy decoding would accept: the student's top-1 is the teacher's, and (where known) the target's
        top-1 over the full vocabulary lies inside V_d."""
        agree = self.agree()
        return agree if self.outside_vd is None else agree & (self.outside_vd == 0)

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """The mean of `values` over the counted outputs, 0 (with a graph) when there are none; no host sync."""
        counted = self.counted
        return (values * counted).sum() / counted.sum().clamp(min=1)

    def selected(self) -> Distilled:
        """The counted outputs alone, as 1-D tensors (validation and evaluation: a host sync per call)."""
        sel = self.counted
        pick = {k: getattr(self, k) for k in ("kl", "student_top1", "teacher_top1", "fill", "outside_vd")}
        picked = {k: None if v is None else v[sel] for k, v in pick.items()}
        return Distilled(counted=sel[sel], **picked)


class ViewAgreement(NamedTuple):
    """What validation and the staircase evaluation read of a forward: per counted output of every copy, top-1
    agreement, depth and fill; and the loss copy's counted outputs (`loss`; `loss.accepted()` is what greedy
    decoding would accept)."""

    agree: torch.Tensor
    depth: torch.Tensor
    fill: torch.Tensor
    loss: Distilled


class EveryFill(NamedTuple):
    """The loss copy's drafts of a batch made at every fill level (`SPDModule.every_fill`): at output `i` (which
    drafts `x_{i+1}`) and fill `k` (`[..., k - 1]`), top-1 agreement within `V_d` and what greedy decoding would
    accept, `[B, T, n]` each; `counted` `[B, T]`, the outputs that draft an answer token."""

    agree: torch.Tensor
    accepted: torch.Tensor
    counted: torch.Tensor

    def by_fill(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`values` (`agree` or `accepted`) at every counted output and fill, flattened, and the fill `k` of each
        (`GroupedAgreement`'s groups); a host sync."""
        counted = self.counted.bool()
        picked = values[counted]  # [outputs, n]
        fills = torch.arange(1, values.shape[-1] + 1, device=values.device).expand_as(picked)
        return picked.flatten(), fills.flatten()

    def answer_drafts(self, b: int, limit: int | None = None) -> torch.Tensor:
        """`accepted` `[tokens, n]` over the drafted tokens of sequence `b`'s first answer, as a decode of that
        answer judges them (its first token comes from the prefill), at most `limit` of them: what
        `fill_chain.walk` walks."""
        counted = self.counted[b].tolist()
        start = counted.index(True) + 1  # output i drafts x_{i+1}: the first counted output drafts the prefill's token
        end = start
        while end < len(counted) and counted[end] and (limit is None or end - start < limit):
            end += 1
        return self.accepted[b, start:end]


def distill(fwd: ReplicatedForward, copy: int, teacher_temperature: float) -> Distilled:
    """KL(P || q) at every output of `copy`, `[B, T]`, counted where the output is active and predicts a loss
    token. Fixed shapes, no boolean indexing: the head runs on all `T` outputs of the copy."""
    rep = fwd.rep
    student = fwd.pdm.lm_head(fwd.hidden[:, rep.copy_slice(copy)]).float()
    restricted = fwd.teacher.float()
    log_p = F.log_softmax(restricted / teacher_temperature, dim=-1)
    kl = (log_p.exp() * (log_p - F.log_softmax(student, dim=-1))).sum(-1)
    return Distilled(
        kl=kl,
        counted=fwd.predicts_loss_token & rep.active[copy],
        student_top1=student.argmax(-1),
        teacher_top1=restricted.argmax(-1),
        fill=rep.fill[copy],
        outside_vd=fwd.outside_vd,
    )


def auxiliary_kl(fwd: ReplicatedForward, teacher_temperature: float) -> torch.Tensor:
    """The mean KL over the counted outputs of every copy but the loss copy (`aux_loss_weight`), no host sync."""
    others = [distill(fwd, c, teacher_temperature) for c in range(fwd.rep.num_copies) if c != fwd.rep.loss_copy]
    total = sum((d.kl * d.counted).sum() for d in others)
    tokens = sum(d.counted.sum() for d in others)
    return total / tokens.clamp(min=1)


def view_agreement(fwd: ReplicatedForward, teacher_temperature: float) -> ViewAgreement:
    """Every copy's counted outputs: agreement, depth and fill; the loss copy's acceptance (a sync per copy)."""
    agree, depth, fill = [], [], []
    for c in range(fwd.rep.num_copies):
        d = distill(fwd, c, teacher_temperature).selected()
        agree.append(d.agree())
        depth.append(torch.full_like(d.fill, fwd.rep.copy_depths[c]))
        fill.append(d.fill)
        if c == fwd.rep.loss_copy:
            loss = d
    return ViewAgreement(torch.cat(agree), torch.cat(depth), torch.cat(fill), loss)
