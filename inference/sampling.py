"""Sampling settings and the distributions they define (docs/DESIGN.md, "Verification").

Temperature, top-k and top-p are applied to BOTH the target distribution `P` and the draft distribution `q`
(`warp`), so verification (`inference.cycle.verify`) keeps the warped target's distribution exactly. Greedy
(temperature 0) is the limit where both are one-hot. `q` lives on the reduced draft vocabulary `V_d` and is
zero outside it; `d2t` maps it into the target vocabulary (`draft_distribution`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from spd_lightning.errors import UserError


class SamplingError(UserError):
    """An impossible sampling setting; the message names the value and the allowed range."""


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0  # 0 keeps every token
    top_p: float = 1.0

    def __post_init__(self):
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise SamplingError(f"temperature={self.temperature} must be a finite number >= 0 (0 is greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise SamplingError(f"top_k={self.top_k} must be >= 0 (0 disables top-k)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


def warp(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The sampling distribution over the last dimension: temperature, then top-k, then top-p (float32).

    Greedy returns the one-hot of the argmax, so verification and sampling share one code path. The logits
    are shifted so their maximum is 0 BEFORE dividing by the temperature: as T -> 0 the others go to -inf
    and the maximum stays 0, so a tiny T is the argmax limit instead of inf - inf = NaN."""
    logits = logits.float()
    if sampling.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = (logits - logits.amax(-1, keepdim=True)) / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the tokens ranked above it already reach top_p; the top token always stays.
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from a 1-D distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """A token from 1-D logits: the argmax when greedy (no randomness spent), else a draw from `warp`."""
    if sampling.greedy:
        return int(logits.argmax())
    return sample(warp(logits, sampling), generator)


def draft_distribution(draft_probs: torch.Tensor, d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`q` over the target vocabulary: the draft-vocabulary distribution scattered through `d2t`, zero elsewhere."""
    q = torch.zeros(vocab_size, dtype=draft_probs.dtype, device=draft_probs.device)
    return q.index_copy_(0, d2t.to(draft_probs.device), draft_probs)
