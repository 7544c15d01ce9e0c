"""Training-time test (TTT) of the EAGLE-3 drafter (docs/DESIGN.md, "The EAGLE-3 baseline"), as pure functions of tensors.

A sequence `x_0..x_{T-1}` with fused target features `h_i`, target logits `Z_i` (the distribution of
`x_{i+1}`) and loss mask `m_i` (1 where `x_i` is an assistant token). Step `j = 0..k-1`, row `i`:

    hidden   j = 0: fc(features of x_i)      j > 0: the drafter's own output of step j-1, row i
    embed    embed(x_{i+j+1})                (inputs shifted by one per step; past the end: pad id 0)
    position i + j                           (RoPE at the TRUE position of the chain rooted at i)
    drafts   x_{i+j+2}: teacher Z_{i+j+1}, counted iff m_{i+j+2} (targets and loss mask shifted per step)

Attention ("the diagonal mask"): the query of step `j`, row `i` sees the step-0 keys of rows `0..i`
(causal) and the keys of steps `1..j` at ITS OWN row `i` only. This is exactly what chain drafting sees
at inference (inference/chain/drafter.py): committed positions `<= i`, then its own drafts at positions
`i+1..i+j`. `ttt_mask` states the mask once as a dense boolean (the definition the tests read);
`TTTAttention` computes the same attention in `O(T^2 + T*k)` through the two-part backend of
spd_lightning/training/attention.py (a causal prefix plus `j` explicit keys per row).

Loss: forward KL from the target restricted to `V_d` and renormalized (docs/DESIGN.md, "Loss, optimizer, checkpoints"), per step; the total
weights step `j` by `step_weight ** j` (EAGLE-3 uses 0.8).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..training.attention import TwoPartPlan, two_part_attend
from .model import Eagle3Drafter


def ttt_mask(T: int, step: int) -> torch.Tensor:
    """`[T, (step+1)*T]` bool: may the step-`step` query of row `q` see key `s*T + r` (step `s`, row `r`)?"""
    q = torch.arange(T)[:, None]
    s, r = torch.arange(step + 1).repeat_interleave(T)[None], torch.arange(T).repeat(step + 1)[None]
    return ((s == 0) & (r <= q)) | ((s >= 1) & (r == q))


def ttt_plan(batch: int, T: int, step: int, device: torch.device) -> TwoPartPlan:
    """`ttt_mask` as a two-part plan: a causal prefix over the step-0 block plus keys `s*T + i`, s = 1..step."""
    rows = torch.arange(T, device=device)
    stair = rows[:, None] + T * torch.arange(1, step + 1, device=device)[None]
    return TwoPartPlan(0, T, rows[None].expand(batch, T), stair[None].expand(batch, T, step))


class TTTAttention:
    """The drafter's `attend` across TTT steps: each call is the next step; its keys/values are kept for the
    later steps. `dense=True` evaluates `ttt_mask` with SDPA instead (small sizes, tests)."""

    def __init__(self, dense: bool = False):
        self.dense = dense
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.keys.append(k)
        self.values.append(v)
        step, (B, _, T, _) = len(self.keys) - 1, q.shape
        keys, values = torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2)
        if self.dense:
            mask = ttt_mask(T, step).to(q.device)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return two_part_attend(ttt_plan(B, T, step, q.device))(layer, q, keys, values)


def shift_left(x: torch.Tensor, by: int, fill: int = 0) -> torch.Tensor:
    """`x[:, by:]` padded back to length T with `fill`: row i holds `x[:, i + by]`."""
    return F.pad(x[:, by:], (0, min(by, x.shape[1])), value=fill)


def ttt_outputs(
    drafter: Eagle3Drafter,
    features: torch.Tensor,
    input_ids: torch.Tensor,
    embed: Callable[[torch.Tensor], torch.Tensor],
    steps: int,
    dense: bool = False,
) -> list[torch.Tensor]:
    """The layer outputs `o_j[B, T, H]` of TTT steps `j = 0..steps-1`; `features[B, T, 3, H]`, `embed` is the
    target's frozen embedding (called without grad)."""
    if steps < 1:
        raise ValueError(f"ttt_steps={steps} must be >= 1")
    B, T = input_ids.shape
    positions = torch.arange(T, device=input_ids.device)[None].expand(B, T)
    attend = TTTAttention(dense)
    hidden, outs = drafter.fuse(features), []
    for j in range(steps):
        with torch.no_grad():
            embeds = embed(shift_left(input_ids, j + 1)).to(hidden.dtype)
        hidden = drafter.step(hidden, embeds, positions + j, attend)
        outs.append(hidden)
    return outs


def restricted_kl(
    teacher_logits: torch.Tensor, student_logits: torch.Tensor, d2t: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """`KL(P || q)` per row: `P` = softmax of the teacher's target-vocabulary logits restricted to `V_d`
    (renormalized, at `temperature`), `q` = softmax of the student's draft-vocabulary logits."""
    log_p = F.log_softmax(teacher_logits.float()[..., d2t] / temperature, dim=-1)
    return (log_p.exp() * (log_p - F.log_softmax(student_logits.float(), dim=-1))).sum(-1)


@dataclass
class StepLoss:
    kl: torch.Tensor  # [N] per counted row
    agree: torch.Tensor  # [N] bool: student argmax == restricted teacher argmax


def step_targets(loss_mask: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(batch, row, teacher_row)` of the rows step `step` is trained on: row `i` counts iff the token it
    drafts, `x_{i+step+2}`, is an assistant token; its teacher is the target's logits at `i + step + 1`."""
    b, i = shift_left(loss_mask.bool(), step + 2, fill=0).nonzero(as_tuple=True)
    return b, i, i + step + 1


def ttt_step_losses(
    drafter: Eagle3Drafter,
    outs: list[torch.Tensor],
    teacher_logits: torch.Tensor,
    loss_mask: torch.Tensor,
    temperature: float = 1.0,
) -> list[StepLoss]:
    """Per step: KL and top-1 agreement (vs the restricted teacher's argmax) on the counted rows."""
    losses = []
    for j, out in enumerate(outs):
        b, i, teacher_row = step_targets(loss_mask, j)
        student = drafter.logits(out[b, i])
        teacher = teacher_logits[b, teacher_row]
        kl = restricted_kl(teacher, student, drafter.d2t, temperature)
        agree = student.argmax(-1) == teacher.float()[:, drafter.d2t].argmax(-1)
        losses.append(StepLoss(kl, agree))
    return losses


def ttt_total(losses: list[StepLoss], step_weight: float) -> torch.Tensor:
    """`sum_j step_weight**j * mean(KL_j)`; a step without counted rows adds 0 (with a graph)."""
    total = None
    for j, step in enumerate(losses):
        term = (step_weight**j) * step.kl.sum() / max(step.kl.numel(), 1)
        total = term if total is None else total + term
    return total
