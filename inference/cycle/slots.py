"""One sequence in a slot of the decoder (docs/DESIGN.md, "One cycle over B slots"): its request, its own schedule
and optimistic steps (`PipelineSchedule`, `Steps`), its verifier (with its generator, seeded by `generator_seeds`),
and the verdicts it awaits. Only the forwards are shared with the other slots, so a slot's tokens, N, K and
counters are those of its decode alone (batch 1), whatever the other slots do; a step wasted for one slot (a
REJECT, an EOS or a STOP of its verdict) idles that slot alone, and its next step redoes the cycle.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from inference.cycle.result import DecodeResult
from inference.cycle.schedule import PipelineSchedule, Step, Steps, Verdict, VerdictMessage
from inference.cycle.verify import Verifier
from inference.sampling import Sampling
from spd_lightning.geometry import Geometry


def generator_seeds(seed: int) -> tuple[int, int]:
    """Independent generator seeds for the verifier and the drafter, so each rank owns its randomness. Any
    integer works: it is taken modulo 2**63 first, so both stay within torch.manual_seed's 64-bit range
    (the seeds 0 .. 2**63 - 1 keep the random sequences they always had)."""
    seed %= 2**63
    return 2 * seed, 2 * seed + 1


@dataclass(frozen=True)
class Request:
    """What one sequence asks for. `on_tokens(new)` gets its newly verified tokens after each cycle that verified
    some; `stop()` is polled once per cycle, and from its first True the slot's next verdict is STOP."""

    prompt_ids: Sequence[int]
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    sampling: Sampling = Sampling()
    seed: int = 0
    on_tokens: Callable[[list[int]], None] | None = field(default=None, compare=False)
    stop: Callable[[], bool] | None = field(default=None, compare=False)


class SlotSequence:
    """`verifier` is None in a process that does not host the verifier's rank (a distributed stage or PDM rank):
    it follows the slot's schedule from the verdicts it receives."""

    def __init__(self, request: Request, geometry: Geometry, verifier: Verifier | None):
        if not request.prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        self.request, self.geometry = request, geometry
        self.schedule = PipelineSchedule(geometry, request.max_new_tokens, request.eos_token_ids)
        self.steps = Steps(self.schedule)
        self.verifier = verifier
        if verifier is not None:
            verifier.reset(generator_seeds(request.seed)[0])
        self.step: Step | None = None
        self.stop_seen = -1
        self.emitted = 0
        self.prefill_s, self.started = 0.0, time.perf_counter()

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def capacity(self) -> int:
        """Positions the slot's caches need: the prompt, every token, and the drafts in flight past the last."""
        return self.prompt_len + self.request.max_new_tokens + self.geometry.n + 1

    def first(self, token: int) -> None:
        """The first token, sampled after the slot's prefill."""
        self.prefill_s = time.perf_counter() - self.started
        self.started = time.perf_counter()
        self.step = self.steps.first(token, self.prompt_len)
        self._emit()

    def poll_stop(self) -> None:
        stop = self.request.stop
        if stop is not None and self.stop_seen < 0 and stop():
            self.stop_seen = self.step.plan.cycle

    def wasted(self, awaited: VerdictMessage | None) -> bool | None:
        """Whether this step is wasted for the slot; None while the verdict it awaits is not known here."""
        if not self.step.awaits:
            return False
        return None if awaited is None else self.steps.wasted(*awaited)

    def judge(self, logits: torch.Tensor, row: torch.Tensor) -> None:
        """Judge the draft this step's plan judges into the device row `[verdict, token]` (STOP once cancelled)."""
        self.verifier.judge(self.step.plan.judged_position, logits, row)
        if self.stop_seen >= 0:
            row[0] = Verdict.STOP

    def advance(self, awaited: VerdictMessage | None, own: VerdictMessage | None) -> None:
        """The step has run (or idled): on to the next, given the verdict it awaited (iff `step.awaits`) and its
        own (iff `step.final` and it ran); `step` is None once the decode has stopped."""
        self.step = self.steps.after(self.step, awaited, own)
        self._emit()

    def _emit(self) -> None:
        new = self.schedule.tokens[self.emitted :]
        if new and self.request.on_tokens is not None:
            self.request.on_tokens(list(new))
        self.emitted = len(self.schedule.tokens)

    def result(self) -> DecodeResult:
        schedule = self.schedule
        return DecodeResult(
            mode=self.geometry.mode,
            n=self.geometry.n,
            prompt_len=self.prompt_len,
            tokens=list(schedule.tokens),
            K=schedule.K,
            stop_reason=schedule.stop_reason,
            counters=schedule.counters.to_dict(),
            prefill_s=self.prefill_s,
            decode_s=time.perf_counter() - self.started,
        )
