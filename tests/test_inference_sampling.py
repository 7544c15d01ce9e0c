"""Under sampling the pipeline's output distribution is the target's (SPEC 5.2), checked end to end.

A tiny-vocabulary target and a random PDM over part of that vocabulary (so drafts are often rejected and
some tokens can only come from the residual) decode the first three tokens under many seeds; the
empirical distribution must match the exact one computed from the target's logits with the same
temperature / top-k / top-p. Chi-square with fixed seeds, so the outcome is deterministic.
"""

import itertools

import numpy as np
import torch
from conftest import make_tiny_model
from scipy.stats import chisquare
from test_inference_support import one_thread, random_pdm  # noqa: F401 - one_thread is an autouse fixture

from inference.cycle.simulator import Simulator
from inference.sampling import Sampling, warp
from spd_lightning.geometry import Geometry
from spd_lightning.target import Target

V, PROMPT, RUNS = 8, [1, 2, 3], 800
SAMPLING = Sampling(0.9, top_k=6, top_p=0.95)


def exact_distributions(target: Target):
    """P(t0, t1) and P(t2) of the warped target, from its logits for every prefix."""
    with torch.no_grad():
        p0 = warp(target.model(torch.tensor([PROMPT])).logits[0, -1], SAMPLING).double()
        prefixes = torch.tensor([PROMPT + [a, b] for a, b in itertools.product(range(V), repeat=2)])
        logits = target.model(prefixes).logits
    p1 = warp(logits[::V, -2], SAMPLING).double()  # row a: P(t1 | t0 = a)
    p2 = warp(logits[:, -1], SAMPLING).double().view(V, V, V)  # [a, b]: P(t2 | t0 = a, t1 = b)
    joint01 = p0[:, None] * p1
    return joint01, (joint01[:, :, None] * p2).sum((0, 1))


def merged_chisquare(observed: np.ndarray, expected: np.ndarray) -> float:
    """Chi-square p-value with the cells of expected count < 5 pooled into one (zero cells must stay empty)."""
    assert observed[expected == 0].sum() == 0, "a token of probability 0 was generated"
    small = (expected > 0) & (expected < 5)
    big = expected >= 5
    obs, exp = list(observed[big]), list(expected[big])
    if small.any():
        obs.append(observed[small].sum())
        exp.append(expected[small].sum())
    exp = np.array(exp) * (sum(obs) / sum(exp))
    return chisquare(np.array(obs), exp).pvalue


def test_first_tokens_follow_the_target_distribution():
    model = make_tiny_model("qwen3", num_layers=2, vocab_size=V)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.3)  # a spread-out target distribution
    target = Target(model, "tiny-v8")
    geometry = Geometry.build(2, 2)
    pdm = random_pdm(target, geometry, draft_vocab=5, num_layers=1)
    with torch.no_grad():
        pdm.lm_head.weight.mul_(3.0)  # a draft distribution that clearly differs from the target's
    simulator = Simulator(target, pdm, geometry, SAMPLING)
    results = [simulator.decode(PROMPT, 3, seed=seed) for seed in range(RUNS)]
    accepted = sum(sum(r.counters["accepted_by_fill"]) for r in results)
    rejected = sum(sum(r.counters["rejected_by_fill"]) for r in results)
    assert accepted > RUNS / 4 and rejected > RUNS / 4  # both branches of the rejection sampler are exercised
    outputs = np.array([r.tokens for r in results])
    joint01, marginal2 = exact_distributions(target)
    observed01 = np.bincount(outputs[:, 0] * V + outputs[:, 1], minlength=V * V)
    observed2 = np.bincount(outputs[:, 2], minlength=V)
    assert merged_chisquare(observed01, joint01.flatten().numpy() * RUNS) > 1e-3
    assert merged_chisquare(observed2, marginal2.numpy() * RUNS) > 1e-3
