"""Pooled counters of a set of decodes: N, K, alpha, n*alpha, tokens/s, repetition, and the lossless check."""

from __future__ import annotations

from collections.abc import Sequence

from inference.cycle.result import DecodeResult
from inference.evaluation.repetition import repeated_share


def decode_rate(results: Sequence[DecodeResult]) -> float | None:
    """Pooled decode-phase tokens per second (the first token of each prompt comes from prefill)."""
    seconds = sum(r.decode_s for r in results)
    return sum(r.N - 1 for r in results) / seconds if seconds > 0 else None


def pooled_totals(results: list[DecodeResult], references: list[DecodeResult] | None, n: int) -> dict:
    """Pooled N, K, alpha, n*alpha, tokens/s and repeated 4-grams of the outputs; with AR `references`,
    whether every output is identical to its reference and the wall-clock speedup."""
    N, K = sum(r.N for r in results), sum(r.K for r in results)
    alpha = N / K if K and results[0].mode != "ar" else None
    out = {
        "N": N,
        "K": K,
        "alpha": alpha,
        "theoretical_speedup": n * alpha if alpha is not None else None,
        "decode_tokens_per_s": decode_rate(results),
        "repeated_4gram_share": repeated_share([r.tokens for r in results]),
    }
    if references is not None:
        out["lossless"] = all(a.tokens == b.tokens for a, b in zip(results, references))
        out["ar_decode_tokens_per_s"] = decode_rate(references)
        if out["decode_tokens_per_s"] and out["ar_decode_tokens_per_s"]:
            out["wall_clock_speedup"] = out["decode_tokens_per_s"] / out["ar_decode_tokens_per_s"]
    return out
