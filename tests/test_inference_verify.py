"""Verification is lossless: exact in expectation (analytically) and empirically, greedy and sampled."""

import pytest
import torch
from kit import chisquare_pvalues, random_dist

from inference.cycle.schedule import Verdict
from inference.cycle.verify import Verifier, acceptance_probability, judge, residual
from inference.sampling import Sampling, SamplingError, draft_distribution, warp


def output_distribution(p, q):
    """P(out = x) = q(x) min(1, P/q) + (1 - sum_y q(y) min(1, P(y)/q(y))) residual(x)."""
    accept = acceptance_probability(p, q)
    return q * accept + (1 - (q * accept).sum()) * residual(p, q)


@pytest.mark.parametrize("seed", range(6))
def test_rejection_sampling_is_exact_in_expectation(seed):
    V = 40
    p = random_dist(V, seed, zero_frac=0.3)
    q = random_dist(V, 100 + seed, zero_frac=0.5)  # q is zero on part of the vocabulary, like V_d
    assert torch.allclose(output_distribution(p.double(), q.double()), p.double(), atol=1e-12)


def test_identical_distributions_never_reject():
    p = random_dist(10, 1)
    assert torch.all(acceptance_probability(p, p)[p > 0] == 1)
    assert torch.allclose(residual(p, p), p)  # total where P == q


def test_judge_matches_the_target_empirically():
    V, draws = 6, 8000
    p, q = random_dist(V, 3), random_dist(V, 4, zero_frac=0.4)
    g = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(q, draws, replacement=True, generator=g)
    outputs = torch.tensor([judge(p, int(x), q, g).token for x in drafts])
    counts = torch.bincount(outputs, minlength=V)
    assert counts[p == 0].sum() == 0
    # Cells of expected count < 5 pooled (the chi-square approximation needs it).
    assert chisquare_pvalues(counts.numpy(), p.double().numpy())[0] > 1e-3


def test_greedy_judge_accepts_only_the_argmax():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9])
    assert judge(logits, 1, None, None).verdict == Verdict.ACCEPT
    wrong = judge(logits, 3, None, None)
    assert wrong.verdict == Verdict.REJECT and wrong.token == 1


def test_warp_temperature_top_k_top_p():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    assert torch.equal(warp(logits, Sampling()), torch.tensor([1.0, 0, 0, 0, 0]))
    full = torch.softmax(logits / 0.5, -1)
    assert torch.allclose(warp(logits, Sampling(0.5)), full)
    top2 = warp(logits, Sampling(1.0, top_k=2))
    assert torch.allclose(top2[:2], torch.softmax(logits[:2], -1)) and top2[2:].sum() == 0
    base = torch.softmax(logits, -1)  # ~[.64, .23, .09, ...]: top-p 0.8 keeps the first two
    nucleus = warp(logits, Sampling(1.0, top_p=0.8))
    assert torch.allclose(nucleus[:2], base[:2] / base[:2].sum()) and nucleus[2:].sum() == 0
    assert warp(logits, Sampling(1.0, top_p=0.01)).argmax() == 0 and warp(logits, Sampling(1.0, top_p=0.01)).max() == 1


def test_draft_distribution_is_zero_outside_the_draft_vocabulary():
    d2t = torch.tensor([2, 5, 7])
    q = draft_distribution(torch.tensor([0.5, 0.25, 0.25]), d2t, 9)
    assert torch.equal(q, torch.tensor([0, 0, 0.5, 0, 0, 0.25, 0, 0.25, 0]))


def test_verifier_remembers_by_position():
    sampling = Sampling(1.0)
    verifier = Verifier(
        sampling, window=3, vocab_size=5, d2t=torch.tensor([0, 1, 2]), draft_vocab_size=3, device=torch.device("cpu")
    )
    verifier.reset(0)
    verifier.remember(
        7, torch.tensor([4]), torch.tensor([0.2, 0.3, 0.5])
    )  # token 4 is outside V_d: q(4) = 0, never accepted
    verdict, token = verifier.judge(7, torch.zeros(5), torch.zeros(2, dtype=torch.long)).tolist()
    assert verdict == Verdict.REJECT and token in (3, 4)  # the residual is P - q, positive only on 3 and 4


def test_greedy_verifier_writes_the_verdict_message():
    verifier = Verifier(Sampling(), window=3, vocab_size=5, d2t=None, draft_vocab_size=1, device=torch.device("cpu"))
    verifier.reset(0)
    logits = torch.tensor([0.0, 0.0, 3.0, 1.0, 0.0])
    out = torch.zeros(2, dtype=torch.long)
    for position, draft, expected in ((4, 2, [Verdict.ACCEPT, 2]), (5, 3, [Verdict.REJECT, 2])):
        verifier.remember(position, torch.tensor([draft]), None)
        assert verifier.judge(position, logits, out).tolist() == expected


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
    ],
)
def test_bad_sampling_settings(kwargs, match):
    with pytest.raises(SamplingError, match=match):
        Sampling(**kwargs)
