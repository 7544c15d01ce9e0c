"""The multi-process decoder over gloo: n stage ranks + 1 PDM rank as real processes (docs/DESIGN.md, "Lossless", "Processes").

Lossless against AR and identical (tokens, N, K, counters) to the one-process simulator; the closed forms
with replay drafters; the same random streams under sampling; and failures that end every rank fast.
Every launch uses a free port and a process-group timeout, and pytest-timeout bounds each test.
"""

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch
from kit import REPO, make_tiny_model, run_unless_hung, save_random_drafter, target_dir

from inference.cycle.ar import ar_decode
from inference.cycle.simulator import Simulator
from inference.processes.job import DecodeJob
from inference.processes.launch import LaunchError, launch, run_rank
from inference.runtime.replay import ReplayDrafter
from inference.sampling import Sampling
from spd_lightning.errors import UsageError, UserError
from spd_lightning.export import load_drafter
from spd_lightning.geometry import Geometry

pytestmark = pytest.mark.timeout(240)
PROMPTS = [[3, 14, 15, 92, 65, 35], [7, 7, 8]]
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    return {arch: target_dir(tmp_path_factory, arch, make_tiny_model) for arch in ("qwen3_5", "qwen3")}


def job_for(path, target, geometry, **overrides) -> DecodeJob:
    fields = dict(
        target_path=path,
        geometry=geometry,
        prompts=PROMPTS,
        max_new_tokens=20,
        eos_token_ids=[],
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        sampling=Sampling(),
        timeout_s=TIMEOUT_S,
    )
    fields.update(overrides)
    return DecodeJob(**fields)


@pytest.mark.parametrize("arch,n", [("qwen3_5", 3), ("qwen3", 2)])
def test_gloo_greedy_is_lossless_and_equals_the_simulator(targets, tmp_path, arch, n):
    path, target = targets[arch]
    geometry = Geometry.build(target.num_layers, n)
    drafter = save_random_drafter(target, geometry, str(tmp_path / "drafter"))
    results = launch(job_for(path, target, geometry, drafter_path=drafter, profile=True))
    simulator = Simulator(target, load_drafter(drafter)[0], geometry)
    for prompt, result in zip(PROMPTS, results):
        simulated = simulator.decode(prompt, 20)
        assert result.tokens == ar_decode(target, prompt, 20).tokens == simulated.tokens
        assert (result.N, result.K, result.counters) == (simulated.N, simulated.K, simulated.counters)
        per_cycle = result.timing["per_cycle"]
        assert len(per_cycle["wall_s"]) == result.K and all(len(r) == n for r in per_cycle["stage_compute_s"])
        assert result.timing["totals"]["draft_s"] > 0 and result.timing["totals"]["comm_s"] > 0


def test_a_launch_leaves_the_callers_signal_handlers_alone(targets):
    """torch's elastic agent installs its own SIGTERM handler; after a launch the caller's is back, so a server or
    a training run that called the decoder still handles SIGTERM its own way."""
    import signal

    path, target = targets["qwen3"]
    geometry = Geometry.build(target.num_layers, 2)
    references = [ar_decode(target, p, 4).tokens for p in PROMPTS]
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        launch(job_for(path, target, geometry, replay=("oracle", references), max_new_tokens=4))
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_gloo_closed_forms(targets):
    path, target = targets["qwen3_5"]
    n = 3
    geometry = Geometry.build(target.num_layers, n)
    references = [ar_decode(target, p, 20).tokens for p in PROMPTS]
    for policy, expected_K in (("oracle", lambda N: N + n - 2), ("adversary", lambda N: n * (N - 1))):
        results = launch(job_for(path, target, geometry, replay=(policy, references)))
        for reference, result in zip(references, results):
            assert result.tokens == reference and result.K == expected_K(result.N)
        simulator = Simulator(target, ReplayDrafter(references, policy, target.vocab_size), geometry)
        assert [simulator.decode(p, 20).K for p in PROMPTS] == [r.K for r in results]


