"""Fill levels as decoding meets them (docs/DESIGN.md, "Simulated fill levels"), defined once for training,
validation, the staircase evaluation and the decoder's tests. Plain Python: `inference/` may import it.

A judged draft's fill level is the number of tokens in flight when it was drafted (`PipelineSchedule`). After a
rejection (and after the prefill) the pipeline refills from fill 1, and each accepted draft lets the next one be
drafted one fill higher, up to `n`. With `p[k-1]` the acceptance of drafts made at fill `k`, the fills of
successive judged drafts are a Markov chain on `1..n`: accept -> `min(k + 1, n)`, reject -> 1. Its stationary
distribution is the share of judged drafts at each fill:

    pi_k ~ p_1 ... p_{k-1}                      (k < n)
    pi_n ~ p_1 ... p_{n-1} / (1 - p_n)

which for one acceptance `p` at every fill is `(1 - p) p^(k-1)` at `k < n` and `p^(n-1)` at `n`. Each rejection
costs `n - 1` cycles beyond the one a token takes, so with `p_bar = sum_k pi_k p_k` (the acceptance per judged
draft) `n*alpha = n / (1 + (n - 1)(1 - p_bar))` in the long run (a decode of `N` tokens also pays one refill at
its start, about `n - 1` cycles, which this leaves out).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def per_fill(acceptance: float | Sequence[float], n: int) -> list[float]:
    """`acceptance` as one value per fill `1..n` (a scalar means the same at every fill), checked."""
    values = [float(acceptance)] * n if isinstance(acceptance, int | float) else [float(p) for p in acceptance]
    if len(values) != n or any(not 0.0 <= p <= 1.0 for p in values):
        raise ValueError(f"acceptance {acceptance!r} must be one value or n={n} values, each in [0, 1]")
    return values


def judged_fill_shares(acceptance: float | Sequence[float], n: int) -> list[float]:
    """The share of judged drafts made at fill `k = 1..n` (the stationary distribution of the refill chain)."""
    p = per_fill(acceptance, n)
    reach = [1.0]  # reach[k-1]: p_1 ... p_{k-1}, the chance a refill gets to fill k
    for k in range(1, n):
        reach.append(reach[-1] * p[k - 1])
    if p[-1] >= 1.0 and reach[-1] > 0:  # a full pipeline is never left: every judged draft ends up at fill n
        return [0.0] * (n - 1) + [1.0]
    weights = reach[:-1] + [reach[-1] / (1.0 - p[-1])]
    total = sum(weights)
    return [w / total for w in weights]


def judged_acceptance(acceptance: float | Sequence[float], n: int) -> float:
    """`p_bar`: the acceptance of a judged draft, averaged over the fills decoding judges drafts at."""
    p = per_fill(acceptance, n)
    return sum(share * pk for share, pk in zip(judged_fill_shares(p, n), p))


def predicted_n_alpha(acceptance: float | Sequence[float], n: int) -> float:
    """`n*alpha` of the refill model: `n / (1 + (n - 1)(1 - p_bar))`."""
    return n / (1.0 + (n - 1) * (1.0 - judged_acceptance(acceptance, n)))


def walk(accepted: Sequence[Sequence[bool]], n: int) -> list[int]:
    """One greedy decode of a known answer, walked: `accepted[j][k - 1]` says whether the draft of the answer's `j`-th
    drafted token (its first token comes from the prefill) is accepted when made at fill `k`. From fill 1, an accept
    goes to `min(k + 1, n)`, a reject to 1. Returns the fill each draft is judged at."""
    fills, fill = [], 1
    for row in accepted:
        fills.append(fill)
        fill = min(fill + 1, n) if row[fill - 1] else 1
    return fills


def walked_counts(accepted: Sequence[Sequence[bool]], n: int) -> tuple[list[int], list[int]]:
    """The accepted and rejected drafts per fill of `walk`, which at T = 0 are the decoder's own `accepted_by_fill` /
    `rejected_by_fill` for that answer (tests/test_decode_prediction.py)."""
    accepted_by_fill, rejected_by_fill = [0] * n, [0] * n
    for row, fill in zip(accepted, walk(accepted, n)):
        (accepted_by_fill if row[fill - 1] else rejected_by_fill)[fill - 1] += 1
    return accepted_by_fill, rejected_by_fill


def walked_cycles(accepted: Sequence[Sequence[bool]], n: int) -> int:
    """`K` of the walked decode: `n` cycles until the first draft is judged (the prefill's token goes through every
    stage first), then 1 cycle after an accept and `n` after a rejection (the corrected token refills the pipeline);
    the decode ends with its last verdict. Its `N` is one token per judged draft plus the prefill's."""
    rows = list(accepted)
    if not rows:
        return 0
    fills = walk(rows, n)
    return n + sum(1 if row[fill - 1] else n for row, fill in zip(rows[:-1], fills[:-1]))


def measured_prediction(accept_by_fill: Mapping[int, float], n: int) -> tuple[float, float] | None:
    """`(p_bar, n*alpha)` from acceptances measured per fill `k` (teacher-forced, say); a fill with no measurement
    takes the mean of the others; None when none was measured."""
    if not accept_by_fill:
        return None
    mean = sum(accept_by_fill.values()) / len(accept_by_fill)
    p = [accept_by_fill.get(k, mean) for k in range(1, n + 1)]
    return judged_acceptance(p, n), predicted_n_alpha(p, n)
