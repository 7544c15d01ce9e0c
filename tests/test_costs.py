"""The one cost model (inference/evaluation/costs.py), the rows built on it (rows.py) and the bootstrap intervals
(intervals.py), on hand-computed numbers."""

import pytest

from inference.cycle.result import DecodeResult
from inference.evaluation import costs
from inference.evaluation.intervals import bootstrap, median_of, overlap, pooled_ratio
from inference.evaluation.rows import eagle3_row, pdm_row


def test_speedup_formulas_by_hand():
    assert costs.s_spd(8, 0.5, 0.1) == pytest.approx(4.0)  # n r = 0.8 < 1: drafting hidden behind a stage
    assert costs.s_spd(8, 0.5, 0.25) == pytest.approx(2.0)  # n r = 2: the draft is twice a stage
    assert costs.s_spd(8, 0.5, 0.0) == pytest.approx(4.0)
    assert costs.s_ppsd(8, 0.5, 0.1) == pytest.approx(4.0 / 1.8)
    assert costs.pdm_speedup("post_step", 4, 0.5, 0.5) == pytest.approx(2.0 / 3.0)
    assert costs.pdm_speedup("spd", 4, 0.5, 0.5) == pytest.approx(1.0)
    # EAGLE-3: 5 drafts at 0.1 T_full each and a verify over 6 tokens at 1.2 T_full: 3 / (1 + 0.5 + 0.2)
    assert costs.s_eagle3(3.0, 5, 0.1, 1.2) == pytest.approx(3.0 / 1.7)
    assert costs.s_eagle3(3.0, 5, 0.0, 1.0) == pytest.approx(3.0)  # free drafts, verify as cheap as one forward
    with pytest.raises(ValueError, match="eagle3"):
        costs.pdm_speedup("eagle3", 4, 0.5, 0.1)


def test_gpu_r_from_the_papers_times():
    # T_full = 8 stages x 4.20 ms = 33.6 ms; a PDM layer = 3.49 ms / 3
    assert costs.gpu_r(3) == pytest.approx(3.49 / 33.6)
    assert costs.gpu_r(1) == pytest.approx(3.49 / 3 / 33.6)
    assert costs.s_spd(8, 0.42, costs.gpu_r(3)) == pytest.approx(8 * 0.42)  # 8 r = 0.83: masked on the GPU


def _pdm(K: int, N: int, draft_s: float, decode_s: float) -> DecodeResult:
    timing = {"totals": {"draft_s": draft_s, "wall_s": decode_s}}
    return DecodeResult(
        mode="spd", n=4, prompt_len=3, tokens=[1] * N, K=K, stop_reason="length", decode_s=decode_s, timing=timing
    )


def _ar(N: int, decode_s: float) -> DecodeResult:
    return DecodeResult(mode="ar", n=1, prompt_len=3, tokens=[1] * N, K=N, stop_reason="length", decode_s=decode_s)


def test_pdm_row_charges_the_draft_per_prompt_in_ar_forwards():
    # each AR prompt: 11 tokens in 1 s -> T_full 0.1 s; drafts 0.05 s per cycle -> r 0.5 on every prompt
    spd = [_pdm(10, 8, 0.5, 2.0), _pdm(20, 12, 1.0, 2.0), _pdm(10, 6, 0.5, 1.0)]
    ar = [_ar(11, 1.0)] * 3
    row = pdm_row("ppsd", 4, 1, spd, ar)
    assert row["alpha"] == pytest.approx(26 / 40) and row["S0"] == pytest.approx(4 * 26 / 40)
    assert (row["r"], row["r_min"], row["r_max"], row["r_repeats"]) == pytest.approx((0.5, 0.5, 0.5, 3))
    assert row["S"] == pytest.approx(4 * 0.65 / (1 + 4 * 0.5)) == row["S_ppsd"]
    assert row["S_spd"] == pytest.approx(4 * 0.65 / 2)
    assert row["S_gpu"] == pytest.approx(4 * 0.65 / (1 + 4 * costs.gpu_r(1)))
    assert row["wall_clock_speedup"] == pytest.approx((23 / 5.0) / (30 / 3.0))
    for key in ("alpha", "S0", "S", "S_gpu", "wall_clock_speedup"):
        low, high = row["ci"][key]
        assert low <= row[key] + 1e-12 and row[key] <= high + 1e-12, key
    assert row["ci"]["r"] == pytest.approx([0.5, 0.5])  # one r on every prompt: no spread to resample


def test_eagle3_row_charges_k_drafts_and_a_verify_over_k_plus_1_in_ar_forwards():
    # AR 0.1 s per token; 2 verify forwards at 0.2 s (2 T_full) and 6 draft steps at 0.05 s (0.5 T_full)
    timing = {"totals": {"draft_s": 0.3, "verify_s": 0.4, "draft_steps": 6}}
    chain = DecodeResult(
        mode="eagle3",
        n=1,
        prompt_len=3,
        tokens=[1] * 7,
        K=2,
        stop_reason="length",
        decode_s=0.7,
        timing=timing,
        counters={"accept_lengths": [4, 2]},
    )
    row = eagle3_row(3, [chain, chain], [_ar(11, 1.0), _ar(11, 1.0)])
    assert (row["tau"], row["r"], row["verify_ratio"]) == pytest.approx((3.0, 0.5, 2.0))
    assert row["S_eagle3"] == pytest.approx(3.0 / (1 + 3 * 0.5 + (2.0 - 1))) == row["S"]
    assert row["S_gpu"] == pytest.approx(3.0 / (1 + 3 * costs.gpu_r(1)))
    assert row["accept_by_position"] == pytest.approx([1.0, 0.5, 1.0])


def test_bootstrap_is_seeded_and_covers_the_pooled_value():
    columns = {"N": [5, 9, 2, 7, 4, 8], "K": [10, 10, 10, 10, 10, 10], "r": [0.1, None, 0.3, 0.2, 0.2, 0.4]}
    stats = {"alpha": pooled_ratio("N", "K"), "r": median_of("r")}
    a = bootstrap(columns, stats)
    many = {"N": [(7 * i) % 23 + 1 for i in range(40)], "K": [30] * 40}
    stats_many = {"alpha": pooled_ratio("N", "K")}
    assert bootstrap(many, stats_many) == bootstrap(many, stats_many) != bootstrap(many, stats_many, seed=1)  # seeded
    assert a["alpha"][0] < 35 / 60 < a["alpha"][1] and 0.2 <= a["alpha"][1] - a["alpha"][0] <= 0.4
    assert 0.1 <= a["r"][0] <= 0.25 <= a["r"][1] <= 0.4
    assert bootstrap({"N": [1], "K": [2]}, stats | {"r": pooled_ratio("N", "K")})["alpha"] is None
    assert overlap([1.0, 2.0], [1.5, 3.0]) and not overlap([1.0, 2.0], [2.1, 3.0]) and overlap(None, [1, 2]) is None
