"""Batched pipeline decoding in one process (issue 26): up to B sequences share every stage forward and the draft.

`BatchSimulator` is the `BatchRunner` (batch_runner.py) with every rank in this process (`LocalTransport`), as
`Simulator` is the `PipelineRunner`: the same per-slot scheduling and the same messages as the distributed ranks,
so it checks their protocol too. One cycle (`step`), over all slots at once:

  1. per slot: apply its plan's rollback and seed (a rejection rolls back that slot's caches only);
  2. every stage runs ONE forward over every slot that has a token at it, on what the stage before it produced
     in the previous cycle;
  3. the PDM drafts for every running slot in one forward (pre-step from the states before the cycle, post-step
     from those the cycle produced);
  4. per slot: the verifier judges its draft; all verdicts reach the host in one read.

A slot whose step is wasted (its awaited verdict rejected, or ended it) idles in that cycle, as the batch-1
simulator's ranks skip a step they know is wasted, and redoes the cycle in the next. A request joins a free slot
between cycles (`join`: its prefill is a step of its own, one slot's forward through every stage) and leaves it
when it ends: EOS, `max_new_tokens`, or a STOP verdict after its `stop()` said so. The other slots' tokens
never depend on who joins or leaves: every row of a forward is its own slot's computation.
"""

from __future__ import annotations

from inference.cycle.batch_runner import BatchRunner
from inference.cycle.nccl_rules import checked
from inference.cycle.pipeline import RunnerConfig
from inference.cycle.transport import LocalTransport
from inference.runtime.slot_drafter import SlotDrafter
from inference.runtime.slot_stage import SlotStage
from inference.runtime.stages import Stage
from inference.sampling import Sampling
from spd_lightning.geometry import Geometry
from spd_lightning.pdm import PipelineDraftModule
from spd_lightning.target import Target


class BatchSimulator(BatchRunner):
    def __init__(
        self,
        target: Target,
        pdm: PipelineDraftModule,
        geometry: Geometry,
        max_batch: int,
        replay_wasted_work: bool = False,
        compile: bool = False,
    ):
        """`replay_wasted_work`: the stages before the last also run each slot's wasted steps, as distributed
        stage ranks do when the verdict comes late (`Simulator`'s flag), and the redo rolls them back.
        `compile`: the stage steps and the PDM's draft step through `torch.compile`, one graph per batch bucket."""
        geometry.check_target(target.num_layers)
        stages = {
            s: SlotStage(Stage.from_target(target, geometry, s), max_batch, compile) for s in range(1, geometry.n + 1)
        }
        first = stages[1].stage
        drafter = SlotDrafter(pdm, geometry, target.embed_tokens, first.dtype, max_batch, compile)
        config = RunnerConfig(
            Sampling(),  # unused: each request brings its own
            target.vocab_size,
            pdm.cfg.draft_vocab_size,
            target.hidden_size,
            first.dtype,
            first.device,
            pdm.d2t,
            replay_wasted_work=replay_wasted_work,
        )
        super().__init__(geometry, checked(LocalTransport(geometry.n + 1)), stages, drafter, config, max_batch)
