"""`python -m inference.decode`: decode prompts with the SPD pipeline, a baseline, or the simulator.

    python -m inference.decode --ckpt last.ckpt --prompt "Explain RoPE." --max-new-tokens 256
    python -m inference.decode --ckpt drafter/ --prompts mt_bench.jsonl --json out.json --check-lossless
    python -m inference.decode --ckpt none --target Qwen/Qwen3.5-9B --mode ar --prompt "Hi" --stream
    torchrun --nproc-per-node 5 -m inference.decode --ckpt drafter/ --device cuda --prompt "Hi"   # n=4

Modes: `spd` (pre-step drafting, the default for an SPD drafter), `post_step`, `ppsd` (needs a drafter
trained with first-stage features), `eagle3` (chain speculative decoding with an EAGLE-3 drafter, `--k`
drafts per target forward, in this process; the default for such a drafter) and `ar` (plain autoregressive
decoding through the same stages). Without `--simulate` the pipeline runs as n+1 processes; with it, in this
process.

    python -m inference.decode --ckpt drafter_eagle3/ --mode eagle3 --k 7 --prompt "Hi" --check-lossless

Output (stdout): for each prompt a `### prompt I: TEXT` line, the generated text, and one line of counters
(N, K, alpha, n*alpha, the share of repeated 4-grams of the output, why it stopped); then one line of
totals. With `--stream` each prompt's text is printed as its tokens are verified (the counters follow).
`--json` writes everything, token ids included (`--profile` adds each prompt's per-cycle timing: with
`--max-batch B` a row per cycle of the batch while the prompt decoded, with the number of slots it ran). Exit status:
0 done, 2 bad input, a rank's included (one line on stderr; `--debug` or SPD_DEBUG=1 shows tracebacks),
1 anything else (e.g. a rank that died), 3 `--check-lossless` found a difference, 130 ctrl-C
(128 + the signal for one the launcher's agent catches, e.g. 143 SIGTERM): every rank stopped, one line;
141 (quietly) when the reader of stdout went away (`| head -1`): the decode still ends and writes its `--json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Callable
from functools import partial

from inference import cli
from inference.backends import make_backend
from inference.cycle.result import DecodeResult
from inference.evaluation.repetition import repeated_share
from inference.evaluation.tables import fmt
from inference.evaluation.totals import pooled_totals
from inference.processes.job import DecodeJob
from inference.processes.launch import job_requests, launch, run_rank
from inference.prompts import read_prompts
from inference.sampling import Sampling
from inference.setup import Setup, decode_job, encode_prompts, prepare
from inference.textstream import StreamPrinter
from spd_lightning.eagle3.export import KIND as EAGLE3

log = logging.getLogger("inference")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = cli.parser("python -m inference.decode", __doc__)
    p.add_argument("--prompt", help="one prompt text")
    p.add_argument("--prompts", help='EAGLE-style jsonl: one {"turns": [...]} per line, first turn used')
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off; applied to both the target and the draft")
    p.add_argument("--top-p", type=float, default=1.0, help="in (0, 1]; applied to both the target and the draft")
    p.add_argument("--json", dest="json_out", help="write the full report here")
    p.add_argument("--stream", action="store_true", help="print each prompt's text as its tokens are verified")
    p.add_argument("--check-lossless", action="store_true", help="greedy only: also decode with AR and compare tokens")
    p.add_argument(
        "--profile",
        action="store_true",
        help="per-cycle timing (stage compute, draft, verify, messages, slots) in the --json report, at any "
        "--max-batch; off, the decoder runs no timer and no device synchronization",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=1,
        help="decode the prompts this many at a time through the ranks (batched pipeline decoding; each prompt's "
        "tokens are its batch-1 decode's); 1 = one prompt at a time; at most the number of prompts is used",
    )
    cli.add_decoder_arguments(p, max_new_tokens=128, with_ar=True)
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> Sampling:
    cli.check_decoder_args(args)
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    if args.check_lossless and not sampling.greedy:
        raise cli.UsageError("--check-lossless compares tokens and needs greedy decoding (--temperature 0)")
    if args.max_batch < 1:
        raise cli.UsageError(f"--max-batch={args.max_batch} must be >= 1")
    return sampling


def run(args: argparse.Namespace) -> dict:
    sampling = check_args(args)
    setup = prepare(args)
    texts = read_prompts(args.prompt, args.prompts)
    prompts = encode_prompts(setup, texts, args.max_new_tokens)
    # A slot per prompt at most: a slot's caches are sized for a whole decode, so unused slots would only take
    # memory (--max-batch 100000000 took all of it); the tokens do not depend on the batch size
    args.max_batch = min(args.max_batch, len(prompts))
    if args.max_batch > 1 and setup.mode in ("ar", EAGLE3):
        raise cli.UsageError(f"--max-batch > 1 is pipeline decoding: --mode {setup.mode} decodes one prompt at a time")
    cli.warn_unused_placement(args, setup.mode)
    if args.profile and setup.mode in ("ar", EAGLE3):
        log.warning("--profile times the pipeline's cycles; --mode %s has none: ignored", setup.mode)
    if args.check_lossless and setup.mode == "ar":
        log.warning("--check-lossless compares a drafter's output with AR decoding, which --mode ar is: ignored")
    report = {
        "mode": setup.mode,
        "n": setup.geometry.n,
        **({"k": args.k} if setup.mode == EAGLE3 else {}),
        "geometry": setup.geometry.to_dict(),
        "target": setup.target_path,
        "drafter": setup.ckpt,
        "sampling": sampling.to_dict(),
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
        "device": args.device,
        "dtype": setup.dtype,
        "simulate": args.simulate,
        "max_batch": args.max_batch,
        "eos_token_ids": setup.eos,
        "streamed": args.stream,
    }
    printer = StreamPrinter(setup.tokenizer, texts) if args.stream else None
    results = _decode(setup, args, prompts, sampling, _while_open(printer) if printer else None)
    if printer is not None:
        _while_open(printer.end)()
    if results is None:  # a torchrun rank that does not report
        return {}
    for result in results:
        result.text = setup.tokenizer.decode(result.tokens, skip_special_tokens=True)
    references = None
    if args.check_lossless and setup.mode != "ar":  # the AR reference, through the same stages
        references = _decode(dataclasses.replace(setup, mode="ar"), args, prompts, sampling)
    report["prompts"] = [
        _prompt_entry(text, r, references[i] if references else None) for i, (text, r) in enumerate(zip(texts, results))
    ]
    report["totals"] = pooled_totals(results, references, setup.geometry.n)
    return report


def _decode(
    setup: Setup,
    args,
    prompts: list[list[int]],
    sampling: Sampling,
    on_tokens: Callable[[int, list[int]], None] | None = None,
) -> list[DecodeResult] | None:
    """Every prompt's result; `on_tokens(prompt index, tokens)` as tokens are verified."""
    if setup.mode in ("ar", EAGLE3):  # in this process, one prompt at a time
        backend = make_backend(setup, args.device, compile=args.compile)
        return [
            backend.generate(ids, args.max_new_tokens, sampling, args.seed + i, on_tokens and partial(on_tokens, i))
            for i, ids in enumerate(prompts)
        ]
    job = decode_job(setup, args, prompts, sampling, profile=args.profile)
    if args.simulate:  # every prompt a request of the one simulator, B at a time, as the ranks take them
        backend = make_backend(setup, args.device, compile=args.compile, profile=args.profile, max_batch=args.max_batch)
        return backend.simulator.run(job_requests(job, on_tokens))
    job.stream = on_tokens is not None
    job.max_batch = args.max_batch
    return _distributed(job, on_tokens)