@pytest.mark.parametrize("kind", ["pre_step", "post_step"])
def test_gloo_optimistic_rejections_after_refills(targets, kind):
    """Drafts right by an exact pattern: rejections right after a refill and after accepts at full fill.
    The stage ranks run ahead of every verdict, and a late rejection makes them run a step that the redo
    rolls back (hybrid target: linear-attention states restored): AR's tokens, the simulator's N, K and
    counters - the logical schedule's. Post-step sends its anchor states within the step, so the
    verdicts share the last stage's channel to the PDM with them in another order."""
    path, target = targets["qwen3_5"]
    n, pattern = 3, "WRRRW"
    geometry = Geometry.build(target.num_layers, n, schedule=kind)
    references = [ar_decode(target, p, 20).tokens for p in PROMPTS]
    results = launch(job_for(path, target, geometry, replay=(pattern, references)))
    simulator = Simulator(target, ReplayDrafter(references, pattern, target.vocab_size), geometry)
    for prompt, reference, result in zip(PROMPTS, references, results):
        simulated = simulator.decode(prompt, 20)
        assert result.tokens == reference
        assert (result.N, result.K, result.counters) == (simulated.N, simulated.K, simulated.counters)
        assert result.counters["rejected_by_fill"][0] > 0 and result.counters["rejected_by_fill"][n - 1] > 0
        assert sum(result.counters["accepted_by_fill"]) > 0


@pytest.mark.parametrize("right_at_eos", [True, False])
def test_gloo_eos_verdict_during_an_optimistic_step(targets, right_at_eos):
    """EOS accepted (or sampled as the correction) while every rank already runs the next step: the
    output ends there, that step is thrown away, and every rank stops."""
    path, target = targets["qwen3"]
    n, pattern = 2, "RRW"
    geometry = Geometry.build(target.num_layers, n)
    reference = ar_decode(target, PROMPTS[0], 20).tokens
    i = next(
        i
        for i in range(n + 1, len(reference))
        if reference[i] not in reference[:i] and (pattern[i % len(pattern)] == "R") == right_at_eos
    )
    [result] = launch(
        job_for(
            path, target, geometry, prompts=PROMPTS[:1], eos_token_ids=[reference[i]], replay=(pattern, [reference])
        )
    )
    simulated = Simulator(target, ReplayDrafter([reference], pattern, target.vocab_size), geometry).decode(
        PROMPTS[0], 20, eos_token_id=reference[i]
    )
    assert result.tokens == reference[: i + 1] and result.stop_reason == "eos"
    assert (result.K, result.counters) == (simulated.K, simulated.counters)


def test_gloo_sampling_draws_the_simulators_tokens(targets, tmp_path):
    """Each rank owns its random stream (verifier, drafter), so a seed gives the same tokens in both."""
    path, target = targets["qwen3"]
    geometry = Geometry.build(target.num_layers, 2)
    drafter = save_random_drafter(target, geometry, str(tmp_path / "drafter"))
    sampling = Sampling(1.0, top_k=30, top_p=0.95)
    results = launch(job_for(path, target, geometry, drafter_path=drafter, sampling=sampling, seed=5))
    simulator = Simulator(target, load_drafter(drafter)[0], geometry, sampling)
    for i, (prompt, result) in enumerate(zip(PROMPTS, results)):
        simulated = simulator.decode(prompt, 20, seed=5 + i)
        assert (result.tokens, result.K, result.counters) == (simulated.tokens, simulated.K, simulated.counters)


