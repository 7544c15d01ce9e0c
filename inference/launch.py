"""Start the distributed decoder: `n` stage ranks + 1 PDM rank (SPEC 5.3).

`launch` spawns the `n + 1` ranks as local processes on a free port and watches them: the first rank
that exits non-zero (an exception, a kill, a lost peer) ends the whole run at once, and the error names
that rank. Inside the ranks every blocking call is bounded by the process-group timeout, so a rank that
hangs makes its peers fail too. Under `torchrun` the same `run_rank` runs in every process instead.

Each rank loads only what its role needs: a stage rank its layer range (plus the embedding or the head
at the ends), the PDM rank the drafter and the target's embedding table.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

from spd_lightning.export import load_drafter
from spd_lightning.geometry import Geometry
from spd_lightning.target import resolve_dtype

from .drafter import PDMDrafter, ReplayDrafter, read_drafter_spec
from .pipeline import PipelineRunner
from .result import DecodeResult, summarize_timing
from .stages import Stage, load_pieces, meta_target
from .transport import DistributedTransport, close_distributed, init_distributed
from .verify import Sampling


class LaunchError(RuntimeError):
    """A rank failed; the message names it and says why."""


@dataclass
class DecodeJob:
    """Everything a rank needs, picklable for the spawned processes."""

    target_path: str
    geometry: dict
    prompts: list[list[int]]
    max_new_tokens: int
    eos_token_ids: list[int]
    vocab_size: int
    hidden_size: int
    sampling: dict
    drafter_path: str | None = None  # an exported drafter dir or a Lightning .ckpt
    replay: tuple[str, list[list[int]]] | None = None  # (policy, reference continuation per prompt) instead of a PDM
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    timeout_s: float = 120.0
    debug: bool = False

    @property
    def world_size(self) -> int:
        return self.geometry["n"] + 1


def role_name(rank: int, n: int) -> str:
    return f"stage {rank + 1}" if rank < n else "PDM"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def rank_device(job: DecodeJob, local_rank: int) -> torch.device:
    return torch.device(f"cuda:{local_rank}") if job.device.startswith("cuda") else torch.device("cpu")


def build_runner(job: DecodeJob, rank: int, device: torch.device) -> PipelineRunner:
    """The roles of `rank`: a stage (the last one also verifies) or the drafter."""
    geometry = Geometry.from_dict(job.geometry)
    n, sampling, dtype = geometry.n, Sampling(**job.sampling), resolve_dtype(job.dtype)
    stages, drafter, d2t, draft_vocab = {}, None, None, 1
    if job.replay is not None and not sampling.greedy:
        raise ValueError("a replay drafter has no draft distribution: use it with greedy decoding only")
    if job.replay is None:
        spec, d2t = read_drafter_spec(job.drafter_path)
        draft_vocab = spec.pdm.draft_vocab_size
    if rank < n:
        stages[rank + 1] = Stage.load(job.target_path, geometry, rank + 1, dtype, device)
    elif job.replay is not None:
        drafter = ReplayDrafter(job.replay[1], job.replay[0], job.vocab_size)
    else:
        pdm, _ = load_drafter(job.drafter_path, map_location=device)
        embed = load_pieces(job.target_path, range(0), embed=True, head=False, dtype=dtype, device=device).embed_tokens
        drafter = PDMDrafter(pdm.to(dtype), geometry, embed, sampling, dtype)
    return PipelineRunner(geometry, DistributedTransport(), stages, drafter, sampling, job.vocab_size, draft_vocab,
                          d2t, device, job.hidden_size, dtype)


def run_rank(job: DecodeJob, rank: int, local_rank: int, init_method: str | None,
             report: Callable[[int, DecodeResult], None]) -> None:
    """One rank's whole life: join, load, decode every prompt, leave. The last stage reports results."""
    device = rank_device(job, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # ranks share the CPU: oversubscribed threads make every rank slower
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // job.world_size))
    backend = "nccl" if device.type == "cuda" else "gloo"
    init_distributed(backend, rank, job.world_size, job.timeout_s, init_method)
    runner = build_runner(job, rank, device)
    n, reporter = runner.n, runner.verifier_rank
    for i, prompt in enumerate(job.prompts):
        result = runner.decode(prompt, job.max_new_tokens, frozenset(job.eos_token_ids), job.seed + i)
        rows = runner.transport.gather(torch.from_numpy(runner.clock[rank]).to(device), dst=reporter)
        if rank == reporter:
            result.timing = summarize_timing(torch.stack(rows).cpu()[:, 1:], result.K, n, has_drafter=job.replay is None)
            report(i, result)
    # Only a clean finish leaves the group here. After a failure the connections close when the process
    # exits, i.e. after the error was reported, so the launcher hears the cause before the peers' echoes.
    close_distributed()


def _rank_entry(job: DecodeJob, rank: int, init_method: str, results) -> None:
    """Process entry point: any failure becomes one message to the launcher and a non-zero exit."""
    if not job.debug:
        _quiet_transformers()
    try:
        run_rank(job, rank, rank, init_method, lambda i, r: results.put(("result", rank, i, r.to_dict())))
    except BaseException as e:  # noqa: BLE001 - whatever it was, the launcher must hear about it
        first = str(e).splitlines()[0] if str(e) else ""
        results.put(("error", rank, f"{type(e).__name__}: {first}", traceback.format_exc()))
        results.close()
        results.join_thread()  # the message is in the pipe before this process (and its sockets) goes away
        sys.exit(1)


def launch(job: DecodeJob, on_result: Callable[[int, DecodeResult], None] | None = None) -> list[DecodeResult]:
    """Run `job` on `n + 1` local processes; results in prompt order. Raises `LaunchError` naming the
    first rank that failed, after ending all of them."""
    n = job.geometry["n"]
    if job.device.startswith("cuda"):
        available = torch.cuda.device_count()
        if available < job.world_size:
            raise LaunchError(f"n={n} stages + 1 PDM rank need {job.world_size} GPUs, {available} are visible: "
                              f"lower n, or run the one-process simulator with --simulate")
    ctx = _context(job)
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank_entry, args=(job, r, init_method, results), name=f"spd-rank{r}", daemon=True)
             for r in range(job.world_size)]
    for p in procs:
        p.start()
    collected: dict[int, DecodeResult] = {}
    errors: list[tuple[int, str, str]] = []
    try:
        while True:
            _drain(results, collected, errors, on_result, wait_s=0.05)
            codes = [p.exitcode for p in procs]
            if any(c not in (None, 0) for c in codes):
                deadline = time.monotonic() + 1.0  # let the failing ranks' own messages arrive
                while time.monotonic() < deadline:
                    _drain(results, collected, errors, on_result, wait_s=0.05)
                raise LaunchError(_failure_message(job, [p.exitcode for p in procs], errors))
            if all(c == 0 for c in codes):
                _drain(results, collected, errors, on_result, wait_s=0.0)
                break
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    missing = [i for i in range(len(job.prompts)) if i not in collected]
    if missing:
        raise LaunchError(f"every rank exited cleanly but prompts {missing} produced no result")
    return [collected[i] for i in range(len(job.prompts))]


