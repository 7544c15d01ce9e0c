"""Sampling settings at their edges (docs/DESIGN.md, "Verification"): a vanishing temperature is the greedy limit, impossible
temperatures are user errors, and a replay drafter's tokens live on the runner's device."""

import math

import pytest
import torch
from kit import random_pdm

from inference.cycle.ar import ar_decode
from inference.cycle.simulator import Simulator
from inference.cycle.slots import Request
from inference.runtime.replay import ReplayDrafter
from inference.sampling import Sampling, SamplingError, sample_token, warp
from spd_lightning.errors import UserError
from spd_lightning.geometry import Geometry

# Dividing raw float32 logits by these overflows to +-inf (1e-38 for |logit| > 3.4, the smallest subnormal
# 1e-45 for any logit), and the softmax then computes inf - inf = NaN.
TINY_T, SUBNORMAL_T = 1e-38, 1e-45


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(TINY_T),
        Sampling(TINY_T, top_k=3),
        Sampling(TINY_T, top_p=0.5),
        Sampling(SUBNORMAL_T, top_k=2, top_p=0.9),
    ],
)
def test_vanishing_temperature_is_the_argmax(sampling):
    logits = torch.tensor([[3.0, 20.0, -5.0, 19.5, 0.0], [1e4, -1e4, 0.0, 2.0, 9999.0], [-3.0, -2.0, -1.0, -4.0, -9.0]])
    probs = warp(logits, sampling)
    assert torch.isfinite(probs).all()
    assert torch.equal(probs, torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0))
    g = torch.Generator().manual_seed(0)
    assert all(sample_token(row, sampling, g) == int(row.argmax()) for row in logits for _ in range(20))


def test_vanishing_temperature_decodes_like_greedy_ar(tiny_qwen3):
    """End to end: the draft's q and the target's P are both one-hot, so SPD samples the greedy AR tokens."""
    geometry = Geometry.build(tiny_qwen3.num_layers, 3)
    prompt = [3, 14, 15, 92, 65, 35]
    simulator = Simulator(
        tiny_qwen3, random_pdm(tiny_qwen3, geometry), geometry, Sampling(SUBNORMAL_T, top_k=10, top_p=0.9)
    )
    assert simulator.decode(prompt, 16, seed=1).tokens == ar_decode(tiny_qwen3, prompt, 16).tokens


def test_a_hostile_setting_in_one_slot_leaves_its_neighbours_alone(tiny_qwen35):
    """Settings the API accepts at their extremes (a temperature or top_p of 1e-50: greedy; 1e300: uniform over
    the finite logits) decode in a batch beside ordinary sampled requests: every request finishes, the
    greedy-limit ones with greedy AR's tokens, and the neighbours with their batch-1 tokens."""
    geometry = Geometry.build(tiny_qwen35.num_layers, 2)
    pdm = random_pdm(tiny_qwen35, geometry)
    prompt, sampled = [3, 14, 15, 92], Sampling(0.8, top_k=20, top_p=0.9)
    hostile = [Sampling(1e-50), Sampling(1.0, top_p=1e-50), Sampling(1e300, top_k=3)]
    requests = [Request(prompt, 10, sampling=s, seed=i) for i, s in enumerate([sampled, *hostile, sampled])]
    results = Simulator(tiny_qwen35, pdm, geometry, max_batch=3).run(requests)
    greedy = ar_decode(tiny_qwen35, prompt, 10).tokens
    assert [r.tokens for r in results[1:3]] == [greedy, greedy]
    assert all(len(r.tokens) == 10 for r in results)
    for request, result in zip(requests, results):
        if request.sampling is sampled:
            alone = Simulator(tiny_qwen35, pdm, geometry, sampled).decode(prompt, 10, seed=request.seed)
            assert result.tokens == alone.tokens


@pytest.mark.parametrize("temperature", [math.inf, -math.inf, -0.5, math.nan])
def test_impossible_temperatures_are_user_errors(temperature):
    with pytest.raises(SamplingError, match=f"temperature={temperature}") as info:
        Sampling(temperature)
    assert isinstance(info.value, UserError) and "\n" not in str(info.value)


def test_replay_tokens_live_on_the_runner_device():
    """The pipeline starts the drafter with the prompt on its own device; drafts must be created there (on
    CUDA a CPU tensor cannot go into an NCCL send). The meta device stands in for CUDA on a CPU machine."""
    drafter = ReplayDrafter([[5, 6, 7]], "RW", vocab_size=10)
    drafter.start(0, torch.zeros(1, 4, dtype=torch.long, device="meta"), capacity=16)
    for position in (3, 4):
        token, q = drafter.draft({0: [(0, position)]})
        assert token.device.type == "meta" and token.shape == (1,) and q is None
    cpu = ReplayDrafter([[5, 6, 7]], "RW", vocab_size=10)
    cpu.start(0, torch.zeros(1, 4, dtype=torch.long), capacity=16)
    assert [int(cpu.draft({0: [(0, p)]}).tokens[0]) for p in (3, 4, 5)] == [5, 7, 7]
