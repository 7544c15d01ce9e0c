"""Under sampling the pipeline's output distribution is the target's (docs/DESIGN.md, "Lossless"), checked end to end.

A tiny-vocabulary target and a random PDM over part of that vocabulary (so drafts are often rejected and
some tokens can only come from the residual) decode the first three tokens under many seeds; the
empirical distribution must match the exact one computed from the target's logits with the same
temperature / top-k / top-p. Chi-square with fixed seeds, so the outcome is deterministic.
"""

import numpy as np
import pytest
import torch
from kit import exact_distributions, make_tiny_model, merged_chisquare, random_pdm

from inference.cycle.simulator import Simulator
from inference.sampling import Sampling
from spd_lightning.geometry import Geometry
from spd_lightning.pdm import PipelineDraftModule
from spd_lightning.target import Target

V, PROMPT, RUNS = 8, [1, 2, 3], 800
SAMPLING = Sampling(0.9, top_k=6, top_p=0.95)


@pytest.fixture(scope="module")
def pipeline() -> tuple[Target, Geometry, PipelineDraftModule]:
    """A tiny target of V ids with a spread-out distribution, and a random drafter over 5 of them whose draft
    distribution clearly differs from the target's (both read only by the decodes)."""
    model = make_tiny_model("qwen3", num_layers=2, vocab_size=V)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.3)
    target = Target(model, "tiny-v8")
    geometry = Geometry.build(2, 2)
    pdm = random_pdm(target, geometry, draft_vocab=5, num_layers=1)
    with torch.no_grad():
        pdm.lm_head.weight.mul_(3.0)
    return target, geometry, pdm


@pytest.mark.slow  # fast: the batched test below (the same cycle at B = 4) and test_sampling_power (B = 1)
def test_first_tokens_follow_the_target_distribution(pipeline):
    target, geometry, pdm = pipeline
    simulator = Simulator(target, pdm, geometry, SAMPLING)
    results = [simulator.decode(PROMPT, 3, seed=seed) for seed in range(RUNS)]
    accepted = sum(sum(r.counters["accepted_by_fill"]) for r in results)
    rejected = sum(sum(r.counters["rejected_by_fill"]) for r in results)
    assert accepted > RUNS / 4 and rejected > RUNS / 4  # both branches of the rejection sampler are exercised
    outputs = np.array([r.tokens for r in results])
    joint01, marginal2 = exact_distributions(target, PROMPT, SAMPLING)
    observed01 = np.bincount(outputs[:, 0] * V + outputs[:, 1], minlength=V * V)
    observed2 = np.bincount(outputs[:, 2], minlength=V)
    assert merged_chisquare(observed01, joint01.flatten().numpy() * RUNS) > 1e-3
    assert merged_chisquare(observed2, marginal2.numpy() * RUNS) > 1e-3


def test_batched_sequences_follow_the_target_distribution(pipeline):
    """Batched decoding (docs/DESIGN.md, "One cycle over B slots"): requests of two prompts under two sampling settings
    share four slots, joining as others leave; each prompt's first tokens follow its own warped target distribution
    whatever it shared the pipeline with."""
    from inference.cycle.slots import Request

    target, geometry, pdm = pipeline
    settings = [(PROMPT, SAMPLING), ([4, 1], Sampling(1.0, top_k=5))]
    requests = [Request(settings[i % 2][0], 3, sampling=settings[i % 2][1], seed=i) for i in range(2 * RUNS)]
    results = Simulator(target, pdm, geometry, max_batch=4).run(requests)
    rejected = sum(sum(r.counters["rejected_by_fill"]) for r in results)
    assert rejected > RUNS / 4  # the residual branch of the rejection sampler is exercised in the batch
    for which, (prompt, sampling) in enumerate(settings):
        outputs = np.array([r.tokens for r in results[which::2]])
        joint01, marginal2 = exact_distributions(target, prompt, sampling)
        observed01 = np.bincount(outputs[:, 0] * V + outputs[:, 1], minlength=V * V)
        assert merged_chisquare(observed01, joint01.flatten().numpy() * RUNS) > 1e-3
        assert merged_chisquare(np.bincount(outputs[:, 2], minlength=V), marginal2.numpy() * RUNS) > 1e-3
