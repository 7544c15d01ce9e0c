"""What the inference command lines share: arguments, checks, the decode setup, jobs, totals, the guarded `main`.

`inference.decode`, `inference.eval` and `inference.plan` are thin: each adds its own arguments, runs, and
prints. The error policy is `spd_lightning.errors`: a `UserError` (bad input) ends with one `error:` line on
stderr and exit 2; any other exception is a bug: one line and exit 1, with the traceback under `--debug`
(or `SPD_DEBUG=1`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from spd_lightning.eagle3_export import KIND as EAGLE3
from spd_lightning.eagle3_export import Eagle3Spec, load_eagle3
from spd_lightning.errors import UserError
from spd_lightning.export import PDM_KIND, DrafterSpec, drafter_kind, read_drafter_spec
from spd_lightning.geometry import MODES, Geometry
from spd_lightning.target import Target, TargetInfo

from .ar import target_eos
from .launch import DecodeJob
from .prompts import PromptError, load_tokenizer, render
from .repetition import repeated_share
from .result import DecodeResult
from .schedule import eos_set
from .stages import meta_target
from .verify import Sampling

if TYPE_CHECKING:  # transformers is imported lazily at run time
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("inference")


class UsageError(UserError):
    """A bad command line."""


DEFAULT_K = 7  # EAGLE-3's chain length


def parser(prog: str, doc: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_decoder_arguments(
    p: argparse.ArgumentParser, max_new_tokens: int, with_ar: bool, k_values: bool = False
) -> None:
    """The options of every CLI that decodes: drafter, target, mode, where and how long to decode
    (`k_values`: `--k` takes a list, one evaluation per value)."""
    p.add_argument(
        "--ckpt",
        required=not with_ar,
        help="Lightning .ckpt or exported drafter directory"
        + ("; 'none' (or absent) for --mode ar" if with_ar else ""),
    )
    p.add_argument(
        "--target",
        help="target checkpoint directory or hub id ORG/NAME[@REV], read from the Hugging Face "
        "cache when cached (default: the target the drafter was trained on)",
    )
    p.add_argument("--trust-remote-code", action="store_true", help="allow the target's own modeling code")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="verified tokens to generate per prompt")
    p.add_argument("--seed", type=int, default=0, help="prompt i uses seed + i")
    p.add_argument(
        "--mode",
        choices=[*MODES, EAGLE3, "ar"] if with_ar else [*MODES, EAGLE3],
        help="default: the drafter's own mode"
        + (", 'ar' without a drafter" if with_ar else "")
        + f"; {EAGLE3} (chain decoding, one process) needs an EAGLE-3 drafter, the others a PDM",
    )
    p.add_argument(
        "--k",
        type=int,
        nargs="+" if k_values else None,
        default=[DEFAULT_K] if k_values else DEFAULT_K,
        help=f"--mode {EAGLE3}: draft tokens per verify forward" + (" (one evaluation per value)" if k_values else ""),
    )
    p.add_argument("--simulate", action="store_true", help="run every rank in this process (stages in sequence)")
    p.add_argument(
        "--pdm-placement",
        choices=["separate", "shared"],
        default="separate",
        help="separate: the PDM is rank n on its own GPU (n + 1 GPUs); shared: the PDM runs in stage "
        "1's process, on its GPU (n GPUs)",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda (the distributed decoder uses cuda:0..n)")
    p.add_argument(
        "--dtype", default="auto", help="target/PDM dtype: float32, bfloat16, float16; auto = bf16 on cuda, fp32 on cpu"
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run the one-token stage steps and the PDM draft through torch.compile (CUDA graphs on a "
        "GPU; a long first compile on the CPU); prefill stays eager",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds any rank may wait on a peer before the run fails (no --simulate)",
    )
    add_debug_argument(p)


def add_debug_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true", help="show tracebacks (also SPD_DEBUG=1)")


def check_decoder_args(args: argparse.Namespace) -> None:
    for k in args.k if isinstance(args.k, list) else [args.k]:
        if k < 1:
            raise UsageError(f"--k={k} must be >= 1 (draft tokens per verify forward)")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
    if args.timeout <= 0:
        raise UsageError(f"--timeout={args.timeout} must be > 0 seconds")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        raise UsageError(f"--device {args.device!r}: use cpu or cuda")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device} but CUDA is not available here: use --device cpu")


@dataclass
class Setup:
    """What a decode needs before any weight is loaded: the drafter, mode, target, geometry, dtype, tokenizer, EOS."""

    ckpt: str | None
    spec: DrafterSpec | Eagle3Spec | None
    mode: str
    target_path: str
    info: TargetInfo
    skeleton: Target  # the target on the meta device: shapes and config, no weights
    geometry: Geometry
    dtype: str
    tokenizer: PreTrainedTokenizerBase
    eos: list[int]
    trust_remote_code: bool = False
    k: int | list[int] | None = None  # --mode eagle3: drafts per verify forward (a list in eval)


def drafter_for_mode(ckpt: str | None, mode: str | None) -> tuple[DrafterSpec | Eagle3Spec | None, str]:
    """The drafter's description and the mode to decode in (`mode`, or the drafter's own); one line when
    the drafter's kind cannot run that mode."""
    kind = drafter_kind(ckpt) if ckpt else None
    if kind not in (None, PDM_KIND, EAGLE3):
        raise UsageError(f"{ckpt!r} holds a {kind!r} drafter, which this build cannot decode: re-export it")
    if kind == EAGLE3:
        if mode not in (None, EAGLE3, "ar"):
            raise UsageError(
                f"--mode {mode} needs a PDM (SPD) drafter, but {ckpt!r} is an EAGLE-3 drafter: pass --mode "
                f"{EAGLE3}, or a drafter trained with `fit --model.drafter pdm`"
            )
        return load_eagle3(ckpt)[1], mode or EAGLE3
    spec = read_drafter_spec(ckpt)[0] if ckpt else None
    if mode == EAGLE3 and spec is not None:
        raise UsageError(
            f"--mode {EAGLE3} needs an EAGLE-3 drafter, but {ckpt!r} is a PDM (SPD) drafter: pass --mode "
            f"{spec.geometry.mode}, or a drafter trained with `fit --model.drafter {EAGLE3}`"
        )
    mode = mode or (spec.geometry.mode if spec else "ar")
    if spec is None and mode != "ar":
        raise UsageError(f"--mode {mode} needs a drafter: pass --ckpt (only --mode ar runs without one)")
    return spec, mode


