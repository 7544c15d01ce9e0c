"""`python -m inference.eval`: benchmark a drafter on prompt sets (SPEC 6): alpha, speedups, wall-clock.

    python -m inference.eval --ckpt drafter/ --prompts ../shared/data/gsm8k_question.jsonl \\
        ../shared/data/humaneval_question.jsonl --temperatures 0 1 --limit 80 --out eval_out --simulate

For each EAGLE-style jsonl set (or dataset, see inference/prompts.py) and each temperature (T > 0
samples with `--top-k`/`--top-p`, by default top-k 50 and top-p 1.0), every prompt is decoded by the SPD
decoder (`--simulate`: the one-process simulator; otherwise the n+1-process pipeline) and by plain AR
decoding of the same target loaded in this process. Reported per set and overall (all sets pooled):

- `alpha = N / K` (pooled over prompts) and `S0 = n * alpha`;
- `r = T_draft / T_full`: `T_draft` is the decoder's mean per-cycle draft time, `T_full` the AR
  baseline's mean per-token decode time (one full forward of the target);
- the draft-cost-adjusted speedups of SPEC 6: `S_spd = n*alpha*min(1, 1/(n*r))` (drafting masked while
  it fits in one stage) and `S_post = S_ppsd = n*alpha / (1 + n*r)`;
- wall-clock: decode-phase tokens/s of the decoder over the AR baseline's (prefill excluded). Under
  `--simulate` the stages run in sequence, so this number is not the pipeline's.

Writes DIR/eval.json (every number, plus what `inference.plan` reads), DIR/eval.md (a markdown table)
and DIR/eval.png. Exit status: 0 done, 2 bad input (one line on stderr; `--debug` shows tracebacks),
1 an unexpected error.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

from .ar import ar_decode
from .decode import DecodeJob, UsageError, encode_prompts, prepare, run_guarded
from .prompts import PromptError, dataset_spec, read_prompts
from .result import DecodeResult
from .verify import Sampling


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m inference.eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="Lightning .ckpt or exported drafter directory")
    p.add_argument("--prompts", nargs="+", required=True,
                   help="EAGLE-style jsonl sets (first turn of each line), or datasets NAME[:CONFIG][@SPLIT] (hub or local)")
    p.add_argument("--target", help="target checkpoint directory (default: the one the drafter was trained on)")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="0 = greedy")
    p.add_argument("--top-k", type=int, default=50, help="for T > 0 (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="for T > 0, in (0, 1]")
    p.add_argument("--limit", type=int, help="first K prompts of each set")
    p.add_argument("--out", default="eval_out", help="output directory")
    p.add_argument("--mode", choices=["spd", "post_step", "ppsd"], help="default: the drafter's own mode")
    p.add_argument("--simulate", action="store_true", help="decode in this process (stages in sequence)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16; auto = bf16 on cuda, fp32 on cpu")
    p.add_argument("--seed", type=int, default=0, help="prompt i uses seed + i")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a rank may wait on a peer (no --simulate)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p.parse_args(argv)


def speedups(n: int, alpha: float | None, r: float | None) -> dict:
    """SPEC 6's speedups over single-device AR decoding for `n` stages, acceptance `alpha`, `r = T_draft/T_full`."""
    if alpha is None:
        return {"S0": None, "S_spd": None, "S_post": None, "S_ppsd": None}
    s0 = n * alpha
    if r is None:
        return {"S0": s0, "S_spd": None, "S_post": None, "S_ppsd": None}
    s_post = s0 / (1 + n * r)
    s_spd = s0 * (min(1.0, 1.0 / (n * r)) if r > 0 else 1.0)
    return {"S0": s0, "S_spd": s_spd, "S_post": s_post, "S_ppsd": s_post}


