"""The deterministic pipeline schedule (docs/DESIGN.md, "The decode schedule"), as a pure state machine (no tensors, no model).

Every rank (and the one-process simulator) runs one `PipelineSchedule` per sequence and feeds it the
same verdicts, so every rank agrees on which token each stage processes, what the PDM reads, which
position a rejection rolls back to, and on `N`, `K` and the acceptance counters.

One cycle, seen from the schedule:

    begin(verdict of the previous cycle)  ->  CyclePlan  ->  the ranks run it  ->  verdict  ->  begin(...)

`PipelineSchedule` is the logical schedule: it only ever sees real verdicts, and `N`, `K` and the
counters are its own. `Steps` lays the physical steps of optimistic execution over it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple

from spd_lightning.geometry import Geometry


class Verdict(IntEnum):
    """What the verifier reports after a cycle (the first field of the control message)."""

    NONE = 0  # no token completed stage n this cycle
    ACCEPT = 1  # the judged draft is verified; the token field repeats it
    REJECT = 2  # the judged draft is replaced by the correction in the token field
    FIRST = 3  # after prefill: the token field is the first generated token, sampled from the target
    STOP = 4  # the request was cancelled: every rank ends the decode with this cycle (the judged draft is dropped)


@dataclass
class Slot:
    """One in-flight token."""

    position: int
    depth: int  # stages completed at the start of the current cycle
    fill: int  # fill level when it was drafted; 0 once verified (the first token, a correction, an accepted draft)

    @property
    def verified(self) -> bool:
        return self.fill == 0


@dataclass
class CyclePlan:
    """Everything a rank needs to run one cycle; identical on every rank."""

    cycle: int  # 1-based; equals K once the cycle has run
    stage_positions: tuple[int, ...]  # stage s (index s-1) processes this position, or -1 when idle
    seed_token: int  # the token stage 1 embeds when it is a seed (first token / correction), else -1
    draft_entered: bool  # stage 1 embeds the previous cycle's fresh draft (the PDM sends it)
    rollback_to: int  # a rejection discarded every position >= this one, or -1
    # (depth, position) of the in-flight tokens the PDM reads, oldest first; every older position is
    # verified and complete, read at depth n
    draft_view: tuple[tuple[int, int], ...]
    draft_position: int  # the position of the token the PDM drafts this cycle
    fill: int  # a: in-flight tokens at the start of the cycle
    anchors_before: tuple[tuple[int, int], ...]  # (stage, position) states produced last cycle that the PDM still needs
    anchors_during: tuple[tuple[int, int], ...]  # (stage, position) states produced by this cycle's compute
    judged_position: int  # the position the verifier judges after this cycle, or -1


@dataclass
class Counters:
    """Accepted / rejected drafts by the fill level `a` (1..n, list index a-1) at which they were drafted,
    and by their drafting depth `inflight_depth(a-1)` (0..n): the depth at which the PDM read the oldest
    in-flight token, which tells pre-step (a-1) from post-step (a) drafting at the same fill."""

    accepted_by_fill: list[int]
    rejected_by_fill: list[int]
    accepted_by_depth: list[int]
    rejected_by_depth: list[int]

    @classmethod
    def zeros(cls, n: int) -> Counters:
        return cls([0] * n, [0] * n, [0] * (n + 1), [0] * (n + 1))

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class PipelineSchedule:
    geometry: Geometry
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    tokens: list[int] = field(default_factory=list)  # the verified generated tokens, in order
    K: int = 0
    stop_reason: str = ""
    _inflight: list[Slot] = field(default_factory=list)
    _fresh_fill: int = 0  # fill level of the draft made in the cycle that just ran

    def __post_init__(self):
        if self.geometry.n < 2:
            raise ValueError(f"pipeline decoding needs n >= 2 stages (got n={self.geometry.n}); use --mode ar for n=1")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        self.counters = Counters.zeros(self.geometry.n)

    @property
    def n(self) -> int:
        return self.geometry.n

    @property
    def N(self) -> int:
        return len(self.tokens)

    @property
    def done(self) -> bool:
        return bool(self.stop_reason)

    def begin(self, verdict: int, token: int, prompt_len: int = -1) -> CyclePlan | None:
        """Apply the previous cycle's verdict and plan the next cycle; None once decoding has stopped."""
        verdict = Verdict(verdict)
        rollback_to = -1
        completed = None
        if verdict == Verdict.FIRST:
            if self.tokens or prompt_len < 1:
                raise RuntimeError("FIRST is only valid once, right after a prefill of prompt_len >= 1 tokens")
            self._inflight = [Slot(prompt_len, 0, 0)]
            self._verified(token)
        else:
            if not self._inflight or self.done:
                raise RuntimeError(f"schedule received {verdict.name} outside a running decode")
            if verdict == Verdict.STOP:
                self.stop_reason = "cancelled"
                return None
            for slot in self._inflight:
                slot.depth += 1
            if self._inflight[0].depth == self.n:
                completed = self._inflight.pop(0)
            fresh = Slot(self._inflight[-1].position + 1, 0, self._fresh_fill)  # n >= 2: someone is still in flight
            if verdict == Verdict.NONE:
                if completed is not None:
                    raise RuntimeError(
                        f"cycle {self.K}: a token completed stage n but the verifier reported no verdict"
                    )
                self._inflight.append(fresh)
            else:
                judged = self._inflight[0] if completed is not None and self._inflight else None
                if judged is None or judged.verified or judged.position != completed.position + 1:
                    raise RuntimeError(f"cycle {self.K}: verdict {verdict.name} but no draft was due for judgement")
                self._count(verdict == Verdict.ACCEPT, judged.fill)
                if verdict == Verdict.ACCEPT:
                    judged.fill = 0  # verified from now on
                    self._inflight.append(fresh)
                else:
                    self._inflight = [Slot(judged.position, 0, 0)]
                    rollback_to = judged.position
                self._verified(token)
        if self.done:
            return None
        self.K += 1
        plan = self._plan(self._inflight, self.K, token, rollback_to, completed)
        self._fresh_fill = plan.fill
        return plan

    @property
    def judging(self) -> bool:
        """The cycle that just ran judges a draft, so its verdict is not known in advance."""
        return bool(self._inflight) and self._inflight[0].depth == self.n - 1

    def speculate(self) -> CyclePlan:
        """The plan an ACCEPT of the draft being judged would give, without applying anything.

        A later `begin(ACCEPT, token)` returns this very plan (unless the token ends the decode); a
        REJECT replaces it. Judged cycles run at fill n, so the accepted successor keeps the fill at n."""
        if not self.judging or self.done:
            raise RuntimeError(f"cycle {self.K}: nothing is being judged, there is no verdict to anticipate")
        slots = [Slot(s.position, s.depth + 1, s.fill) for s in self._inflight]
        completed = slots.pop(0)
        slots[0].fill = 0
        slots.append(Slot(slots[-1].position + 1, 0, self._fresh_fill))
        return self._plan(slots, self.K + 1, -1, -1, completed)

    def _verified(self, token: int) -> None:
        self.tokens.append(int(token))
        if int(token) in self.eos_token_ids:
            self.stop_reason = "eos"
        elif self.N >= self.max_new_tokens:
            self.stop_reason = "max_new_tokens"

    def _count(self, accepted: bool, fill: int) -> None:
        c, depth = self.counters, self.geometry.inflight_depth(fill - 1)  # its drafting depth (see `Counters`)
        (c.accepted_by_fill if accepted else c.rejected_by_fill)[fill - 1] += 1
        (c.accepted_by_depth if accepted else c.rejected_by_depth)[depth] += 1

    def _plan(
        self, inflight: list[Slot], cycle: int, token: int, rollback_to: int, completed: Slot | None
    ) -> CyclePlan:
        """The plan of cycle `cycle` with `inflight` at the start of it; no side effects."""
        n = self.n
        stage_positions = [-1] * n
        for slot in inflight:
            stage_positions[slot.depth] = slot.position
        newest = inflight[-1]
        a = len(inflight)
        view = tuple((self.geometry.inflight_depth(a - 1 - i), slot.position) for i, slot in enumerate(inflight))
        before = [(slot.depth, slot.position) for slot in inflight if slot.depth >= 1]
        if completed is not None:
            before.append((n, completed.position))
        during = [(slot.depth + 1, slot.position) for slot in inflight]
        oldest = inflight[0]
        return CyclePlan(
            cycle=cycle,
            stage_positions=tuple(stage_positions),
            seed_token=int(token) if newest.verified else -1,
            draft_entered=not newest.verified,
            rollback_to=rollback_to,
            draft_view=view,
            draft_position=newest.position + 1,
            fill=a,
            anchors_before=tuple(sorted(before)),
            anchors_during=tuple(sorted(during)),
            judged_position=oldest.position + 1 if oldest.depth == n - 1 else -1,
        )


