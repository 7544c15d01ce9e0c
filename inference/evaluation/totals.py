"""Pooled counters of a set of decodes: N, K, alpha, n*alpha, tokens/s, repetition, and the lossless check."""

from __future__ import annotations

from collections.abc import Sequence

from inference.cycle.result import DecodeResult
from inference.evaluation.intervals import bootstrap, pooled_ratio
from inference.evaluation.repetition import repeated_share


def decode_rate(results: Sequence[DecodeResult]) -> float | None:
    """Pooled decode-phase tokens per second (the first token of each prompt comes from prefill)."""
    seconds = sum(r.decode_s for r in results)
    return sum(r.N - 1 for r in results) / seconds if seconds > 0 else None


def acceptance_by(results: Sequence[DecodeResult], kind: str) -> list[float | None]:
    """Pooled acceptance of the judged drafts per `kind` (`depth` or `fill`): accepted / judged at each index,
    None where none was judged (depth and fill: docs/DESIGN.md, "Terms")."""
    rows = [(r.counters.get(f"accepted_by_{kind}"), r.counters.get(f"rejected_by_{kind}")) for r in results]
    rows = [(a, b) for a, b in rows if a is not None and b is not None]  # none: zip() gives []
    accepted = [sum(col) for col in zip(*(a for a, _ in rows))]
    rejected = [sum(col) for col in zip(*(b for _, b in rows))]
    return [a / (a + b) if a + b else None for a, b in zip(accepted, rejected)]


def acceptance_by_position(accept_lengths: Sequence[int], k: int) -> list[float | None]:
    """Chain decoding (EAGLE-3): per draft position j = 1..k, the share of forwards that reached j whose draft j
    was accepted (`accept_lengths` are accepted drafts + 1 per target forward)."""
    accepted = [tau - 1 for tau in accept_lengths]
    rates = []
    for j in range(1, k + 1):
        reached = sum(a >= j - 1 for a in accepted)
        rates.append(sum(a >= j for a in accepted) / reached if reached else None)
    return rates


def pooled_totals(results: list[DecodeResult], references: list[DecodeResult] | None, n: int) -> dict:
    """Pooled N, K, alpha, n*alpha (with its 95 % bootstrap interval over the prompts), tokens/s and repeated
    4-grams of the outputs; with AR `references`, whether every output is identical to its reference and the
    wall-clock speedup."""
    N, K = sum(r.N for r in results), sum(r.K for r in results)
    alpha = N / K if K and results[0].mode != "ar" else None
    out = {
        "N": N,
        "K": K,
        "alpha": alpha,
        "theoretical_speedup": n * alpha if alpha is not None else None,
        "theoretical_speedup_interval": None,
        "decode_tokens_per_s": decode_rate(results),
        "repeated_4gram_share": repeated_share([r.tokens for r in results]),
    }
    if alpha is not None:
        per_prompt = {"N": [r.N for r in results], "K": [r.K for r in results]}
        out["theoretical_speedup_interval"] = bootstrap(per_prompt, {"n_alpha": pooled_ratio("N", "K", n)})["n_alpha"]
    if references is not None:
        out["lossless"] = all(a.tokens == b.tokens for a, b in zip(results, references))
        out["ar_decode_tokens_per_s"] = decode_rate(references)
        if out["decode_tokens_per_s"] and out["ar_decode_tokens_per_s"]:
            out["wall_clock_speedup"] = out["decode_tokens_per_s"] / out["ar_decode_tokens_per_s"]
    return out