def _distributed(job: DecodeJob, on_tokens: Callable[[int, list[int]], None] | None) -> list[DecodeResult] | None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        collected: dict[int, DecodeResult] = {}  # batched, prompts end out of order
        rank = int(os.environ["RANK"])
        run_rank(job, rank, int(os.environ.get("LOCAL_RANK", rank)), collected.__setitem__, on_tokens)
        return [collected[i] for i in sorted(collected)] if rank == job.n - 1 else None
    return launch(
        job,
        on_result=_while_open(lambda i, r: print(f"prompt {i + 1}: {_counters(r)}", file=sys.stderr, flush=True)),
        on_tokens=on_tokens,
    )


def _while_open(write: Callable[..., None]) -> Callable[..., None]:
    """`write` (a print) until its reader goes away (`| head -1`: BrokenPipeError), then nothing: the decode goes on
    (a callback on the launcher's report thread that raised would lose every later result) and its `--json` holds
    every result; the closed stdout then ends the run quietly (`run_main`: exit 141)."""
    closed = False

    def call(*args) -> None:
        nonlocal closed
        if not closed:
            try:
                write(*args)
            except BrokenPipeError:
                closed = True

    return call


def _counters(r: DecodeResult) -> str:
    rates = "" if r.alpha is None else f"{_rates(r.mode, r.K, r.alpha, r.theoretical_speedup)} "
    return f"N={r.N} {rates}repeated 4-grams {fmt(repeated_share([r.tokens]), 2)} ({r.stop_reason})"