def _context(job: DecodeJob):
    """Fresh interpreters for the ranks (never `fork`: torch's thread pools and CUDA do not survive it).

    On Linux a fork server that has already imported torch, transformers, the decoder and the target's
    modeling code starts every rank in milliseconds instead of re-importing them all; it stays up for the
    life of this process, so later launches are fast too. Elsewhere `spawn`."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    modeling = type(meta_target(job.target_path).model).__module__
    ctx.set_forkserver_preload(["torch", "transformers", "inference.launch", modeling])
    return ctx


def _drain(results, collected, errors, on_result, wait_s: float) -> None:
    while True:
        try:
            item = results.get(timeout=wait_s) if wait_s > 0 else results.get_nowait()
        except queue_module.Empty:
            return
        wait_s = 0.0
        if item[0] == "result":
            _, _, index, payload = item
            collected[index] = result = DecodeResult.from_dict(payload)
            if on_result is not None:
                on_result(index, result)
        else:
            errors.append(item[1:])


def _failure_message(job: DecodeJob, codes: list[int | None], errors: list[tuple[int, str, str]]) -> str:
    """The rank that failed first: a rank killed by a signal, else the first error reported."""
    n = job.geometry["n"]
    killed = [r for r, c in enumerate(codes) if c is not None and c < 0]
    if killed:
        r = killed[0]
        head = f"rank {r} ({role_name(r, n)}) was killed by signal {-codes[r]}"
    elif errors:
        r, message, trace = errors[0]
        head = f"rank {r} ({role_name(r, n)}) failed: {message}" + (f"\n{trace}" if job.debug else "")
    else:
        r = next(r for r, c in enumerate(codes) if c not in (None, 0))
        head = f"rank {r} ({role_name(r, n)}) exited with code {codes[r]}"
    others = [f"{role_name(q, n)}" for q, c in enumerate(codes) if c not in (None, 0) and q != r]
    return head + (f" (then also: {', '.join(others)})" if others else "") + "; every rank was stopped"
