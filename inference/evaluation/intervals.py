"""95 % bootstrap intervals over prompts for every number a benchmark row reports (alpha, n*alpha, tokens per
target forward, every speedup).

A row's numbers are functions of per-prompt columns (tokens, forwards, the per-prompt draft cost `r`, decode
seconds). One bootstrap draws RESAMPLES sets of prompts with replacement (seeded, so a rerun gives the same
interval) and evaluates every statistic on all of them at once: each column becomes a [RESAMPLES, prompts]
array, a statistic maps those to one value per resample, and the interval is the 2.5th and 97.5th
percentile. The draft cost is resampled with the acceptance, so a speedup's interval carries both noises.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping

import numpy as np

RESAMPLES = 2000
SEED = 0
LEVEL = 0.95

Columns = Mapping[str, np.ndarray]
Statistic = Callable[[Columns], np.ndarray]


def pooled_ratio(numerator: str, denominator: str, scale: float = 1.0) -> Statistic:
    """`scale * sum(numerator) / sum(denominator)` over the prompts of each resample (alpha = N / K pooled)."""
    return lambda c: scale * c[numerator].sum(axis=1) / c[denominator].sum(axis=1)


def median_of(column: str) -> Statistic:
    """The median of a per-prompt measurement (the draft cost r), ignoring prompts where it is missing (NaN)."""
    return lambda c: np.nanmedian(c[column], axis=1)


def bootstrap(
    columns: Mapping[str, list], statistics: Mapping[str, Statistic], seed: int = SEED
) -> dict[str, list[float] | None]:
    """{name: [low, high]} of each statistic's 95 % percentile interval over prompts; None for fewer than two
    prompts or a statistic undefined on most resamples. Missing per-prompt values (None) become NaN."""
    sizes = {len(v) for v in columns.values()}
    if len(sizes) != 1:
        raise ValueError(f"per-prompt columns differ in length: {sorted(sizes)}")
    prompts = sizes.pop()
    if prompts < 2:
        return {name: None for name in statistics}
    index = np.random.default_rng(seed).integers(0, prompts, size=(RESAMPLES, prompts))
    drawn = {name: np.array([np.nan if x is None else x for x in v], dtype=float)[index] for name, v in columns.items()}
    tail = (1.0 - LEVEL) / 2 * 100
    out: dict[str, list[float] | None] = {}
    with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # nanmedian of a resample without the value: dropped below
        for name, statistic in statistics.items():
            values = np.asarray(statistic(drawn), dtype=float)
            values = values[np.isfinite(values)]
            ok = len(values) >= RESAMPLES / 2
            out[name] = [float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))] if ok else None
    return out


def overlap(a: list[float] | None, b: list[float] | None) -> bool | None:
    """Whether two intervals overlap (None when either is missing)."""
    if a is None or b is None:
        return None
    return a[0] <= b[1] and b[0] <= a[1]
