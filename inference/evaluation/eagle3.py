"""The EAGLE-3 part of `inference.eval`: chain decoding at each `--k`, summarized on SPD's footing (docs/DESIGN.md, "Speedup formulas", "The EAGLE-3 baseline").

Every row is measured in the same run, on the same target object and prompts, as the SPD rows and the AR
baseline (`inference/eval.py`); the AR time is the one the SPD rows use. Per row:

- `alpha = N / K`: tokens per target forward (`K` verify forwards after prefill; the prefill's token
  counted in `N`, as in SPD's alpha); `S0 = alpha` (n = 1: the speedup with a free drafter);
- `tau`: mean accepted drafts + 1 per verify forward; `r` = one chain step (the drafter's commit of
  accepted rows included) over the same prompt's AR forward, `verify_ratio` = one target forward over
  k + 1 positions over it (medians over prompts); `S_eagle3 = tau / (1 + k r + (verify_ratio - 1))`
  (inference/evaluation/costs.py, the row built by inference/evaluation/rows.py);
- wall-clock: decode-phase tokens/s over AR's.

`plan_inputs(rows)` is what `inference.plan` reads to predict EAGLE-3's wall clock beside SPD's; the report
puts these rows beside the PDM drafters' (inference/evaluation/report.py).
"""

from __future__ import annotations

from collections.abc import Callable

from inference.chain.decoder import ChainDecoder
from inference.cycle.result import DecodeResult
from inference.sampling import Sampling
from spd_lightning.target import Target


class Eagle3Decoders:
    """One EAGLE-3 drafter on the eval's target (weights shared), one chain decoder per (k, sampling)."""

    def __init__(self, target: Target, drafter_path: str, ks: list[int]):
        self.ks = sorted(set(ks))
        self.base = ChainDecoder.on_target(target, drafter_path, max(self.ks))

    def warm_up(self, sampling: Sampling, prompt: list[int], max_new_tokens: int, eos: list[int], seed: int) -> None:
        for k in self.ks:
            self.base.variant(k, sampling).decode(prompt, min(4, max_new_tokens), eos, seed)

    def decode(
        self,
        k: int,
        sampling: Sampling,
        prompts: list[list[int]],
        args,
        eos: list[int],
        progress: Callable[[int], None],
    ) -> list[DecodeResult]:
        decoder, results = self.base.variant(k, sampling), []
        for i, ids in enumerate(prompts):
            results.append(decoder.decode(ids, args.max_new_tokens, eos, args.seed + i).to_decode_result())
            progress(1)
        return results


def plan_inputs(rows: list[dict]) -> list[dict]:
    """Per k, from the pooled rows at the lowest temperature: what `inference.plan` predicts EAGLE-3 from."""
    overall = [r for r in rows if r["set"] == "overall"]
    if not overall:
        return []
    lowest = min(r["temperature"] for r in overall)
    keys = ("k", "alpha", "tau", "T_full_s", "T_draft_step_s", "T_verify_s")
    return [{key: r[key] for key in keys} for r in overall if r["temperature"] == lowest]
