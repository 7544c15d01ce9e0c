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


# Below these a setting is greedy (documented in docs/SERVING.md): dividing float32 logits by a temperature under
# float32's smallest normal (1e-38) overflows or divides by 0.0, and a top_p that rounds to 0.0 in float32 drops
# every token. At 1e-4 the sampled distribution is already the argmax's one-hot for any logit gap above 0.01
# (exp(-100) vanishes), so the greedy limit changes nothing a client could tell apart.
GREEDY_TEMPERATURE = 1e-4
GREEDY_TOP_P = 1e-4


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
        """Temperature 0, or a temperature or top_p below the greedy thresholds (their limit is the argmax)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_p < GREEDY_TOP_P

    def to_dict(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


def one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)


def warp(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The sampling distribution over the last dimension: temperature, then top-k, then top-p (float32).

    Greedy returns the one-hot of the argmax, so verification and sampling share one code path. Otherwise it is
    finite and sums to 1 for any logits (`_scaled`) and any setting `Sampling` accepts: the top token always
    survives top-k and top-p, and it has probability > 0."""
    if sampling.greedy:
        return one_hot_argmax(logits)
    logits = _scaled(logits.float(), min(sampling.temperature, _BIG))
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return _top_p(probs, sampling.top_p) if sampling.top_p < 1.0 else probs


def warp_rows(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """`warp` of each row of `logits[R, V]` under its own setting (`temperature`, `top_k`, `top_p`: `[R]` device
    tensors, as `Sampling` accepts them): the same rule with the same ops for every mix of settings, so a batch
    of requests warps in a fixed number of ops (the PDM's batched draft)."""
    greedy = ((temperature < GREEDY_TEMPERATURE) | (top_p < GREEDY_TOP_P))[:, None]
    scaled = _scaled(logits.float(), torch.where(greedy, 1.0, temperature[:, None].clamp(max=_BIG)))
    V = logits.shape[-1]
    k = top_k[:, None]
    kth = scaled.sort(dim=-1, descending=True).values.gather(-1, (k - 1).clamp(0, V - 1))
    scaled = scaled.masked_fill((k > 0) & (scaled < kth), float("-inf"))
    probs = _top_p(torch.softmax(scaled, dim=-1), top_p[:, None])
    return torch.where(greedy, one_hot_argmax(logits), probs)


_BIG = torch.finfo(torch.float32).max


def _top_p(probs: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Drop a token when the tokens ranked above it already reach `top_p`, renormalized. The top token always
    stays: the mass above it is exactly 0 and top_p > 0 (no in-place write of a Python scalar: that would be a
    device copy). With `top_p` 1 nothing is dropped (the mass above any token is below 1 up to rounding)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    kept = probs.masked_fill(drop, 0.0)
    kept = kept / kept.sum(-1, keepdim=True)
    # rows at 1.0 keep their softmax untouched, bit for bit, whatever the rounding of the cumulative sum
    return torch.where(top_p < 1.0, kept, probs) if isinstance(top_p, torch.Tensor) else kept


def _scaled(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """`logits / temperature` (at most float32's largest) shifted so each row's maximum is exactly 0 and nothing
    is NaN: NaN counts as -inf, +inf as the largest float (so +inf tokens share the mass), and a row without a
    finite logit as uniform. The shift comes BEFORE the division, so a small temperature sends the others to
    -inf, never to inf - inf; a -inf logit stays -inf under a temperature that is inf in float32 (-inf / inf
    would be NaN)."""
    logits = logits.nan_to_num(nan=float("-inf"), posinf=_BIG, neginf=float("-inf"))
    top = logits.amax(-1, keepdim=True)
    logits = torch.where(top == float("-inf"), torch.zeros_like(logits), logits - top.clamp_min(-_BIG))
    return torch.where(logits == float("-inf"), logits, logits / temperature)


def draw_rows(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One index per row of `probs[R, V]` by the inverse CDF at `uniforms[R]` (in [0, 1)): a fixed number of ops
    for any R, never an index of probability 0 (rounding at the top end falls back to the last positive one)."""
    cdf = probs.double().cumsum(-1)
    index = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)[:, 0]
    last_positive = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1)
    return torch.minimum(index, last_positive)


# Counter-based uniforms: a draw of request `seed` at counter `c` (its drafted position) is a hash of the two, so
# it is the same whichever slot, batch or step makes it, with no generator state to keep, give back or send;
# the hash is Wellons' lowbias32 (a bijection of 32-bit words with near-ideal avalanche), twice for 53 bits.
_M32 = 0xFFFFFFFF


def _mul32(x, c: int):
    """`x * c mod 2**32` for `x` in [0, 2**32) (a Python int or an int64 tensor) with no int64 overflow."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x):
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seed_keys(seed: int) -> tuple[int, int]:
    """The two 32-bit keys of `counter_uniforms` for any integer seed (taken modulo 2**64)."""
    seed %= 2**64
    return _mix32(seed & _M32), _mix32(((seed >> 32) ^ 0x9E3779B9) & _M32)


def counter_uniforms(key1: torch.Tensor, key2: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Float64 uniforms in [0, 1), one per row, from the row's seed keys (`seed_keys`) and counter (int64
    tensors, counters below 2**32)."""
    h1 = _mix32(key1 ^ _mix32((counters & _M32) ^ key2))
    h2 = _mix32(h1 ^ key2 ^ 0x5851F42D)
    return ((h1 >> 5) * 2**26 + (h2 >> 6)).double() / 2**53


def sample_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """A token from 1-D logits: the argmax when greedy (no randomness spent), else a draw from `warp`."""
    if sampling.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(warp(logits, sampling), 1, generator=generator))


def draft_distribution(draft_probs: torch.Tensor, d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`q` over the target vocabulary: the draft-vocabulary distribution scattered through `d2t`, zero elsewhere."""
    q = torch.zeros(vocab_size, dtype=draft_probs.dtype, device=draft_probs.device)
    return q.index_copy_(0, d2t.to(draft_probs.device), draft_probs)
