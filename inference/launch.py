"""Start the distributed decoder: `n` stage ranks + 1 PDM rank (SPEC 5.3).

`launch` spawns the `n + 1` ranks as local processes on a free port and watches them: the first rank
that exits non-zero (an exception, a kill, a lost peer) ends the whole run at once, and the error names
the rank that caused it. Inside the ranks every blocking call is bounded by the process-group timeout, so
a rank that stalls makes its peers fail too, and each rank holds a lifeline to the launcher, so a launcher
that dies takes its ranks with it. Under `torchrun` the same `run_rank` runs in every process instead.

Each rank loads only what its role needs: a stage rank its layer range (plus the embedding or the head
at the ends), the PDM rank the drafter and the target's embedding table.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import signal
import socket
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

from spd_lightning.export import load_drafter
from spd_lightning.geometry import Geometry
from spd_lightning.target import resolve_dtype

from .drafter import PDMDrafter, ReplayDrafter, read_drafter_spec
from .pipeline import PipelineRunner, role_name
from .result import DecodeResult, summarize_timing
from .stages import Stage, load_pieces, meta_target
from .transport import DistributedTransport, PeerError, close_distributed, init_distributed
from .verify import Sampling

EXIT_ORPHANED = 4  # a rank's exit status when it ends because its launcher is gone


class LaunchError(RuntimeError):
    """A rank failed; the message names it and says why. `pids` are the ranks' processes, all ended by the
    time it is raised, and `exitcodes` how each ended (negative: the signal that ended it)."""

    def __init__(self, message: str, pids: tuple[int, ...] = ()):
        super().__init__(message)
        self.pids = pids
        self.exitcodes: tuple[int | None, ...] = ()


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
    fault: str | None = None  # test-only, see `Fault`

    @property
    def world_size(self) -> int:
        return self.geometry["n"] + 1


@dataclass(frozen=True)
class Fault:
    """Test-only fault injection (tests/test_faults.py). `DecodeJob.fault = "RANK:POINT:COUNT:ACTION"` makes
    rank RANK fail the COUNT-th time it reaches POINT: `prefill`, `step` (any decode step) or `redo` (the
    step right after a rejection). ACTION: `exit` (os._exit(3), dies without a word), `kill` (SIGKILL to
    itself), `raise` (an exception, reported like any error) or `stall` (sleeps forever, a silent peer)."""

    rank: int
    point: str
    count: int
    action: str

    @classmethod
    def parse(cls, spec: str) -> "Fault":
        rank, point, count, action = spec.split(":")
        if point not in ("prefill", "step", "redo") or action not in ("exit", "kill", "raise", "stall"):
            raise ValueError(f"bad fault {spec!r}: want RANK:prefill|step|redo:COUNT:exit|kill|raise|stall")
        return cls(int(rank), point, int(count), action)

    def hook(self) -> Callable[[str], None]:
        seen = Counter()

        def on_step(point: str) -> None:
            seen[point] += 1
            if point == "redo":
                seen["step"] += 1
            if (point == self.point or (point, self.point) == ("redo", "step")) and seen[self.point] == self.count:
                if self.action == "exit":
                    os._exit(3)
                if self.action == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if self.action == "raise":
                    raise RuntimeError(f"injected fault at {self.point} #{self.count}")
                while True:
                    time.sleep(3600)
        return on_step


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
    fault = Fault.parse(job.fault) if job.fault else None
    on_step = fault.hook() if fault is not None and fault.rank == rank else None
    if rank < n:
        stages[rank + 1] = Stage.load(job.target_path, geometry, rank + 1, dtype, device)
    elif job.replay is not None:
        drafter = ReplayDrafter(job.replay[1], job.replay[0], job.vocab_size)
    else:
        pdm, _ = load_drafter(job.drafter_path, map_location=device)
        embed = load_pieces(job.target_path, range(0), embed=True, head=False, dtype=dtype, device=device).embed_tokens
        drafter = PDMDrafter(pdm.to(dtype), geometry, embed, sampling, dtype)
    transport = DistributedTransport([role_name(r, n) for r in range(n + 1)])
    return PipelineRunner(geometry, transport, stages, drafter, sampling, job.vocab_size, draft_vocab, d2t, device,
                          job.hidden_size, dtype, on_step=on_step)


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


def _rank_entry(job: DecodeJob, rank: int, init_method: str, results, lifeline) -> None:
    """Process entry point: any failure becomes one message to the launcher and a non-zero exit."""
    _follow_launcher(lifeline, rank)
    if not job.debug:
        _quiet_transformers()
    try:
        run_rank(job, rank, rank, init_method, lambda i, r: results.put(("result", rank, i, r.to_dict())))
    except BaseException as e:  # noqa: BLE001 - whatever it was, the launcher must hear about it
        first = str(e).splitlines()[0] if str(e) else ""
        results.put(("error", rank, f"{type(e).__name__}: {first}", traceback.format_exc(), getattr(e, "peer", None)))
        results.close()
        results.join_thread()  # the message is in the pipe before this process (and its sockets) goes away
        sys.exit(1)


def _follow_launcher(lifeline, rank: int) -> None:
    """End this rank when the launcher is gone, however it died: nothing is ever sent on the lifeline, so
    a read returns only when the launcher's end of it closes."""
    def watch() -> None:
        try:
            lifeline.recv()
        except (EOFError, OSError):
            pass
        print(f"spd rank {rank}: the launcher is gone, exiting", file=sys.stderr, flush=True)
        os._exit(EXIT_ORPHANED)

    threading.Thread(target=watch, name="spd-lifeline", daemon=True).start()


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
    lifeline, keep_alive = ctx.Pipe(duplex=False)  # the ranks hold the reading end; only this process writes
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank_entry, args=(job, r, init_method, results, lifeline), name=f"spd-rank{r}",
                         daemon=True) for r in range(job.world_size)]
    for p in procs:
        p.start()
    pids = tuple(p.pid for p in procs)
    collected: dict[int, DecodeResult] = {}
    errors: list[tuple] = []
    failure: LaunchError | None = None
    try:
        while True:
            _drain(results, collected, errors, on_result, wait_s=0.05)
            codes = [p.exitcode for p in procs]
            if any(c not in (None, 0) for c in codes):
                deadline = time.monotonic() + 1.0  # let the failing ranks' own messages arrive
                while time.monotonic() < deadline:
                    _drain(results, collected, errors, on_result, wait_s=0.05)
                failure = LaunchError(_failure_message(job, [p.exitcode for p in procs], errors), pids)
                raise failure
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
                p.join()
        keep_alive.close()
        lifeline.close()
        if failure is not None:
            failure.exitcodes = tuple(p.exitcode for p in procs)
    missing = [i for i in range(len(job.prompts)) if i not in collected]
    if missing:
        raise LaunchError(f"every rank exited cleanly but prompts {missing} produced no result", pids)
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


