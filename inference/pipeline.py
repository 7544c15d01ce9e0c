"""The pipeline runner: one scheduler, any transport (SPEC 5.1, 5.3, 11).

Ranks `0..n-1` are the stages (stage `s` on rank `s-1`; the last one also verifies), rank `n` the PDM.
`PipelineRunner` hosts the roles of whichever ranks live in its process: all of them in the simulator
(`LocalTransport`), exactly one in a distributed rank (`DistributedTransport`). Every process runs the
same code below: the same `Steps` over the same `PipelineSchedule`, the same messages in the same order,
with the work of ranks it does not host skipped. So the simulator and the distributed decoder produce the
same tokens, N, K and counters by construction, and the simulator checks the message order.

There is no barrier: sends never block, a rank waits only for the messages it needs, and the verdict goes
point-to-point from the verifier to each rank (`schedule.Steps` is the optimistic step sequence). One step:
  1. send the previous step's outputs that this step consumes: the draft (PDM -> stage 1, and -> the
     verifier with `q`), the activations (stage s -> s+1) and, pre-step, the anchor states (-> PDM).
     Nothing on a redo step: its inputs arrived with the wasted step it repeats;
  2. the PDM receives the verdict the step awaits. It costs the PDM nothing (the verifier sends it before
     the anchor states the PDM waits for anyway) and the PDM then never drafts for a wasted step;
     the stage ranks post their receive of it and go on;
  3. receive this step's inputs (anchor states are stored even for a wasted step: they are the previous,
     real cycle's, and its redo needs them);
  4. every stage runs its token (a redo rolls back and reseeds first) - optimistically: a stage skips it
     only when the verdict has already arrived and says the step is wasted;
  5. post-step: this step's anchor states -> PDM;  6. the PDM drafts;
  7. the verifier judges and sends the verdict to every other rank;
  8. the stage ranks wait for the verdict the step awaited (at the end of the decode, this step's own).
So a stage rank never waits for verification before it runs its token; when the gamble loses (a rejection
that arrives late), it has run a token that the redo rolls back. The verifier (which made the verdict) and
the PDM skip a step they know is wasted; in the simulator the verdict is always there in time, unless
`replay_wasted_work` makes its stages run wasted steps as distributed ranks do when it comes late.
Skipping or running a wasted step changes no output: its work is never sent on and is rolled back.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np
import torch

from spd_lightning.geometry import Geometry

from .drafter import Drafter
from .result import COMM, COMPUTE, TIMING_FIELDS, VERIFY, WALL, DecodeResult, max_cycles, summarize_timing
from .schedule import PipelineSchedule, Step, Steps, Verdict
from .stages import Stage
from .transport import Transport
from .verify import Sampling, Verifier


def mode_name(geometry: Geometry) -> str:
    if geometry.features == "first_stage":
        return "ppsd"
    return "post_step" if geometry.schedule == "post_step" else "spd"


def role_name(rank: int, n: int) -> str:
    return f"stage {rank + 1}" if rank < n else "PDM"


def stream_seeds(seed: int) -> tuple[int, int]:
    """Independent generator seeds for the verifier and the drafter, so each rank owns its randomness."""
    return 2 * seed, 2 * seed + 1


class PipelineRunner:
    def __init__(self, geometry: Geometry, transport: Transport, stages: dict[int, Stage], drafter: Drafter | None,
                 sampling: Sampling, vocab_size: int, draft_vocab_size: int, d2t: torch.Tensor | None,
                 device: torch.device | str, hidden_size: int, state_dtype: torch.dtype,
                 replay_wasted_work: bool = False, on_step: Callable[[str], None] | None = None):
        self.geometry, self.transport, self.stages, self.drafter = geometry, transport, stages, drafter
        self.n = n = geometry.n
        self.sampling, self.device = sampling, torch.device(device)
        self.drafter_rank, self.verifier_rank = n, n - 1
        for s, stage in stages.items():
            if not transport.hosts(s - 1):
                raise ValueError(f"stage {s} is given to a process that does not host rank {s - 1}")
        if transport.hosts(self.drafter_rank) and drafter is None:
            raise ValueError("this process hosts the PDM rank but got no drafter")
        self.hosted = [r for r in range(n + 1) if transport.hosts(r)]
        self.hosts_verifier = transport.hosts(self.verifier_rank)
        self.replay_wasted_work = replay_wasted_work
        self._arrivals: dict[int, object] = {}  # stage rank -> its posted receive of the awaited verdict
        self._wasted = False  # the current step is wasted, as the verifier and the PDM know before they compute
        self.on_step = on_step  # test-only fault injection (launch.Fault); called with "prefill", "step", "redo"
        self.verifier = (Verifier(sampling, n + 1, vocab_size, d2t, draft_vocab_size, self.device)
                         if n in stages else None)
        self.draft_generator = torch.Generator(device=self.device)
        # Host clocks only see kernel launches on a GPU; wait for the work when it is timed.
        self._sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        self.hidden_size, self.state_dtype = hidden_size, state_dtype
        self.anchor_counts = {s: len([b for b in geometry.anchors_of_stage(s) if b > 0]) for s in range(1, n + 1)}
        # Fixed-shape message buffers, allocated once: "in" receives, "out" is what a rank sends. The
        # verifier's verdict message alternates between two rows, so a row is rewritten only after the
        # sends of it have settled.
        H, dev = hidden_size, self.device
        self.inbox: dict[tuple[int, str], torch.Tensor] = {}
        self.outbox: dict[tuple[int, str], torch.Tensor] = {}
        long = dict(dtype=torch.long, device=dev)
        for r in self.hosted:
            if 0 < r < n:
                self.inbox[r, "act"] = torch.zeros(1, 1, H, dtype=state_dtype, device=dev)
            if r in (0, n - 1):
                self.inbox[r, "draft_token"] = torch.zeros(1, **long)
            if r == n - 1 and not sampling.greedy:
                self.inbox[r, "draft_q"] = torch.zeros(draft_vocab_size, device=dev)
            if r != n - 1:
                self.inbox[r, "verdict"] = torch.zeros(2, **long)
            if r == n:
                for s, count in self.anchor_counts.items():
                    self.inbox[r, f"anchors{s}"] = torch.zeros(1, count, H, dtype=state_dtype, device=dev)
        self.verdict_rows = torch.zeros(2, 2, **long)
        self.seed_input = torch.zeros(1, 1, **long)  # stage 1's input when it runs a seed (first token, correction)
        self._judged: tuple[int, int] | None = None  # the verifier's latest verdict, on the host
        self._awaited: tuple[int, int] | None = None  # the verdict the current step awaits, once this process has it

    # -- messages ---------------------------------------------------------------------------------
    def _send(self, src: int, dst: int, kind: str, tensor: torch.Tensor | None = None) -> None:
        if not self.transport.hosts(src):
            return
        t0 = time.perf_counter()
        self.transport.send(src, dst, self.outbox[src, kind] if tensor is None else tensor, kind)
        self.clock[src, self._cycle, COMM] += time.perf_counter() - t0

    def _recv(self, src: int, dst: int, kind: str, buffer: torch.Tensor | None = None) -> torch.Tensor | None:
        """Receive when this process hosts `dst`; returns the buffer (None elsewhere)."""
        if not self.transport.hosts(dst):
            return None
        buffer = self.inbox[dst, kind] if buffer is None else buffer
        t0 = time.perf_counter()
        self.transport.recv(src, dst, buffer, kind)
        self.clock[dst, self._cycle, COMM] += time.perf_counter() - t0
        return buffer

    def _send_verdict(self, row: torch.Tensor) -> None:
        """The verifier's verdict (or the first token) to every other rank; the verifier keeps it on the host."""
        if self.verifier is None:
            return
        self._judged = tuple(row.tolist())  # the one host sync per verdict
        for r in range(self.n + 1):
            if r != self.verifier_rank:
                self._send(self.verifier_rank, r, "verdict", row)

    def _take_verdict(self, ranks: Sequence[int], known: tuple[int, int] | None) -> tuple[int, int]:
        """The hosted `ranks` receive the verifier's pending verdict; its value (all copies are equal)."""
        for r in ranks:
            if r in self.hosted:
                buffer = self._recv(self.verifier_rank, r, "verdict")
                known = known if known is not None else tuple(buffer.tolist())
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
    def decode(self, prompt_ids: Sequence[int], max_new_tokens: int, eos_token_ids: frozenset[int], seed: int = 0) -> DecodeResult:
        """Decode one prompt; every hosted rank returns the same result (timing rows of remote ranks are zero)."""
        n = self.n
        prompt = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device)
        schedule = PipelineSchedule(self.geometry, max_new_tokens, eos_token_ids)
        self.steps = steps = Steps(schedule)
        # Seconds per (rank, cycle, field), in numpy: bookkeeping must not cost tensor ops on the critical path.
        self.clock = np.zeros((n + 1, max_cycles(n, max_new_tokens) + 1, TIMING_FIELDS))
        self._cycle = 0  # row 0 collects prefill; cycle k uses row k (a wasted step and its redo share it)
        verify_seed, draft_seed = stream_seeds(seed)
        if self.verifier is not None:
            self.verifier.reset(verify_seed)
        self.draft_generator.manual_seed(draft_seed)
        t0 = time.perf_counter()
        if self.drafter is not None:  # room for every position a draft can reach
            self.drafter.start(prompt, prompt.shape[1] + max_new_tokens + n + 1)
        self._prefill(prompt)
        others = [r for r in range(n + 1) if r != self.verifier_rank]
        verdict, token = self._take_verdict(others, self._judged if self.hosts_verifier else None)
        if verdict != Verdict.FIRST:
            raise RuntimeError(f"protocol error: the first message after prefill is {Verdict(verdict).name}, not FIRST")
        step = steps.first(token, prompt.shape[1])
        prefill_s = time.perf_counter() - t0
        t_start = time.perf_counter()
        while step is not None:
            self._cycle = step.plan.cycle
            t_step = time.perf_counter()
            self._run_step(step)
            awaited = self._receive_awaited()
            own = None
            if step.final and not (awaited is not None and steps.wasted(*awaited)):
                own = self._take_verdict(others, self._judged if self.hosts_verifier else None)
            for r in self.hosted:
                self.clock[r, self._cycle, WALL] += time.perf_counter() - t_step
            step = steps.after(step, awaited, own)
        self.transport.flush()
        decode_s = time.perf_counter() - t_start
        return DecodeResult(mode_name(self.geometry), n, prompt.shape[1], list(schedule.tokens), schedule.K,
                            schedule.stop_reason, schedule.counters.to_dict(), prefill_s, decode_s)

    def _receive_awaited(self) -> tuple[int, int] | None:
        """Step 8: the stage ranks wait for the verdict they posted a receive for in step 2; the PDM got it
        in step 2, the verifier made it. None when the step awaited nothing."""
        awaited = self._awaited
        for r, arrival in self._arrivals.items():
            t0 = time.perf_counter()
            arrival.wait()
            self.clock[r, self._cycle, COMM] += time.perf_counter() - t0
            awaited = awaited if awaited is not None else tuple(self.inbox[r, "verdict"].tolist())
        return awaited

    def timing(self, K: int) -> dict:
        """Per-cycle timing of the last prompt from this process's rows (see `result.summarize_timing`)."""
        return summarize_timing(torch.from_numpy(self.clock[:, 1:]), K, self.n)

    def _prefill(self, prompt: torch.Tensor) -> None:
        """The prompt through every stage in order; each stage fills its own cache and sends its anchors;
        the verifier samples the first token and sends it to every rank."""
        if self.on_step is not None:
            self.on_step("prefill")
        n, P = self.n, prompt.shape[1]
        hidden, anchors = None, {}
        for s in range(1, n + 1):
            stage = self.stages.get(s)
            if stage is not None:
                stage.cache.reset()
                t0 = time.perf_counter()
                out = stage(prompt if s == 1 else hidden, 0)
                self._sync()
                self.clock[s - 1, 0, COMPUTE] += time.perf_counter() - t0
                self.outbox[s - 1, "act_prefill"] = out.hidden
                anchors[s] = out.anchors
                if s == n:
                    row = self.verdict_rows[0]
                    row[0], row[1] = Verdict.FIRST, self.verifier.first(out.logits)
            if s < n:  # the prompt length varies, so these two buffers are the only per-prompt allocations
                self._send(s - 1, s, "act_prefill")
                hidden = self._recv(s - 1, s, "act_prefill", self._empty(1, P, self.hidden_size))
        for s, count in self.anchor_counts.items():
            if count:
                self._send(s - 1, n, "anchors_prefill", anchors.get(s))
                states = self._recv(s - 1, n, "anchors_prefill", self._empty(P, count, self.hidden_size))
                if states is not None:
                    self.drafter.store_anchors(s, 0, states)
        self._send_verdict(self.verdict_rows[0])

    def _empty(self, *shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=self.state_dtype, device=self.device)

    def _run_step(self, step: Step) -> None:
        n, plan = self.n, step.plan
        if self.on_step is not None:
            self.on_step("redo" if step.redo else "step")
        self.transport.settle()
        self._awaited = self._judged if step.awaits and self.hosts_verifier else None
        # 1. the previous step's outputs that this step consumes
        if not step.redo:
            if plan.draft_entered:
                self._send(n, 0, "draft_token")
                self._send(n, n - 1, "draft_token")
                if not self.sampling.greedy:
                    self._send(n, n - 1, "draft_q")
            for s in range(1, n):
                if plan.stage_positions[s] >= 0:
                    self._send(s - 1, s, "act")
            if self.geometry.schedule == "pre_step":
                for s, _ in plan.anchors_before:
                    if self.anchor_counts[s]:
                        self._send(s - 1, n, f"anchors{s}")
        # 2. the PDM learns whether this step is wasted; the stage ranks will look when they get there
        self._arrivals.clear()
        if step.awaits:
            self._awaited = self._take_verdict([n], self._awaited)
            for r in range(n - 1):
                if r in self.hosted:
                    self._arrivals[r] = self.transport.post(self.verifier_rank, r, self.inbox[r, "verdict"], "verdict")
        self._wasted = self._awaited is not None and self.steps.wasted(*self._awaited)  # known to verifier and PDM
        # 3. inputs
        if not step.redo:
            if plan.draft_entered:
                self._recv(n, 0, "draft_token")
                token = self._recv(n, n - 1, "draft_token")
                q = None if self.sampling.greedy else self._recv(n, n - 1, "draft_q")
                if self.verifier is not None and not self._wasted:
                    self.verifier.remember(plan.stage_positions[0], token, q)
            for s in range(1, n):
                if plan.stage_positions[s] >= 0:
                    self._recv(s - 1, s, "act")
            if self.geometry.schedule == "pre_step":
                for s, position in plan.anchors_before:
                    recv = self._recv(s - 1, n, f"anchors{s}") if self.anchor_counts[s] else None
                    if recv is not None:
                        self.drafter.store_anchors(s, position, recv)
        # 4. compute
        logits = self._compute(plan)
        # 5.-6. the draft (after this step's anchors when post-step)
        if self.geometry.schedule == "post_step":
            self._send_anchors(plan.anchors_during, store=not self._wasted)
        if self.drafter is not None and not self._wasted:
            t0 = time.perf_counter()
            token, q = self.drafter.draft(plan.draft_view, self.draft_generator)
            self.outbox[n, "draft_token"] = token
            if q is not None:
                self.outbox[n, "draft_q"] = q
            self._sync()
            self.clock[n, plan.cycle, COMPUTE] += time.perf_counter() - t0
        # 7. verification
        if self.verifier is not None and plan.judged_position >= 0 and not self._wasted:
            t0 = time.perf_counter()
            row = self.verdict_rows[plan.cycle % 2]
            self.verifier.judge(plan.judged_position, logits, row)
            self.clock[n - 1, plan.cycle, VERIFY] += time.perf_counter() - t0
            self._send_verdict(row)

    def _known_wasted(self, rank: int) -> bool:
        """Whether `rank` knows now that this step is wasted (a stage rank: once its verdict is in)."""
        if rank >= self.verifier_rank:
            return self._wasted
        arrival = self._arrivals.get(rank)
        if arrival is None or self.replay_wasted_work or not arrival.ready():
            return False
        return self.steps.wasted(*self.inbox[rank, "verdict"].tolist())

    def _compute(self, plan) -> torch.Tensor | None:
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
            t0 = time.perf_counter()
            out = stage(x, position)
            self._sync()
            self.clock[s - 1, plan.cycle, COMPUTE] += time.perf_counter() - t0
            self.outbox[s - 1, "act"] = out.hidden
            self.outbox[s - 1, f"anchors{s}"] = out.anchors
            logits = out.logits if s == n else logits
        return logits
