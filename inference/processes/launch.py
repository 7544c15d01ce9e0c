"""Start the distributed decoder: `n` stage ranks + 1 PDM rank (docs/DESIGN.md, "Processes"), on torch's elastic launcher.

`launch` runs the `n + 1` ranks as local processes through `torch.distributed.launcher.api.elastic_launch`,
the agent `torchrun` uses: it finds a free port (its c10d rendezvous), sets each rank's environment
(`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, ...), watches the processes, and stops all of them as soon as one
exits non-zero. Under `torchrun` the same `run_rank` runs in every process instead. What this module
adds to the agent:

- the ranks report through one queue: their pid, each result as it is ready (`on_result`), and the
  error that ends them (`reports`). The launcher names the rank that caused a failure from these reports
  and the agent's exit codes (`reports.failure_message`);
- inside the ranks every blocking call is bounded by the process-group timeout, so a rank that stalls
  makes its peers fail too; a rank that lost a peer waits `PEER_REPORT_GRACE_S` before it exits, so the
  other ranks that lost it report before the agent stops them, and the chain of blame reaches the rank
  that went silent;
- each rank watches the launching process (a Linux pidfd, readable once that process has exited) and
  exits when it is gone, however it died, so a launcher that dies takes its ranks with it (and then its
  fork server, which lives as long as a rank holds its end of the server's pipe).

Each rank loads only what its role needs (`roles`). With `DecodeJob.nodes` this launcher runs one node's share
of the ranks of a multi-node run (`nodes`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing as mp
import os
import select
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable

import torch

from inference.cycle.result import DecodeResult, summarize_timing
from inference.cycle.slots import Request
from inference.cycle.transport import PeerError, close_distributed, init_distributed
from inference.processes.job import DecodeJob
from inference.processes.nodes import ReportListener, ReportSender, agent_rendezvous
from inference.processes.reports import Failed, Finished, Inbox, Started, Streamed, blamed_report, failure_message
from inference.processes.roles import build_runner
from inference.processes.store_binding import stores_listen_on
from inference.runtime.stages import meta_target
from spd_lightning.errors import UsageError, UserError, first_line

log = logging.getLogger(__name__)
# What a rank does between joining and leaving: (job, rank, device, request_channel, report, on_tokens) -> None.
RankWork = Callable[[DecodeJob, int, torch.device, object, Callable, Callable | None], None]
PEER_REPORT_GRACE_S = 1.0
EXIT_ORPHANED = 4  # a rank's exit status when it ends because its launcher is gone


class LaunchError(RuntimeError):
    """A rank failed; the message names it and says why. `pids` are the ranks' processes (all ended by the
    time it is raised) and `failed` the exit code of each rank the launcher saw fail on its own (negative:
    the signal that ended it); the launcher stopped the others."""

    def __init__(self, message: str, pids: tuple[int, ...] = (), failed: dict[int, int] | None = None):
        super().__init__(message)
        self.pids = pids
        self.failed = failed or {}


class RankInputError(LaunchError, UserError):
    """A rank rejected its input (e.g. a target directory without the layers it must load): the user's to fix."""


# -- the ranks ------------------------------------------------------------------------------------
def run_rank(
    job: DecodeJob,
    rank: int,
    local_rank: int,
    report: Callable[[int, DecodeResult], None],
    on_tokens: Callable[[int, list[int]], None] | None = None,
    request_channel=None,
    work: RankWork | None = None,
) -> None:
    """One rank's whole life: join (the `torchrun`/elastic environment), load and do its `work` (by default
    `decode_prompts`: every prompt of the job), leave. A server passes its own `work`, which reads the
    `request_channel` (`inference.serving.ranks`); the decoder never imports the server."""
    _check_world_size(job, int(os.environ["WORLD_SIZE"]))
    device = torch.device(f"cuda:{local_rank}" if job.device.startswith("cuda") else "cpu")
    if device.type == "cuda":
        _check_local_device(local_rank)
        torch.cuda.set_device(device)
    else:  # ranks share the CPU: oversubscribed threads make every rank slower
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // job.local_ranks))
    init_distributed("nccl" if device.type == "cuda" else "gloo", rank, job.world_size, job.timeout_s)
    (work or decode_prompts)(job, rank, device, request_channel, report, on_tokens)
    # Only a clean finish leaves the group here. After a failure the connections close when the process
    # exits, i.e. after the error was reported, so the launcher hears the cause before the peers' echoes.
    close_distributed()


