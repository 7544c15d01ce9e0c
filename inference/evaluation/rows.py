"""One benchmark row per method and group of prompts, every method on one footing (inference/evaluation/costs.py):
pooled acceptance, the draft cost `r` in units of the same process's AR forward (median over prompts, with
its spread), the theoretical speedup at that `r` and at the paper's GPU `r`, the wall-clock speedup, and a
95 % bootstrap interval over prompts for each of them (inference/evaluation/intervals.py).

The decodes of a method and the AR baseline come in the same prompt order, so each resample draws the same
prompts for both.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial

import numpy as np

from inference.cycle.result import DecodeResult
from inference.evaluation import costs
from inference.evaluation.intervals import bootstrap, median_of, pooled_ratio
from inference.evaluation.totals import acceptance_by, acceptance_by_position, decode_rate

log = logging.getLogger(__name__)


def _intervals(
    results: Sequence[DecodeResult], ar: Sequence[DecodeResult], columns: dict[str, list], statistics: dict
) -> dict:
    """The row's 95 % intervals: pooled alpha = N / K, the method's own `statistics` of its per-prompt `columns`,
    and the wall-clock speedup (decoded tokens over decode seconds, the method's over AR's)."""
    columns = {
        "N": [r.N for r in results],
        "K": [r.K for r in results],
        **columns,
        "tokens": [r.N - 1 for r in results],
        "seconds": [r.decode_s for r in results],
        "ar_tokens": [r.N - 1 for r in ar],
        "ar_seconds": [r.decode_s for r in ar],
    }

    def wall_clock(c):
        return pooled_ratio("tokens", "seconds")(c) / pooled_ratio("ar_tokens", "ar_seconds")(c)

    return bootstrap(columns, {"alpha": pooled_ratio("N", "K"), **statistics, "wall_clock_speedup": wall_clock})


def _wall_and_times(results: Sequence[DecodeResult], ar: Sequence[DecodeResult]) -> dict:
    tps, ar_tps = decode_rate(results), decode_rate(ar)
    return {
        "T_full_s": 1.0 / ar_tps if ar_tps else None,
        "decode_tokens_per_s": tps,
        "ar_decode_tokens_per_s": ar_tps,
        "wall_clock_speedup": tps / ar_tps if tps and ar_tps else None,
    }


def _spread(name: str, values: Sequence[float | None]) -> dict:
    """`name`: the median of the measured per-prompt values (None: not measured), beside their min, max and
    count; fewer than MIN_REPEATS is warned about."""
    xs = [x for x in values if x is not None]
    if 0 < len(xs) < costs.MIN_REPEATS:
        log.warning(
            "%s is the median of %d prompt(s), under %d: evaluate more prompts", name, len(xs), costs.MIN_REPEATS
        )
    median = float(np.median(xs)) if xs else None
    return {
        name: median,
        f"{name}_min": min(xs, default=None),
        f"{name}_max": max(xs, default=None),
        f"{name}_repeats": len(xs),
    }


def pdm_row(mode: str, n: int, L_s: int, results: list[DecodeResult], ar: list[DecodeResult]) -> dict:
    """A PDM drafter (SPD, post-step, PPSD) at `n` stages and `L_s` layers on a group of prompts."""
    N, K = sum(r.N for r in results), sum(r.K for r in results)
    alpha = N / K if K else None
    rs = costs.pdm_r(results, ar)
    r = _spread("r", rs)
    r_gpu = costs.gpu_r(L_s)
    speedup = partial(costs.pdm_speedup, mode)
    row = {
        "prompts": len(results),
        "N": N,
        "K": K,
        "alpha": alpha,
        **r,
        **_cycle_times(results, K),
        "S0": n * alpha if alpha is not None else None,
        "S_spd": _maybe(costs.s_spd, n, alpha, r["r"]),
        "S_post": _maybe(costs.s_ppsd, n, alpha, r["r"]),
        "S_ppsd": _maybe(costs.s_ppsd, n, alpha, r["r"]),
        "S": _maybe(speedup, n, alpha, r["r"]),
        "r_gpu": r_gpu,
        "S_gpu": _maybe(speedup, n, alpha, r_gpu),
        **_wall_and_times(results, ar),
        "accept_by_depth": acceptance_by(results, "depth"),
        "accept_by_fill": acceptance_by(results, "fill"),
    }
    alpha_of, r_of = pooled_ratio("N", "K"), median_of("r")
    statistics = {
        "S0": pooled_ratio("N", "K", n),
        "r": r_of,
        "S": lambda c: speedup(n, alpha_of(c), r_of(c)),
        "S_gpu": lambda c: speedup(n, alpha_of(c), r_gpu),
    }
    row["ci"] = _intervals(results, ar, {"r": rs}, statistics)
    return row


def _cycle_times(results: Sequence[DecodeResult], K: int) -> dict:
    """Per-cycle means the planner reads (evaluation/plan.py): draft, wall, slowest stage, the stages' sum."""
    if not K:
        return dict.fromkeys(("T_draft_s", "mean_cycle_s", "mean_slowest_stage_s", "mean_stage_sum_s"))
    totals = [r.timing.get("totals", {}) for r in results]
    return {
        "T_draft_s": sum(t.get("draft_s", 0.0) for t in totals) / K,
        "mean_cycle_s": sum(t.get("wall_s", 0.0) for t in totals) / K,
        "mean_slowest_stage_s": sum(t.get("mean_slowest_stage_s", 0.0) * r.K for t, r in zip(totals, results)) / K,
        "mean_stage_sum_s": sum(sum(t.get("stage_compute_s", [])) for t in totals) / K,
    }


