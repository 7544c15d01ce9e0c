"""Batched decoding over the ranks (every rank steps B sequences at once): n stage ranks + 1 PDM rank as real gloo
processes, B = 3.

Each sequence of a batch decoded through the ranks is its batch-1 simulator decode and its `Simulator`
decode: tokens, N, K and the acceptance counters, which depend on every draft, so equal counters mean every
slot's drafts and verdicts were its batch-1 ones. A random PDM is rejected almost always: the stage ranks run
wasted optimistic steps per slot and roll them back (a hybrid target at n = 3: Gated DeltaNet states restored).
Mixed prompt lengths and max_new_tokens make sequences leave at different steps and later ones join the freed
slots. Every launch uses a free port and a process-group timeout; pytest-timeout bounds each test.
"""

import json
import multiprocessing as mp
import time

import pytest
from kit import check_batched_timing, make_tiny_model, save_random_drafter, target_dir

from inference.cycle.simulator import Simulator
from inference.cycle.slots import Request
from inference.decode import main
from inference.processes.job import DecodeJob
from inference.processes.launch import LaunchError, launch
from inference.sampling import Sampling
from spd_lightning.export import load_drafter
from spd_lightning.geometry import Geometry

pytestmark = pytest.mark.timeout(300)
PROMPTS = [[3, 14, 15, 92, 65, 35], [7, 7, 8], [5], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [40, 41]]
MAX_NEW = [14, 6, 18, 9, 12]
TIMEOUT_S = 60
SAMPLED = Sampling(1.0, top_k=30, top_p=0.95)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    return {arch: target_dir(tmp_path_factory, arch, make_tiny_model) for arch in ("qwen3_5", "qwen3")}


def batched_job(path, target, geometry, drafter, B, sampling=Sampling(), **overrides) -> DecodeJob:
    fields = dict(
        target_path=path,
        geometry=geometry,
        prompts=PROMPTS,
        max_new_tokens=max(MAX_NEW),
        max_new_tokens_each=MAX_NEW,
        eos_token_ids=[],
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        sampling=sampling,
        drafter_path=drafter,
        seed=5,
        timeout_s=TIMEOUT_S,
        max_batch=B,
    )
    fields.update(overrides)
    return DecodeJob(**fields)


def requests(sampling=Sampling()) -> list[Request]:
    return [Request(p, m, sampling=sampling, seed=5 + i) for i, (p, m) in enumerate(zip(PROMPTS, MAX_NEW))]


def summary(results) -> list[tuple]:
    return [(r.tokens, r.N, r.K, r.counters) for r in results]


@pytest.mark.parametrize("arch,n", [("qwen3", 2), ("qwen3_5", 3)])
def test_batched_ranks_equal_batch_one_and_the_batch_simulator(targets, tmp_path, arch, n):
    """3 processes (n = 2) and 4 (n = 3), B = 3, five greedy requests."""
    path, target = targets[arch]
    geometry = Geometry.build(target.num_layers, n)
    drafter = save_random_drafter(target, geometry, str(tmp_path / "drafter"))
    pdm = load_drafter(drafter)[0]
    ranks = launch(batched_job(path, target, geometry, drafter, 3))
    simulator = Simulator(target, pdm, geometry)
    alone = [simulator.decode(r.prompt_ids, r.max_new_tokens, seed=r.seed) for r in requests()]
    simulated = Simulator(target, pdm, geometry, max_batch=3).run(requests())
    assert summary(ranks) == summary(alone) == summary(simulated)
    assert [r.N for r in ranks] == MAX_NEW
    assert sum(r.counters["rejected_by_fill"][0] for r in ranks) > 0  # rollbacks happened


def test_batched_ranks_sample_the_same_tokens_at_batch_one_and_three(targets, tmp_path):
    """A seeded sampled request draws the same tokens through the ranks at B = 1 and B = 3, and alone."""
    path, target = targets["qwen3"]
    geometry = Geometry.build(target.num_layers, 2)
    drafter = save_random_drafter(target, geometry, str(tmp_path / "drafter"))
    one = launch(batched_job(path, target, geometry, drafter, 1, SAMPLED))
    three = launch(batched_job(path, target, geometry, drafter, 3, SAMPLED))
    simulator = Simulator(target, load_drafter(drafter)[0], geometry, SAMPLED)
    alone = [simulator.decode(r.prompt_ids, r.max_new_tokens, seed=r.seed) for r in requests(SAMPLED)]
    assert summary(one) == summary(three) == summary(alone)
    assert len({tuple(r.tokens) for r in three}) == len(PROMPTS)


def test_a_rank_killed_with_requests_in_flight_ends_every_rank(targets, tmp_path):
    """Stage 1 is killed at its 8th step, three requests in flight: the launch fails fast naming it, every rank
    has ended, and no request in flight reports a result."""
    path, target = targets["qwen3"]
    geometry = Geometry.build(target.num_layers, 2)
    drafter = save_random_drafter(target, geometry, str(tmp_path / "drafter"))
    job = batched_job(path, target, geometry, drafter, 3, fault="0:step:8:kill")
    pids, reported = {}, []
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 0 \(stage 1\) was killed by signal 9") as info:
        launch(job, on_start=pids.__setitem__, on_result=lambda i, r: reported.append(i))
    assert time.monotonic() - start < TIMEOUT_S
    assert reported == []  # every request was in flight or queued: each ends with the launch's error
    assert info.value.failed and all(code != 0 for code in info.value.failed.values())
    assert len(pids) == 3 and not [p for p in mp.active_children() if p.pid in pids.values()]


def test_the_decode_command_line_decodes_a_prompts_file_in_batches(targets, tmp_path, capsys):
    """`python -m inference.decode --max-batch 2 --profile`: three prompts through the ranks, lossless against AR,
    each with the timing rows of the batch's cycles it took part in."""
    path, target = targets["qwen3"]
    drafter = save_random_drafter(target, Geometry.build(target.num_layers, 2), str(tmp_path / "drafter"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"turns": ["{t}"]}}\n' for t in ("hello world", "the cat sat on the mat", "hi")))
    out = tmp_path / "out.json"
    argv = ["--ckpt", drafter, "--target", path, "--prompts", str(prompts), "--max-new-tokens", "8"]
    rc = main([*argv, "--max-batch", "2", "--check-lossless", "--profile", "--json", str(out), "--timeout", "60"])
    assert rc == 0 and "lossless=yes" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["max_batch"] == 2 and [p["lossless"] for p in report["prompts"]] == [True] * 3
    assert all(p["N"] == 8 or p["stop_reason"] == "eos" for p in report["prompts"])
    check_batched_timing(report["prompts"], n=2, max_batch=2)
