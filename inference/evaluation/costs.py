"""One cost model for every method: the speedup formulas, the draft cost `r` measured in one process, and the
`r` a GPU has at the paper's shapes (the unit `T_full`, `r`, `v` and the formulas: docs/DESIGN.md, "Speedup
formulas").

CPU timings are noisy, so `r` (and `v`) is the median of the per-prompt ratios, each prompt's drafter time
over the same prompt's AR time (one repeat per prompt), with its spread. The formulas take floats or numpy
arrays (the bootstrap of inference/evaluation/intervals.py evaluates them on every resample at once).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from inference.cycle.result import DecodeResult
from spd_lightning.errors import UsageError

MIN_REPEATS = 5  # per-prompt timings behind one median r; fewer is flagged in the row (`r_repeats`)


def measured_value(value: object, where: str, fix: str, integer: bool = False, zero_ok: bool = False):
    """A number an eval or bench JSON holds, before any formula reads it (a hand-edited file: a string, 0, NaN, a
    negative): None when absent, else a finite number > 0 (>= 0 with `zero_ok`; an integer >= 1 with `integer`);
    one line naming it (`where`) and the `fix` otherwise."""
    if value is None:
        return None
    kind = int if integer else (int, float)
    number = isinstance(value, kind) and not isinstance(value, bool) and math.isfinite(value)
    if not number or value < 0 or (value == 0 and not zero_ok):
        what = "an integer >= 1" if integer else f"a number {'>= 0' if zero_ok else '> 0'}"
        raise UsageError(f"{where}={value!r} must be {what}: {fix}")
    return value


def s_spd(n: int, alpha, r):
    """`n*alpha * min(1, 1/(n r))`, written so that r = 0 gives `n*alpha`."""
    return n * alpha / np.maximum(1.0, n * r)


def s_ppsd(n: int, alpha, r):
    """`n*alpha / (1 + n r)`: PPSD and post-step SPD, whose drafting is serial."""
    return n * alpha / (1.0 + n * r)


def s_eagle3(tau, k: int, r, verify_ratio):
    """`tau / (1 + k r + (T_verify(k+1)/T_full - 1))`: k serial drafts plus one verify over k + 1 tokens."""
    return tau / (1.0 + k * r + (verify_ratio - 1.0))


def cycle(stage, draft, overhead, schedule: str):
    """The planner's cycle: drafting overlaps the stages pre-step and follows them post-step (PPSD)."""
    return (max(stage, draft) if schedule == "pre_step" else stage + draft) + overhead


FORMULAS = {"spd": s_spd, "post_step": s_ppsd, "ppsd": s_ppsd}


def pdm_speedup(mode: str, n: int, alpha, r):
    """The theoretical speedup of a PDM drafter in `mode` (spd, post_step, ppsd), draft cost charged."""
    if mode not in FORMULAS:
        raise ValueError(f"mode={mode!r} has no speedup formula: expected one of {', '.join(FORMULAS)}")
    return FORMULAS[mode](n, alpha, r)


# The paper's 4B run at n = 8, L_s = 3 (docs/DESIGN.md, "Reference numbers"): slowest stage 4.20 ms, PDM 3.49 ms.
PAPER_N, PAPER_L_S = 8, 3
PAPER_SLOWEST_STAGE_S, PAPER_PDM_S = 4.20e-3, 3.49e-3
# Inferred, not reported: T_full = n x the slowest stage (32 layers split evenly over 8 stages), a draft layer
# costs the PDM's time / L_s (no fixed part), EAGLE-3's one layer costs a PDM layer, and a batch-1 verify over
# k + 1 <= 8 tokens costs one forward on a GPU (weight-bound).
PAPER_T_FULL_S = PAPER_N * PAPER_SLOWEST_STAGE_S
PAPER_DRAFT_LAYER_S = PAPER_PDM_S / PAPER_L_S
GPU_VERIFY_RATIO = 1.0
GPU_LABEL = "GPU r (from the paper's times)"


def gpu_r(draft_layers: int) -> float:
    """The `r` of a drafter of `draft_layers` layers at the paper's 4B shapes on its GPUs (about 0.035 per layer)."""
    return draft_layers * PAPER_DRAFT_LAYER_S / PAPER_T_FULL_S


def ar_token_s(ar: DecodeResult) -> float | None:
    """One prompt's AR time per decoded token: one full target forward (the prefill's token excluded)."""
    return ar.decode_s / (ar.N - 1) if ar.N > 1 and ar.decode_s > 0 else None


def pdm_r(results: Sequence[DecodeResult], ar: Sequence[DecodeResult]) -> list[float | None]:
    """Per prompt: the PDM's draft time per cycle (one draft token per cycle) over the same prompt's AR time per
    token; None where either was not measured."""
    out = []
    for spd, base in zip(results, ar, strict=True):
        t_full, draft_s = ar_token_s(base), spd.timing.get("totals", {}).get("draft_s")
        out.append(draft_s / spd.K / t_full if t_full and spd.K and draft_s is not None else None)
    return out


def eagle3_r(results: Sequence[DecodeResult], ar: Sequence[DecodeResult]) -> tuple[list, list]:
    """Per prompt: (r = one chain step, the drafter's commit of the accepted rows included, / T_full, v = one verify
    forward over k + 1 tokens / T_full)."""
    rs, vs = [], []
    for chain, base in zip(results, ar, strict=True):
        totals, t_full = chain.timing["totals"], ar_token_s(base)
        ok = t_full and totals["draft_steps"] and chain.K
        rs.append(totals["draft_s"] / totals["draft_steps"] / t_full if ok else None)
        vs.append(totals["verify_s"] / chain.K / t_full if ok else None)
    return rs, vs