class VerdictMessage(NamedTuple):
    """A verdict message as every rank reads it (and as chain decoding judges on the host): the verdict and the
    token it concerns."""

    verdict: int
    token: int


@dataclass(frozen=True)
class Step:
    """One physical step: a cycle of the logical schedule as the ranks run it."""

    plan: CyclePlan
    awaits: bool = False  # runs before the previous cycle's verdict is known; that verdict arrives during the step
    redo: bool = False  # repeats a cycle whose optimistic run was wasted: its inputs came with that run, none travel
    # the decode ends with this cycle's verdict whatever it is: delivered at once, nothing anticipated
    final: bool = False


class Steps:
    """Optimistic execution over the logical schedule (docs/DESIGN.md, "The decode schedule"): after a judged
    cycle every rank runs the cycle an ACCEPT gives (`PipelineSchedule.speculate`) while the verdict travels
    point-to-point, and at the end of that step the verdict is applied to the logical schedule:

    - ACCEPT: the step was the real cycle; the schedule confirms exactly its plan.
    - REJECT: the step is wasted. The next step redoes the cycle as the rejection plans it (every stage
      rolls back, stage 1 runs the correction, the PDM drafts from it); its inputs are the ones that
      arrived for the wasted step (the previous cycle's outputs), so nothing travels for it.
    - a token that ends the decode (EOS), or STOP (a cancelled request): the step is wasted and decoding stops.

    Non-judged cycles have the verdict NONE, known in advance. When any verdict of a judged cycle ends the decode
    (`max_new_tokens`), it is delivered at once instead. So the physical steps are the logical cycles plus one
    wasted step per rejection (and per EOS verdict).
    """

    def __init__(self, schedule: PipelineSchedule):
        self.schedule = schedule

    def first(self, token: int, prompt_len: int) -> Step | None:
        return self._real(self.schedule.begin(Verdict.FIRST, token, prompt_len))

    def wasted(self, verdict: int, token: int) -> bool:
        """Whether the step that awaited this verdict is thrown away."""
        return verdict in (Verdict.REJECT, Verdict.STOP) or int(token) in self.schedule.eos_token_ids

    def after(self, step: Step, awaited: VerdictMessage | None, own: VerdictMessage | None) -> Step | None:
        """The step after `step`, or None when decoding has stopped. `awaited` is the previous cycle's
        verdict (given iff `step.awaits`), `own` this cycle's (iff `step.final` and `step` was not wasted)."""
        schedule = self.schedule
        if step.awaits:
            plan = schedule.begin(*awaited)
            if plan is None or awaited[0] == Verdict.REJECT:
                return None if plan is None else Step(plan, redo=True)
            if (plan.cycle, plan.stage_positions) != (step.plan.cycle, step.plan.stage_positions):
                raise RuntimeError(f"cycle {plan.cycle}: the accepted plan differs from the one run optimistically")
        if step.final:
            if schedule.begin(*own) is not None:
                raise RuntimeError(f"cycle {step.plan.cycle}: the decode was due to end with this verdict")
            return None
        if schedule.judging:
            return Step(schedule.speculate(), awaits=True, final=schedule.N + 2 >= schedule.max_new_tokens)
        return self._real(schedule.begin(Verdict.NONE, -1))

    def _real(self, plan: CyclePlan | None) -> Step | None:
        schedule = self.schedule
        return (
            None if plan is None else Step(plan, final=schedule.judging and schedule.N + 1 >= schedule.max_new_tokens)
        )


def eos_set(eos_token_id: int | Sequence[int] | None) -> frozenset[int]:
    """`eos_token_id` may be an int, a list of ints, or missing (docs/DESIGN.md, "Pitfalls we avoid")."""
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset({eos_token_id})
    return frozenset(int(t) for t in eos_token_id)
