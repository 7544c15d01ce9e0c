"""`python -m inference.decode`: decode prompts with the SPD pipeline, a baseline, or the simulator.

    python -m inference.decode --ckpt last.ckpt --prompt "Explain RoPE." --max-new-tokens 256
    python -m inference.decode --ckpt drafter/ --prompts mt_bench.jsonl --json out.json --check-lossless
    python -m inference.decode --ckpt none --target Qwen3.5-dir --mode ar --prompt "Hi"
    torchrun --nproc-per-node 5 -m inference.decode --ckpt drafter/ --device cuda --prompt "Hi"   # n=4

Modes: `spd` (pre-step drafting, the default for an SPD drafter), `post_step`, `ppsd` (needs a drafter
trained with first-stage features) and `ar` (plain autoregressive decoding through the same stages).
Without `--simulate` the pipeline runs as n+1 processes; with it, in this process. Exit status: 0 done,
2 bad input or a failed rank (one line on stderr; `--debug` shows tracebacks), 1 an unexpected error,
3 `--check-lossless` found a difference.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass

import torch

from spd_lightning.export import DrafterLoadError, load_drafter
from spd_lightning.geometry import Geometry, GeometryError
from spd_lightning.target import Target, TargetError

from .ar import ar_decode_stages, target_eos
from .cache import CacheError
from .drafter import read_drafter_spec
from .launch import DecodeJob, LaunchError, launch, run_rank
from .pipeline import mode_name
from .prompts import PromptError, load_tokenizer, read_prompts, render
from .result import DecodeResult
from .schedule import eos_set
from .simulator import Simulator
from .stages import Stage, meta_target
from .verify import Sampling, SamplingError
from spd_lightning.errors import UserError

MODES = {"spd": ("pre_step", "spd"), "post_step": ("post_step", "spd"), "ppsd": ("post_step", "first_stage")}
USER_ERRORS = (SamplingError, PromptError, DrafterLoadError, TargetError, GeometryError, LaunchError, CacheError)


class UsageError(UserError):
    """A bad command line."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m inference.decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", help="Lightning .ckpt or exported drafter directory; 'none' (or absent) for --mode ar")
    p.add_argument("--target", help="target checkpoint directory (default: the one the drafter was trained on)")
    p.add_argument("--prompt", help="one prompt text")
    p.add_argument("--prompts", help="EAGLE-style jsonl: one {\"turns\": [...]} per line, first turn used")
    p.add_argument("--max-new-tokens", type=int, default=128, help="verified tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off; applied to both the target and the draft")
    p.add_argument("--top-p", type=float, default=1.0, help="in (0, 1]; applied to both the target and the draft")
    p.add_argument("--seed", type=int, default=0, help="prompt i uses seed + i")
    p.add_argument("--mode", choices=[*MODES, "ar"], help="default: the drafter's own mode, 'ar' without a drafter")
    p.add_argument("--simulate", action="store_true", help="run every rank in this process (stages in sequence)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (the distributed decoder uses cuda:0..n)")
    p.add_argument("--dtype", default="auto", help="target/PDM dtype: float32, bfloat16, float16; auto = bf16 on cuda, fp32 on cpu")
    p.add_argument("--json", dest="json_out", help="write the full report here")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any rank may wait on a peer before the run fails")
    p.add_argument("--check-lossless", action="store_true", help="greedy only: also decode with AR and compare tokens")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p.parse_args(argv)


def decode_geometry(trained: Geometry, mode: str) -> Geometry:
    """The drafter's geometry with the mode's schedule; the features must be the ones it was trained on."""
    schedule, features = MODES[mode]
    if features != trained.features:
        raise GeometryError(f"--mode {mode} reads {features!r} features but this drafter was trained with "
                            f"features={trained.features!r}: use --mode {mode_name(trained)} or a matching drafter")
    return Geometry.build(trained.num_layers, trained.n, list(trained.split), list(trained.anchors), schedule, features)


def check_args(args: argparse.Namespace) -> Sampling:
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
    if args.timeout <= 0:
        raise UsageError(f"--timeout={args.timeout} must be > 0 seconds")
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    if args.check_lossless and not sampling.greedy:
        raise UsageError("--check-lossless compares tokens and needs greedy decoding (--temperature 0)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device} but CUDA is not available here: use --device cpu")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        raise UsageError(f"--device {args.device!r}: use cpu or cuda")
    return sampling


