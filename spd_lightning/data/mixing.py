"""Deterministic train/validation split and weighted mixing of several sources.

Weights are mixture proportions: after normalization, source `s` makes up `w_s` of the training set, and
the training set has as many samples as all sources' training parts together (so a single source, or
equal weights on equal sizes, is just a shuffle). A source whose share exceeds its size is repeated, one
below it is subsampled; the log line says which. Validation is split off each source BEFORE mixing, in
the same proportions, so a repeated sample can never sit in both splits. Everything depends only on
`seed`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .formats import DataError


@dataclass
class MixturePlan:
    """Per source, the row indices (into that source's usable samples) of each split, and the log line."""

    train: list[np.ndarray]
    val: list[np.ndarray]
    summary: str


def allocate(total: int, weights: Sequence[float]) -> list[int]:
    """Split `total` into integer counts proportional to `weights` (largest remainder; ties to the earlier source)."""
    shares = np.asarray(weights, dtype=np.float64) / float(np.sum(weights)) * total
    counts = np.floor(shares).astype(np.int64)
    remainder_order = np.argsort(-(shares - counts), kind="stable")
    counts[remainder_order[: total - int(counts.sum())]] += 1
    return counts.tolist()


def check_val_size(val_size: float | int) -> None:
    if isinstance(val_size, bool) or not val_size >= 0:
        raise DataError(f"val_size={val_size!r}: use a sample count (int >= 0) or a fraction in (0, 1)")
    if isinstance(val_size, float) and not val_size.is_integer() and val_size > 1:
        raise DataError(f"val_size={val_size}: a fraction must be below 1 (or pass an integer count)")


def validation_count(val_size: float | int, total: int) -> int:
    """`val_size` as a count: an int is a count, a float in (0, 1) a fraction (at least one sample)."""
    check_val_size(val_size)
    if isinstance(val_size, float) and not val_size.is_integer():
        count = max(1, round(val_size * total))
    else:
        count = int(val_size)
    if count >= total:
        raise DataError(
            f"val_size={val_size!r} asks for {count} validation samples but only {total} usable samples "
            f"exist: lower val_size or add data"
        )
    return count


def _draw(pool: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` items of `pool`: whole reshuffled copies, then a random part of one more."""
    repeats, rest = divmod(count, len(pool))
    parts = [rng.permutation(pool) for _ in range(repeats)] + [rng.permutation(pool)[:rest]]
    return np.concatenate(parts)


def plan_mixture(
    names: Sequence[str], sizes: Sequence[int], weights: Sequence[float], val_size: float | int, seed: int
) -> MixturePlan:
    total = int(sum(sizes))
    val_counts = allocate(validation_count(val_size, total), weights)
    # every source keeps at least one training sample, whatever its share of the validation set
    val_counts = [min(v, n - 1) for v, n in zip(val_counts, sizes)]
    rng = np.random.default_rng(seed)
    permutations = [rng.permutation(n) for n in sizes]
    val = [perm[:v] for perm, v in zip(permutations, val_counts)]
    pools = [perm[v:] for perm, v in zip(permutations, val_counts)]

    train_counts = allocate(sum(len(p) for p in pools), weights)
    train = [_draw(pool, count, rng) for pool, count in zip(pools, train_counts)]
    shares = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
    parts = [
        f"{name} {share:.1%} ({count:,} samples = {count / len(pool):.2f}x its {len(pool):,})"
        for name, share, count, pool in zip(names, shares, train_counts, pools)
    ]
    summary = (
        f"training mixture of {sum(train_counts):,} samples: "
        + "; ".join(parts)
        + f". validation: {sum(val_counts):,} samples"
    )
    return MixturePlan(train, val, summary)
