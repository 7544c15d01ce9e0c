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

from inference.chain.decoder import ChainDecoder
from inference.cycle.result import DecodeResult
from inference.evaluation.rows import eagle3_row
from inference.sampling import Sampling


class Eagle3Decoder:
    """EAGLE-3 chain decoding at one k on the eval's target (one drafter, its weights shared by every k)."""

    results = "eagle3_results"  # the report's list of this method's rows

    def __init__(self, base: ChainDecoder, k: int, args, eos: list[int]):
        self.base, self.k, self.args, self.eos = base, k, args, eos

    def warm_up(self, sampling: Sampling, prompt: list[int]) -> None:
        self.base.variant(self.k, sampling).decode(prompt, min(4, self.args.max_new_tokens), self.eos, self.args.seed)

    def decode(self, sampling: Sampling, prompts: list[list[int]], progress) -> list[DecodeResult]:
        decoder, args, results = self.base.variant(self.k, sampling), self.args, []
        for i, ids in enumerate(prompts):
            results.append(decoder.decode(ids, args.max_new_tokens, self.eos, args.seed + i).to_decode_result())
            progress(1)
        return results

    def row(self, results: list[DecodeResult], ar: list[DecodeResult]) -> dict:
        return eagle3_row(self.k, results, ar)


def plan_inputs(rows: list[dict]) -> list[dict]:
    """Per k, from the pooled rows at the lowest temperature: what `inference.plan` predicts EAGLE-3 from."""
    overall = [r for r in rows if r["set"] == "overall"]
    if not overall:
        return []
    lowest = min(r["temperature"] for r in overall)
    keys = ("k", "alpha", "tau", "T_full_s", "T_draft_step_s", "T_verify_s")
    return [{key: r[key] for key in keys} for r in overall if r["temperature"] == lowest]
