"""The pipeline runner: one scheduler over B slots, any transport (docs/DESIGN.md, "The decoder").

Ranks `0..n-1` are the stages (stage `s` on rank `s-1`; the last one also verifies), rank `n` the PDM.
`PipelineRunner` hosts the roles of whichever ranks live in its process: all of them in the simulator
(`LocalTransport`), one in a distributed rank (`DistributedTransport`), stage 1 and the PDM in process 0 of the
shared placement (`SharedTransport`). Batch 1 is `max_batch = 1`: there is no other cycle. Every process keeps
every slot's `SlotSequence` (its schedule and optimistic steps; only the verifier's process holds verifiers) and
feeds it the same verdicts, so every process derives the same per-slot plans: which rows of a message are valid
never travels. Every message has one shape, sized by B (`Mailboxes` with `slots`): draft tokens `[B]` and `q`
`[B, V_d]`, activations `[B, 1, H]`, anchors `[B, A_s, H]`; each is sent in a step when any slot's plan needs it,
from the sender's output of the previous step (post-step anchors: of this step). The verdict is `[B, 2]` host
rows on the gloo control group, one message per step (rows of slots not judged are stale and never read).

There is no barrier: sends never block and a rank waits only for the messages it needs. One step (`step`):
sends of the previous step's outputs (nothing for a slot that redoes a wasted step: its inputs came with it),
the receive of the previous step's verdict posted, this step's inputs, every hosted stage's one forward over the
slots with a token at it, the verifier's copy of the entering drafts, pre-step the anchor states from other
processes (after the forward of a stage the PDM shares a process with was launched, on the drafter's own stream),
the draft, the verdicts. A process that does not know yet whether a slot's step is wasted (a stage rank before
the verdict is in) runs it optimistically; the redo rolls it back per slot. The verifier's process knows, and
skips wasted steps (unless `replay_wasted_work` makes the simulator's stages run them as distributed ranks do);
the PDM drafts without a verdict that is not in yet and discards a wasted slot's draft. A step ends with the
previous step's verdict taken everywhere, and this step's too when it ends some slot's decode whatever it says
(`Step.final`): so at a step boundary every process holds the same slots, and requests join free slots in the
same order on every rank (`run`: a FIFO; a join's prefill is a step of its own). Timing goes through one
`Profiler`, off unless `RunnerConfig.profile`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from inference.cycle.messages import Mailboxes, MessageShapes
from inference.cycle.prefill import prefill_stages
from inference.cycle.profiler import Profiler
from inference.cycle.result import COMM, COMPUTE, VERIFY, WALL, DecodeResult, max_cycles, summarize_timing
from inference.cycle.schedule import CyclePlan, Steps, Verdict, VerdictMessage
from inference.cycle.slots import Request, SlotSequence, generator_seeds
from inference.cycle.transport import Arrival, Transport
from inference.cycle.verify import Verifier
from inference.runtime.drafter import Drafter
from inference.runtime.slot_rows import RowSets, batch_bucket
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
    profile: bool = False  # per-cycle timing (`Profiler`); off: no timer, no device synchronization


@dataclass
class Judging:
    """What a process knows at the end of `step` of whether the verifier judged in it: surely (`real`), or if one
    of the slots `unknown` (slot, its `Steps`) turns out real once the previous step's verdict is in."""

    step: int
    real: bool
    unknown: list[tuple[int, Steps]]


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
        self.geometry, self.transport, self.stages, self.drafter, self.config = (
            geometry,
            transport,
            stages,
            drafter,
            config,
        )
        self.n, self.max_batch, self.device = geometry.n, max_batch, torch.device(config.device)
        self.verifier_rank, self.drafter_rank = self.n - 1, self.n
        for s in stages:
            if not transport.hosts(s - 1):
                raise ValueError(f"stage {s} is given to a process that does not host rank {s - 1}")
        self.hosted = [r for r in range(self.n + 1) if transport.hosts(r)]
        self.hosts_verifier = transport.hosts(self.verifier_rank)
        if transport.hosts(self.drafter_rank) and drafter is None:
            raise ValueError("this process hosts the PDM rank but got no drafter")
        self.listeners = [r for r in self.hosted if r != self.verifier_rank]  # hosted ranks the verdict goes to
        self.anchor_counts = {s: len([b for b in geometry.anchors_of_stage(s) if b > 0]) for s in range(1, self.n + 1)}
        self.box = Mailboxes(
            MessageShapes(
                n=self.n,
                hosted=self.hosted,
                anchor_counts=self.anchor_counts,
                hidden_size=config.hidden_size,
                state_dtype=config.state_dtype,
                draft_vocab_size=config.draft_vocab_size,
                greedy=False,  # requests bring their own sampling: `q` travels whenever one is sampled
                device=self.device,
                control_device=transport.control_device(self.device),
                slots=max_batch,
            )
        )
        self.clock = Profiler(config.profile, self.device)
        # where the PDM receives what comes from other processes: its own stream when it has one (`shared_stream`)
        self._drafter_receiving = getattr(drafter, "receiving", nullcontext)
        self.slots: list[SlotSequence | None] = [None] * max_batch
        self.verdicts: dict[int, list[list[int]]] = {}  # step -> its verdict rows, once this process holds them
        # steps that may have a verdict message the hosted listeners have not taken yet (`_due`)
        self._owed: deque[Judging] = deque()
        self._arrivals: dict[int, Arrival] = {}  # listener rank -> its posted receive of the oldest owed verdict
        self._draft_tokens = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        self._draft_q = torch.zeros(max_batch, config.draft_vocab_size, device=self.device)
        self._kept_rows = RowSets(max_batch, self.device)  # which rows of a draft the step sends
        self._kept_mask = self._kept_rows.mask()
        self.steps_run = 0
        self.discarded_drafts = 0  # drafts the PDM made before learning that their slot's step was wasted
        self.cycles = 0  # steps in which some slot ran a real cycle
        self._clock_base = 0  # `cycles` when the clock last started
        self._finished: list[tuple[int, DecodeResult]] = []
        self.stop_seen = -1  # see `decode`

    @property
    def free_slots(self) -> list[int]:
        return [b for b, seq in enumerate(self.slots) if seq is None]

    @property
    def busy(self) -> bool:
        return any(seq is not None for seq in self.slots)

    # -- messages ---------------------------------------------------------------------------------
    def _send(self, src: int, dst: int, kind: str, tensor: torch.Tensor | None = None) -> None:
        if self.transport.hosts(src):
            with self.clock.span(src, COMM):
                self.transport.send(src, dst, self.box.outbox[src, kind] if tensor is None else tensor, kind)

    def _recv(self, src: int, dst: int, kind: str, buffer: torch.Tensor | None = None) -> torch.Tensor | None:
        """Receive when this process hosts `dst`; returns the buffer (None elsewhere)."""
        if not self.transport.hosts(dst):
            return None
        buffer = self.box.inbox[dst, kind] if buffer is None else buffer
        with self.clock.span(dst, COMM):
            self.transport.recv(src, dst, buffer, kind)
        return buffer

    def _post_verdict(self) -> None:
        """The listeners start receiving the previous step's verdict, if it is still owed."""
        if self._owed_head() == self.steps_run - 1:
            for r in self.listeners:
                self._arrivals[r] = self.transport.post(self.verifier_rank, r, self.box.inbox[r, "verdict"], "verdict")

    def _take_verdict(self) -> None:
        """The listeners take the oldest owed verdict message (waiting for it); its rows are this process's."""
        step = self._owed.popleft().step
        for r in self.listeners:
            arrival = self._arrivals.pop(r, None)
            with self.clock.span(r, COMM):
                if arrival is None:
                    self.transport.recv(self.verifier_rank, r, self.box.inbox[r, "verdict"], "verdict")
                else:
                    arrival.wait()
        if not self.hosts_verifier:  # the verifier's process made them
            self.verdicts[step] = self._read_verdict(self.listeners[0])

    def _read_verdict(self, rank: int) -> list[list[int]]:
        """The `[B, 2]` verdict rows `rank` received, read once per message (host memory: no device sync)."""
        return self.box.inbox[rank, "verdict"].tolist()

    def _take_verdict_of(self, step: int) -> None:
        while (head := self._owed_head()) is not None and head <= step:
            self._take_verdict()

    def _owed_head(self) -> int | None:
        """The oldest step whose verdict message is still to be taken (steps without one dropped)."""
        while self._owed and not self._due(self._owed[0]):
            self._owed.popleft()
        return self._owed[0].step if self._owed else None

    def _due(self, judging: Judging) -> bool:
        """Whether the verifier sent a verdict message in that step: it did iff it judged some slot, i.e. a slot
        with a judged position ran a real step. A slot not known to be real then awaited the previous step's
        verdict, which this process has taken by the time it asks."""
        if judging.real:
            return True
        rows = self.verdicts[judging.step - 1]
        return any(not steps.wasted(*rows[b]) for b, steps in judging.unknown)

    def _awaited(self, b: int) -> VerdictMessage | None:
        """Slot `b`'s verdict from the previous step, when this process has it."""
        rows = self.verdicts.get(self.steps_run - 1)
        return None if rows is None else VerdictMessage(*rows[b])

    # -- joining ----------------------------------------------------------------------------------
    @torch.no_grad()
    def join(self, request: Request) -> int:
        """`request` takes the first free slot: its prefill through every stage and its first token. Returns the
        slot; a request that ends with its first token is reported by the next `step`."""
        if not self.free_slots:
            raise RuntimeError(f"all {self.max_batch} slots are busy: a request joins when one is free")
        b = self.free_slots[0]
        self._take_verdict_of(self.steps_run)  # the control channel carries the join's first token after it
        if not self.busy:  # timing rows start with a busy period (per prompt at batch 1)
            self.clock.start(self.n + 1, max_cycles(self.n, request.max_new_tokens))
            self._clock_base = self.cycles
        self.clock.cycle = 0
        if self.config.on_step is not None:
            self.config.on_step("prefill")
        verifier = None
        if self.hosts_verifier:
            config = self.config
            verifier = Verifier(
                request.sampling, self.n + 1, config.vocab_size, config.d2t, config.draft_vocab_size, self.device
            )
        seq = SlotSequence(request, self.geometry, verifier, self.device)
        seq.first(self._prefill(b, seq))
        self.slots[b] = seq
        return b

    def _prefill(self, b: int, seq: SlotSequence) -> int:
        """Slot `b`'s prompt through every stage in order, its anchors to the PDM (`prefill.prefill_stages`); the
        first token, which the verifier samples and sends to every rank."""
        prompt = torch.tensor([list(seq.request.prompt_ids)], dtype=torch.long, device=self.device)
        if self.drafter is not None:
            self.drafter.start(b, prompt, seq.capacity, seq.request.sampling, generator_seeds(seq.request.seed)[1])

        def run_stage(s: int, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
            with self.clock.span(s - 1, COMPUTE, device_work=True):
                return self.stages[s].prefill(b, inputs, seq.capacity)

        def store_anchors(s: int, states: torch.Tensor) -> None:
            self.drafter.store_anchors(b, s, 0, states)

        logits = prefill_stages(self, prompt, self.config.hidden_size, run_stage, store_anchors)
        token = -1 if logits is None else seq.verifier.first(logits)
        first = self.box.first_host  # the rows of other slots are stale: their receivers read only row `b`
        first[b, 0], first[b, 1] = Verdict.FIRST, token
        for r in range(self.n + 1):
            if r != self.verifier_rank:
                self._send(self.verifier_rank, r, "verdict", first)
        for r in self.listeners:
            self._recv(self.verifier_rank, r, "verdict")
            if not self.hosts_verifier:
                verdict, token = self._read_verdict(r)[b]
                if verdict != Verdict.FIRST:
                    raise RuntimeError(f"protocol error: slot {b}'s first message is {Verdict(verdict).name}")
        return token

    # -- one step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[tuple[int, DecodeResult]]:
        """One step over every live slot; (slot, result) of the sequences that ended since the last call."""
        self._retire_ended()
        live = {b: seq for b, seq in enumerate(self.slots) if seq is not None}
        if live:
            self.clock.cycle = self.cycles - self._clock_base + 1  # a wasted step and its redo share a row
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
        fresh = {b: seq.step.plan for b, seq in live.items() if not seq.step.redo}  # their inputs travel now
        self._send_inputs(fresh)
        self._post_verdict()
        self._receive_inputs(fresh)
        rows = batch_bucket(max(live) + 1, self.max_batch)  # the forwards run the bucket of the live slots
        self._seed_drafter(live)
        logits = self._compute(live, rows)
        self._receive_draft_to_judge(live, fresh)
        if self.geometry.schedule == "pre_step":
            with self._drafter_receiving():
                self._receive_anchors_before(fresh, from_here=False)
        self._draft(live, rows)
        self._verify(live, logits)
        self._finish_step(live)

    def _sampled(self, slots: Iterable[int]) -> bool:
        return any(not self.slots[b].request.sampling.greedy for b in slots)

    def _anchor_stages(self, plans: dict[int, CyclePlan], during: bool) -> list[int]:
        """The stages whose anchor states some plan needs (this step's, or the previous step's)."""
        pairs = [pair for plan in plans.values() for pair in (plan.anchors_during if during else plan.anchors_before)]
        return sorted({s for s, _ in pairs if self.anchor_counts[s]})

    def _send_inputs(self, fresh: dict[int, CyclePlan]) -> None:
        """In the order the receivers take them: the verifier takes the draft after the activation it runs (they
        share a channel when the PDM shares stage 1's process)."""
        n = self.n
        entered = [b for b, plan in fresh.items() if plan.draft_entered]
        if entered:
            self._send(n, 0, "draft_token")
        for s in range(1, n):
            if any(plan.stage_positions[s] >= 0 for plan in fresh.values()):
                self._send(s - 1, s, "act")
        if entered:
            self._send(n, n - 1, "draft_token")
            if self._sampled(entered):
                self._send(n, n - 1, "draft_q")
        if self.geometry.schedule == "pre_step":
            for s in self._anchor_stages(fresh, during=False):
                self._send(s - 1, n, f"anchors{s}")

    def _receive_inputs(self, fresh: dict[int, CyclePlan]) -> None:
        """Stage 1's drafts, the activations, and pre-step the anchor states of the stages in this process."""
        n = self.n
        if any(plan.draft_entered for plan in fresh.values()):
            self._recv(n, 0, "draft_token")
        for s in range(1, n):
            if any(plan.stage_positions[s] >= 0 for plan in fresh.values()):
                self._recv(s - 1, s, "act")
        if self.geometry.schedule == "pre_step":
            self._receive_anchors_before(fresh, from_here=True)

    def _receive_anchors_before(self, fresh: dict[int, CyclePlan], from_here: bool) -> None:
        """Pre-step, the PDM's anchor states of the previous step, which it stores even for a slot whose step
        turns out wasted (they are its previous, real cycle's): those of a stage in this process (`from_here`)
        with this step's inputs, those of other processes after this process's stage forward was launched, so
        that forward never waits for them (the shared placement's stage 1)."""
        if not self.transport.hosts(self.n):
            return
        for s in self._anchor_stages(fresh, during=False):
            if self.transport.hosts(s - 1) != from_here:
                continue
            states = self._recv(s - 1, self.n, f"anchors{s}")
            for b, plan in fresh.items():
                for stage, position in plan.anchors_before:
                    if stage == s:
                        self.drafter.store_anchors(b, s, position, states[b : b + 1])

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

    def _runs(self, s: int, seq: SlotSequence, b: int) -> bool:
        """Whether stage `s` takes part in slot `b`'s step here: unless known wasted (the last stage never runs a
        wasted step: its process made the verdict), or the simulator replays wasted work on the others."""
        wasted = seq.wasted(self._awaited(b))
        return not wasted or (s < self.n and self.config.replay_wasted_work)

    def _compute(self, live: dict[int, SlotSequence], rows: int) -> torch.Tensor | None:
        """Every hosted stage: its slots' rollbacks, then one forward over the leading `rows` rows (the slots with
        a token at it run it, the others idle)."""
        logits = None
        for s, stage in self.stages.items():
            taking = {b: seq.step.plan for b, seq in live.items() if self._runs(s, seq, b)}
            for b, plan in taking.items():
                if plan.rollback_to >= 0:
                    stage.cache.rollback(b, plan.rollback_to)
            tokens = {b: plan.stage_positions[s - 1] for b, plan in taking.items() if plan.stage_positions[s - 1] >= 0}
            if not tokens:
                continue
            inputs = self._stage1_input(taking) if s == 1 else self.box.inbox[s - 1, "act"]
            with self.clock.span(s - 1, COMPUTE, device_work=True):
                out = stage.step(inputs[:rows], tokens)
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

    def _receive_draft_to_judge(self, live: dict[int, SlotSequence], fresh: dict[int, CyclePlan]) -> None:
        """The verifier's copy of the drafts that entered stage 1, taken after its own forward."""
        n = self.n
        entered = [b for b, plan in fresh.items() if plan.draft_entered]
        if not entered:
            return
        tokens = self._recv(n, n - 1, "draft_token")
        q = self._recv(n, n - 1, "draft_q") if self._sampled(entered) else None
        if tokens is None:
            return
        for b in entered:
            seq = live[b]
            if seq.wasted(self._awaited(b)) is False:
                greedy = seq.request.sampling.greedy
                seq.verifier.remember(fresh[b].stage_positions[0], tokens[b : b + 1], None if greedy else q[b])

    def _draft(self, live: dict[int, SlotSequence], rows: int) -> None:
        """Post-step, this step's anchor states reach the PDM first; the PDM learns the previous verdict if it is
        in, then drafts for every slot whose step is real or not known to be wasted, in one forward. A verdict that
        is late does not hold the draft up (as at batch 1, "The critical path"): the PDM drafts without it, then
        waits for it, and a slot's draft for a step that turns out wasted is discarded: its row of the outgoing
        message keeps what it held (a redo's input travelled with it). A draft's randomness is a function of its
        request and position (`drafter`), so a discarded draft spends none: every draft is that of a PDM that knew
        in time."""
        n = self.n
        late = self.drafter is not None and self._verdict_late()
        if self.drafter is not None and not late:
            self._take_verdict_of(self.steps_run - 1)
        if self.geometry.schedule == "post_step":
            self._send_anchors_during(live)
        if self.drafter is None:
            return
        drafting = [b for b, seq in live.items() if seq.wasted(self._awaited(b)) is not True]
        if not drafting:
            return
        with self.clock.span(n, COMPUTE, device_work=True):
            drafts = self.drafter.draft({b: live[b].step.plan.draft_view for b in drafting}, rows)
        if late:
            self._take_verdict_of(self.steps_run - 1)
        kept = [b for b in drafting if not live[b].wasted(self._awaited(b))]
        # Its writes need no undo: the positions a discarded draft appended to the KV cache as verified left the
        # last stage before the rejected token did, and the rows it wrote are rewritten before any draft reads them.
        self.discarded_drafts += len(drafting) - len(kept)
        R = drafts.tokens.shape[0]
        if len(kept) == R:  # every row of the draft is sent
            self._draft_tokens[:R] = drafts.tokens
            if drafts.q is not None:
                self._draft_q[:R] = drafts.q
        elif kept:
            keep = self._kept_rows.write(kept, self._kept_mask)[:R]
            self._draft_tokens[:R] = torch.where(keep, drafts.tokens, self._draft_tokens[:R])
            if drafts.q is not None:
                self._draft_q[:R] = torch.where(keep[:, None], drafts.q, self._draft_q[:R])
        self.box.put(n, "draft_token", self._draft_tokens)
        self.box.put(n, "draft_q", self._draft_q)

    def _verdict_late(self) -> bool:
        """Whether the PDM's posted receive of the previous step's verdict is not in yet."""
        arrival = self._arrivals.get(self.n)
        return arrival is not None and not arrival.ready()

    def _send_anchors_during(self, live: dict[int, SlotSequence]) -> None:
        n = self.n
        plans = {b: seq.step.plan for b, seq in live.items()}
        for s in self._anchor_stages(plans, during=True):
            self._send(s - 1, n, f"anchors{s}")
            states = self._recv(s - 1, n, f"anchors{s}")
            if states is None:
                continue
            for b, plan in plans.items():
                if live[b].wasted(self._awaited(b)) is not True:  # real, or drafted for before its verdict is in
                    for stage, position in plan.anchors_during:
                        if stage == s:
                            self.drafter.store_anchors(b, s, position, states[b : b + 1])

    def _verify(self, live: dict[int, SlotSequence], logits: torch.Tensor | None) -> None:
        """The verifier judges each real slot's draft into its device row; one host read brings them all; one
        `[B, 2]` message to every other rank, in each step in which it judged some slot (so no host read nor
        message while the pipeline fills)."""
        step = self.steps_run
        judging = Judging(step, False, [])
        for b, seq in live.items():
            if seq.step.plan.judged_position >= 0:
                wasted = seq.wasted(self._awaited(b))
                if wasted is None:
                    judging.unknown.append((b, seq.steps))
                judging.real = judging.real or wasted is False
        if self.hosts_verifier and judging.real:
            index = step % 2  # a row pair is rewritten two steps later, once its sends have settled
            rows = self.box.verdict_rows[index]
            with self.clock.span(self.verifier_rank, VERIFY, device_work=True):
                for b, seq in live.items():
                    if seq.step.plan.judged_position >= 0 and seq.wasted(self._awaited(b)) is False:
                        seq.judge(logits[b], rows[b])
            self.verdicts[step] = self.box.verdict_to_host(index)
            for r in range(self.n + 1):
                if r != self.verifier_rank:
                    self._send(self.verifier_rank, r, "verdict", self.box.verdict_host[index])
        if self.listeners and (judging.real or judging.unknown):
            self._owed.append(judging)

    def _finish_step(self, live: dict[int, SlotSequence]) -> None:
        """Every process takes the previous verdict (and this step's when it ends a slot's decode), then every
        slot moves on to its next step."""
        step = self.steps_run
        self._take_verdict_of(step - 1)
        if any(seq.step.final for seq in live.values()):
            self._take_verdict_of(step)
        rows = self.verdicts.get(step)
        ran = False
        for b, seq in live.items():
            awaited = self._awaited(b) if seq.step.awaits else None
            real = seq.wasted(awaited) is False
            ran = ran or real
            own = VerdictMessage(*rows[b]) if seq.step.final and real else None
            seq.advance(awaited, own)
        self.cycles += ran
        self.verdicts = {s: v for s, v in self.verdicts.items() if s >= step - 1}  # the next step's `_due` reads both
        self._retire_ended()

    def _retire_ended(self) -> None:
        for b, seq in enumerate(self.slots):
            if seq is not None and seq.step is None:
                self._finished.append((b, seq.result()))
                self.slots[b] = None

    # -- a whole workload -------------------------------------------------------------------------
    def run(
        self, requests: Iterable[Request], on_result: Callable[[int, DecodeResult], None] | None = None
    ) -> list[DecodeResult]:
        """Decode every request, each joining the first free slot between steps (a FIFO); results in order, and
        `on_result(index, result)` as each ends."""
        queue = deque(enumerate(requests))
        results: dict[int, DecodeResult] = {}
        owner: dict[int, int] = {}
        while queue or self.busy:
            while queue and self.free_slots:
                index, request = queue.popleft()
                owner[self.join(request)] = index
            for b, result in self.step():
                index = owner.pop(b)
                results[index] = result
                if on_result is not None:
                    on_result(index, result)
        self._take_verdict_of(self.steps_run)
        self.transport.flush()
        return [results[i] for i in sorted(results)]

    @torch.no_grad()
    def run_one(self, request: Request) -> DecodeResult:
        """`request` alone on an idle runner (one prompt, batch 1's way at any B). `stop_seen` is then
        the cycle at which its `stop()` first returned True (else -1)."""
        if self.busy:
            raise RuntimeError("decode runs one request on an idle runner: join it beside the others instead")
        seq = self.slots[self.join(request)]
        ended: list[tuple[int, DecodeResult]] = []
        while not ended:
            ended = self.step()
        self._take_verdict_of(self.steps_run)
        self.transport.flush()
        self.stop_seen = seq.stop_seen
        return ended[0][1]

    def timing(self, K: int) -> dict:
        """Per-cycle timing since the clock last started (a prompt at batch 1) from this process's rows (see
        `result.summarize_timing`); empty unless profiling."""
        if not self.clock.enabled:
            return {}
        return summarize_timing(torch.from_numpy(self.clock.rows[:, 1:]), K, self.n)