def job_requests(job: DecodeJob, on_tokens: Callable[[int, list[int]], None] | None) -> list[Request]:
    """Every prompt of the job as a request: its own `max_new_tokens` (`job.max_new_tokens_each`, else the
    job's), seed `job.seed + i` (so its tokens do not depend on the batch size), and its streamed tokens as
    `on_tokens(i, tokens)`."""
    each = job.max_new_tokens_each or [job.max_new_tokens] * len(job.prompts)
    eos = frozenset(job.eos_token_ids)
    return [
        Request(prompt, each[i], eos, job.sampling, job.seed + i, on_tokens and functools.partial(on_tokens, i))
        for i, prompt in enumerate(job.prompts)
    ]


def decode_prompts(
    job: DecodeJob,
    rank: int,
    device: torch.device,
    request_channel,
    report: Callable[[int, DecodeResult], None],
    on_tokens: Callable[[int, list[int]], None] | None,
) -> None:
    """A rank's part in decoding every prompt of the job, `job.max_batch` at a time (`request_channel` is unused:
    the job brings the prompts): every rank runs the same FIFO, so every rank joins the same prompt into the same
    slot at the same step. The verifier's rank reports the results, and with `on_tokens(prompt index, tokens)`
    the tokens each cycle verified. `job.profile`: the results wait for the end, when every process's timing
    rows are gathered on the reporter, which gives each prompt the rows of its cycles (`PipelineRunner.spans`).
    `job.warm_up`: first the longest request once, unreported (each workload starts its own timing rows)."""
    runner = build_runner(job, rank, device)
    reporter = runner.verifier_rank
    work = job_requests(job, on_tokens if rank == reporter else None)
    if job.warm_up:  # timed work (eval): the largest capacity bucket's graphs compiled and captured before it
        runner.run([max(job_requests(job, None), key=lambda r: len(r.prompt_ids) + r.max_new_tokens)])
    if not job.profile:
        runner.run(work, on_result=report if rank == reporter else None)
        return
    results = runner.run(work)
    cycles = max((end for _, end in runner.spans.values()), default=1)  # the same on every rank
    rows = runner.transport.gather(torch.from_numpy(runner.clock.rows[:, :cycles].copy()).to(device), dst=reporter)
    if rank == reporter:
        rows = torch.stack(rows).sum(0).cpu()
        for index, result in enumerate(results):
            shared = job.pdm_placement == "shared"
            result.timing = summarize_timing(rows, runner.n, runner.spans[index], shared_pdm=shared)
            report(index, result)


def _rank_main(job: DecodeJob, messages, launcher_pid: int, request_channel=None, work: RankWork | None = None) -> None:
    """A rank process under the elastic agent: any failure becomes one report and a non-zero exit."""
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    _exit_with(launcher_pid, rank)
    messages.put(Started(rank, os.getpid()))
    if not job.debug:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    try:
        on_tokens = (lambda i, tokens: messages.put(Streamed(i, list(tokens)))) if job.stream else None
        report = lambda i, r: messages.put(Finished(i, r))  # noqa: E731
        run_rank(job, rank, local_rank, report, on_tokens, request_channel, work)
    except BaseException as e:  # noqa: BLE001 - whatever it was, the launcher must hear about it
        messages.put(
            Failed(
                rank,
                f"{type(e).__name__}: {first_line(e)}",
                traceback.format_exc(),
                getattr(e, "peer", None),
                isinstance(e, UserError),
            )
        )
        messages.close()
        messages.join_thread()  # the report is in the pipe before this process (and its sockets) goes away
        if isinstance(e, PeerError):
            time.sleep(PEER_REPORT_GRACE_S)
        sys.exit(1)


class NodesMismatch(UserError):
    """The nodes (one under a plain `torchrun`) together start another number of ranks than the drafter's pipeline
    has."""


