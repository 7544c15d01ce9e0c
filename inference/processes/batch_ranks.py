"""Batched decoding over the ranks (issue 26): a rank's part in decoding a job's prompts B at a time.

`decode_batched` is the rank work (`launch.RankWork`) that `python -m inference.decode --max-batch B` runs in
place of `decode_prompts`: every rank builds the `BatchRunner` of its role over the same weights `roles` loads
(a stage as a `SlotStage`, the PDM as a `SlotDrafter`) and runs the same FIFO of the job's prompts, so every
rank joins the same prompt into the same slot at the same step; the verifier's rank reports each result as its
sequence ends. Prompt i samples with seed `job.seed + i`, as at batch 1, so its tokens are the same at any B.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from inference.cycle.batch_runner import BatchRunner
from inference.cycle.nccl_rules import checked
from inference.cycle.pipeline import RunnerConfig, role_name
from inference.cycle.result import DecodeResult
from inference.cycle.slots import Request
from inference.cycle.transport import DistributedTransport
from inference.processes.faults import step_hook
from inference.processes.job import DecodeJob
from inference.processes.launch import job_prompts
from inference.processes.roles import load_role
from inference.runtime.slot_drafter import SlotDrafter
from inference.runtime.slot_stage import SlotStage
from inference.sampling import Sampling
from spd_lightning.export import read_drafter_spec
from spd_lightning.geometry import Geometry
from spd_lightning.target import resolve_dtype


def check_batched(job: DecodeJob) -> None:
    """What batched decoding over the ranks supports so far."""
    if job.replay is not None:
        raise ValueError("batched decoding drafts with a PDM: a replay drafter runs at batch 1 only")
    if job.pdm_placement != "separate":
        raise ValueError("batched decoding runs the PDM on a rank of its own: use --pdm-placement separate")


def build_batch_runner(job: DecodeJob, rank: int, device: torch.device) -> BatchRunner:
    """The batched roles of `rank`: a stage (the last one also verifies) or the PDM, `job.max_batch` slots."""
    check_batched(job)
    geometry, dtype, B = Geometry.from_dict(job.geometry), resolve_dtype(job.dtype), job.max_batch
    spec, d2t = read_drafter_spec(job.drafter_path)
    loaded = load_role(job, rank, device)
    stages = {s: SlotStage(stage, B) for s, stage in loaded.stages.items()}
    drafter = (
        None if loaded.pdm is None else SlotDrafter(loaded.pdm, geometry, loaded.embed, dtype, B, compile=job.compile)
    )
    config = RunnerConfig(
        Sampling(**job.sampling),
        job.vocab_size,
        spec.pdm.draft_vocab_size,
        job.hidden_size,
        dtype,
        device,
        d2t.to(device),
        on_step=step_hook(job.fault, rank),
    )
    transport = DistributedTransport([role_name(r, geometry.n) for r in range(geometry.n + 1)])
    return BatchRunner(geometry, checked(transport, device), stages, drafter, config, B)


def decode_batched(
    job: DecodeJob,
    rank: int,
    device: torch.device,
    requests,
    report: Callable[[int, DecodeResult], None],
    on_tokens: Callable[[int, list[int]], None] | None,
) -> None:
    """A rank's part in decoding every prompt of the job, `job.max_batch` at a time (`requests` is unused: the
    job brings the prompts). The verifier's rank reports the results, and with `on_tokens(prompt index, tokens)`
    the tokens each cycle verified."""
    runner = build_batch_runner(job, rank, device)
    reporter = rank == runner.verifier_rank
    sampling, eos = Sampling(**job.sampling), frozenset(job.eos_token_ids)
    work = [
        Request(w.prompt, w.max_new_tokens, eos, sampling, w.seed, on_tokens=w.on_tokens)
        for w in job_prompts(job, reporter, on_tokens)
    ]
    runner.run(work, on_result=report if reporter else None)