def prepare(args: argparse.Namespace) -> Setup:
    """Resolve the drafter, mode, target and geometry from `--ckpt --target --mode --device --dtype`."""
    ckpt = None if args.ckpt in (None, "", "none") else args.ckpt
    spec, mode = drafter_for_mode(ckpt, args.mode)
    target_path = args.target or (spec.target.name_or_path if spec else None)
    if not target_path:
        raise UsageError("no target: pass --target DIR (required without --ckpt)")
    trust = bool(getattr(args, "trust_remote_code", False))
    skeleton = meta_target(target_path, trust_remote_code=trust)
    target_path = skeleton.name_or_path  # a hub id resolved to its directory in the cache
    info = skeleton.info
    if spec is not None:
        spec.check_target(info)
    if not isinstance(spec, DrafterSpec):  # AR and chain decoding run the target as one stage
        geometry = Geometry.build(info.num_layers, 1)
    else:
        geometry = spec.geometry if mode == "ar" else spec.geometry.with_mode(mode)
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if args.device.startswith("cuda") else "float32")
    eos = sorted(eos_set(target_eos(skeleton.config, _generation_config(target_path))))
    k = getattr(args, "k", None) if mode == EAGLE3 else None
    return Setup(
        ckpt, spec, mode, target_path, info, skeleton, geometry, dtype, load_tokenizer(target_path), eos, trust, k
    )


def _generation_config(path: str):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:
        return None