def _check_world_size(job: DecodeJob, world_size: int) -> None:
    if world_size != job.world_size:
        raise NodesMismatch(
            f"{world_size} ranks were started in all; n={job.n} stages with --pdm-placement {job.pdm_placement} "
            f"need {job.world_size}: make the nodes' --nproc-per-node add up to it"
        )


def _check_local_device(local_rank: int) -> None:
    """Under torchrun (or hand-set ranks) nothing checked the GPUs before the ranks started: one line, not CUDA's
    "invalid device ordinal" from `set_device`."""
    visible = torch.cuda.device_count()
    if local_rank >= visible:
        raise UsageError(
            f"this rank's LOCAL_RANK={local_rank} has no GPU ({visible} visible on this node): start at most {visible} "
            f"ranks per node (torchrun --nproc-per-node), lower n, or use --pdm-placement shared"
        )


def _exit_with(launcher_pid: int, rank: int) -> None:
    """End this rank when the launching process is gone. Without pidfds (not Linux >= 5.3) nothing watches:
    the process-group timeout still ends a rank whose peers are gone."""
    try:
        launcher = os.pidfd_open(launcher_pid)
    except (AttributeError, OSError):
        return

    def watch() -> None:
        select.select([launcher], [], [])
        log.warning("rank %d: the launcher (pid %d) is gone, exiting", rank, launcher_pid)
        os._exit(EXIT_ORPHANED)

    threading.Thread(target=watch, name="spd-launcher-watch", daemon=True).start()


# -- the launcher -----------------------------------------------------------------------------
def launch(
    job: DecodeJob,
    on_result: Callable[[int, DecodeResult], None] | None = None,
    on_start: Callable[[int, int], None] | None = None,
    on_tokens: Callable[[int, list[int]], None] | None = None,
    request_channel=None,
    work: RankWork | None = None,
) -> list[DecodeResult]:
    """Run `job` on `n + 1` local processes; results in prompt order. `on_result(prompt index, result)` as
    each prompt is done, `on_start(rank, pid)` as each rank starts, with `job.stream` `on_tokens(prompt
    index, tokens)` as each cycle verifies tokens (all on a helper thread). With `request_channel` (the server's
    `RequestChannel`, made with this launcher's start method) and `work` (a module-level function, see
    `run_rank`) the ranks serve what it brings until it brings None (`inference.serving.ranks`). Raises
    `LaunchError` naming the rank that caused a failure, after every rank has ended."""
    from torch.distributed import DistStoreError
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    _check_devices(job)
    method = start_method(job)
    inbox = Inbox(mp.get_context(method).Queue(), on_result, on_start, on_tokens)
    try:
        with (
            contextlib.closing(inbox),  # first in, last out: every report is in before a failure is read
            tempfile.TemporaryDirectory(prefix="spd_launch_") as logs,
            _quiet_agent(job.debug),
            _callers_signal_handlers(),
            _nodes_met(job, inbox, request_channel) as reports,
            # never on every interface: loopback on one node, node 0's --master-addr across nodes
            stores_listen_on("127.0.0.1" if job.nodes is None else job.nodes.master_addr),
        ):
            elastic_launch(_agent_config(job, method, logs), _rank_main)(
                job, reports, os.getpid(), request_channel, work
            )
    except DistStoreError as e:  # the agent's rendezvous: another node's agent never came
        if job.nodes is None:
            raise
        raise LaunchError(f"the nodes did not meet: {first_line(e)}", inbox.pid_list()) from None
    except ChildFailedError as e:
        failed = {rank: f.exitcode for rank, f in e.failures.items()}
        blamed = blamed_report(failed, inbox.failures)
        cls = RankInputError if blamed is not None and blamed.user_error else LaunchError
        raise cls(failure_message(job, failed, inbox.failures), inbox.pid_list(), failed) from None
    if request_channel is not None:
        return []
    missing = [i for i in range(len(job.prompts)) if i not in inbox.results]
    if missing:
        raise LaunchError(f"every rank exited cleanly but prompts {missing} produced no result", inbox.pid_list())
    return [inbox.results[i] for i in range(len(job.prompts))]