def summarize(n: int, spd: list[DecodeResult], ar: list[DecodeResult]) -> dict:
    """Pooled numbers of a group of prompts (one set, or all sets) at one temperature."""
    N, K = sum(r.N for r in spd), sum(r.K for r in spd)
    alpha = N / K if K else None
    spd_s, ar_s = sum(r.decode_s for r in spd), sum(r.decode_s for r in ar)
    spd_tok, ar_tok = sum(r.N - 1 for r in spd), sum(r.N - 1 for r in ar)
    t_full = ar_s / ar_tok if ar_tok and ar_s > 0 else None
    draft_s = sum(r.timing.get("totals", {}).get("draft_s", 0.0) for r in spd)
    t_draft = draft_s / K if K else None
    cycle_s = sum(r.timing.get("totals", {}).get("wall_s", 0.0) for r in spd) / K if K else None
    slowest = sum(r.timing.get("totals", {}).get("mean_slowest_stage_s", 0.0) * r.K for r in spd) / K if K else None
    stages_sum = sum(sum(r.timing.get("totals", {}).get("stage_compute_s", [])) for r in spd) / K if K else None
    r_ratio = t_draft / t_full if t_draft is not None and t_full else None
    spd_tps = spd_tok / spd_s if spd_tok and spd_s > 0 else None
    ar_tps = ar_tok / ar_s if ar_tok and ar_s > 0 else None
    out = {"prompts": len(spd), "N": N, "K": K, "alpha": alpha, "r": r_ratio, "T_full_s": t_full, "T_draft_s": t_draft,
           "mean_cycle_s": cycle_s, "mean_slowest_stage_s": slowest, "mean_stage_sum_s": stages_sum,
           **speedups(n, alpha, r_ratio), "decode_tokens_per_s": spd_tps, "ar_decode_tokens_per_s": ar_tps,
           "wall_clock_speedup": spd_tps / ar_tps if spd_tps and ar_tps else None}
    return out


def check_args(args: argparse.Namespace) -> list[Sampling]:
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit={args.limit} must be >= 1")
    if args.timeout <= 0:
        raise UsageError(f"--timeout={args.timeout} must be > 0 seconds")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device} but CUDA is not available here: use --device cpu")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        raise UsageError(f"--device {args.device!r}: use cpu or cuda")
    if len(set(args.temperatures)) != len(args.temperatures):
        raise UsageError(f"--temperatures {args.temperatures} repeats a value")
    return [Sampling(t, args.top_k if t > 0 else 0, args.top_p if t > 0 else 1.0) for t in args.temperatures]


def set_name(path: str, taken: set[str]) -> str:
    name = os.path.splitext(os.path.basename(dataset_spec(path.rstrip("/"))[0]))[0].removesuffix("_question")
    base, i = name, 2
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    taken.add(name)
    return name


def run(args: argparse.Namespace) -> dict:
    samplings = check_args(args)
    setup = prepare(args.ckpt, args.target, args.mode, args.device, args.dtype)
    if setup.mode == "ar":
        raise UsageError("inference.eval compares a drafter with AR decoding: --ckpt must name a drafter")
    taken: set[str] = set()
    sets = []
    for path in args.prompts:
        texts = read_prompts(None, path)[: args.limit]
        sets.append((set_name(path, taken), path, texts, encode_prompts(setup.tokenizer, texts, setup.info, args.max_new_tokens)))
    os.makedirs(args.out, exist_ok=True)

    from spd_lightning.export import load_drafter
    from spd_lightning.target import Target

    from .simulator import Simulator

    target = Target.load(setup.target_path, setup.dtype, args.device)
    pdm = load_drafter(setup.ckpt, map_location=args.device)[0].to(target.model.dtype) if args.simulate else None
    n = setup.geometry.n
    report = {"target": setup.target_path, "drafter": setup.ckpt, "mode": setup.mode, "n": n, "L": setup.info.num_layers,
              "L_s": setup.spec.pdm.num_layers, "hidden_size": setup.info.hidden_size, "geometry": setup.geometry.to_dict(),
              "max_new_tokens": args.max_new_tokens, "limit": args.limit, "simulate": args.simulate,
              "device": args.device, "dtype": setup.dtype, "seed": args.seed, "results": []}
    total = len(samplings) * sum(len(s[3]) for s in sets)
    bar = _progress(total, args.no_progress)
    try:
        for sampling in samplings:
            simulator = Simulator(target, pdm, setup.geometry, sampling) if args.simulate else None
            if simulator is not None:  # warm-up (allocator, kernels) so the first measured prompt is not penalized
                simulator.decode(sets[0][3][0], min(4, args.max_new_tokens), setup.eos, args.seed)
            ar_decode(target, sets[0][3][0], min(4, args.max_new_tokens), sampling, setup.eos, args.seed)
            pooled_spd: list[DecodeResult] = []
            pooled_ar: list[DecodeResult] = []
            for name, path, _texts, prompts in sets:
                bar.set_description(f"{name} T={sampling.temperature:g}")
                spd = _decode(args, setup, simulator, sampling, prompts, bar)
                ar = [ar_decode(target, ids, args.max_new_tokens, sampling, setup.eos, args.seed + i)
                      for i, ids in enumerate(prompts)]
                pooled_spd += spd
                pooled_ar += ar
                report["results"].append({"set": name, "path": path, "temperature": sampling.temperature,
                                          "sampling": sampling.to_dict(), **summarize(n, spd, ar)})
            report["results"].append({"set": "overall", "path": None, "temperature": sampling.temperature,
                                      "sampling": sampling.to_dict(), **summarize(n, pooled_spd, pooled_ar)})
    finally:
        bar.close()
    _plan_inputs(report)
    write_outputs(report, args.out)
    return report


