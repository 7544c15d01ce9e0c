"""What one rank process of the distributed decoder loads and runs: its role's weights and its runner.

A stage rank loads only its layer range (plus the embedding or the head at the ends), the PDM rank the
drafter and the target's embedding table; with the shared PDM placement process 0 loads both stage 1 and
the PDM (`shared_transport`). The weights are loaded once (`load_role`); `build_runner` puts the runner of the
rank's roles over them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference.cycle.nccl_rules import checked
from inference.cycle.pipeline import PipelineRunner, RunnerConfig, role_name
from inference.cycle.shared_transport import SharedTransport
from inference.cycle.transport import DistributedTransport
from inference.processes.faults import step_hook
from inference.processes.job import DecodeJob
from inference.runtime.drafter import PDMDrafter
from inference.runtime.replay import ReplayDrafter
from inference.runtime.shared_stream import SideStreamDrafter, draft_stream
from inference.runtime.stages import Stage, load_pieces
from spd_lightning.export import load_drafter, read_drafter_spec
from spd_lightning.target import resolve_dtype


@dataclass
class Loaded:
    """The weights of one rank's role, loaded once: its stage, or the PDM and the target's embedding."""

    stages: dict[int, Stage]
    pdm: torch.nn.Module | None = None
    embed: torch.nn.Module | None = None


def load_role(job: DecodeJob, rank: int, device: torch.device) -> Loaded:
    """What process `rank` loads: its stage, or the PDM's pieces, or both for process 0 of a shared placement."""
    geometry, dtype = job.geometry, resolve_dtype(job.dtype)
    stages = {}
    if rank < geometry.n:
        stages[rank + 1] = Stage.load(
            job.target_path, geometry, rank + 1, dtype, device, job.trust_remote_code, job.max_batch, job.compile
        )
    hosts_pdm = rank == geometry.n or (rank == 0 and job.pdm_placement == "shared")
    if not hosts_pdm or job.replay is not None:
        return Loaded(stages)
    head = read_drafter_spec(job.drafter_path)[0].pdm.head_from_target  # the drafter's head is the target's rows
    pieces = load_pieces(
        job.target_path,
        range(0),
        embed=True,
        head=head,
        dtype=dtype,
        device=device,
        trust_remote_code=job.trust_remote_code,
    )
    target_head = pieces.lm_head.weight if head else None
    pdm, _ = load_drafter(job.drafter_path, map_location=device, target_head=target_head)
    return Loaded(stages, pdm.to(dtype), pieces.embed_tokens)


def build_runner(job: DecodeJob, rank: int, device: torch.device) -> PipelineRunner:
    """The roles of `rank` over `job.max_batch` slots: a stage (the last one also verifies) or the drafter (a PDM,
    or a replay drafter), over the weights `load_role` loads."""
    geometry = job.geometry
    n, dtype, B = geometry.n, resolve_dtype(job.dtype), job.max_batch
    if job.replay is not None:
        if not job.sampling.greedy:
            raise ValueError("a replay drafter has no draft distribution: use it with greedy decoding only")
        d2t, draft_vocab = None, 1
    else:
        spec, d2t = read_drafter_spec(job.drafter_path)
        d2t, draft_vocab = d2t.to(device), spec.pdm.draft_vocab_size
    loaded = load_role(job, rank, device)
    drafter = None
    shared = job.pdm_placement == "shared"
    if rank == n or (shared and rank == 0):
        drafter = (
            ReplayDrafter(job.replay.references, job.replay.policy, job.vocab_size)
            if job.replay is not None
            else PDMDrafter(loaded.pdm, geometry, loaded.embed, dtype, B, compile=job.compile, capture=not shared)
        )
        if shared:  # beside stage 1's forward on their one GPU (`shared_stream`): so not in its CUDA graph pool
            drafter = SideStreamDrafter(drafter, draft_stream(device))
    config = RunnerConfig(
        job.vocab_size,
        draft_vocab,
        job.hidden_size,
        dtype,
        device,
        d2t,
        on_step=step_hook(job.fault, rank),
        profile=job.profile,
    )
    names = [role_name(r, n) for r in range(n + 1)]
    transport = SharedTransport(n, names) if shared else DistributedTransport(names)
    return PipelineRunner(geometry, checked(transport, device), loaded.stages, drafter, config, B)