@contextlib.contextmanager
def _nodes_met(job: DecodeJob, inbox: Inbox, request_channel):
    """Where this node's ranks report (`nodes`): the local queue, but node 0's listener from the other nodes.
    On node 0 of a multi-node run, the other nodes' reports come into the inbox while the ranks run, the
    server's cancels (`request_channel`) go out to a verifier on another node, and its ranks start once every
    other node has joined this pipeline: a node that refuses it (`DecodeJob.agree`) ends it at once, where the
    ranks would have waited for it until --timeout."""
    if job.nodes is None:
        yield inbox.messages
    elif job.nodes.node_rank != 0:
        yield ReportSender(job.nodes, inbox.messages, local_kinds=(Started, Failed))
    else:
        with contextlib.closing(ReportListener(job.nodes, inbox, request_channel)):
            why = inbox.await_nodes(job.nodes.nnodes - 1, job.timeout_s)
            if why is not None:
                raise LaunchError(f"the nodes did not meet: {why}")
            yield inbox.messages


@contextlib.contextmanager
def _callers_signal_handlers():
    """The elastic agent installs SIGTERM/SIGINT/SIGHUP/SIGQUIT handlers that raise its `SignalException`, and
    leaves them in place: the caller (a server, a training job's callback, a test) would then die on a later
    SIGTERM with the agent's exception instead of its own handling. Restore the caller's handlers."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread can set handlers
        yield
        return
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    saved = {sig: signal.getsignal(sig) for sig in (getattr(signal, n) for n in names if hasattr(signal, n))}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _check_devices(job: DecodeJob) -> None:
    if job.device.startswith("cuda"):
        available = torch.cuda.device_count()
        if available < job.local_ranks:
            pdm = "the PDM on stage 1's GPU" if job.pdm_placement == "shared" else "1 PDM rank"
            here = "" if job.nodes is None else f" ({job.local_ranks} on this node)"
            raise UsageError(
                f"n={job.n} stages + {pdm} need {job.world_size} GPUs{here}, {available} are visible: "
                f"lower n, use --pdm-placement shared, or run the one-process simulator with --simulate"
            )


def _agent_config(job: DecodeJob, start_method: str, log_dir: str):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    # One node: what `torchrun --standalone --nproc-per-node n+1` does (c10d on a free port); several:
    # this node's share in a static rendezvous (`nodes`). No restarts.
    if job.nodes is None:
        rendezvous = dict(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=job.world_size,
            run_id=f"spd-{uuid.uuid4().hex}",
            rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0",
        )
    else:
        rendezvous = agent_rendezvous(job.nodes, job.timeout_s)
    return LaunchConfig(
        **rendezvous,
        max_restarts=0,
        monitor_interval=0.05,
        start_method=start_method,
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
        shutdown_timeout=5,
    )


def start_method(job: DecodeJob) -> str:
    """Fresh interpreters for the ranks (never `fork`: torch's thread pools and CUDA do not survive it).

    On Linux a fork server that has already imported torch, transformers and the decoder (and on the CPU the target's
    modeling code) starts every rank in milliseconds instead of re-importing them all; it stays up for the life of
    this process, so later launches are fast too. Elsewhere `spawn`."""
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    preload = ["torch", "transformers", "inference.processes.launch"]
    # Modeling code may touch the GPU when imported (Qwen3.5's imports `fla`, which reads the device's properties):
    # a fork server with CUDA initialised starts ranks that fail "Cannot re-initialize CUDA in forked subprocess".
    if not job.device.startswith("cuda"):
        preload.append(type(meta_target(job.target_path, trust_remote_code=job.trust_remote_code).model).__module__)
    mp.get_context("forkserver").set_forkserver_preload(preload)
    return "forkserver"


@contextlib.contextmanager
def _quiet_agent(debug: bool):
    """The agent logs every stopped worker with a traceback; our own message says it in one line."""
    levels = {}
    if not debug:
        for name, logger in list(logging.root.manager.loggerDict.items()):
            if name.startswith(("torch.distributed", "torchelastic")) and isinstance(logger, logging.Logger):
                levels[logger] = logger.level
                logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for logger, level in levels.items():
            logger.setLevel(level)