def encode_prompts(setup: Setup, texts: list[str], max_new_tokens: int) -> list[list[int]]:
    """Render each prompt with the chat template; a prompt longer than the target's context is an error."""
    prompts = [render(setup.tokenizer, t) for t in texts]
    context = setup.info.max_position_embeddings
    for text, ids in zip(texts, prompts):
        if context and len(ids) >= context:
            raise PromptError(f"the prompt {text[:40]!r} has {len(ids)} tokens; the target's context is {context}")
        if context and len(ids) + max_new_tokens > context:
            log.warning(
                "%d prompt tokens + %d new tokens exceed the target's context of %d", len(ids), max_new_tokens, context
            )
    return prompts


def decode_job(
    setup: Setup, args: argparse.Namespace, prompts: list[list[int]], sampling: Sampling, profile: bool
) -> DecodeJob:
    """The distributed decoder's job for these prompts (`profile`: with per-cycle timing)."""
    if setup.mode == EAGLE3:
        raise UsageError(f"--mode {EAGLE3} decodes in one process, not on pipeline ranks: add --simulate")
    info = setup.info
    return DecodeJob(
        setup.target_path,
        setup.geometry.to_dict(),
        prompts,
        args.max_new_tokens,
        setup.eos,
        info.vocab_size,
        info.hidden_size,
        sampling.to_dict(),
        drafter_path=setup.ckpt,
        seed=args.seed,
        dtype=setup.dtype,
        device=args.device,
        timeout_s=args.timeout,
        debug=debugging(args),
        profile=profile,
        trust_remote_code=setup.trust_remote_code,
        pdm_placement=getattr(args, "pdm_placement", "separate"),
        compile=getattr(args, "compile", False),
    )


def decode_rate(results: Sequence[DecodeResult]) -> float | None:
    """Pooled decode-phase tokens per second (the first token of each prompt comes from prefill)."""
    seconds = sum(r.decode_s for r in results)
    return sum(r.N - 1 for r in results) / seconds if seconds > 0 else None


def totals(results: list[DecodeResult], references: list[DecodeResult] | None, n: int) -> dict:
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


@contextmanager
def writing(path: str) -> Iterator[None]:
    """Output the user asked for: a path that cannot be written is bad input, not a bug."""
    try:
        yield
    except OSError as e:
        raise UsageError(f"cannot write {path!r}: {e.strerror or e}; choose another output path") from e


def debugging(args: argparse.Namespace | None = None) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get("SPD_DEBUG", "") not in ("", "0")


def run_guarded(run: Callable[[argparse.Namespace], object], args: argparse.Namespace) -> tuple[int | None, object]:
    """`run(args)` under the error policy: returns (None, its result), or (exit code, None) after one
    `error:` line on stderr. Under `--debug` every exception propagates with its traceback."""
    debug = debugging(args)
    configure_logging(debug)
    try:
        return None, run(args)
    except UserError as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code, None
    except Exception as e:  # noqa: BLE001 - a bug still ends with one line unless --debug
        if debug:
            raise
        first = str(e).splitlines()[0] if str(e) else ""
        print(f"error: {type(e).__name__}: {first} (rerun with --debug for the traceback)", file=sys.stderr)
        return 1, None


def configure_logging(debug: bool) -> None:
    """Warnings of this project on stderr; transformers and torch's launcher quiet unless debugging."""
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, format="%(levelname)s: %(message)s")
    logging.getLogger("inference").setLevel(logging.DEBUG if debug else logging.INFO)
    if not debug:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()


def main(
    argv: list[str] | None,
    parse: Callable[[list[str] | None], argparse.Namespace],
    run: Callable[[argparse.Namespace], object],
    finish: Callable[[argparse.Namespace, object], int],
) -> int:
    """A CLI's `main`: parse, run under the error policy, then `finish(args, result)` prints and says the exit code."""
    args = parse(argv)
    code, result = run_guarded(run, args)
    return code if code is not None else finish(args, result)