def _decode(args, setup, simulator, sampling: Sampling, prompts: list[list[int]], bar) -> list[DecodeResult]:
    if simulator is not None:
        results = []
        for i, ids in enumerate(prompts):
            results.append(simulator.decode(ids, args.max_new_tokens, setup.eos, args.seed + i))
            bar.update(1)
        return results
    from .launch import launch

    info = setup.info
    job = DecodeJob(setup.target_path, setup.geometry.to_dict(), prompts, args.max_new_tokens, setup.eos, info.vocab_size,
                    info.hidden_size, sampling.to_dict(), drafter_path=setup.ckpt, seed=args.seed, dtype=setup.dtype,
                    device=args.device, timeout_s=args.timeout, debug=args.debug)
    return launch(job, on_result=lambda i, r: bar.update(1))


def _progress(total: int, disable: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="prompt", file=sys.stderr, disable=disable, dynamic_ncols=True)


def _plan_inputs(report: dict) -> None:
    """What `inference.plan --times eval.json` reads: measured T_full, draft time at this L_s, slowest stage, overhead."""
    greedy = [r for r in report["results"] if r["set"] == "overall"]
    row = min(greedy, key=lambda r: r["temperature"])
    overhead = None
    if row["mean_cycle_s"] is not None and row["T_draft_s"] is not None:
        # the simulator runs stages and drafter in sequence; the pipeline overlaps them
        busy = (row["mean_stage_sum_s"] + row["T_draft_s"]) if report["simulate"] else max(row["mean_slowest_stage_s"], row["T_draft_s"])
        overhead = max(0.0, row["mean_cycle_s"] - busy)
    report["plan_inputs"] = {"T_full_s": row["T_full_s"], "T_draft_s": row["T_draft_s"], "L_s": report["L_s"],
                             "overhead_s": overhead, "n": report["n"], "alpha": row["alpha"], "L": report["L"],
                             "slowest_stage_s": row["mean_slowest_stage_s"]}


def _fmt(x, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def markdown(report: dict) -> str:
    head = ["set", "T", "prompts", "N", "K", "alpha", "S0 = n*alpha", "r", "S_spd", "S_post/ppsd", "tok/s", "AR tok/s", "wall-clock"]
    lines = [f"SPD eval: mode={report['mode']} n={report['n']} L_s={report['L_s']} target={report['target']} "
             f"max_new_tokens={report['max_new_tokens']}{' (simulator: wall-clock is sequential)' if report['simulate'] else ''}",
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["results"]:
        cells = [r["set"], f"{r['temperature']:g}", str(r["prompts"]), str(r["N"]), str(r["K"]), _fmt(r["alpha"]),
                 _fmt(r["S0"], 2), _fmt(r["r"]), _fmt(r["S_spd"], 2), _fmt(r["S_post"], 2),
                 _fmt(r["decode_tokens_per_s"], 1), _fmt(r["ar_decode_tokens_per_s"], 1), _fmt(r["wall_clock_speedup"], 2)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    labels = [f"{r['set']}\nT={r['temperature']:g}" for r in rows]
    x = list(range(len(rows)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 2.2 * len(rows)), 4))
    ax1.bar(x, [r["alpha"] or 0.0 for r in rows], color="tab:blue")
    ax1.set_xticks(x, labels, fontsize=8)
    ax1.set_ylim(0, 1)
    ax1.set_title("alpha = N / K")
    keys = [("S0", "S0 = n*alpha"), ("S_spd", "S_spd"), ("S_post", "S_post/ppsd"), ("wall_clock_speedup", "wall-clock")]
    width = 0.8 / len(keys)
    for j, (key, label) in enumerate(keys):
        ax2.bar([i + (j - (len(keys) - 1) / 2) * width for i in x], [r[key] or 0.0 for r in rows], width, label=label)
    ax2.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax2.set_xticks(x, labels, fontsize=8)
    ax2.set_title(f"speedup over AR (n={report['n']}, L_s={report['L_s']})")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(report: dict, out: str) -> None:
    with open(os.path.join(out, "eval.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(out, "eval.md"), "w") as f:
        f.write(markdown(report))
    plot(report, os.path.join(out, "eval.png"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    code, report = run_guarded(run, args, (PromptError, OSError))
    if code is not None:
        return code
    print(markdown(report), end="")
    print(f"wrote {os.path.join(args.out, 'eval.json')}, eval.md, eval.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
