"""What the inference command lines share: arguments, their checks, and the guarded `main`.

`inference.decode`, `inference.eval` and `inference.plan` are thin: each adds its own arguments, runs, and
prints. The error policy is `spd_lightning.errors.run_main`: a `UserError` (bad input) ends with one `error:`
line on stderr and exit 2; any other exception is a bug: one line and exit 1, with the traceback under `--debug`
(or `SPD_DEBUG=1`).
"""

from __future__ import annotations

import argparse
import logging
import signal
from collections.abc import Callable

import torch

from spd_lightning.eagle3.export import KIND as EAGLE3
from spd_lightning.errors import Stopped, UsageError, debug_requested, run_main
from spd_lightning.errors import writing as writing  # re-exported: the commands write their outputs through `cli`
from spd_lightning.geometry import MODES

log = logging.getLogger("inference")

DEFAULT_K = 7  # EAGLE-3's chain length
# --timeout's range: the process group counts milliseconds (below 1 ms is 0, "timed out after 0ms") and its
# nanoseconds overflow int64 above about 9.2e9 s
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 0.001, 1e9


def parser(prog: str, doc: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_decoder_arguments(
    p: argparse.ArgumentParser, max_new_tokens: int, with_ar: bool, k_values: bool = False, seed: bool = True
) -> None:
    """The options of every CLI that decodes: drafter, target, mode, where and how long to decode
    (`k_values`: `--k` takes a list, one evaluation per value; `seed`: a `--seed` for prompt lists, which the
    server has not: each request brings its own)."""
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
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=max_new_tokens,
        help="verified tokens to generate per prompt (at most the target's context)",
    )
    if seed:
        p.add_argument("--seed", type=int, default=0, help="prompt i uses seed + i")
    else:
        p.set_defaults(seed=0)
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
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:INDEX (the distributed decoder uses cuda:0..n)")
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
        help=f"seconds any rank may wait on a peer before the run fails (no --simulate), in [{MIN_TIMEOUT_S}, "
        f"{MAX_TIMEOUT_S:g}]",
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
    if not MIN_TIMEOUT_S <= args.timeout <= MAX_TIMEOUT_S:  # NaN too; torch's process group takes neither end
        raise UsageError(
            f"--timeout={args.timeout} must be a number of seconds in [{MIN_TIMEOUT_S}, {MAX_TIMEOUT_S:g}]"
        )
    if args.device != "cpu" and not args.device.startswith("cuda"):
        raise UsageError(f"--device {args.device!r}: use cpu or cuda")
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError(f"--device {args.device} but CUDA is not available here: use --device cpu")
        try:  # torch fails on cuda:abc at once, on cuda:5 of fewer GPUs at the first tensor
            index = torch.device(args.device).index
        except RuntimeError as e:
            raise UsageError(f"--device {args.device!r}: use cuda or cuda:INDEX (e.g. cuda:0)") from e
        count = torch.cuda.device_count()
        if index is not None and index >= count:
            raise UsageError(f"--device {args.device}: this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}")


def warn_unused_placement(args: argparse.Namespace, mode: str) -> None:
    """`--pdm-placement shared` where no rank process is placed: the simulator and the one-process modes."""
    if args.pdm_placement == "shared" and (args.simulate or mode in ("ar", EAGLE3)):
        log.warning("--pdm-placement shared places the PDM's rank process; here every part runs in this one: ignored")


def debugging(args: argparse.Namespace) -> bool:
    return debug_requested(args.debug)


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
    """A CLI's `main`: parse, then run and `finish(args, result)` (prints, says the exit code) under the project's
    error policy (`spd_lightning.errors.run_main`)."""
    args = parse(argv)
    debug = debugging(args)
    configure_logging(debug)
    return run_main(lambda: interruptible(lambda: finish(args, run(args))), debug)


def interruptible(work: Callable[[], int]) -> int:
    """ctrl-C (or SIGTERM, SIGHUP, SIGQUIT while the launcher's agent watches the ranks, which then stops them
    all) is an expected end, not a bug: `Stopped` with exit code 128 + the signal, one line."""
    try:
        from torch.distributed.elastic.multiprocessing.api import SignalException
    except ImportError:  # a torch build without torch.distributed: no launcher, no agent signals
        SignalException = KeyboardInterrupt  # noqa: N806
    try:
        return work()
    except (KeyboardInterrupt, SignalException) as e:
        number = getattr(e, "sigval", signal.SIGINT)
        raise Stopped(
            f"interrupted by {signal.Signals(number).name}: stopped, with every rank it had started, before writing "
            "its results",
            128 + number,
        ) from None
