"""The EAGLE-3 part of `inference.eval`: chain decoding at each `--k`, summarized on SPD's footing (SPEC 6, 12).

Every row is measured in the same run, on the same target object and prompts, as the SPD rows and the AR
baseline (`inference/eval.py`); the AR time is the one the SPD rows use. Per row:

- `alpha = N / K`: tokens per target forward (`K` verify forwards after prefill; the prefill's token
  counted in `N`, as in SPD's alpha); `S0 = alpha` (n = 1: the speedup with a free drafter);
- `tau`: mean accepted drafts + 1 per verify forward; `T_draft_step_s` (one chain step, the drafter's
  commit of accepted rows included) and `T_verify_s` (one target forward over k + 1 positions);
  `r = T_draft_step / T_verify` and `S_eagle3 = tau / (1 + k r)` (SPEC 6);
- wall-clock: decode-phase tokens/s over AR's.

`plan_inputs(rows)` is what `inference.plan` reads to predict EAGLE-3's wall clock beside SPD's;
`side_by_side` puts every method's rows of a report on one footing (its table and plot): each PDM drafter
(SPD, PPSD, post-step: `--ckpt` and `--compare`) and EAGLE-3 at each k.
"""

from __future__ import annotations

from collections.abc import Callable

from spd_lightning.target import Target

from . import cli
from .chain import ChainDecoder
from .result import DecodeResult
from .tables import fmt, grouped_bars, markdown_table, pyplot, save
from .verify import Sampling


class Eagle3Decoders:
    """One EAGLE-3 drafter on the eval's target (weights shared), one chain decoder per (k, sampling)."""

    def __init__(self, target: Target, drafter_path: str, ks: list[int]):
        self.ks = sorted(set(ks))
        self.base = ChainDecoder.on_target(target, drafter_path, max(self.ks))
        self.path = drafter_path

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


def summarize(k: int, results: list[DecodeResult], ar: list[DecodeResult]) -> dict:
    """Pooled numbers of EAGLE-3 at `k` on a group of prompts, beside the AR baseline `ar` of the same prompts."""
    N, K = sum(r.N for r in results), sum(r.K for r in results)
    totals = [r.timing["totals"] for r in results]
    draft_s, verify_s = sum(t["draft_s"] for t in totals), sum(t["verify_s"] for t in totals)
    steps = sum(t["draft_steps"] for t in totals)
    tau = sum(sum(r.counters["accept_lengths"]) for r in results) / K if K else None
    t_step = draft_s / steps if steps else None
    t_verify = verify_s / K if K else None
    r_ratio = t_step / t_verify if t_step is not None and t_verify else None
    ar_tps, tps = cli.decode_rate(ar), cli.decode_rate(results)
    return {
        "method": "eagle3",
        "k": k,
        "prompts": len(results),
        "N": N,
        "K": K,
        "alpha": N / K if K else None,
        "tau": tau,
        "S0": N / K if K else None,
        "r": r_ratio,
        "T_full_s": 1.0 / ar_tps if ar_tps else None,
        "T_draft_step_s": t_step,
        "T_verify_s": t_verify,
        "S_eagle3": tau / (1.0 + k * r_ratio) if tau is not None and r_ratio is not None else None,
        "decode_tokens_per_s": tps,
        "ar_decode_tokens_per_s": ar_tps,
        "wall_clock_speedup": tps / ar_tps if tps and ar_tps else None,
    }


def plan_inputs(rows: list[dict]) -> list[dict]:
    """Per k, from the pooled rows at the lowest temperature: what `inference.plan` predicts EAGLE-3 from."""
    overall = [r for r in rows if r["set"] == "overall"]
    if not overall:
        return []
    lowest = min(r["temperature"] for r in overall)
    keys = ("k", "alpha", "tau", "T_full_s", "T_draft_step_s", "T_verify_s")
    return [{key: r[key] for key in keys} for r in overall if r["temperature"] == lowest]


THEORETICAL = {"spd": "S_spd", "post_step": "S_post", "ppsd": "S_ppsd"}


def side_by_side(report: dict) -> list[dict]:
    """Every method's rows on one footing: tokens per target forward, theoretical and wall-clock speedup."""
    spd = [{**r, "theoretical": r[THEORETICAL[r["mode"]]]} for r in report["results"]]
    eagle3 = [{**r, "method": f"eagle3 k={r['k']}", "theoretical": r["S_eagle3"]} for r in report["eagle3_results"]]
    return sorted(spd + eagle3, key=lambda r: (r["temperature"], r["set"] == "overall", r["set"]))


def side_by_side_table(report: dict) -> list[str]:
    head = ["method", "set", "T", "prompts", "tokens per target forward", "theoretical", "wall-clock"]
    rows = [
        [
            r["method"],
            r["set"],
            f"{r['temperature']:g}",
            str(r["prompts"]),
            fmt(r["S0"], 2),
            fmt(r["theoretical"], 2),
            fmt(r["wall_clock_speedup"], 2),
        ]
        for r in side_by_side(report)
    ]
    eagle3 = f", EAGLE-3 drafter {report['eagle3_drafter']}" if report["eagle3_drafter"] else ""
    title = (
        f"Side by side, speedups over AR measured in this run (tokens per target forward: n*alpha for SPD, "
        f"N/K for EAGLE-3; theoretical: S_spd, S_post/S_ppsd, S_eagle3 = tau/(1+k*r)){eagle3}"
    )
    return [title, "", *markdown_table(head, rows)]


def plot_side_by_side(report: dict, path: str) -> None:
    rows = side_by_side(report)
    labels = [f"{r['method']}\n{r['set']} T={r['temperature']:g}" for r in rows]
    fig, (ax1, ax2) = pyplot().subplots(1, 2, figsize=(max(8, 1.6 * len(rows)), 4))
    x = grouped_bars(ax1, [("tokens per target forward", [r["S0"] for r in rows])])
    ax1.set_xticks(x, labels, fontsize=6)
    ax1.set_title("tokens per target forward")
    keys = [("theoretical", "theoretical"), ("wall_clock_speedup", "wall-clock")]
    x = grouped_bars(ax2, [(label, [r[key] for r in rows]) for key, label in keys])
    ax2.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax2.set_xticks(x, labels, fontsize=6)
    ax2.set_title("speedup over AR, same run")
    ax2.legend(fontsize=8)
    save(fig, path)
