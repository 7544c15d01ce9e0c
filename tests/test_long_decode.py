"""Long runs in one process (the simulator): thousands of tokens, and many prompts back to back, without
memory growth and without state carried from one prompt into the next.

Memory is the process's resident set (VmRSS in /proc/self/status), read after a warm-up run has made
every allocator pool, cache and lazily built table exist; the bound is generous (the tiny models' caches
for a whole run are a few MB), so it catches a leak per cycle or per prompt, not noise.
"""
import random

import pytest

from spd_lightning.geometry import Geometry
from inference.ar import ar_decode
from inference.simulator import Simulator
from inference.verify import Sampling
from test_inference_support import one_thread, random_pdm  # noqa: F401 - one_thread is an autouse fixture

GROWTH_BOUND_MB = 64


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def long_decode(target, tokens: int) -> None:
    """Greedy SPD for `tokens` tokens equals AR, and the memory of the process stays flat over the run."""
    geometry = Geometry.build(target.num_layers, 2)
    simulator = Simulator(target, random_pdm(target, geometry), geometry)
    prompt = [3, 14, 15, 92, 65, 35]
    simulator.decode(prompt, 100)  # warm-up
    start = rss_mb()
    result = simulator.decode(prompt, tokens)
    end = rss_mb()
    print(f"\n{tokens} tokens (K={result.K}): RSS {start:.1f} MB at the start, {end:.1f} MB at the end")
    assert result.N == tokens and result.tokens == ar_decode(target, prompt, tokens).tokens
    assert end - start < GROWTH_BOUND_MB, f"RSS grew from {start:.1f} to {end:.1f} MB over one {tokens}-token decode"


def test_a_long_decode(tiny_qwen3):
    long_decode(tiny_qwen3, 200)


@pytest.mark.slow
def test_a_2000_token_decode(tiny_qwen35):
    long_decode(tiny_qwen35, 2000)


def back_to_back(target, tokens: int) -> None:
    """20 prompts in one simulator, greedy and sampled: each result is the one a fresh simulator gives
    (caches, drafter state and random streams are reset per prompt), and memory stays flat."""
    n = 3
    geometry = Geometry.build(target.num_layers, n)
    pdm = random_pdm(target, geometry)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, target.vocab_size) for _ in range(rng.randrange(2, 14))] for _ in range(20)]
    for sampling in (Sampling(), Sampling(1.0, top_k=20)):
        simulator = Simulator(target, pdm, geometry, sampling)
        for i in range(2):  # warm-up
            simulator.decode(prompts[i], tokens, seed=i)
        start = rss_mb()
        results = [simulator.decode(p, tokens, seed=i) for i, p in enumerate(prompts)]
        end = rss_mb()
        print(f"\n20 prompts x {tokens} tokens ({sampling}): RSS {start:.1f} MB at the start, {end:.1f} MB at the end")
        assert end - start < GROWTH_BOUND_MB, f"RSS grew from {start:.1f} to {end:.1f} MB over 20 prompts"
        for i in (0, 7, 19):
            fresh = Simulator(target, pdm, geometry, sampling).decode(prompts[i], tokens, seed=i)
            assert (results[i].tokens, results[i].K, results[i].counters) == (fresh.tokens, fresh.K, fresh.counters)
        if sampling.greedy:
            assert all(r.tokens == ar_decode(target, p, tokens).tokens for p, r in zip(prompts[:3], results))


def test_prompts_back_to_back(tiny_qwen35):
    back_to_back(tiny_qwen35, 8)


@pytest.mark.slow
def test_long_prompts_back_to_back(tiny_qwen35):
    back_to_back(tiny_qwen35, 64)