def _rates(mode: str, K: int, alpha: float, speedup: float, within: str = "") -> str:
    if mode == EAGLE3:  # one target forward per step: alpha is the tokens per target forward
        return f"K={K} tokens/forward={alpha:.3f}"
    return f"K={K} alpha={alpha:.3f} n*alpha={speedup:.2f}{within}"


def _prompt_entry(text: str, r: DecodeResult, reference: DecodeResult | None) -> dict:
    entry = {"prompt": text, **r.to_dict(), "repeated_4gram_share": repeated_share([r.tokens])}
    if reference is not None:
        entry["lossless"] = reference.tokens == r.tokens
        entry["ar_decode_tokens_per_s"] = reference.decode_tokens_per_s
    return entry


def print_report(report: dict) -> None:
    """Each prompt's generated text and counters, then the totals."""
    for i, p in enumerate(report["prompts"]):
        if not report.get("streamed"):  # else the text is already out
            print(f"### prompt {i + 1}: {p['prompt']}")
            print(p["text"])
        print(f"({_counters(DecodeResult.from_dict(p))})\n")
    t = report["totals"]
    shape = f"k={report['k']}" if report["mode"] == EAGLE3 else f"n={report['n']}"
    parts = [f"mode={report['mode']} {shape} prompts={len(report['prompts'])} N={t['N']}"]
    if t["alpha"] is not None:
        interval = t.get("theoretical_speedup_interval")
        within = f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else ""
        parts.append(_rates(report["mode"], t["K"], t["alpha"], t["theoretical_speedup"], within))
    parts.append(f"repeated_4grams={fmt(t['repeated_4gram_share'], 2)}")
    if t.get("decode_tokens_per_s"):
        parts.append(f"{t['decode_tokens_per_s']:.1f} tok/s")
    if "lossless" in t:
        parts.append(f"lossless={'yes' if t['lossless'] else 'NO'}")
    print(" ".join(parts))


def finish(args: argparse.Namespace, report: dict) -> int:
    if not report:
        return 0
    try:
        print_report(report)  # first: a path that cannot be written loses no result
    finally:  # nor does a reader of stdout that went away (`| head -1`)
        if args.json_out:
            with cli.writing(args.json_out), open(args.json_out, "w") as f:
                json.dump(report, f, indent=1)
    return 0 if report["totals"].get("lossless", True) else 3


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, parse_args, run, finish)


if __name__ == "__main__":
    sys.exit(main())