@dataclass
class Setup:
    """What a decode needs before any weight is loaded: the drafter, mode, target, geometry, dtype, tokenizer, EOS."""
    ckpt: str | None
    spec: object
    mode: str
    target_path: str
    info: object
    skeleton: object
    geometry: Geometry
    dtype: str
    tokenizer: object
    eos: list[int]


def prepare(ckpt: str | None, target: str | None, mode: str | None, device: str, dtype: str) -> Setup:
    """Resolve the drafter, mode, target and geometry (shared by `inference.decode` and `inference.eval`)."""
    ckpt = None if ckpt in (None, "", "none") else ckpt
    spec = read_drafter_spec(ckpt)[0] if ckpt else None
    mode = mode or (mode_name(spec.geometry) if spec else "ar")
    if spec is None and mode != "ar":
        raise UsageError(f"--mode {mode} needs a drafter: pass --ckpt (only --mode ar runs without one)")
    target_path = target or (spec.target.name_or_path if spec else None)
    if not target_path:
        raise UsageError("no target: pass --target DIR (required without --ckpt)")
    skeleton = meta_target(target_path)
    info = skeleton.info
    if spec is not None:
        spec.check_target(info)
    geometry = decode_geometry(spec.geometry, mode) if mode != "ar" else (spec.geometry if spec else Geometry.build(info.num_layers, 1))
    dtype = dtype if dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    tokenizer = load_tokenizer(target_path)
    eos = sorted(eos_set(target_eos(skeleton.config, _generation_config(target_path))))
    return Setup(ckpt, spec, mode, target_path, info, skeleton, geometry, dtype, tokenizer, eos)


def encode_prompts(tokenizer, texts: list[str], info, max_new_tokens: int) -> list[list[int]]:
    """Render each prompt with the chat template; a prompt longer than the target's context is an error."""
    prompts = [render(tokenizer, t) for t in texts]
    context = info.max_position_embeddings
    for text, ids in zip(texts, prompts):
        if context and len(ids) >= context:
            raise PromptError(f"the prompt {text[:40]!r} has {len(ids)} tokens; the target's context is {context}")
        if context and len(ids) + max_new_tokens > context:
            print(f"warning: {len(ids)} prompt tokens + {max_new_tokens} new tokens exceed the target's "
                  f"context of {context}", file=sys.stderr)
    return prompts


def run(args: argparse.Namespace) -> dict:
    sampling = check_args(args)
    setup = prepare(args.ckpt, args.target, args.mode, args.device, args.dtype)
    ckpt, spec, mode, target_path, info, geometry, dtype, tokenizer, eos = (
        setup.ckpt, setup.spec, setup.mode, setup.target_path, setup.info, setup.geometry, setup.dtype, setup.tokenizer,
        setup.eos)
    texts = read_prompts(args.prompt, args.prompts)
    prompts = encode_prompts(tokenizer, texts, info, args.max_new_tokens)
    report = {"mode": mode, "n": geometry.n, "geometry": geometry.to_dict(), "target": target_path, "drafter": ckpt,
              "sampling": sampling.to_dict(), "max_new_tokens": args.max_new_tokens, "seed": args.seed,
              "device": args.device, "dtype": dtype, "simulate": args.simulate, "eos_token_ids": eos}

    results: list[DecodeResult]
    if mode == "ar":
        results = _ar(target_path, geometry, prompts, args, sampling, eos, dtype)
    elif args.simulate:
        target = Target.load(target_path, dtype, args.device)
        pdm, _ = load_drafter(ckpt, map_location=args.device)
        simulator = Simulator(target, pdm.to(target.model.dtype), geometry, sampling)
        results = [simulator.decode(ids, args.max_new_tokens, eos, args.seed + i) for i, ids in enumerate(prompts)]
    else:
        job = DecodeJob(target_path, geometry.to_dict(), prompts, args.max_new_tokens, eos, info.vocab_size,
                        info.hidden_size, sampling.to_dict(), drafter_path=ckpt, seed=args.seed, dtype=dtype,
                        device=args.device, timeout_s=args.timeout, debug=args.debug)
        results = _distributed(job)
        if results is None:  # a torchrun rank that does not report
            return {}
    for text, result in zip(texts, results):
        result.text = tokenizer.decode(result.tokens, skip_special_tokens=True)
    references = None
    if args.check_lossless and mode != "ar":
        references = _ar(target_path, geometry, prompts, args, sampling, eos, dtype)
    report["prompts"] = [_prompt_entry(text, r, references[i] if references else None)
                         for i, (text, r) in enumerate(zip(texts, results))]
    report["totals"] = _totals(results, references, geometry.n)
    return report


