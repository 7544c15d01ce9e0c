"""Chain speculative decoding (the EAGLE-3 baseline, docs/DESIGN.md, "The EAGLE-3 baseline"): k drafts, ONE target forward over k + 1.

Each round the target runs the last committed token and the drafts `d_1..d_k`, `[x_t, d_1..d_k]` at positions
`t..t+k` (inference/chain/target.py): row `j` of its logits is the target distribution `P_{j+1}` that judges
`d_{j+1}`, and `P_{k+1}` gives the bonus token (the rules: docs/EAGLE3.md, "Chain decoding"). The target cache is
rolled back to the accepted positions, whose features the drafter then commits. Lossless: greedy output is AR's
token for token, sampled output has the target's distribution (tests/test_eagle3_decode.py).

Counting: `N` generated tokens (the prefill's included), `K` target forwards after prefill, `tau` per forward;
the speedup with the draft cost charged is evaluation's (docs/DESIGN.md, "Speedup formulas").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from inference.chain.drafter import Draft, Eagle3Runtime
from inference.chain.target import ChainTarget
from inference.cycle.result import DecodeResult
from inference.cycle.schedule import Verdict, eos_set
from inference.cycle.slots import generator_seeds
from inference.cycle.verify import judge
from inference.sampling import Sampling, draft_distribution, sample_token, warp
from spd_lightning.eagle3.export import load_eagle3
from spd_lightning.target import Target


class ChainDrafter(Protocol):
    """What chain decoding needs from a drafter (inference/chain/drafter.py `Eagle3Runtime`)."""

    def start(self, capacity: int) -> None: ...
    def commit(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None: ...
    def draft(self, k: int, generator: torch.Generator | None) -> Draft: ...


@dataclass
class ChainResult:
    k: int
    prompt_len: int
    tokens: list[int]
    accept_lengths: list[int]  # tau per target forward (accepted drafts + 1, before EOS / length truncation)
    stop_reason: str
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    draft_steps: int = 0
    decode_s: float = 0.0  # wall-clock after the prefill: drafts, verifies, judging and rollbacks (like AR's)

    @property
    def N(self) -> int:
        return len(self.tokens)

    @property
    def K(self) -> int:
        return len(self.accept_lengths)

    @property
    def tau(self) -> float | None:
        """Mean tokens per target forward."""
        return sum(self.accept_lengths) / self.K if self.K else None

    @property
    def draft_over_verify(self) -> float | None:
        """One draft step's time over one verify forward's, as measured here. Not the cost model's `r`, which is in
        units of an AR forward that only evaluation times (inference/evaluation/costs.py gives the speedup)."""
        if not self.draft_steps or not self.verify_s:
            return None
        return (self.draft_s / self.draft_steps) / (self.verify_s / self.K)

    def counters(self) -> dict:
        """What the decode and eval reports add to a `DecodeResult` of this prompt."""
        return {
            "k": self.k,
            "tau": self.tau,
            "accept_lengths": self.accept_lengths,
            "draft_over_verify": self.draft_over_verify,
        }

    def to_decode_result(self) -> DecodeResult:
        """The prompt as the decode / eval reports hold every mode's: n = 1 (one target forward per step), so
        `alpha = N / K` is the tokens per target forward and `n * alpha` the speedup with a free drafter."""
        timing = {"totals": {"draft_s": self.draft_s, "verify_s": self.verify_s, "draft_steps": self.draft_steps}}
        return DecodeResult(
            mode="eagle3",
            n=1,
            prompt_len=self.prompt_len,
            tokens=list(self.tokens),
            K=self.K,
            stop_reason=self.stop_reason,
            counters=self.counters(),
            prefill_s=self.prefill_s,
            decode_s=self.decode_s,
            timing=timing,
        )


def judge_chain(
    logits: torch.Tensor, draft: Draft, sampling: Sampling, d2t: torch.Tensor | None, generator: torch.Generator | None
) -> list[int]:
    """The tokens one verify forward yields: the accepted drafts, then the correction or the bonus token.
    `logits[k+1, V]` are the target's at `[x_t, d_1..d_k]`; `d2t` maps `draft.q` into the target vocabulary."""
    out = []
    for j, token in enumerate(draft.tokens):
        q = None if sampling.greedy else draft_distribution(draft.q[j], d2t, logits.shape[-1])
        verdict = judge(logits[j] if q is None else warp(logits[j], sampling), token, q, generator)
        out.append(verdict.token)
        if verdict.verdict != Verdict.ACCEPT:
            return out
    out.append(sample_token(logits[len(draft.tokens)], sampling, generator))
    return out


