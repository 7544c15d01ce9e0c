"""How repetitive a generated output is: the share of tokens that complete a k-gram seen earlier in it.

A target trained for a few CPU minutes repeats itself, and repetition flatters every drafter (docs/DESIGN.md, "Real parts, offline"):
`decode` prints this share beside alpha, and `scripts/bench_paper.py repetition` measures it per prompt set.
"""

from __future__ import annotations

from collections.abc import Sequence


def repeated_kgrams(tokens: Sequence[int], k: int = 4) -> tuple[int, int]:
    """(generated tokens that complete a k-gram already seen earlier in the same output, tokens that end a k-gram)."""
    seen, repeats = set(), 0
    for i in range(k - 1, len(tokens)):
        gram = tuple(tokens[i - k + 1 : i + 1])
        repeats += gram in seen
        seen.add(gram)
    return repeats, max(len(tokens) - k + 1, 0)


def repeated_share(outputs: Sequence[Sequence[int]], k: int = 4) -> float | None:
    """Pooled over `outputs`: the share of k-gram ends that repeat an earlier k-gram of the same output
    (None when no output is k tokens long)."""
    counts = [repeated_kgrams(tokens, k) for tokens in outputs]
    ends = sum(e for _, e in counts)
    return sum(r for r, _ in counts) / ends if ends else None
