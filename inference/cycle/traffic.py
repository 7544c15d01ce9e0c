"""The runner's message traffic: what a step sends and receives between the ranks this process hosts and the
others, in the order every rank derives from the same plans (docs/DESIGN.md, "One cycle over B slots", which gives
each message's `[B, ...]` shape and when it travels). A message carries the sender's output of the previous step
(post-step anchors: of this step). Every send and receive is timed on its hosted end (`Profiler`, `COMM`); the
verdict channel (`verdicts.py`) and the prefill (`prefill.py`) send through the same `send` and `recv`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from inference.cycle.messages import Mailboxes
from inference.cycle.profiler import Profiler
from inference.cycle.result import COMM
from inference.cycle.schedule import CyclePlan
from inference.cycle.slots import SlotSequence
from inference.cycle.transport import Arrival, Transport
from inference.runtime.drafter import DraftBatch, Drafter
from inference.runtime.slot_rows import RowSets, leading
from spd_lightning.geometry import Geometry


class StepInputs(NamedTuple):
    """What a step's fresh plans take from the previous step, derived once per step (`Traffic.inputs`)."""

    plans: Mapping[int, CyclePlan]  # the slots whose inputs travel now, and their plans
    entered: list[int]  # the slots whose draft enters stage 1
    sampled: bool  # some of those slots samples: the drafts travel with their distribution `q`
    acts: list[int]  # the stages `s` whose activation goes on to stage `s + 1`
    anchors: list[int]  # pre-step: the stages whose anchor states of the previous step go to the PDM