def eagle3_row(k: int, results: list[DecodeResult], ar: list[DecodeResult]) -> dict:
    """EAGLE-3 chain decoding at `k` on a group of prompts: tokens per target forward `alpha = N / K` (`K` verify
    forwards after prefill, the prefill's token counted in `N` as in SPD's alpha; `S0 = alpha`, the speedup with a
    free drafter at n = 1), `tau`, and `S_eagle3` with k draft steps and one verify over k + 1 tokens, each in
    units of the AR forward."""
    N, K = sum(r.N for r in results), sum(r.K for r in results)
    accepted = [sum(r.counters["accept_lengths"]) for r in results]
    alpha, tau = (N / K, sum(accepted) / K) if K else (None, None)
    rs, vs = costs.eagle3_r(results, ar)
    r, v = _spread("r", rs), _spread("verify_ratio", vs)
    totals = [x.timing["totals"] for x in results]
    steps = sum(t["draft_steps"] for t in totals)
    r_gpu = costs.gpu_r(1)
    row = {
        "method": "eagle3",
        "k": k,
        "prompts": len(results),
        "N": N,
        "K": K,
        "alpha": alpha,
        "tau": tau,
        "S0": alpha,
        **r,
        **v,
        "T_draft_step_s": sum(t["draft_s"] for t in totals) / steps if steps else None,
        "T_verify_s": sum(t["verify_s"] for t in totals) / K if K else None,
        "S_eagle3": _maybe(costs.s_eagle3, tau, k, r["r"], v["verify_ratio"]),
        "r_gpu": r_gpu,
        "S_gpu": _maybe(costs.s_eagle3, tau, k, r_gpu, costs.GPU_VERIFY_RATIO),
        **_wall_and_times(results, ar),
        "accept_by_position": acceptance_by_position([t for x in results for t in x.counters["accept_lengths"]], k),
    }
    row["S"] = row["S_eagle3"]
    tau_of, r_of, v_of = pooled_ratio("accepted", "K"), median_of("r"), median_of("v")
    statistics = {
        "S0": pooled_ratio("N", "K"),
        "tau": tau_of,
        "r": r_of,
        "S": lambda c: costs.s_eagle3(tau_of(c), k, r_of(c), v_of(c)),
        "S_gpu": lambda c: costs.s_eagle3(tau_of(c), k, r_gpu, costs.GPU_VERIFY_RATIO),
    }
    row["ci"] = _intervals(results, ar, {"accepted": accepted, "r": rs, "v": vs}, statistics)
    return row


def _maybe(formula, *args) -> float | None:
    """The formula's value as a float, None when an input is missing."""
    return None if any(a is None for a in args) else float(formula(*args))