def test_a_rank_that_raises_ends_every_rank(targets, tmp_path):
    """Stage 2 cannot load its layers: the launch fails at once, naming that rank (no wait for a timeout)."""
    from safetensors.torch import load_file, save_file

    path, target = targets["qwen3"]
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in os.listdir(path):
        if name != "model.safetensors":
            (broken / name).write_bytes(open(os.path.join(path, name), "rb").read())
    weights = load_file(os.path.join(path, "model.safetensors"))
    save_file(
        {k: v for k, v in weights.items() if ".layers.3." not in k},
        str(broken / "model.safetensors"),
        metadata={"format": "pt"},
    )
    geometry = Geometry.build(target.num_layers, 2)
    references = [ar_decode(target, p, 20).tokens for p in PROMPTS]
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 1 \(stage 2\) failed: TargetError: .*layers\.3") as info:
        launch(job_for(str(broken), target, geometry, replay=("oracle", references)))
    assert time.monotonic() - start < TIMEOUT_S
    assert isinstance(info.value, UserError)  # the rank rejected its input: exit 2 in the CLIs, not a bug


def test_a_rank_killed_mid_decode_ends_every_rank(targets):
    path, target = targets["qwen3"]
    geometry = Geometry.build(target.num_layers, 2)
    prompts = PROMPTS * 20
    references = [ar_decode(target, p, 20).tokens for p in PROMPTS] * 20

    pids = {}

    def kill_a_rank(index, result):
        if index == 0:  # the first prompt is done: decoding is under way
            os.kill(pids[0], signal.SIGKILL)

    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 0 \(stage 1\) was killed by signal 9") as info:
        launch(
            job_for(path, target, geometry, prompts=prompts, replay=("adversary", references)),
            on_result=kill_a_rank,
            on_start=pids.__setitem__,
        )
    assert time.monotonic() - start < TIMEOUT_S
    assert len(pids) == 3 and not [p for p in mp.active_children() if p.pid in pids.values()]
    assert not isinstance(info.value, UserError)  # a dead rank is not bad input


FORKSERVER_PROBE = """
import multiprocessing as mp, sys
from inference.processes.launch import start_method
from inference.processes.job import DecodeJob

def fla_imported(answer):
    answer.put("fla" in sys.modules)  # a rank inherits the fork server's modules

if __name__ == "__main__":
    job = DecodeJob(sys.argv[1], None, [], 1, [], 1, 1, None, device=sys.argv[2])
    context = mp.get_context(start_method(job))
    answer = context.SimpleQueue()
    rank = context.Process(target=fla_imported, args=(answer,))
    rank.start()
    rank.join()
    print(answer.get())
"""


@pytest.mark.parametrize("device,preloaded", [("cpu", True), ("cuda", False)])
def test_a_gpu_jobs_fork_server_never_imports_the_targets_modeling_code(targets, tmp_path, device, preloaded):
    """Qwen3.5's modeling code imports `fla` where it is installed (the `gpu` extra), and `fla` reads the GPU's
    properties at import: in the fork server that initialises CUDA, and every rank forked from it fails at its first
    CUDA call. A stand-in `fla` shows where the modeling code was imported: the fork server of a CPU job preloads it
    (the fast start), that of a GPU job must not."""
    (tmp_path / "fla").mkdir()
    (tmp_path / "fla" / "__init__.py").write_text("def chunk_gated_delta_rule(*a, **k): ...\n")
    (tmp_path / "probe.py").write_text(FORKSERVER_PROBE)
    path, _ = targets["qwen3_5"]
    env = {"PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}"}
    run = run_unless_hung([str(tmp_path / "probe.py"), path, device], 120, "the fork server probe", env=env)
    assert run.returncode == 0 and run.stdout.split()[-1] == str(preloaded), run.stderr[-2000:]


def test_a_rank_without_a_gpu_of_its_own_is_one_line(targets, monkeypatch):
    """`torchrun --nproc-per-node 5` for n = 4 on a 4-GPU node: the fifth rank has no device (no launcher checked)."""
    path, target = targets["qwen3"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # stands in for the node's GPUs
    monkeypatch.setenv("WORLD_SIZE", "5")
    job = job_for(path, target, Geometry.build(target.num_layers, 4), device="cuda")
    with pytest.raises(UsageError, match=r"LOCAL_RANK=4 has no GPU \(4 visible on this node\): start at most 4 ranks"):
        run_rank(job, 4, 4, report=lambda *_: None)
