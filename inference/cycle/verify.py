"""Sampling and lossless verification of drafted tokens (docs/DESIGN.md, "Verification": the warp, the greedy limit
and `q`'s reduced vocabulary).

The target distribution `P` (from the final logits of the token that just completed every stage) judges the next
token, which the PDM proposed from its draft distribution `q`. Both are warped alike before the test, so the
accepted stream is distributed exactly as plain sampling from the warped target:

    accept x with probability min(1, P(x) / q(x));  on rejection sample from norm(max(0, P - q)).
"""

from __future__ import annotations

import torch

from inference.cycle.schedule import Verdict, VerdictMessage
from inference.sampling import Sampling, sample_token, warp


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


def accept_or_correct(
    p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rejection rule, on the device: accept the drafted token (`draft`, a one-element long tensor) with
    probability `min(1, P(x)/q(x))`, else the correction drawn from `norm(max(0, P - q))`. Both draws are made every
    time (the uniform and the correction), so no draw depends on a host decision. Returns (accepted, token)."""
    u = torch.rand((), generator=generator, device=p.device)
    accepted = u < acceptance_probability(p.gather(0, draft), q.gather(0, draft))[0]
    correction = torch.multinomial(residual(p, q), 1, generator=generator)[0]
    return accepted, torch.where(accepted, draft[0], correction)


def judge(p: torch.Tensor, token: int, q: torch.Tensor | None, generator: torch.Generator | None) -> VerdictMessage:
    """Verify the drafted `token` against the target distribution `p` (both over the target vocabulary), on the host:
    the verdict message (ACCEPT with the draft, or REJECT with the correction).

    `q is None` means greedy: `p` is one-hot and the draft is accepted iff it is the argmax. Otherwise
    `accept_or_correct`, read on the host (chain decoding decides on the host)."""
    if q is None:
        target = int(p.argmax())
        return VerdictMessage(Verdict.ACCEPT if token == target else Verdict.REJECT, target)
    accepted, verified = accept_or_correct(p, q, torch.tensor([token], device=p.device), generator)
    return VerdictMessage(Verdict.ACCEPT if bool(accepted) else Verdict.REJECT, int(verified))


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
        self.sampling, self.window = sampling, window
        self.d2t = None if d2t is None else d2t.to(device)
        self.tokens = torch.full((window,), -1, dtype=torch.long, device=device)
        self.q = None if sampling.greedy else torch.zeros(window, draft_vocab_size, device=device)
        self.q_target = None if sampling.greedy else torch.zeros(vocab_size, device=device)
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
        the only host sync). Sampling: `accept_or_correct`."""
        slot = position % self.window
        draft = self.tokens[slot]
        if self.sampling.greedy:
            token = logits.argmax()
            accepted = token == draft
        else:
            p = warp(logits, self.sampling)
            q = self.q_target.zero_().index_copy_(0, self.d2t, self.q[slot])  # q over the target vocabulary
            accepted, token = accept_or_correct(p, q, draft.view(1), self.generator)
        out[0] = torch.where(accepted, Verdict.ACCEPT, Verdict.REJECT)
        out[1] = token
        return out
