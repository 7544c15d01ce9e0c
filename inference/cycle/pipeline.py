"""The pipeline runner: one scheduler over B slots, any transport (docs/DESIGN.md, "One cycle over B slots", which
gives a step's phases on each rank and why every process holds the same slots at a step boundary).

Ranks `0..n-1` are the stages (stage `s` on rank `s-1`; the last one also verifies), rank `n` the PDM.
`PipelineRunner` hosts the roles of whichever ranks live in its process: all of them in the simulator
(`LocalTransport`), one in a distributed rank (`DistributedTransport`), stage 1 and the PDM in process 0 of the
shared placement (`SharedTransport`). What travels, and in which order, is the step's message traffic
(`traffic.py`); the verdicts travel on their own channel (`verdicts.py`). The verifier's process skips the wasted
steps it knows of (the others run them optimistically), unless `replay_wasted_work` makes the simulator's stages run
them as distributed stage ranks do.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from inference.cycle.messages import Mailboxes
from inference.cycle.prefill import prefill_slot
from inference.cycle.profiler import Profiler
from inference.cycle.result import COMPUTE, WALL, DecodeResult, max_cycles, summarize_timing
from inference.cycle.schedule import CyclePlan, VerdictMessage
from inference.cycle.slots import Request, SlotSequence
from inference.cycle.traffic import StepInputs, Traffic
from inference.cycle.transport import Transport
from inference.cycle.verdicts import VerdictChannel
from inference.cycle.verify import Verifier
from inference.runtime.drafter import Drafter
from inference.runtime.slot_rows import batch_bucket, leading
from inference.runtime.stages import Stage
from spd_lightning.geometry import Geometry


def role_name(rank: int, n: int) -> str:
    return f"stage {rank + 1}" if rank < n else "PDM"


@dataclass(frozen=True)
class RunnerConfig:
    """How a runner decodes: vocabulary and state shapes, device, and the test/profiling switches (each request
    brings its own sampling)."""

    vocab_size: int
    draft_vocab_size: int
    hidden_size: int
    state_dtype: torch.dtype
    device: torch.device | str
    d2t: torch.Tensor | None = None  # draft id -> target id (None: a drafter that proposes target ids)
    replay_wasted_work: bool = False  # see the module docstring
    on_step: Callable[[str], None] | None = None  # test-only fault injection (faults.Fault)
    profile: bool = False  # per-cycle timing (`Profiler`) in each result; off: no timer, no device synchronization


class PipelineRunner:
    def __init__(
        self,
        geometry: Geometry,
        transport: Transport,
        stages: dict[int, Stage],
        drafter: Drafter | None,
        config: RunnerConfig,
        max_batch: int = 1,
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be >= 1")
        self.geometry, self.stages, self.drafter, self.config = geometry, stages, drafter, config
        self.n, self.max_batch, self.device = geometry.n, max_batch, torch.device(config.device)
        self.verifier_rank = self.n - 1
        for s in stages:
            if not transport.hosts(s - 1):
                raise ValueError(f"stage {s} is given to a process that does not host rank {s - 1}")
        self.hosted = [r for r in range(self.n + 1) if transport.hosts(r)]
        if transport.hosts(self.n) and drafter is None:
            raise ValueError("this process hosts the PDM rank but got no drafter")
        self.clock = Profiler(config.profile, self.device)
        self.box = Mailboxes(  # the message buffers
            geometry,
            self.hosted,
            hidden_size=config.hidden_size,
            state_dtype=config.state_dtype,
            draft_vocab_size=config.draft_vocab_size,
            slots=max_batch,
            device=self.device,
        )
        self.traffic = Traffic(geometry, transport, self.clock, drafter, self.box)
        self.verdicts = VerdictChannel(self.traffic, self.verifier_rank)
        # where the PDM receives what comes from other processes: its own stream when it has one (`shared_stream`)
        self._drafter_receiving = getattr(drafter, "receiving", nullcontext)
        self.slots: list[SlotSequence | None] = [None] * max_batch
        self.steps_run = 0
        self.discarded_drafts = 0  # drafts the PDM made before learning that their slot's step was wasted
        self.cycles = 0  # steps in which some slot ran a real cycle, since the last `run` began
        self.spans: dict[int, tuple[int, int]] = {}  # the last workload's requests: their timing rows (`run`)
        self._finished: list[tuple[int, DecodeResult]] = []
        self.stop_seen = -1  # the cycle at which the last request to end first saw its `stop()` say True (else -1)

    @property
    def transport(self) -> Transport:
        return self.traffic.transport

    @transport.setter
    def transport(self, transport: Transport) -> None:  # tests swap in a recording transport
        self.traffic.transport = transport

    @property
    def free_slots(self) -> list[int]:
        return [b for b, seq in enumerate(self.slots) if seq is None]

    @property
    def busy(self) -> bool:
        return any(seq is not None for seq in self.slots)

    def _awaited(self, b: int) -> VerdictMessage | None:
        """Slot `b`'s verdict from the previous step, when this process has it."""
        return self.verdicts.message(self.steps_run - 1, b)

    # -- joining ----------------------------------------------------------------------------------
    @torch.no_grad()
    def join(self, request: Request) -> int:
        """`request` takes the first free slot: its prefill through every stage and its first token. Returns the
        slot; a request that ends with its first token is reported by the next `step`."""
        if not self.free_slots:
            raise RuntimeError(f"all {self.max_batch} slots are busy: a request joins when one is free")
        b = self.free_slots[0]
        self.verdicts.take_through(self.steps_run)  # the control channel carries the join's first token after it
        self.clock.cycle = 0
        if self.config.on_step is not None:
            self.config.on_step("prefill")
        verifier = None
        if self.verdicts.hosts_verifier:
            config = self.config
            verifier = Verifier(
                request.sampling, self.n + 1, config.vocab_size, config.d2t, config.draft_vocab_size, self.device
            )
        seq = SlotSequence(request, self.geometry, verifier)
        logits = prefill_slot(self.traffic, self.stages, b, seq)
        # the first token: the verifier samples it and sends it to every rank
        seq.first(self.verdicts.send_first(b, -1 if logits is None else seq.verifier.first(logits)))
        self.slots[b] = seq
        return b

    # -- one step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[tuple[int, DecodeResult]]:
        """One step over every live slot; (slot, result) of the sequences that ended since the last call."""
        self._retire_ended()
        live = {b: seq for b, seq in enumerate(self.slots) if seq is not None}
        if live:
            self.clock.cycle = self.cycles + 1  # a wasted step and its redo share a row
            with self.clock.span(self.hosted, WALL):
                self._run_step(live)
        finished, self._finished = self._finished, []
        return finished

    def _run_step(self, live: dict[int, SlotSequence]) -> None:
        if self.config.on_step is not None:
            self.config.on_step("redo" if any(seq.step.redo for seq in live.values()) else "step")
        self.steps_run += 1
        self.transport.settle()
        self.box.next_step()
        for seq in live.values():
            seq.poll_stop()
        inputs = self.traffic.inputs(live)
        self.traffic.send_inputs(inputs)
        self.verdicts.post(self.steps_run - 1)
        self.traffic.receive_inputs(inputs)
        rows = batch_bucket(max(live) + 1, self.max_batch)  # the forwards run the bucket of the live slots
        self._seed_drafter(live)
        wasted = {b: seq.wasted(self._awaited(b)) for b, seq in live.items()}  # as known before the draft
        logits = self._compute(live, rows, wasted)
        self._receive_draft_to_judge(live, inputs, wasted)
        if inputs.anchors:
            with self._drafter_receiving():
                self.traffic.receive_anchors_before(inputs, from_here=False)
        self._draft(live, rows)
        self.verdicts.judge(self.steps_run, live, logits)
        self._finish_step(live)

    def _seed_drafter(self, live: dict[int, SlotSequence]) -> None:
        """The PDM's copy of each seed (a first token, a correction), before any forward of the step is launched,
        so a draft on its own stream never waits for one. A seed enters only in a real step (a speculative step
        carries a draft instead)."""
        if self.drafter is None:
            return
        for b, seq in live.items():
            plan = seq.step.plan
            if plan.seed_token >= 0:
                self.drafter.set_token(b, plan.stage_positions[0], plan.seed_token)

    def _compute(self, live: dict[int, SlotSequence], rows: int, wasted: dict[int, bool | None]) -> torch.Tensor | None:
        """Every hosted stage: its slots' rollbacks, then one forward over the leading `rows` rows (the slots with
        a token at it run it, the others idle). A stage takes part in a slot's step unless it is known to be wasted
        (the last stage never runs one: its process made the verdict), or the simulator replays wasted work on the
        others."""
        logits = None
        for s, stage in self.stages.items():
            replay = s < self.n and self.config.replay_wasted_work
            taking = {b: seq.step.plan for b, seq in live.items() if not wasted[b] or replay}
            tokens = {}
            for b, plan in taking.items():
                if plan.rollback_to >= 0:
                    stage.cache.rollback(b, plan.rollback_to)
                if plan.stage_positions[s - 1] >= 0:
                    tokens[b] = plan.stage_positions[s - 1]
            if not tokens:
                continue
            inputs = self._stage1_input(taking) if s == 1 else self.box.inbox[s - 1, "act"]
            with self.clock.span(s - 1, COMPUTE, device_work=True):
                out = stage.step(leading(inputs, rows), tokens)
            if s < self.n:
                self.box.put(s - 1, "act", out.hidden, rows)
            self.box.put(s - 1, f"anchors{s}", out.anchors, rows)
            logits = out.logits if s == self.n else logits
        return logits

    def _stage1_input(self, taking: dict[int, CyclePlan]) -> torch.Tensor:
        """`[B, 1]` ids: each slot's seed, or the draft that entered with this step's message."""
        ids = self.box.seed_input
        if any(plan.draft_entered for plan in taking.values()):
            ids.copy_(self.box.inbox[0, "draft_token"].view_as(ids))
        for b, plan in taking.items():
            if plan.seed_token >= 0:
                ids[b].fill_(plan.seed_token)  # a kernel argument, not a copy of host memory
        return ids

    def _receive_draft_to_judge(
        self, live: dict[int, SlotSequence], inputs: StepInputs, wasted: dict[int, bool | None]
    ) -> None:
        """The verifier's copy of the drafts that entered stage 1, taken after its own forward."""
        n, entered = self.n, inputs.entered
        if not entered:
            return
        tokens = self.traffic.recv(n, n - 1, "draft_token")
        q = self.traffic.recv(n, n - 1, "draft_q") if inputs.sampled else None
        if tokens is None:
            return
        for b in entered:
            if wasted[b] is False:  # a greedy slot's verifier keeps no q
                live[b].verifier.remember(
                    inputs.plans[b].stage_positions[0], tokens[b : b + 1], None if q is None else q[b]
                )

    def _draft(self, live: dict[int, SlotSequence], rows: int) -> None:
        """Post-step, this step's anchor states reach the PDM first; the PDM drafts for every slot whose step is
        real or not known to be wasted, in one forward, without a verdict that is late, and discards the draft of a
        slot whose step turns out wasted (docs/DESIGN.md, "The critical path")."""
        late, drafting = False, []
        if self.drafter is not None:
            late = self.verdicts.late(self.n)
            if not late:
                self.verdicts.take_through(self.steps_run - 1)
            drafting = [b for b, seq in live.items() if seq.wasted(self._awaited(b)) is not True]
        if self.geometry.schedule == "post_step":
            self.traffic.exchange_anchors_during({b: seq.step.plan for b, seq in live.items()}, drafting)
        if not drafting:
            return
        with self.clock.span(self.n, COMPUTE, device_work=True):
            drafts = self.drafter.draft({b: live[b].step.plan.draft_view for b in drafting}, rows)
        kept = drafting  # unless the verdict came late and makes some slot's step wasted
        if late:
            self.verdicts.take_through(self.steps_run - 1)
            kept = [b for b in drafting if not live[b].wasted(self._awaited(b))]
        # Its writes need no undo: the positions a discarded draft appended to the KV cache as verified left the
        # last stage before the rejected token did, and the rows it wrote are rewritten before any draft reads them.
        self.discarded_drafts += len(drafting) - len(kept)
        self.traffic.put_drafts(drafts, kept)

    def _finish_step(self, live: dict[int, SlotSequence]) -> None:
        """Every process takes the previous verdict (and this step's when it ends a slot's decode), then every
        slot moves on to its next step."""
        step = self.steps_run
        self.verdicts.take_through(step - 1)
        if any(seq.step.final for seq in live.values()):
            self.verdicts.take_through(step)
        ran = 0  # the slots that ran a real cycle
        for b, seq in live.items():
            awaited = self._awaited(b) if seq.step.awaits else None
            real = seq.wasted(awaited) is False
            ran += real
            own = self.verdicts.message(step, b) if seq.step.final and real else None
            seq.advance(awaited, own)
        self.clock.count(self.hosted, ran)
        self.cycles += ran > 0
        self.verdicts.keep_from(step - 1)  # the next step's `VerdictChannel._due` reads both
        self._retire_ended()

    def _retire_ended(self) -> None:
        for b, seq in enumerate(self.slots):
            if seq is not None and seq.step is None:
                self._finished.append((b, seq.result()))
                self.slots[b] = None
                self.stop_seen = seq.stop_seen

    # -- a whole workload -------------------------------------------------------------------------
    def run(
        self, requests: Iterable[Request], on_result: Callable[[int, DecodeResult], None] | None = None
    ) -> list[DecodeResult]:
        """Decode every request on an idle runner, each joining the first free slot between steps (a FIFO); results
        in order, and `on_result(index, result)` as each ends. Each request's timing rows are those of the cycles
        from its first to its last (`spans`, [first, end); this process's rows: the ranks gather theirs)."""
        if self.busy:
            raise RuntimeError("a workload starts on an idle runner: join a request beside the others instead")
        queue = deque(enumerate(requests))
        self.clock.start(self.n + 1, max((max_cycles(self.n, r.max_new_tokens) for _, r in queue), default=0))
        self.cycles, self.spans = 0, {}
        results: dict[int, DecodeResult] = {}
        owner: dict[int, int] = {}
        while queue or self.busy:
            while queue and self.free_slots:
                index, request = queue.popleft()
                owner[self.join(request)] = index
                self.spans[index] = (self.cycles + 1, -1)  # its first cycle is the next step's
            for b, result in self.step():
                index = owner.pop(b)
                self.spans[index] = (self.spans[index][0], self.cycles + 1)
                if self.clock.enabled:
                    result.timing = summarize_timing(torch.from_numpy(self.clock.rows), self.n, self.spans[index])
                results[index] = result
                if on_result is not None:
                    on_result(index, result)
        self.verdicts.take_through(self.steps_run)
        self.transport.flush()
        return [results[i] for i in sorted(results)]

    def run_one(self, request: Request) -> DecodeResult:
        """`request` alone on an idle runner (batch 1's way at any B)."""
        (result,) = self.run([request])
        return result