class Traffic:
    """The messages of one process's ranks, over `transport` (which tests may swap for a recording one)."""

    def __init__(
        self, geometry: Geometry, transport: Transport, clock: Profiler, drafter: Drafter | None, box: Mailboxes
    ):
        """`drafter`: where the anchor states land (where the PDM is hosted); `box`: the messages' buffers."""
        self.n, self.pre_step = geometry.n, geometry.schedule == "pre_step"
        self.transport, self.clock, self.drafter, self.box = transport, clock, drafter, box
        self._kept_rows = RowSets(box.slots, box.device)  # which rows of a draft the step sends
        self._kept_mask = self._kept_rows.mask()

    def send(self, src: int, dst: int, kind: str, tensor: torch.Tensor | None = None) -> None:
        """Send `tensor` (else what `src` put in its outbox) when this process hosts `src`."""
        if self.transport.hosts(src):
            with self.clock.span(src, COMM):
                self.transport.send(src, dst, self.box.outbox[src, kind] if tensor is None else tensor, kind)

    def recv(self, src: int, dst: int, kind: str, buffer: torch.Tensor | None = None) -> torch.Tensor | None:
        """Receive when this process hosts `dst`; returns the buffer (None elsewhere)."""
        if not self.transport.hosts(dst):
            return None
        buffer = self.box.inbox[dst, kind] if buffer is None else buffer
        with self.clock.span(dst, COMM):
            self.transport.recv(src, dst, buffer, kind)
        return buffer

    def post(self, src: int, dst: int, kind: str) -> Arrival:
        """Start receiving into `dst`'s inbox without waiting (`wait` finishes it)."""
        return self.transport.post(src, dst, self.box.inbox[dst, kind], kind)

    def wait(self, dst: int, arrival: Arrival) -> None:
        with self.clock.span(dst, COMM):
            arrival.wait()

    def inputs(self, live: Mapping[int, SlotSequence]) -> StepInputs:
        """What the plans of the `live` slots that do not redo a wasted step take this step."""
        fresh = {b: seq.step.plan for b, seq in live.items() if not seq.step.redo}
        entered = [b for b, plan in fresh.items() if plan.draft_entered]
        acts = {s for plan in fresh.values() for s, position in enumerate(plan.stage_positions) if s and position >= 0}
        return StepInputs(
            fresh,
            entered,
            any(not live[b].request.sampling.greedy for b in entered),
            sorted(acts),
            self.anchor_stages(fresh, during=False) if self.pre_step else [],
        )

    def send_inputs(self, inputs: StepInputs) -> None:
        """The previous step's outputs that this step's fresh plans take, in the order the receivers take them:
        the verifier takes the draft after the activation it runs (they share a channel when the PDM shares stage
        1's process)."""
        n = self.n
        if inputs.entered:
            self.send(n, 0, "draft_token")
        for s in inputs.acts:
            self.send(s - 1, s, "act")
        if inputs.entered:
            self.send(n, n - 1, "draft_token")
            if inputs.sampled:
                self.send(n, n - 1, "draft_q")
        for s in inputs.anchors:
            self.send(s - 1, n, f"anchors{s}")

    def receive_inputs(self, inputs: StepInputs) -> None:
        """Stage 1's drafts, the activations, and pre-step the anchor states of the stages in this process."""
        n = self.n
        if inputs.entered:
            self.recv(n, 0, "draft_token")
        for s in inputs.acts:
            self.recv(s - 1, s, "act")
        self.receive_anchors_before(inputs, from_here=True)

    def receive_anchors_before(self, inputs: StepInputs, from_here: bool) -> None:
        """Pre-step, the PDM's anchor states of the previous step, which it stores even for a slot whose step
        turns out wasted (they are its previous, real cycle's): those of a stage in this process (`from_here`)
        with this step's inputs, those of other processes after this process's stage forward was launched, so
        that forward never waits for them (the shared placement's stage 1)."""
        for s in inputs.anchors:
            if self.transport.hosts(s - 1) == from_here:
                self._store_anchors(s, {b: plan.anchors_before for b, plan in inputs.plans.items()})

    def exchange_anchors_during(self, plans: Mapping[int, CyclePlan], drafting: list[int]) -> None:
        """Post-step, this step's anchor states to the PDM, which stores those of the `drafting` slots (real, or
        drafted for before their verdict is in)."""
        for s in self.anchor_stages(plans, during=True):
            self.send(s - 1, self.n, f"anchors{s}")
            self._store_anchors(s, {b: plans[b].anchors_during for b in drafting})

    def _store_anchors(self, stage: int, anchors: Mapping[int, Sequence[tuple[int, int]]]) -> None:
        """`stage`'s anchor message, received and stored where the PDM is hosted: slot `b`'s row holds the anchors
        of the one position of `stage` in `anchors[b]` (a message has one row per slot)."""
        states = self.recv(stage - 1, self.n, f"anchors{stage}")
        if states is None:
            return
        positions: dict[int, int] = {}
        for b, pairs in anchors.items():
            for s, position in pairs:
                if s == stage:
                    if b in positions:
                        raise RuntimeError(f"slot {b}: two positions of stage {stage}'s anchors in one message")
                    positions[b] = position
        self.drafter.store_step_anchors(stage, positions, states)

    def put_drafts(self, drafts: DraftBatch, kept: list[int]) -> None:
        """The PDM's outgoing draft message: the rows of the `kept` slots' drafts; the row of a discarded draft
        keeps what it held (a redo's input travelled with it)."""
        R = drafts.tokens.shape[0]
        sent_tokens, sent_q = self.box.drafts
        tokens, q = leading(sent_tokens, R), leading(sent_q, R)
        if len(kept) == R:  # every row of the draft is sent
            tokens.copy_(drafts.tokens)
            if drafts.q is not None:
                q.copy_(drafts.q)
        elif kept:
            keep = leading(self._kept_rows.write(kept, self._kept_mask), R)
            tokens.copy_(torch.where(keep, drafts.tokens, tokens))
            if drafts.q is not None:
                q.copy_(torch.where(keep[:, None], drafts.q, q))
        self.box.put(self.n, "draft_token", sent_tokens)
        if drafts.q is not None:  # else no slot that drafted samples, and no draft entering next step needs its q
            self.box.put(self.n, "draft_q", sent_q)

    def anchor_stages(self, plans: Mapping[int, CyclePlan], during: bool) -> list[int]:
        """The stages whose anchor states some plan needs (this step's, or the previous step's)."""
        pairs = [pair for plan in plans.values() for pair in (plan.anchors_during if during else plan.anchors_before)]
        return sorted({s for s, _ in pairs if self.box.anchor_counts[s]})
