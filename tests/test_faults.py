"""Fault injection into the multi-process decoder (gloo, CPU, docs/DESIGN.md, "Processes": a failed rank ends the run with a
clear error on every rank, never a hang).

A rank that dies, raises or stalls at a chosen point - prefill, steady state, right after a rejection
(`DecodeJob.fault`, see `faults.Fault`) - ends the whole run well within the process-group timeout, every
rank exits non-zero, the launcher names the rank that failed and why, and no process is left behind
(checked in /proc on the recorded pids). A stalled peer is caught by the timeout, not waited on forever,
and a launcher that dies takes its ranks with it. The replay pattern makes rejections happen early, so
`redo` points come within the first cycles.
"""

import dataclasses
import json
import pickle
import subprocess
import sys
import time

import pytest
from kit import REPO, child_pids, make_tiny_model, still_alive, target_dir

from inference.cycle.ar import ar_decode
from inference.processes.job import DecodeJob
from inference.processes.launch import Failed, LaunchError, failure_message, launch
from inference.sampling import Sampling
from spd_lightning.geometry import Geometry

pytestmark = pytest.mark.timeout(180)
PROMPTS = [[3, 14, 15, 92, 65, 35], [7, 7, 8]]
PATTERN = "WRRW"
TIMEOUT_S = 20  # the process-group timeout: every failure below must end the run well before a hang would
STALL_TIMEOUT_S = 10  # short, so the stall cases stay quick, yet ample for loading a tiny stage


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path, target = target_dir(tmp_path_factory, "qwen3", make_tiny_model)
    return path, target, [ar_decode(target, p, 24).tokens for p in PROMPTS]


def job_for(qwen3, n: int, fault: str | None, timeout_s: float = TIMEOUT_S, repeat: int = 1, **geometry) -> DecodeJob:
    path, target, references = qwen3
    return DecodeJob(
        target_path=path,
        geometry=Geometry.build(target.num_layers, n, **geometry),
        prompts=PROMPTS * repeat,
        max_new_tokens=24,
        eos_token_ids=[],
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        sampling=Sampling(),
        replay=(PATTERN, references * repeat),
        timeout_s=timeout_s,
        fault=fault,
    )


def failing_launch(job: DecodeJob, match: str) -> LaunchError:
    start = time.monotonic()
    with pytest.raises(LaunchError, match=match) as info:
        launch(job)
    elapsed = time.monotonic() - start
    error = info.value
    assert elapsed < job.timeout_s + 15, f"the failure took {elapsed:.1f} s to surface: {error}"
    assert len(error.pids) == job.world_size and not still_alive(error.pids, 1.0), "a rank outlived the launch"
    assert error.failed and all(code != 0 for code in error.failed.values()), error.failed
    return error


def test_a_stage_rank_that_dies_in_steady_state_ends_every_rank(qwen3):
    """Stage 2 of 3 vanishes without a word at its 8th step: the launcher names it, not its peers' echoes."""
    failing_launch(
        job_for(qwen3, 3, "1:step:8:exit"), r"rank 1 \(stage 2\) exited with code 3 without reporting an error"
    )


def test_a_stalled_peer_is_caught_by_the_timeout(qwen3):
    """The PDM stops sending in steady state: the ranks waiting on it time out and name it."""
    error = failing_launch(
        job_for(qwen3, 2, "2:step:6:stall", timeout_s=STALL_TIMEOUT_S),
        r"^rank 2 \(PDM\) stopped responding: .* timed out",
    )
    assert 2 not in error.failed  # the staller never noticed; the launcher ended it


def test_a_stalled_verifier_is_caught_by_the_timeout_on_the_control_group(qwen3):
    """PPSD: the last stage sends the PDM no anchors, so with the verifier stalled every other rank waits on the
    verdict alone, which travels on the gloo control group: its receives time out after `timeout_s` as the data
    messages' do (that group once kept gloo's 30-minute default)."""
    job = job_for(qwen3, 2, "1:step:6:stall", timeout_s=STALL_TIMEOUT_S, schedule="post_step", features="first_stage")
    failing_launch(job, r"^rank 1 \(stage 2\) stopped responding: .* timed out")


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault,match",
    [
        ("0:prefill:1:exit", r"rank 0 \(stage 1\) exited with code 3 without reporting"),
        ("3:prefill:1:kill", r"rank 3 \(PDM\) was killed by signal 9"),
        ("2:redo:1:raise", r"rank 2 \(stage 3\) failed: RuntimeError: injected fault at redo #1"),
        ("0:redo:2:exit", r"rank 0 \(stage 1\) exited with code 3 without reporting"),
        ("3:step:10:raise", r"rank 3 \(PDM\) failed: RuntimeError: injected fault at step #10"),
        ("1:redo:1:kill", r"rank 1 \(stage 2\) was killed by signal 9"),
    ],
)
def test_every_rank_and_point(qwen3, fault, match):
    """Stage and PDM ranks failing at prefill, in steady state and right after a rejection (n = 3)."""
    failing_launch(job_for(qwen3, 3, fault), match)


