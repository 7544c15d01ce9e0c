"""`fill_probs: auto`: training draws fill levels as decoding meets them (docs/DESIGN.md, "Simulated fill levels").

Decoding judges a draft at fill `k` with the share `judged_fill_shares(p)` of the refill chain
(spd_lightning/fill_chain.py), where `p[k-1]` is the drafter's acceptance at fill `k`. Training does not know `p`
ahead; it estimates it from its own loss-copy outputs: per fill, the share of counted outputs whose top-1 is the
teacher's (and, where known, lies inside `V_d`, so that greedy decoding could accept it), as an exponential
moving average over steps. Every `REFRESH_STEPS` steps the host reads the estimate (one device read) and the
fill distribution becomes the chain's shares for it, mixed with `FLOOR` of the uniform distribution so that
every fill keeps being trained and measured (a fill the chain rarely reaches would otherwise freeze its own
estimate). Before any estimate `p` is 0: an untrained drafter lives at fill 1, and so does its training.
"""

from __future__ import annotations

import torch

from ..fill_chain import judged_acceptance, judged_fill_shares, predicted_n_alpha

REFRESH_STEPS = 25  # host reads of the estimate: one per this many steps (a device sync each)
DECAY = 0.98  # per step: the estimate follows the last ~50 steps
FLOOR = 0.05  # weight of the uniform distribution in the mixture
PRIOR_TOKENS = 32.0  # a fill with few outputs leans on the pooled acceptance by this many pseudo-outputs


class AcceptanceEstimate:
    """The running per-fill acceptance of the loss copy, and the fill weights it gives."""

    def __init__(self, n: int):
        self.n = n
        self.correct = torch.zeros(n, dtype=torch.float64)
        self.total = torch.zeros(n, dtype=torch.float64)
        self.weights = self.fill_weights(self.acceptance())

    @torch.no_grad()
    def update(self, accepted: torch.Tensor, counted: torch.Tensor, fill: torch.Tensor) -> None:
        """Adds one step's outputs (`[B, T]` each); device ops only (index_add, no bincount: no host sync)."""
        if self.total.device != fill.device:
            self.correct, self.total = self.correct.to(fill.device), self.total.to(fill.device)
        index = (fill - 1).reshape(-1)
        counted = counted.reshape(-1).to(torch.float64)
        self.correct.mul_(DECAY).index_add_(0, index, counted * accepted.reshape(-1))
        self.total.mul_(DECAY).index_add_(0, index, counted)

    def acceptance(self, totals: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[float]:
        """Per fill `1..n` (host values: a device read), each fill shrunk toward the pooled acceptance."""
        correct, total = (t.cpu() for t in (totals or (self.correct, self.total)))
        pooled = float(correct.sum() / total.sum()) if total.sum() > 0 else 0.0
        return ((correct + PRIOR_TOKENS * pooled) / (total + PRIOR_TOKENS)).tolist()

    def fill_weights(self, acceptance: list[float]) -> tuple[float, ...]:
        shares = judged_fill_shares(acceptance, self.n)
        return tuple((1 - FLOOR) * s + FLOOR / self.n for s in shares)

    def refresh(self, totals: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, float]:
        """New fill weights from the estimate (`totals`: the accumulators summed over ranks, by default this
        rank's); returns what to log."""
        acceptance = self.acceptance(totals)
        self.weights = self.fill_weights(acceptance)
        return {
            "train/accept_estimate": judged_acceptance(acceptance, self.n),
            "train/predicted_n_alpha": predicted_n_alpha(acceptance, self.n),
            **{f"train/fill_weight{k + 1}": w for k, w in enumerate(self.weights)},
        }

    def state_dict(self) -> dict:
        return {"correct": self.correct.cpu(), "total": self.total.cpu(), "weights": list(self.weights)}

    def load_state_dict(self, state: dict) -> None:
        self.correct, self.total = state["correct"].clone(), state["total"].clone()
        self.weights = tuple(state["weights"])
