"""Sampling and lossless verification of drafted tokens (SPEC 5.1).

The target distribution `P` (from the final logits of the token that just completed every stage) judges
the next token, which the PDM proposed from its draft distribution `q`. Temperature, top-k and top-p are
applied to BOTH `P` and `q` before the test, so the accepted stream is distributed exactly as plain
sampling from the warped target:

    accept x with probability min(1, P(x) / q(x));  on rejection sample from norm(max(0, P - q)).

Greedy (temperature 0) is the limit where both distributions are one-hot: accept iff the draft is the
target's argmax, otherwise the argmax is the correction. `q` lives on the reduced draft vocabulary `V_d`
and is zero outside it; `d2t` maps it into the target vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from spd_lightning.errors import UserError

from .schedule import Verdict


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


def acceptance_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """`min(1, P(x)/q(x))` for every x; tokens the draft cannot propose (q = 0) get 0."""
    ratio = torch.where(q > 0, p / q.clamp_min(torch.finfo(q.dtype).tiny), torch.zeros_like(p))
    return ratio.clamp(max=1.0)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """`norm(max(0, P - q))`, the distribution a rejection resamples from.

    It is all-zero only when P == q, where nothing is ever rejected; P is returned then so the function
    is total (floating-point round-off can still reach it). Decided on the device: no host read."""
    r = (p - q).clamp_min(0.0)
    total = r.sum()
    return torch.where(total > 0, r / total.clamp_min(torch.finfo(r.dtype).tiny), p)


@dataclass
class Judgement:
    accepted: bool
    token: int  # the accepted draft, or the correction drawn from the residual


def judge(p: torch.Tensor, token: int, q: torch.Tensor | None, generator: torch.Generator | None) -> Judgement:
    """Verify the drafted `token` against the target distribution `p` (both over the target vocabulary).

    `q is None` means greedy: `p` is one-hot and the draft is accepted iff it is the argmax. Otherwise one
    uniform draw decides acceptance and, on rejection, one more draw samples the correction."""
    if q is None:
        target = int(p.argmax())
        return Judgement(token == target, target)
    u = torch.rand((), generator=generator, device=p.device)
    if bool(u < acceptance_probability(p[token : token + 1], q[token : token + 1])[0]):
        return Judgement(True, token)
    return Judgement(False, sample(residual(p, q), generator))


class Verifier:
    """The verifier on the last stage's rank: remembers each draft (token and `q`) by position until the
    token before it completes, then judges it; also samples the first token after prefill."""

    def __init__(
        self,
        sampling: Sampling,
        window: int,
        vocab_size: int,
        d2t: torch.Tensor | None,
        draft_vocab_size: int,
        device: torch.device,
    ):
        self.sampling, self.window, self.vocab_size = sampling, window, vocab_size
        self.d2t = None if d2t is None else d2t.to(device)
        self.tokens = torch.full((window,), -1, dtype=torch.long, device=device)
        self.q = None if sampling.greedy else torch.zeros(window, draft_vocab_size, device=device)
        self.generator = torch.Generator(device=device)

    def reset(self, seed: int) -> None:
        self.generator.manual_seed(seed)
        self.tokens.fill_(-1)

    def remember(self, position: int, token: torch.Tensor, q: torch.Tensor | None) -> None:
        """Keep the draft at `position` (a one-element tensor: no host sync until it is judged)."""
        self.tokens[position % self.window].copy_(token[0])
        if self.q is not None:
            self.q[position % self.window].copy_(q)

    def first(self, logits: torch.Tensor) -> int:
        return sample_token(logits, self.sampling, self.generator)

    def judge(self, position: int, logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Judge the draft at `position` with the logits of the token before it; writes the verdict message
        `[verdict, token]` into `out` and returns it, all on the device (the caller's one read of `out` is
        the only host sync). Sampling is `judge`'s rule with the correction drawn every time (used only on a
        rejection): two draws per judgement, whatever the verdict, so no draw depends on a host decision."""
        slot = position % self.window
        draft = self.tokens[slot]
        if self.sampling.greedy:
            target = logits.argmax()
            out[0] = torch.where(target == draft, Verdict.ACCEPT, Verdict.REJECT)
            out[1] = target
            return out
        p = warp(logits, self.sampling)
        q = draft_distribution(self.q[slot], self.d2t, self.vocab_size)
        u = torch.rand((), generator=self.generator, device=p.device)
        index = draft.view(1)
        accepted = u < acceptance_probability(p.gather(0, index), q.gather(0, index))[0]
        correction = torch.multinomial(residual(p, q), 1, generator=self.generator)[0]
        out[0] = torch.where(accepted, Verdict.ACCEPT, Verdict.REJECT)
        out[1] = torch.where(accepted, draft, correction)
        return out