def _timed(device: torch.device, fn, *args):
    """`fn(*args)` and its seconds; on a GPU after its kernels ran (launches return before the work is done)."""
    t0 = time.perf_counter()
    value = fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return value, time.perf_counter() - t0


@torch.no_grad()
def chain_decode(
    target: ChainTarget,
    drafter: ChainDrafter,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    k: int,
    sampling: Sampling = Sampling(),
    eos_token_id: int | Sequence[int] | None = None,
    seed: int = 0,
    d2t: torch.Tensor | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> ChainResult:
    """Decode one prompt; `d2t` (the drafter's) is needed under sampling only; `on_tokens(new tokens)` after the
    prefill and after each verify forward (an exception it raises ends the decode)."""
    if max_new_tokens < 1 or k < 0 or not prompt_ids:
        raise ValueError(f"need max_new_tokens >= 1 (got {max_new_tokens}), k >= 0 (got {k}) and a non-empty prompt")
    if not sampling.greedy and d2t is None:
        raise ValueError("sampled chain decoding needs the drafter's d2t to judge its q")
    eos, device = eos_set(eos_token_id), target.device
    generator = torch.Generator(device=device)
    generator.manual_seed(generator_seeds(seed)[0])  # the seed of AR's first token: same first token per seed
    P = len(prompt_ids)
    t0 = time.perf_counter()
    capacity = P + max_new_tokens + k + 1  # a bound on the positions either cache ever holds
    target.reset(capacity)
    drafter.start(capacity)
    prompt = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    logits, features = target.forward(prompt, 0)
    tokens = [sample_token(logits[-1], sampling, generator)]
    drafter.commit(features, torch.tensor(list(prompt_ids[1:]) + tokens))
    result = ChainResult(k, P, tokens, [], "max_new_tokens", prefill_s=time.perf_counter() - t0)
    if on_tokens is not None:
        on_tokens(tokens[-1:])
    t_start = time.perf_counter()
    while tokens[-1] not in eos and len(tokens) < max_new_tokens:
        chain = min(k, max_new_tokens - len(tokens) - 1)  # never draft past the last token we may emit
        draft, draft_s = _timed(device, drafter.draft, chain, generator)
        start = P + len(tokens) - 1
        block = torch.tensor([[tokens[-1]] + draft.tokens], device=device)
        (logits, features), verify_s = _timed(device, target.forward, block, start)
        new = judge_chain(logits, draft, sampling, d2t, generator)
        target.rollback(start + len(new))  # keeps x_t and the accepted drafts
        # row j's next token is new[j]
        _, commit_s = _timed(device, drafter.commit, features[: len(new)], torch.tensor(new))
        result.draft_s += draft_s + commit_s
        result.verify_s += verify_s
        result.draft_steps += chain
        result.accept_lengths.append(len(new))
        # Up to the first EOS; `chain` already keeps the tokens within max_new_tokens.
        new = new[: next((j + 1 for j, token in enumerate(new) if token in eos), len(new))]
        tokens += new
        if on_tokens is not None:
            on_tokens(new)
    result.stop_reason = "eos" if tokens[-1] in eos else "max_new_tokens"
    result.decode_s = time.perf_counter() - t_start  # after the last `_timed` commit: the device is done
    return result


@dataclass
class ChainDecoder:
    """A loaded target and an exported EAGLE-3 drafter (directory or `.ckpt`), ready to decode prompts."""

    target: ChainTarget
    runtime: Eagle3Runtime
    k: int

    @classmethod
    def on_target(cls, target: Target, drafter_path: str, max_k: int) -> ChainDecoder:
        """On an already-loaded `Target`, its weights shared (what eval measures beside AR on the same target),
        greedy; `variant` then gives any k <= `max_k` under any sampling."""
        drafter, spec = load_eagle3(drafter_path, target.lm_head.weight.device)
        spec.check_target(target.info)
        chain = ChainTarget(target, spec.drafter.feature_layers, max_k + 1)
        return cls(chain, Eagle3Runtime(drafter, chain.embed_tokens, Sampling()), max_k)

    def variant(self, k: int, sampling: Sampling) -> ChainDecoder:
        """The same target and drafter, chaining `k` drafts under `sampling`."""
        return ChainDecoder(self.target, Eagle3Runtime(self.runtime.drafter, self.target.embed_tokens, sampling), k)

    def decode(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        eos_token_id: int | Sequence[int] | None = None,
        seed: int = 0,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> ChainResult:
        return chain_decode(
            self.target,
            self.runtime,
            prompt_ids,
            max_new_tokens,
            self.k,
            self.runtime.sampling,
            eos_token_id,
            seed,
            self.runtime.drafter.d2t,
            on_tokens,
        )
