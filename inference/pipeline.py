"""The pipeline runner: one scheduler, any transport (SPEC 5.1, 5.3).

Ranks `0..n-1` are the stages (stage `s` on rank `s-1`; the last one also verifies), rank `n` the PDM.
`PipelineRunner` hosts the roles of whichever ranks live in its process: all of them in the simulator
(`LocalTransport`), exactly one in a distributed rank (`DistributedTransport`). Every process runs the
same code below: the same `PipelineSchedule`, the same message sequence, the same compute calls, with
the work of ranks it does not host skipped. So the simulator and the distributed decoder produce the
same tokens, N, K and counters by construction.

One cycle (each numbered group is one step of the global message order):
  1. control broadcast from the verifier -> every rank applies it to its schedule -> `CyclePlan`
     (rollback and reseed are applied locally: stages crop/restore caches, the PDM embeds the seed);
  2. inputs: the previous cycle's draft (PDM -> stage 1, and -> verifier with `q`), the activations
     (stage s -> s+1), and for pre-step the anchor states produced last cycle (stage -> PDM);
  3. compute: every stage runs its token; pre-step: the PDM drafts concurrently;
  4. post-step only: this cycle's anchor states (stage -> PDM), then the PDM drafts;
  5. the verifier judges the token after the one that completed stage n -> next control.
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np
import torch

from spd_lightning.geometry import Geometry

from .drafter import Drafter
from .result import COMM, COMPUTE, TIMING_FIELDS, VERIFY, WALL, DecodeResult, max_cycles, summarize_timing
from .schedule import PipelineSchedule, Verdict
from .stages import Stage
from .transport import Transport
from .verify import Sampling, Verifier


def mode_name(geometry: Geometry) -> str:
    if geometry.features == "first_stage":
        return "ppsd"
    return "post_step" if geometry.schedule == "post_step" else "spd"


def stream_seeds(seed: int) -> tuple[int, int]:
    """Independent generator seeds for the verifier and the drafter, so each rank owns its randomness."""
    return 2 * seed, 2 * seed + 1


class PipelineRunner:
    def __init__(self, geometry: Geometry, transport: Transport, stages: dict[int, Stage], drafter: Drafter | None,
                 sampling: Sampling, vocab_size: int, draft_vocab_size: int, d2t: torch.Tensor | None,
                 device: torch.device | str, hidden_size: int, state_dtype: torch.dtype):
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
        self.control = torch.zeros(2, dtype=torch.long, device=self.device)
        self.verifier = (Verifier(sampling, n + 1, vocab_size, d2t, draft_vocab_size, self.device)
                         if n in stages else None)
        self.draft_generator = torch.Generator(device=self.device)
        # Host clocks only see kernel launches on a GPU; wait for the work when it is timed.
        self._sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        self.hidden_size, self.state_dtype = hidden_size, state_dtype
        self.anchor_counts = {s: len([b for b in geometry.anchors_of_stage(s) if b > 0]) for s in range(1, n + 1)}
        # Fixed-shape message buffers, allocated once: "in" receives, "out" is what a rank sends.
        H, dev = hidden_size, self.device
        self.inbox: dict[tuple[int, str], torch.Tensor] = {}
        self.outbox: dict[tuple[int, str], torch.Tensor] = {}
        for r in self.hosted:
            if r < n and r > 0:
                self.inbox[r, "act"] = torch.zeros(1, 1, H, dtype=state_dtype, device=dev)
            if r in (0, n - 1):
                self.inbox[r, "draft_token"] = torch.zeros(1, dtype=torch.long, device=dev)
            if r == n - 1 and not sampling.greedy:
                self.inbox[r, "draft_q"] = torch.zeros(draft_vocab_size, device=dev)
            if r == n:
                for s, count in self.anchor_counts.items():
                    self.inbox[r, f"anchors{s}"] = torch.zeros(1, count, H, dtype=state_dtype, device=dev)
                self.outbox[r, "draft_token"] = torch.zeros(1, dtype=torch.long, device=dev)
                self.outbox[r, "draft_q"] = torch.zeros(draft_vocab_size, device=dev)

    # -- messages ---------------------------------------------------------------------------------
    def _transfer(self, src: int, dst: int, name: str, recv: torch.Tensor | None = None) -> torch.Tensor | None:
        """One message of the global order; returns the receiver's buffer when this process hosts it."""
        hosts_src, hosts_dst = self.transport.hosts(src), self.transport.hosts(dst)
        if not (hosts_src or hosts_dst):
            return None
        if hosts_dst and recv is None:
            recv = self.inbox[dst, name]
        t0 = time.perf_counter()
        self.transport.transfer(src, dst, self.outbox[src, name] if hosts_src else None, recv if hosts_dst else None)
        self.clock[src if hosts_src else dst, self._cycle, COMM] += time.perf_counter() - t0
        return recv

    def _broadcast_control(self) -> tuple[int, int]:
        t0 = time.perf_counter()
        self.transport.broadcast(self.control, self.verifier_rank)
        verdict, token = self.control.tolist()  # one host sync per cycle
        for r in self.hosted:
            self.clock[r, self._cycle, COMM] += time.perf_counter() - t0
        return verdict, token

    def _send_anchors(self, pairs: Sequence[tuple[int, int]]) -> None:
        for s, position in pairs:
            if self.anchor_counts[s] == 0:
                continue
            recv = self._transfer(s - 1, self.drafter_rank, f"anchors{s}")
            if recv is not None:
                self.drafter.store_anchors(s, position, recv)

    # -- one prompt -------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, prompt_ids: Sequence[int], max_new_tokens: int, eos_token_ids: frozenset[int], seed: int = 0) -> DecodeResult:
        """Decode one prompt; every hosted rank returns the same result (timing rows of remote ranks are zero)."""
        n = self.n
        prompt = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device)
        schedule = PipelineSchedule(self.geometry, max_new_tokens, eos_token_ids)
        # Seconds per (rank, cycle, field), in numpy: bookkeeping must not cost tensor ops on the critical path.
        self.clock = np.zeros((n + 1, max_cycles(n, max_new_tokens) + 1, TIMING_FIELDS))
        self._cycle = 0  # row 0 collects prefill; cycle k uses row k
        verify_seed, draft_seed = stream_seeds(seed)
        if self.verifier is not None:
            self.verifier.reset(verify_seed)
        self.draft_generator.manual_seed(draft_seed)
        t0 = time.perf_counter()
        if self.drafter is not None:  # room for every position a draft can reach
            self.drafter.start(prompt, prompt.shape[1] + max_new_tokens + n + 1)
        self._prefill(prompt)
        verdict, token = self._broadcast_control()
        prefill_s = time.perf_counter() - t0
        plan = schedule.begin(verdict, token, prompt_len=prompt.shape[1])
        t_start = time.perf_counter()
        while plan is not None:
            self._cycle = plan.cycle
            t_cycle = time.perf_counter()
            self._run_cycle(plan)
            verdict, token = self._broadcast_control()
            for r in self.hosted:
                self.clock[r, self._cycle, WALL] = time.perf_counter() - t_cycle
            plan = schedule.begin(verdict, token)
        decode_s = time.perf_counter() - t_start
        return DecodeResult(mode_name(self.geometry), n, prompt.shape[1], list(schedule.tokens), schedule.K,
                            schedule.stop_reason, schedule.counters.to_dict(), prefill_s, decode_s)

    def timing(self, K: int) -> dict:
        """Per-cycle timing of the last prompt from this process's rows (see `result.summarize_timing`)."""
        return summarize_timing(torch.from_numpy(self.clock[:, 1:]), K, self.n)

    def _prefill(self, prompt: torch.Tensor) -> None:
        """The prompt through every stage in order; each stage fills its own cache and sends its anchors."""
        n, P = self.n, prompt.shape[1]
        hidden = None
        for s in range(1, n + 1):
            stage = self.stages.get(s)
            if stage is not None:
                stage.cache.reset()
                t0 = time.perf_counter()
                out = stage(prompt if s == 1 else hidden, 0)
                self._sync()
                self.clock[s - 1, 0, COMPUTE] += time.perf_counter() - t0
                self.outbox[s - 1, "act_prefill"] = out.hidden
                self.outbox[s - 1, f"anchors{s}"] = out.anchors
                if s == n:
                    self.control[0], self.control[1] = Verdict.FIRST, self.verifier.first(out.logits)
            if s < n:  # the prompt length varies, so these two buffers are the only per-prompt allocations
                recv = self._empty(1, P, self.hidden_size) if self.transport.hosts(s) else None
                hidden = self._transfer(s - 1, s, "act_prefill", recv)
        for s, count in self.anchor_counts.items():
            if count:
                recv = self._empty(P, count, self.hidden_size) if self.transport.hosts(n) else None
                states = self._transfer(s - 1, n, f"anchors{s}", recv)
                if states is not None:
                    self.drafter.store_anchors(s, 0, states)

    def _empty(self, *shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=self.state_dtype, device=self.device)

    def _run_cycle(self, plan) -> None:
        n, c = self.n, plan.cycle
        # 1. the previous verdict's local effects
        if plan.rollback_to >= 0:
            for stage in self.stages.values():
                stage.cache.rollback(plan.rollback_to)
        if self.drafter is not None and plan.seed_token >= 0:
            self.drafter.set_token(plan.stage_positions[0], plan.seed_token)
        # 2. inputs
        if plan.draft_entered:
            self._transfer(n, 0, "draft_token")
            token = self._transfer(n, n - 1, "draft_token")
            q = None if self.sampling.greedy else self._transfer(n, n - 1, "draft_q")
            if self.verifier is not None:
                self.verifier.remember(plan.stage_positions[0], token, q)
        for s in range(n - 1, 0, -1):
            if plan.stage_positions[s] >= 0:
                self._transfer(s - 1, s, "act")
        if self.geometry.schedule == "pre_step":
            self._send_anchors(plan.anchors_before)
        # 3. compute
        logits = None
        for s, stage in self.stages.items():
            position = plan.stage_positions[s - 1]
            if position < 0:
                continue
            if s == 1:
                x = (torch.tensor([[plan.seed_token]], device=self.device) if plan.seed_token >= 0
                     else self.inbox[0, "draft_token"].view(1, 1))
            else:
                x = self.inbox[s - 1, "act"]
            t0 = time.perf_counter()
            out = stage(x, position)
            self._sync()
            self.clock[s - 1, c, COMPUTE] += time.perf_counter() - t0
            self.outbox[s - 1, "act"] = out.hidden
            self.outbox[s - 1, f"anchors{s}"] = out.anchors
            logits = out.logits if s == n else logits
        # 4. the draft (after this cycle's anchors when post-step)
        if self.geometry.schedule == "post_step":
            self._send_anchors(plan.anchors_during)
        if self.drafter is not None:
            t0 = time.perf_counter()
            token, q = self.drafter.draft(plan.draft_view, self.draft_generator)
            self.outbox[n, "draft_token"].copy_(token)
            if q is not None:
                self.outbox[n, "draft_q"].copy_(q)
            self._sync()
            self.clock[n, c, COMPUTE] += time.perf_counter() - t0
        # 5. verification
        if self.verifier is not None:
            t0 = time.perf_counter()
            if plan.judged_position >= 0:
                judgement = self.verifier.judge(plan.judged_position, logits)
                self.control[0] = Verdict.ACCEPT if judgement.accepted else Verdict.REJECT
                self.control[1] = judgement.token
            else:
                self.control[0], self.control[1] = Verdict.NONE, -1
            self.clock[n - 1, c, VERIFY] += time.perf_counter() - t0