@pytest.mark.slow
def test_a_stalled_stage_right_after_a_rejection(qwen3):
    """Stage 1 stops after learning of a rejection; a rank that times out waiting on a blocked peer
    (not on stage 1 itself) still leads the launcher to stage 1."""
    failing_launch(
        job_for(qwen3, 3, "0:redo:1:stall", timeout_s=STALL_TIMEOUT_S),
        r"^rank 0 \(stage 1\) stopped responding: .* timed out",
    )


LAUNCHER = """
import json, pickle, sys
from inference.processes.launch import launch
pids = {}
def decoding(index, result):
    if index == 0:  # decoding is under way: tell the test which processes to watch
        print(json.dumps(list(pids.values())), flush=True)
with open(sys.argv[1], "rb") as f:
    job = pickle.load(f)  # typed settings inside: the job travels as the ranks get it
launch(job, on_result=decoding, on_start=pids.__setitem__)
"""


@pytest.mark.slow
def test_a_dead_launcher_takes_its_ranks_with_it(qwen3, tmp_path):
    """SIGKILL the launching process mid-decode: its ranks (and its fork server) exit on their own."""
    job = job_for(qwen3, 2, None, repeat=200)
    pickled = tmp_path / "job.pkl"
    pickled.write_bytes(pickle.dumps(job))
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(pickled)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        ranks = json.loads(launcher.stdout.readline())
        helpers = child_pids(launcher.pid)  # the fork server (the ranks' parent) and the resource tracker
        assert len(ranks) == job.world_size and helpers
    finally:
        launcher.kill()
        launcher.wait()
    assert not still_alive(ranks + helpers, 20.0), "processes outlived their launcher"


def test_the_failure_message_follows_the_chain_of_blame():
    """Without processes: the reports the launcher reads, and the rank it names (n = 3, ranks 0..3)."""
    job = DecodeJob("unused", Geometry.build(4, 3), [[1]], 4, [], 10, 8, Sampling())
    lost = lambda rank, peer: Failed(rank, f"PeerError: waiting on rank {peer} timed out", "trace", peer, False)  # noqa: E731
    chain = {3: lost(3, 2), 2: lost(2, 0)}  # the PDM waited on stage 3, which waited on the silent stage 1
    assert failure_message(job, {3: 1}, chain).startswith(
        "rank 0 (stage 1) stopped responding: rank 3 (PDM) failed: PeerError: waiting on rank 2 timed out"
    )
    own = {**chain, 1: Failed(1, "TargetError: no layer 3", "trace", None, True)}
    assert failure_message(job, {3: 1}, own).startswith("rank 1 (stage 2) failed: TargetError: no layer 3")
    assert failure_message(job, {1: -9}, chain).startswith("rank 1 (stage 2) was killed by signal 9")
    on_gpus = dataclasses.replace(job, device="cuda")  # NCCL's watchdog aborts the rank whose message timed out
    assert failure_message(on_gpus, {1: -6}, {}).startswith(
        "rank 1 (stage 2) was killed by signal 6 (NCCL's watchdog ends a rank whose message failed or timed out: a "
        "peer may have stalled)"
    )
    assert failure_message(job, {1: -6}, {}).startswith("rank 1 (stage 2) was killed by signal 6; every rank")
    assert failure_message(job, {1: 3}, chain).startswith("rank 1 (stage 2) exited with code 3 without reporting")


KILLED_MID_REPORT = """
import multiprocessing as mp, os, signal, time
from inference.processes.reports import Inbox, Started

def rank(messages, ready):
    messages.put(Started(0, os.getpid()))
    messages.put(b"x" * (1 << 20))  # its feeder thread takes the queue's write lock and fills the pipe
    while messages._buffer:  # both taken by the feeder: the second send blocks, 1 MiB over the pipe's room
        time.sleep(0.01)
    time.sleep(0.2)
    ready.set()
    signal.pause()

ctx = mp.get_context("fork")
messages, ready = ctx.Queue(), ctx.Event()
child = ctx.Process(target=rank, args=(messages, ready))
child.start()
ready.wait()
os.kill(child.pid, signal.SIGKILL)  # mid-send: it dies holding the write lock, its report half written
child.join()
inbox = Inbox(messages, None, None)
inbox.close(wait_s=1.0)
print(inbox.pids == {0: child.pid})
"""


def test_a_rank_killed_mid_report_does_not_hang_the_launchers_exit():
    """A rank SIGKILLed while its feeder thread sends a report keeps the report queue's write lock forever. The
    launcher (the server, across restarts) only reads that queue, so closing its inbox and exiting still work;
    with a stop sentinel written into the queue, its exit hung joining that sentinel's feeder thread."""
    done = subprocess.run(
        [sys.executable, "-c", KILLED_MID_REPORT], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout.strip()) == (0, "True"), done.stderr[-2000:]
