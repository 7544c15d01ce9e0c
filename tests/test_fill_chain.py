"""The refill chain (spd_lightning/fill_chain.py): closed forms, and the decoder's own counters on a simulated
pipeline whose drafts are accepted with a fixed probability per fill."""

import random

import pytest

from inference.cycle.schedule import PipelineSchedule, Verdict
from spd_lightning.fill_chain import (
    judged_acceptance,
    judged_fill_shares,
    predicted_n_alpha,
    walk,
    walked_counts,
    walked_cycles,
)
from spd_lightning.geometry import Geometry


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("p", [0.0, 0.42, 0.81, 1.0])
def test_constant_acceptance_matches_the_closed_form(n, p):
    expected = [(1 - p) * p ** (k - 1) for k in range(1, n)] + [p ** (n - 1)]
    assert judged_fill_shares(p, n) == pytest.approx(expected, abs=1e-12)
    assert judged_acceptance(p, n) == pytest.approx(p)
    assert predicted_n_alpha(p, n) == pytest.approx(n / (1 + (n - 1) * (1 - p)))


def test_spec_figures():
    """SPEC section 17: p = 0.42 puts 58 % at fill 1; p = 0.81 at n = 8 about 23 % at fill 8, 19 % at fill 1."""
    assert judged_fill_shares(0.42, 8)[0] == pytest.approx(0.58)
    shares = judged_fill_shares(0.81, 8)
    assert shares[-1] == pytest.approx(0.23, abs=0.005) and shares[0] == pytest.approx(0.19)


def test_a_walk_climbs_on_accepts_and_refills_on_rejects():
    # n = 3: a draft is accepted at fill 1 and 3 only; fill 3 is the ceiling
    accepted = [[True, False, True]] * 2 + [[False, False, True]] * 3 + [[True, True, True]] * 4
    assert walk(accepted, 3) == [1, 2, 1, 1, 1, 1, 2, 3, 3]
    assert walked_counts(accepted, 3) == ([2, 1, 2], [3, 1, 0])
    assert walked_cycles(accepted, 3) == 3 + (1 + 3 + 3 + 3 + 3 + 1 + 1 + 1)  # the last verdict ends it
    assert walked_cycles([], 3) == 0


def test_bad_acceptance_is_refused():
    with pytest.raises(ValueError, match="n=3"):
        judged_fill_shares([0.5, 0.5], 3)
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        judged_fill_shares(1.5, 3)


def simulated_counters(n: int, acceptance: list[float], tokens: int, seed: int = 0):
    """Runs the decoder's schedule with verdicts drawn at the judged draft's fill acceptance."""
    rng = random.Random(seed)
    sched = PipelineSchedule(Geometry.build(n, n), max_new_tokens=tokens)
    plan = sched.begin(Verdict.FIRST, 1, prompt_len=4)
    fill_of = {}  # position -> fill level it was drafted at
    while plan is not None:
        fill_of[plan.draft_position] = plan.fill
        if plan.judged_position < 0:
            verdict = Verdict.NONE
        else:
            accepted = rng.random() < acceptance[fill_of[plan.judged_position] - 1]
            verdict = Verdict.ACCEPT if accepted else Verdict.REJECT
        plan = sched.begin(verdict, 1)
    return sched


@pytest.mark.parametrize(
    "n, acceptance", [(4, [0.6] * 4), (8, [0.42] * 8), (8, [0.3, 0.5, 0.6, 0.7, 0.8, 0.8, 0.9, 0.9])]
)
def test_shares_and_n_alpha_match_the_decoders_counters(n, acceptance):
    sched = simulated_counters(n, acceptance, tokens=40_000)
    c = sched.counters
    judged = [a + r for a, r in zip(c.accepted_by_fill, c.rejected_by_fill)]
    measured = [j / sum(judged) for j in judged]
    assert measured == pytest.approx(judged_fill_shares(acceptance, n), abs=0.01)
    assert n * sched.N / sched.K == pytest.approx(predicted_n_alpha(acceptance, n), rel=0.01)
