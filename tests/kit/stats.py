"""What the sampling tests compare draws against: random distributions, a tiny target's exact distributions of its
next three tokens, and pooled Pearson chi-square p-values."""

import itertools

import numpy as np
import torch
from scipy.stats import chi2, chisquare

from inference.sampling import Sampling, warp
from spd_lightning.target import Target

MIN_EXPECTED = 5.0  # a chi-square cell needs at least this expected count (smaller cells are pooled)


def random_dist(V, seed, zero_frac=0.0):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(V, generator=g) ** 3
    if zero_frac:
        p[torch.rand(V, generator=g) < zero_frac] = 0
    return p / p.sum()


def exact_distributions(target: Target, prompt: list[int], sampling: Sampling):
    """P(t0, t1) and P(t2) of the warped target after `prompt`, from its logits for every prefix (a target whose
    vocabulary is small enough to enumerate every two-token continuation)."""
    V = target.vocab_size
    with torch.no_grad():
        p0 = warp(target.model(torch.tensor([prompt])).logits[0, -1], sampling).double()
        prefixes = torch.tensor([prompt + [a, b] for a, b in itertools.product(range(V), repeat=2)])
        logits = target.model(prefixes).logits
    p1 = warp(logits[::V, -2], sampling).double()  # row a: P(t1 | t0 = a)
    p2 = warp(logits[:, -1], sampling).double().view(V, V, V)  # [a, b]: P(t2 | t0 = a, t1 = b)
    joint01 = p0[:, None] * p1
    return joint01, (joint01[:, :, None] * p2).sum((0, 1))


def merged_chisquare(observed: np.ndarray, expected: np.ndarray) -> float:
    """Chi-square p-value with the cells of expected count < 5 pooled into one (zero cells must stay empty)."""
    assert observed[expected == 0].sum() == 0, "a token of probability 0 was generated"
    small = (expected > 0) & (expected < MIN_EXPECTED)
    big = expected >= MIN_EXPECTED
    obs, exp = list(observed[big]), list(expected[big])
    if small.any():
        obs.append(observed[small].sum())
        exp.append(expected[small].sum())
    exp = np.array(exp) * (sum(obs) / sum(exp))
    return chisquare(np.array(obs), exp).pvalue


def pooling(expected: np.ndarray) -> list[np.ndarray]:
    """Groups of cell indices: every cell of expected count >= 5 alone, the rest pooled (zero cells excluded)."""
    order = [i for i in np.argsort(expected) if expected[i] > 0]
    small = [i for i in order if expected[i] < MIN_EXPECTED]
    groups = [np.array([i]) for i in order if expected[i] >= MIN_EXPECTED]
    if small:
        pooled = np.array(small)
        while expected[pooled].sum() < MIN_EXPECTED and groups:
            pooled = np.concatenate([pooled, groups.pop(0)])  # the smallest cell that stands alone
        groups.append(pooled)
    return groups


def chisquare_pvalues(counts: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Pooled Pearson chi-square p-values for rows of `counts` (each row one experiment of the same N)."""
    counts = np.atleast_2d(counts)
    N = counts[0].sum()
    groups = pooling(N * p)
    observed = np.stack([counts[:, g].sum(1) for g in groups], axis=1)
    expected = np.array([N * p[g].sum() for g in groups])
    stat = ((observed - expected) ** 2 / expected).sum(1)
    return chi2.sf(stat, len(groups) - 1)
