"""The one-process simulator: every rank's role in this process, the stages run in sequence.

It runs the same `PipelineRunner` as the distributed decoder over a `LocalTransport`, so its tokens, N,
K and counters are the distributed decoder's. It takes an in-memory target and PDM, which is what the
staircase-evaluation callback and the benchmarks need:

    result = simulate_decode(target, pdm, geometry, prompt_ids, max_new_tokens=128)
    result.alpha, result.theoretical_speedup, result.counters
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from inference.cycle.nccl_rules import checked
from inference.cycle.pipeline import PipelineRunner, RunnerConfig
from inference.cycle.result import DecodeResult
from inference.cycle.schedule import eos_set
from inference.cycle.transport import LocalTransport
from inference.runtime.drafter import Drafter, PDMDrafter, ReplayDrafter
from inference.runtime.stages import Stage
from inference.sampling import Sampling
from spd_lightning.geometry import Geometry
from spd_lightning.pdm import PipelineDraftModule
from spd_lightning.target import Target


class Simulator:
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
    ):
        """`replay_wasted_work`: the stages also run the optimistic steps that a rejection wastes, as the
        distributed stage ranks do (they learn of it only afterwards), instead of skipping them.
        `profile`: per-cycle timing in each result's `timing` (empty otherwise).
        `compile`: the one-token stage steps and the PDM draft through `torch.compile` (prefill stays eager)."""
        geometry.check_target(target.num_layers)
        self.geometry, self.sampling = geometry, sampling
        stages = {s: Stage.from_target(target, geometry, s) for s in range(1, geometry.n + 1)}
        device = stages[1].device
        for stage in stages.values():
            stage.use_compiled_decode(compile)
        if isinstance(drafter, PipelineDraftModule):
            d2t, draft_vocab = drafter.d2t, drafter.cfg.draft_vocab_size
            drafter = PDMDrafter(drafter, geometry, target.embed_tokens, sampling, stages[1].dtype, compile=compile)
        else:
            if isinstance(drafter, ReplayDrafter) and not sampling.greedy:
                raise ValueError("a replay drafter has no draft distribution: use it with greedy decoding only")
            d2t, draft_vocab = None, 1
        config = RunnerConfig(
            sampling,
            target.vocab_size,
            draft_vocab,
            target.hidden_size,
            stages[1].dtype,
            device,
            d2t,
            replay_wasted_work=replay_wasted_work,
            profile=profile,
        )
        self.runner = PipelineRunner(geometry, checked(LocalTransport(geometry.n + 1)), stages, drafter, config)

    def decode(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        eos_token_id: int | Sequence[int] | None = None,
        seed: int = 0,
        on_tokens: Callable[[list[int]], None] | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> DecodeResult:
        """Decode one prompt; `eos_token_id=None` never stops early (see `ar.target_eos` for the target's).
        `on_tokens`, `stop` (a clean cancellation): see `PipelineRunner.decode`."""
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        result = self.runner.decode(prompt_ids, max_new_tokens, eos_set(eos_token_id), seed, on_tokens, stop)
        result.timing = self.runner.timing(result.K)
        return result


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
