"""Property tests of the sampler (hypothesis): for every setting `Sampling` accepts and any logits (-inf, +inf,
NaN, float32's extremes, subnormals, ties), `warp` is a distribution (finite, >= 0, sums to 1) and the verifier's
rule built on it stays a probability: acceptance in [0, 1], a residual that is a distribution, a token drawn."""

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference.cycle.verify import accept_or_correct, acceptance_probability, residual
from inference.sampling import GREEDY_TEMPERATURE, GREEDY_TOP_P, Sampling, sample_token, warp, warp_rows

F32_MAX = 3.4028234663852886e38
SPECIAL = [-math.inf, math.inf, math.nan, F32_MAX, -F32_MAX, 1e-45, -1e-45, 0.0, 1.0, 1e30, -1e30]
logit = st.one_of(st.sampled_from(SPECIAL), st.floats(-1e4, 1e4, width=32))
vocab = st.integers(1, 12)
temperature = st.one_of(
    st.sampled_from([0.0, 1e-300, 1e-50, 1e-45, 1e-38, GREEDY_TEMPERATURE, 1e-3, 1.0, 1e38, 1e300]),
    st.floats(0.0, 1e300, allow_nan=False, allow_infinity=False),
)
top_p = st.one_of(
    st.sampled_from([1e-300, 1e-50, 1e-45, 1e-8, GREEDY_TOP_P, 0.5, 1.0]),
    st.floats(0.0, 1.0, exclude_min=True),
)
sampling = st.builds(Sampling, temperature, st.integers(0, 14), top_p)
PROPERTY = settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def rows(n: int):
    """`n` rows of logits over one vocabulary, ties included (a row may repeat one value)."""
    return vocab.flatmap(lambda v: st.lists(st.lists(logit, min_size=v, max_size=v), min_size=n, max_size=n))


def assert_distribution(probs: torch.Tensor) -> None:
    assert torch.isfinite(probs).all() and (probs >= 0).all(), probs
    assert torch.allclose(probs.sum(-1), torch.ones(probs.shape[:-1]), atol=1e-5), probs


@PROPERTY
@given(rows(3), sampling)
def test_warp_is_a_distribution_for_any_logits_and_setting(logits, setting):
    logits = torch.tensor(logits, dtype=torch.float32)
    batched = warp(logits, setting)
    assert_distribution(batched)
    for row, probs in zip(logits, batched):  # a row warps alike alone and in a batch (the slots warp per row)
        assert torch.equal(warp(row, setting), probs)


@PROPERTY
@given(rows(3), st.lists(sampling, min_size=3, max_size=3))
def test_warp_rows_is_warp_of_each_row_under_its_own_setting(logits, settings_):
    """The PDM's batched warp (one setting per row, as tensors clamped as the drafter writes them) equals `warp`
    of each row alone, bit for bit, for any logits and any accepted settings."""
    logits = torch.tensor(logits, dtype=torch.float32)
    batched = warp_rows(
        logits,
        torch.tensor([min(s.temperature, F32_MAX) for s in settings_], dtype=torch.float32),
        torch.tensor([s.top_k for s in settings_]),
        torch.tensor([s.top_p for s in settings_], dtype=torch.float32),
    )
    for row, setting, probs in zip(logits, settings_, batched):
        assert torch.equal(warp(row, setting), probs), setting


@PROPERTY
@given(rows(2), sampling, st.integers(0, 2**32))
def test_the_verifiers_rule_stays_a_probability(logits, setting, seed):
    target, draft = torch.tensor(logits, dtype=torch.float32)
    p, q = warp(target, setting), warp(draft, setting)
    accept = acceptance_probability(p, q)
    assert torch.isfinite(accept).all() and (accept >= 0).all() and (accept <= 1).all()
    assert_distribution(residual(p, q))
    generator = torch.Generator().manual_seed(seed)
    drafted = torch.multinomial(q, 1, generator=generator)
    accepted, token = accept_or_correct(p, q, drafted, generator)
    assert 0 <= int(token) < len(p)
    assert p[int(token)] > 0 or (bool(accepted) and q[int(token)] > 0)
    assert 0 <= sample_token(target, setting, generator) < len(p)


@PROPERTY
@given(rows(1), temperature, top_p)
def test_below_the_thresholds_a_setting_is_the_argmax(logits, t, p):
    row = torch.tensor(logits[0], dtype=torch.float32)
    setting = Sampling(t, 0, p)
    if t < GREEDY_TEMPERATURE or p < GREEDY_TOP_P:
        assert setting.greedy
        assert torch.equal(warp(row, setting), torch.zeros_like(row).scatter_(0, row.argmax().view(1), 1.0))