def _failure_message(job: DecodeJob, codes: list[int | None], errors: list[tuple]) -> str:
    """Names the rank that caused the failure: one killed by a signal; else one that exited without
    reporting anything (it died abruptly); else one that reported an error of its own; else, when every
    report is a lost peer (`PeerError`), the rank at the end of the chain of blamed peers: the one that
    went silent (e.g. stalled) while the others, directly or through blocked peers, waited on it."""
    n = job.geometry["n"]
    reported = {e[0]: e for e in errors}
    killed = [r for r, c in enumerate(codes) if c is not None and c < 0]
    silent = [r for r, c in enumerate(codes) if c not in (None, 0) and r not in reported]
    own = [e for e in errors if e[3] is None]
    if killed:
        r = killed[0]
        head = f"rank {r} ({role_name(r, n)}) was killed by signal {-codes[r]}"
    elif silent:
        r = silent[0]
        head = f"rank {r} ({role_name(r, n)}) exited with code {codes[r]} without reporting an error"
    elif errors:
        r, message, trace, peer = (own or errors)[0]
        head = f"rank {r} ({role_name(r, n)}) failed: {message}"
        chain = {r}
        while peer is not None and peer not in chain and peer in reported:
            chain.add(peer)
            peer = reported[peer][3]
        if not own and peer is not None and peer not in reported:
            head = f"rank {peer} ({role_name(peer, n)}) stopped responding: {head}"
        head += f"\n{trace}" if job.debug else ""
    else:
        r = next(r for r, c in enumerate(codes) if c not in (None, 0))
        head = f"rank {r} ({role_name(r, n)}) exited with code {codes[r]}"
    others = [f"{role_name(q, n)}" for q, c in enumerate(codes) if c not in (None, 0) and q != r]
    return head + (f" (then also: {', '.join(others)})" if others else "") + "; every rank was stopped"
