"""Batched pipeline decoding in one process (issue 26): up to B sequences share every stage forward and the draft.

`BatchSimulator` holds B slots. Each live slot is a `SlotSequence` (slots.py): the batch-1 runner's schedule,
optimistic steps, verifier and generators for its one sequence. One cycle (`step`) runs, over all slots at once:

  1. per slot: apply its plan's rollback and seed (a rejection rolls back that slot's caches only);
  2. pre-step: the PDM drafts for every running slot in one forward, from the states before the cycle;
  3. every stage runs ONE forward over every slot that has a token at it (stage n first: a stage reads what
     the stage before it produced in the previous cycle, so running them in reverse needs one buffer each);
  4. post-step: the draft, from the states the cycle produced;
  5. per slot: the verifier judges its draft; all verdicts reach the host in one read.

A slot whose step is wasted (its awaited verdict rejected, or ended it) idles in that cycle, as the batch-1
simulator's ranks skip a step they know is wasted, and redoes the cycle in the next. A request joins a free slot
between cycles (`join`: its prefill is a step of its own, one slot's forward through every stage) and leaves it
when it ends: EOS, `max_new_tokens`, or a STOP verdict after its `stop()` said so. The other slots' tokens
never depend on who joins or leaves: every row of a forward is its own slot's computation.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import torch

from inference.cycle.result import DecodeResult
from inference.cycle.schedule import CyclePlan, VerdictMessage
from inference.cycle.slots import Request, SlotSequence
from inference.cycle.verify import Verifier
from inference.runtime.slot_drafter import SlotDrafter
from inference.runtime.slot_stage import SlotStage
from inference.runtime.stages import Stage
from spd_lightning.geometry import Geometry
from spd_lightning.pdm import PipelineDraftModule
from spd_lightning.target import Target


class BatchSimulator:
    def __init__(
        self,
        target: Target,
        pdm: PipelineDraftModule,
        geometry: Geometry,
        max_batch: int,
        replay_wasted_work: bool = False,
    ):
        """`replay_wasted_work`: the stages before the last also run each slot's wasted steps, as distributed
        stage ranks do when the verdict comes late (`Simulator`'s flag), and the redo rolls them back."""
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be >= 1")
        geometry.check_target(target.num_layers)
        self.geometry, self.n, self.max_batch = geometry, geometry.n, max_batch
        self.stages = {
            s: SlotStage(Stage.from_target(target, geometry, s), max_batch) for s in range(1, geometry.n + 1)
        }
        first = self.stages[1].stage
        self.device, self.vocab_size = first.device, target.vocab_size
        self.pdm = pdm
        self.drafter = SlotDrafter(pdm, geometry, target.embed_tokens, first.dtype, max_batch)
        self.slots: list[SlotSequence | None] = [None] * max_batch
        self.stage1_ids = torch.zeros(max_batch, 1, dtype=torch.long, device=self.device)
        self.hidden: dict[int, torch.Tensor] = {}  # stage -> its output of the last cycle, [B, 1, H]
        self.verdict_rows = torch.zeros(max_batch, 2, dtype=torch.long, device=self.device)
        self.replay_wasted_work = replay_wasted_work
        self.cycles = 0
        self._finished: list[tuple[int, DecodeResult]] = []

    @property
    def free_slots(self) -> list[int]:
        return [b for b, seq in enumerate(self.slots) if seq is None]

    @property
    def busy(self) -> bool:
        return any(seq is not None for seq in self.slots)

    # -- joining ----------------------------------------------------------------------------------
    @torch.no_grad()
    def join(self, request: Request) -> int:
        """`request` takes a free slot: the slot's prefill through every stage and its first token. Returns the
        slot; a request that ends with its first token is finished at once (the next `step` reports it)."""
        if not self.free_slots:
            raise RuntimeError(f"all {self.max_batch} slots are busy: a request joins when one is free")
        b = self.free_slots[0]
        verifier = Verifier(
            request.sampling, self.n + 1, self.vocab_size, self.pdm.d2t, self.pdm.cfg.draft_vocab_size, self.device
        )
        seq = SlotSequence(request, self.geometry, verifier, self.device)
        prompt = torch.tensor([list(request.prompt_ids)], dtype=torch.long, device=self.device)
        self.drafter.start(b, prompt, seq.capacity)
        x, logits = prompt, None
        for s, stage in self.stages.items():
            x, anchors, logits = stage.prefill(b, x, seq.capacity)
            if anchors.shape[1]:
                self.drafter.store_anchors(b, s, 0, anchors)
        seq.first(verifier.first(logits))
        self.slots[b] = seq  # kept until the next `step` even when it already ended: the slot reports it then
        return b

    # -- one cycle --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[tuple[int, DecodeResult]]:
        """One cycle over every live slot; returns (slot, result) of the sequences that ended since the last call."""
        for b in range(self.max_batch):
            self._retire(b)
        live = {b: seq for b, seq in enumerate(self.slots) if seq is not None}
        real = {b: seq.begin() for b, seq in live.items()}  # False: the slot's step is wasted
        running = {b: live[b].step.plan for b, ran in real.items() if ran}
        replayed = {b: live[b].step.plan for b, ran in real.items() if not ran and self.replay_wasted_work}
        if running or replayed:
            self.cycles += 1
            self._prepare(running, replayed)
            pre_step = self.geometry.schedule == "pre_step"
            if pre_step:
                self._draft(running)
            logits = self._stages(running, replayed)
            if not pre_step:
                self._draft(running)
            self._verify(running, logits)
        for b, seq in live.items():
            seq.advance(real[b])
            self._retire(b)
        finished, self._finished = self._finished, []
        return finished

    def _prepare(self, running: dict[int, CyclePlan], replayed: dict[int, CyclePlan]) -> None:
        """Per slot: its rollback, then stage 1's input (a seed, or the draft made last cycle, which the verifier
        keeps until it judges it, unless the step is wasted)."""
        for b, plan in {**running, **replayed}.items():
            seq = self.slots[b]
            if plan.rollback_to >= 0:
                for stage in self.stages.values():
                    stage.cache.rollback(b, plan.rollback_to)
            position = plan.stage_positions[0]
            if plan.seed_token >= 0:
                self.stage1_ids[b, 0] = plan.seed_token
                self.drafter.set_token(b, position, plan.seed_token)
            elif plan.draft_entered:
                token, q = seq.draft
                self.stage1_ids[b].copy_(token)
                if b in running:
                    seq.verifier.remember(position, token, q)
            seq.draft = None

    def _stages(self, running: dict[int, CyclePlan], replayed: dict[int, CyclePlan]) -> torch.Tensor | None:
        """Every stage's one forward over the slots that have a token at it; the last stage's logits `[B, V]`. A
        replayed (wasted) step runs on the stages before the last, which learn too late that it is wasted; its
        outputs reach neither the PDM nor the verifier."""
        logits = None
        for s in range(self.n, 0, -1):
            plans = running if s == self.n else {**running, **replayed}
            tokens = {b: plan.stage_positions[s - 1] for b, plan in plans.items() if plan.stage_positions[s - 1] >= 0}
            if not tokens:
                continue
            out = self.stages[s].step(self.stage1_ids if s == 1 else self.hidden[s - 1], tokens)
            self.hidden[s] = out.hidden
            if out.anchors.shape[1]:
                for b, position in tokens.items():
                    if b in running:
                        self.drafter.store_anchors(b, s, position, out.anchors[b : b + 1])
            if s == self.n:
                logits = out.logits
        return logits

    def _draft(self, running: dict[int, CyclePlan]) -> None:
        if not running:  # only replayed (wasted) steps this cycle: nothing to draft for
            return
        views = {b: plan.draft_view for b, plan in running.items()}
        seqs = {b: self.slots[b] for b in running}
        drafts = self.drafter.draft(
            views,
            {b: seq.request.sampling for b, seq in seqs.items()},
            {b: seq.draft_generator for b, seq in seqs.items()},
        )
        for b, draft in drafts.items():
            seqs[b].draft = draft

    def _verify(self, running: dict[int, CyclePlan], logits: torch.Tensor | None) -> None:
        """Each judged slot's verdict into its device row; one host read brings them all."""
        judged = [b for b, plan in running.items() if plan.judged_position >= 0]
        for b in judged:
            self.slots[b].judge(logits[b], self.verdict_rows[b])
        if judged:
            rows = self.verdict_rows.tolist()  # the cycle's one device-to-host read
            for b in judged:
                self.slots[b].judged = VerdictMessage(*rows[b])

    def _retire(self, b: int) -> None:
        seq = self.slots[b]
        if seq is not None and seq.step is None:
            self._finished.append((b, seq.result()))
            self.slots[b] = None

    # -- a whole workload -------------------------------------------------------------------------
    def run(self, requests: Iterable[Request]) -> list[DecodeResult]:
        """Decode every request, each joining the first free slot between cycles (a FIFO); results in order."""
        queue = deque(enumerate(requests))
        results: dict[int, DecodeResult] = {}
        owner: dict[int, int] = {}
        while queue or self.busy:
            while queue and self.free_slots:
                index, request = queue.popleft()
                owner[self.join(request)] = index
            for b, result in self.step():
                results[owner.pop(b)] = result
        return [results[i] for i in sorted(results)]