def _generation_config(path: str):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:
        return None


def _ar(target_path, geometry, prompts, args, sampling, eos, dtype) -> list[DecodeResult]:
    target = Target.load(target_path, dtype, args.device)
    stages = [Stage.from_target(target, geometry, s) for s in range(1, geometry.n + 1)]
    return [ar_decode_stages(stages, ids, args.max_new_tokens, sampling, eos, args.seed + i) for i, ids in enumerate(prompts)]


def _distributed(job: DecodeJob) -> list[DecodeResult] | None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        if int(os.environ["WORLD_SIZE"]) != job.world_size:
            raise UsageError(f"torchrun started {os.environ['WORLD_SIZE']} processes; this drafter has n={job.world_size - 1} "
                             f"stages and needs n+1 = {job.world_size}")
        collected: list[DecodeResult] = []
        rank = int(os.environ["RANK"])
        run_rank(job, rank, int(os.environ.get("LOCAL_RANK", rank)), None, lambda i, r: collected.append(r))
        return collected if rank == job.world_size - 2 else None
    return launch(job, on_result=lambda i, r: print(f"prompt {i + 1}: {_summary(r)}", file=sys.stderr, flush=True))


def _summary(r: DecodeResult) -> str:
    if r.alpha is None:
        return f"N={r.N} ({r.stop_reason})"
    return f"N={r.N} K={r.K} alpha={r.alpha:.3f} n*alpha={r.theoretical_speedup:.2f} ({r.stop_reason})"


def _prompt_entry(text: str, r: DecodeResult, reference: DecodeResult | None) -> dict:
    entry = {"prompt": text, **r.to_dict()}
    if reference is not None:
        entry["lossless"] = reference.tokens == r.tokens
        entry["ar_decode_tokens_per_s"] = reference.decode_tokens_per_s
    return entry


def _totals(results: list[DecodeResult], references: list[DecodeResult] | None, n: int) -> dict:
    N, K = sum(r.N for r in results), sum(r.K for r in results)
    decode_s = sum(r.decode_s for r in results)
    totals = {"N": N, "K": K, "alpha": N / K if K and results[0].mode != "ar" else None,
              "decode_tokens_per_s": (sum(r.N - 1 for r in results) / decode_s) if decode_s > 0 else None}
    totals["theoretical_speedup"] = n * totals["alpha"] if totals["alpha"] is not None else None
    if references is not None:
        ar_s = sum(r.decode_s for r in references)
        totals["lossless"] = all(a.tokens == b.tokens for a, b in zip(results, references))
        totals["ar_decode_tokens_per_s"] = sum(r.N - 1 for r in references) / ar_s if ar_s > 0 else None
        if totals["decode_tokens_per_s"] and totals["ar_decode_tokens_per_s"]:
            totals["wall_clock_speedup"] = totals["decode_tokens_per_s"] / totals["ar_decode_tokens_per_s"]
    return totals


def print_summary(report: dict) -> None:
    t = report["totals"]
    parts = [f"mode={report['mode']} n={report['n']} prompts={len(report['prompts'])} N={t['N']}"]
    if t["alpha"] is not None:
        parts.append(f"K={t['K']} alpha={t['alpha']:.3f} n*alpha={t['theoretical_speedup']:.2f}")
    if t.get("decode_tokens_per_s"):
        parts.append(f"{t['decode_tokens_per_s']:.1f} tok/s")
    if "lossless" in t:
        parts.append(f"lossless={'yes' if t['lossless'] else 'NO'}")
    print(" ".join(parts))


def run_guarded(run_fn, args, user_errors: tuple = ()) -> tuple[int | None, object]:
    """Run an inference CLI's `run_fn(args)`: quiet transformers, and every failure ends with one line on
    stderr (exit 2 for bad input, 1 for anything unexpected) unless `--debug`. Returns (exit code or None, report)."""
    if not args.debug:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    try:
        return None, run_fn(args)
    except (UsageError, *USER_ERRORS, *user_errors) as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2, None
    except Exception as e:  # noqa: BLE001 - an unexpected failure still ends with one line unless --debug
        if args.debug:
            raise
        print(f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} (rerun with --debug for the traceback)",
              file=sys.stderr)
        return 1, None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    code, report = run_guarded(run, args)
    if code is not None:
        return code
    if not report:
        return 0
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    print_summary(report)
    return 0 if report["totals"].get("lossless", True) else 3


if __name__ == "__main__":
    sys.exit(main())
