"""The one-process simulator: every rank's role in this process, the stages run in sequence.

`Simulator` is the `PipelineRunner` (pipeline.py) with every rank in this process (`LocalTransport`): the same
per-slot scheduling and the same messages as the distributed ranks, so its tokens, N, K and counters are the
distributed decoder's, and it checks their protocol too. It takes an in-memory target and PDM (or a
`ReplayDrafter`), which is what the staircase-evaluation callback and the benchmarks need:

    result = simulate_decode(target, pdm, geometry, prompt_ids, max_new_tokens=128)
    result.alpha, result.theoretical_speedup, result.counters

Up to `max_batch` sequences share every stage forward and the draft (`run`, `join`, `step`; docs/DESIGN.md, "One
cycle over B slots").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from inference.cycle.nccl_rules import checked
from inference.cycle.pipeline import PipelineRunner, RunnerConfig
from inference.cycle.result import DecodeResult
from inference.cycle.schedule import eos_set
from inference.cycle.slots import Request
from inference.cycle.transport import LocalTransport
from inference.runtime.drafter import Drafter, PDMDrafter
from inference.runtime.stages import Stage
from inference.sampling import Sampling
from spd_lightning.geometry import Geometry
from spd_lightning.pdm import PipelineDraftModule
from spd_lightning.target import Target


class Simulator(PipelineRunner):
    """Stages, drafter and verifier of one pipeline, built once and reused across prompts."""

    def __init__(
        self,
        target: Target,
        drafter: PipelineDraftModule | Drafter,
        geometry: Geometry,
        sampling: Sampling = Sampling(),
        replay_wasted_work: bool = False,
        profile: bool = False,
        compile: bool = False,
        max_batch: int = 1,
    ):
        """`sampling`: what `decode` samples with unless told otherwise (a request of `run` brings its own).
        `replay_wasted_work`: the stages before the last also run each slot's wasted steps, as distributed stage
        ranks do when the verdict comes late, and the redo rolls them back. `profile`: per-cycle timing in each
        result's `timing` (empty otherwise). `compile`: the one-token stage steps and the PDM's draft step
        through `torch.compile`, one graph per batch bucket (prefill stays eager)."""
        stages = {s: Stage.from_target(target, geometry, s, max_batch, compile) for s in range(1, geometry.n + 1)}
        first = stages[1]
        d2t, draft_vocab = None, 1  # a replay drafter's (greedy only: it refuses a sampled request itself)
        if isinstance(drafter, PipelineDraftModule):
            d2t, draft_vocab = drafter.d2t, drafter.cfg.draft_vocab_size
            drafter = PDMDrafter(drafter, geometry, target.embed_tokens, first.dtype, max_batch, compile)
        self.sampling = sampling
        config = RunnerConfig(
            target.vocab_size,
            draft_vocab,
            target.hidden_size,
            first.dtype,
            first.device,
            d2t,
            replay_wasted_work=replay_wasted_work,
            profile=profile,
        )
        super().__init__(geometry, checked(LocalTransport(geometry.n + 1)), stages, drafter, config, max_batch)

    def decode(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        eos_token_id: int | Sequence[int] | None = None,
        seed: int = 0,
        on_tokens: Callable[[list[int]], None] | None = None,
        stop: Callable[[], bool] | None = None,
        sampling: Sampling | None = None,
    ) -> DecodeResult:
        """Decode one prompt; `eos_token_id=None` never stops early (see `ar.target_eos` for the target's).
        `on_tokens` and `stop` as in `Request`: an exception `on_tokens` raises ends the decode, leaving this
        simulator's messages half-delivered (it must then be rebuilt); `stop()` cancels cleanly instead (stop reason
        "cancelled"; `stop_seen` the cycle it first said so)."""
        request = Request(
            prompt_ids, max_new_tokens, eos_set(eos_token_id), sampling or self.sampling, seed, on_tokens, stop
        )
        return self.run_one(request)


@torch.no_grad()
def simulate_decode(
    target: Target,
    drafter: PipelineDraftModule | Drafter,
    geometry: Geometry,
    prompt_ids: Sequence[int],
    max_new_tokens: int = 64,
    sampling: Sampling = Sampling(),
    eos_token_id: int | Sequence[int] | None = None,
    seed: int = 0,
    profile: bool = False,
) -> DecodeResult:
    simulator = Simulator(target, drafter, geometry, sampling, profile=profile)
    return simulator.decode(prompt_ids, max_new_tokens, eos_token_id, seed)
