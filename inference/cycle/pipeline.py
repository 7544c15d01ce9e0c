"""The pipeline runner: one scheduler, any transport (docs/DESIGN.md: "The hot path", "The critical path").

Ranks `0..n-1` are the stages (stage `s` on rank `s-1`; the last one also verifies), rank `n` the PDM.
`PipelineRunner` hosts the roles of whichever ranks live in its process: all of them in the simulator
(`LocalTransport`), exactly one in a distributed rank (`DistributedTransport`). Every process runs the
same code below: the same `Steps` over the same `PipelineSchedule`, the same messages in the same order,
with the work of ranks it does not host skipped. So the simulator and the distributed decoder produce the
same tokens, N, K and counters by construction, and the simulator checks the message order.

There is no barrier: sends never block, a rank waits only for the messages it needs, and the verdict goes
point-to-point from the verifier to each rank (`schedule.Steps` is the optimistic step sequence). One step
(`_run_step`, then `_receive_awaited`):
  `_send_inputs`: the previous step's outputs that this step consumes: the draft (PDM -> stage 1), the
     activations (stage s -> s+1), the draft again (PDM -> the verifier, with `q`) and, pre-step, the anchor
     states (-> PDM). Nothing on a redo step: its inputs arrived with the wasted step it repeats;
  `_learn_verdict`: the PDM takes the verdict the step awaits if it is in, else it drafts without it
     (`_draft` then waits for it and discards a wasted step's draft); the stage ranks post their receive
     of it and go on;
  `_receive_inputs`: this step's inputs (anchor states are stored even for a wasted step: they are the
     previous, real cycle's, and its redo needs them), but only the anchor states of a stage in the PDM's
     own process;
  `_compute`: every stage runs its token (a redo rolls back and reseeds first) - optimistically: a stage
     skips it only when the verdict has already arrived and says the step is wasted;
  `_receive_draft_to_judge`: the verifier takes the draft that entered stage 1 after its own forward (it
     judges it only when the token before it leaves the last stage);
  `_receive_anchors_before`: pre-step, the PDM takes the anchor states from the other processes, after the
     forward of a stage it shares a process with was launched (the shared placement; on its own stream);
  `_draft`: post-step, this step's anchor states -> PDM first; the PDM drafts;
  `_verify`: the verifier judges and sends the verdict to every other rank;
  `_receive_awaited`: the stage ranks wait for the verdict the step awaited (at the end of the decode,
     this step's own).
So no stage forward waits for verification or for a draft it does not run; when the gamble loses (a
rejection that arrives late), a stage has run a token that the redo rolls back, and the PDM has drafted for
a step it then discards. The verifier (which made the verdict) skips a step it knows is wasted, and so does
the PDM when the verdict is in before it drafts; in the simulator the verdict is always there in time, unless
`replay_wasted_work` makes its stages run wasted steps as distributed ranks do when it comes late.
Skipping or running a wasted step changes no output: its work is never sent on and is rolled back.
docs/DESIGN.md ("The critical path") draws one cycle of each placement.
Timing goes through one `Profiler`, off unless `RunnerConfig.profile`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from inference.cycle.messages import Mailboxes, MessageShapes
from inference.cycle.prefill import prefill_stages
from inference.cycle.profiler import Profiler
from inference.cycle.result import COMM, COMPUTE, VERIFY, WALL, DecodeResult, max_cycles, summarize_timing
from inference.cycle.schedule import CyclePlan, PipelineSchedule, Step, Steps, Verdict, VerdictMessage
from inference.cycle.transport import Arrival, Transport
from inference.cycle.verify import Verifier
from inference.runtime.drafter import Drafter
from inference.runtime.stages import Stage
from inference.sampling import Sampling
from spd_lightning.geometry import Geometry


def role_name(rank: int, n: int) -> str:
    return f"stage {rank + 1}" if rank < n else "PDM"


def generator_seeds(seed: int) -> tuple[int, int]:
    """Independent generator seeds for the verifier and the drafter, so each rank owns its randomness. Any
    integer works: it is taken modulo 2**63 first, so both stay within torch.manual_seed's 64-bit range
    (the seeds 0 .. 2**63 - 1 keep the random sequences they always had)."""
    seed %= 2**63
    return 2 * seed, 2 * seed + 1


@dataclass(frozen=True)
class RunnerConfig:
    """How a runner decodes: sampling, vocabulary and state shapes, device, and the test/profiling switches."""

    sampling: Sampling
    vocab_size: int
    draft_vocab_size: int
    hidden_size: int
    state_dtype: torch.dtype
    device: torch.device | str
    d2t: torch.Tensor | None = None  # draft id -> target id (None: a drafter that proposes target ids)
    replay_wasted_work: bool = False  # see the module docstring
    on_step: Callable[[str], None] | None = None  # test-only fault injection (faults.Fault)
    profile: bool = False  # per-cycle timing (`Profiler`); off: no timer, no device synchronization


class PipelineRunner:
    def __init__(
        self,
        geometry: Geometry,
        transport: Transport,
        stages: dict[int, Stage],
        drafter: Drafter | None,
        config: RunnerConfig,
    ):
        self.geometry, self.transport, self.stages, self.drafter, self.config = (
            geometry,
            transport,
            stages,
            drafter,
            config,
        )
        self.n = n = geometry.n
        self.sampling, self.device = config.sampling, torch.device(config.device)
        self.drafter_rank, self.verifier_rank = n, n - 1
        self._check_roles()
        self.hosted = [r for r in range(n + 1) if transport.hosts(r)]
        self.hosts_verifier = transport.hosts(self.verifier_rank)
        self.on_step = config.on_step
        self.verifier = (
            Verifier(self.sampling, n + 1, config.vocab_size, config.d2t, config.draft_vocab_size, self.device)
            if n in stages
            else None
        )
        self.draft_generator = torch.Generator(device=self.device)
        self.clock = Profiler(config.profile, self.device)
        self.anchor_counts = {s: len([b for b in geometry.anchors_of_stage(s) if b > 0]) for s in range(1, n + 1)}
        self.box = Mailboxes(
            MessageShapes(
                n=n,
                hosted=self.hosted,
                anchor_counts=self.anchor_counts,
                hidden_size=config.hidden_size,
                state_dtype=config.state_dtype,
                draft_vocab_size=config.draft_vocab_size,
                greedy=self.sampling.greedy,
                device=self.device,
                control_device=transport.control_device(self.device),
            )
        )
        self.inbox, self.outbox = self.box.inbox, self.box.outbox
        self.verdict_rows, self.verdict_host = self.box.verdict_rows, self.box.verdict_host
        self.seed_input = self.box.seed_input
        self._arrivals: dict[int, Arrival] = {}  # stage rank -> its posted receive of the awaited verdict
        self._wasted = False  # the current step is wasted, as the verifier and the PDM know before they compute
        self._judged: VerdictMessage | None = None  # the verifier's latest verdict, on the host
        self._awaited: VerdictMessage | None = None  # the verdict the current step awaits, once this process has it
        self._pdm_pending: Arrival | None = None  # the PDM's receive of it, while it drafts without it
        self.discarded_drafts = 0  # drafts the PDM made before learning that their step was wasted
        # where the PDM receives what comes from other processes: its own stream when it has one (`shared_stream`)
        self._drafter_receiving = getattr(drafter, "receiving", nullcontext)
        self._stop: Callable[[], bool] | None = None  # see `decode`
        self.stop_seen = -1

    def _check_roles(self) -> None:
        for s in self.stages:
            if not self.transport.hosts(s - 1):
                raise ValueError(f"stage {s} is given to a process that does not host rank {s - 1}")
        if self.transport.hosts(self.drafter_rank) and self.drafter is None:
            raise ValueError("this process hosts the PDM rank but got no drafter")

    # -- messages ---------------------------------------------------------------------------------
    def _send(self, src: int, dst: int, kind: str, tensor: torch.Tensor | None = None) -> None:
        if not self.transport.hosts(src):
            return
        with self.clock.span(src, COMM):
            self.transport.send(src, dst, self.outbox[src, kind] if tensor is None else tensor, kind)

    def _recv(self, src: int, dst: int, kind: str, buffer: torch.Tensor | None = None) -> torch.Tensor | None:
        """Receive when this process hosts `dst`; returns the buffer (None elsewhere)."""
        if not self.transport.hosts(dst):
            return None
        buffer = self.inbox[dst, kind] if buffer is None else buffer
        with self.clock.span(dst, COMM):
            self.transport.recv(src, dst, buffer, kind)
        return buffer

    def _send_verdict(self, index: int) -> None:
        """The verifier's verdict (or the first token) in `verdict_rows[index]` to every other rank, from host
        memory; the verifier keeps it on the host. This copy is the decode's one device-to-host read per
        cycle, on one rank: the schedule (which runs on every rank's host) needs the verdict and the token
        (EOS, `max_new_tokens`, the rollback position) to plan the next cycle."""
        if self.verifier is None:
            return
        self._judged = VerdictMessage(*self.box.verdict_to_host(index))
        for r in range(self.n + 1):
            if r != self.verifier_rank:
                self._send(self.verifier_rank, r, "verdict", self.verdict_host[index])

    def _read_verdict(self, rank: int) -> VerdictMessage:
        """The verdict `rank` received, read once per message (it is in host memory: no device sync)."""
        return VerdictMessage(*self.inbox[rank, "verdict"].tolist())

    def _take_verdict(self, ranks: Sequence[int], known: VerdictMessage | None) -> VerdictMessage:
        """The hosted `ranks` receive the verifier's pending verdict; its value (all copies are equal)."""
        for r in ranks:
            if r in self.hosted:
                self._recv(self.verifier_rank, r, "verdict")
                known = known if known is not None else self._read_verdict(r)
        return known

    def _send_anchors(self, pairs: Sequence[tuple[int, int]], store: bool) -> None:
        for s, position in pairs:
            if self.anchor_counts[s]:
                self._send(s - 1, self.drafter_rank, f"anchors{s}")
                recv = self._recv(s - 1, self.drafter_rank, f"anchors{s}")
                if recv is not None and store:
                    self.drafter.store_anchors(s, position, recv)

    # -- one prompt -------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        eos_token_ids: frozenset[int],
        seed: int = 0,
        on_tokens: Callable[[list[int]], None] | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> DecodeResult:
        """Decode one prompt; every hosted rank returns the same result (timing rows of remote ranks are zero).
        `on_tokens(new)` is called with the newly verified tokens after each cycle that verified some (for
        streaming); an exception it raises ends the decode, leaving this runner's messages half-delivered:
        a simulator must then be rebuilt. `stop()` cancels cleanly instead: the verifier's process polls it
        once per cycle (a host read, e.g. a shared-memory flag; never the device) and from the first True the
        next verdict is STOP, which ends the decode on every rank at once, stop reason "cancelled", the runner
        ready for the next prompt. `stop_seen` is then the cycle at which it first returned True (else -1)."""
        n = self.n
        self._stop, self.stop_seen = (stop if self.hosts_verifier else None), -1
        prompt = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device)
        schedule = PipelineSchedule(self.geometry, max_new_tokens, eos_token_ids)
        self.steps = Steps(schedule)
        self.clock.start(n + 1, max_cycles(n, max_new_tokens))
        t0 = time.perf_counter()
        step = self._start(prompt, prompt.shape[1] + max_new_tokens + n + 1, seed)
        prefill_s = time.perf_counter() - t0
        t_start = time.perf_counter()
        emitted = 0
        while True:
            if on_tokens is not None and len(schedule.tokens) > emitted:
                on_tokens(schedule.tokens[emitted:])
                emitted = len(schedule.tokens)
            if step is None:
                break
            step = self._cycle(step)
        self.transport.flush()
        decode_s = time.perf_counter() - t_start
        return DecodeResult(
            mode=self.geometry.mode,
            n=n,
            prompt_len=prompt.shape[1],
            tokens=list(schedule.tokens),
            K=schedule.K,
            stop_reason=schedule.stop_reason,
            counters=schedule.counters.to_dict(),
            prefill_s=prefill_s,
            decode_s=decode_s,
        )

    def _start(self, prompt: torch.Tensor, capacity: int, seed: int) -> Step | None:
        """Seed the generators, prefill, and read the first token: the first step."""
        verify_seed, draft_seed = generator_seeds(seed)
        if self.verifier is not None:
            self.verifier.reset(verify_seed)
        self.draft_generator.manual_seed(draft_seed)
        if self.drafter is not None:  # room for every position a draft can reach
            self.drafter.start(prompt, capacity)
        self._prefill(prompt, capacity)
        verdict, token = self._take_verdict(self._others, self._judged if self.hosts_verifier else None)
        if verdict != Verdict.FIRST:
            raise RuntimeError(f"protocol error: the first message after prefill is {Verdict(verdict).name}, not FIRST")
        return self.steps.first(token, prompt.shape[1])

    @property
    def _others(self) -> list[int]:
        return [r for r in range(self.n + 1) if r != self.verifier_rank]

    def _cycle(self, step: Step) -> Step | None:
        """Run one physical step and return the next (None when the decode has stopped)."""
        self.clock.cycle = step.plan.cycle
        if self._stop is not None and self.stop_seen < 0 and self._stop():
            self.stop_seen = step.plan.cycle
        with self.clock.span(self.hosted, WALL):
            self._run_step(step)
            awaited = self._receive_awaited()
            own = None
            if step.final and not (awaited is not None and self.steps.wasted(*awaited)):
                own = self._take_verdict(self._others, self._judged if self.hosts_verifier else None)
        return self.steps.after(step, awaited, own)

    def _receive_awaited(self) -> VerdictMessage | None:
        """The stage ranks wait for the verdict they posted a receive for in `_learn_verdict`; the PDM got it
        then or while it drafted, the verifier made it. None when the step awaited nothing."""
        if self._pdm_pending is not None:  # a PDM that did not draft this step
            self._settle_pdm_verdict(self._pdm_pending)
        for r, arrival in self._arrivals.items():
            with self.clock.span(r, COMM):
                arrival.wait()
            self._awaited = self._awaited if self._awaited is not None else self._read_verdict(r)
        return self._awaited

    def timing(self, K: int) -> dict:
        """Per-cycle timing of the last prompt from this process's rows (see `result.summarize_timing`);
        empty unless profiling."""
        if not self.clock.enabled:
            return {}
        return summarize_timing(torch.from_numpy(self.clock.rows[:, 1:]), K, self.n)

    def _prefill(self, prompt: torch.Tensor, capacity: int) -> None:
        """The prompt through every stage in order (`prefill.prefill_stages`); the verifier samples the first
        token and sends it to every rank."""
        if self.on_step is not None:
            self.on_step("prefill")

        def run_stage(s: int, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
            stage = self.stages[s]
            stage.cache.reset(capacity)
            with self.clock.span(s - 1, COMPUTE, device_work=True):
                out = stage(inputs, 0)
            return out.hidden, out.anchors, out.logits

        def store_anchors(s: int, states: torch.Tensor) -> None:
            self.drafter.store_anchors(s, 0, states)

        logits = prefill_stages(self, prompt, self.config.hidden_size, run_stage, store_anchors)
        if logits is not None:
            row = self.verdict_rows[0]
            row[0], row[1] = Verdict.FIRST, self.verifier.first(logits)
        self._send_verdict(0)

    # -- one step, phase by phase (see the module docstring) ---------------------------------------
    def _run_step(self, step: Step) -> None:
        if self.on_step is not None:
            self.on_step("redo" if step.redo else "step")
        self.transport.settle()
        self.box.next_step()
        self._awaited = self._judged if step.awaits and self.hosts_verifier else None
        if not step.redo:
            self._send_inputs(step.plan)
        self._learn_verdict(step)
        if not step.redo:
            self._receive_inputs(step.plan)
        logits = self._compute(step.plan)
        if not step.redo and step.plan.draft_entered and self.verifier_rank > 0:
            self._receive_draft_to_judge(step.plan)
        if not step.redo and self.geometry.schedule == "pre_step":
            self._receive_anchors_before(step.plan, from_here=False)
        self._draft(step.plan)
        self._verify(step.plan, logits)

    def _send_inputs(self, plan: CyclePlan) -> None:
        """In the order the receivers take them: the verifier takes the draft after the activation it runs
        (they share a channel when the PDM shares stage 1's process)."""
        n = self.n
        if plan.draft_entered:
            self._send(n, 0, "draft_token")
        for s in range(1, n):
            if plan.stage_positions[s] >= 0:
                self._send(s - 1, s, "act")
        if plan.draft_entered:
            self._send(n, n - 1, "draft_token")
            if not self.sampling.greedy:
                self._send(n, n - 1, "draft_q")
        if self.geometry.schedule == "pre_step":
            for s, _ in plan.anchors_before:
                if self.anchor_counts[s]:
                    self._send(s - 1, n, f"anchors{s}")

    def _learn_verdict(self, step: Step) -> None:
        self._arrivals.clear()
        self._pdm_pending = None
        if step.awaits:
            if self.drafter_rank in self.hosted:
                self._learn_pdm_verdict()
            for r in range(self.n - 1):
                if r in self.hosted:
                    self._arrivals[r] = self.transport.post(self.verifier_rank, r, self.inbox[r, "verdict"], "verdict")
        self._wasted = self._awaited is not None and self.steps.wasted(*self._awaited)  # known to verifier and PDM

    def _learn_pdm_verdict(self) -> None:
        """The PDM takes the awaited verdict if it is in; if not, it drafts without it (`_draft` then waits
        for it and discards the draft of a wasted step)."""
        n = self.n
        if self.hosts_verifier:  # in this process the verdict is known and already sent
            self._awaited = self._take_verdict([n], self._awaited)
            return
        arrival = self.transport.post(self.verifier_rank, n, self.inbox[n, "verdict"], "verdict")
        if arrival.ready():
            arrival.wait()
            self._awaited = self._awaited if self._awaited is not None else self._read_verdict(n)
        else:
            self._pdm_pending = arrival

    def _receive_inputs(self, plan: CyclePlan) -> None:
        n = self.n
        if plan.draft_entered:
            self._recv(n, 0, "draft_token")
            if self.verifier_rank == 0:  # n = 1: the verifier is stage 1, whose input the draft is
                self._receive_draft_to_judge(plan)
        for s in range(1, n):
            if plan.stage_positions[s] >= 0:
                self._recv(s - 1, s, "act")
        if self.geometry.schedule == "pre_step":
            self._receive_anchors_before(plan, from_here=True)

    def _receive_anchors_before(self, plan: CyclePlan, from_here: bool) -> None:
        """Pre-step, the PDM's anchor states of the previous step: those of a stage in this process
        (`from_here`) with this step's inputs; those of other processes after this process's stage forward
        was launched, so that forward never waits for them (the shared placement's stage 1). A drafter with
        a stream of its own (`shared_stream.SideStreamDrafter.receiving`) takes the latter on that stream."""
        n = self.n
        sources = [
            (s, position)
            for s, position in plan.anchors_before
            if self.anchor_counts[s] and self.transport.hosts(s - 1) == from_here
        ]
        if not sources or not self.transport.hosts(n):
            return
        with nullcontext() if from_here else self._drafter_receiving():
            for s, position in sources:
                self.drafter.store_anchors(s, position, self._recv(s - 1, n, f"anchors{s}"))

    def _receive_draft_to_judge(self, plan: CyclePlan) -> None:
        """The verifier's copy of the draft that entered stage 1 this step: it is judged only when the token
        before it leaves the last stage, so the verifier takes it after its own forward, which never waits
        for the PDM."""
        n = self.n
        token = self._recv(n, n - 1, "draft_token")
        q = None if self.sampling.greedy else self._recv(n, n - 1, "draft_q")
        if self.verifier is not None and not self._wasted:
            self.verifier.remember(plan.stage_positions[0], token, q)

    def _known_wasted(self, rank: int) -> bool:
        """Whether `rank` knows now that this step is wasted (a stage rank: once its verdict is in)."""
        if rank >= self.verifier_rank:
            return self._wasted
        arrival = self._arrivals.get(rank)
        if arrival is None or self.config.replay_wasted_work or not arrival.ready():
            return False
        if self._awaited is None:
            self._awaited = self._read_verdict(rank)
        return self.steps.wasted(*self._awaited)

    def _compute(self, plan: CyclePlan) -> torch.Tensor | None:
        """Every hosted stage runs its token; returns the last stage's logits when it ran."""
        n, logits = self.n, None
        if plan.rollback_to >= 0:
            for stage in self.stages.values():
                stage.cache.rollback(plan.rollback_to)
        if plan.seed_token >= 0:
            self.seed_input.fill_(plan.seed_token)
            if self.drafter is not None:
                self.drafter.set_token(plan.stage_positions[0], plan.seed_token)
        for s, stage in self.stages.items():
            position = plan.stage_positions[s - 1]
            if position < 0 or self._known_wasted(s - 1):
                continue
            if s == 1:
                x = self.seed_input if plan.seed_token >= 0 else self.inbox[0, "draft_token"].view(1, 1)
            else:
                x = self.inbox[s - 1, "act"]
            with self.clock.span(s - 1, COMPUTE, device_work=True):
                out = stage(x, position)
            self.box.put(s - 1, "act", out.hidden)
            self.box.put(s - 1, f"anchors{s}", out.anchors)
            logits = out.logits if s == n else logits
        return logits

    def _draft(self, plan: CyclePlan) -> None:
        """Post-step, this step's anchor states reach the PDM first; then the PDM drafts the next token."""
        n = self.n
        if self.geometry.schedule == "post_step":
            self._send_anchors(plan.anchors_during, store=not self._wasted)
        if self.drafter is None or self._wasted:
            return
        pending = self._pdm_pending
        randomness = None if pending is None or self.sampling.greedy else self.draft_generator.get_state()
        with self.clock.span(n, COMPUTE, device_work=True):
            token, q = self.drafter.draft(plan.draft_view, self.draft_generator)
        if pending is not None and self._settle_pdm_verdict(pending):
            # Drafted for a wasted step: not sent, and its randomness given back, as if never drafted. Its
            # writes need no undo: the positions it appended to the KV cache as verified left the last stage
            # before the rejected token did, and the rows it wrote are rewritten before any draft reads them.
            self.discarded_drafts += 1
            if randomness is not None:
                self.draft_generator.set_state(randomness)
            return
        self.box.put(n, "draft_token", token)
        if q is not None:
            self.box.put(n, "draft_q", q)

    def _settle_pdm_verdict(self, arrival: Arrival) -> bool:
        """The PDM waits for the verdict it drafted without; whether it makes this step wasted."""
        with self.clock.span(self.n, COMM):
            arrival.wait()
        self._pdm_pending = None
        self._awaited = self._awaited if self._awaited is not None else self._read_verdict(self.n)
        self._wasted = self.steps.wasted(*self._awaited)
        return self._wasted

    def _verify(self, plan: CyclePlan, logits: torch.Tensor | None) -> None:
        if self.verifier is None or plan.judged_position < 0 or self._wasted:
            return
        index = plan.cycle % 2
        with self.clock.span(self.n - 1, VERIFY, device_work=True):
            row = self.verifier.judge(plan.judged_position, logits, self.verdict_rows[index])
            if self.stop_seen >= 0:
                row[0] = Verdict.STOP
        self._send_verdict(index)
