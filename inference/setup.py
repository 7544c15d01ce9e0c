"""What a decode needs before any weight is loaded (`Setup`), from the arguments every decoding CLI shares.

`prepare` resolves the drafter (a PDM or an EAGLE-3 drafter), the mode to decode in, the target (a directory, a
hub id, resolved once), the geometry, the dtype, the tokenizer and the EOS ids; `decode_job` turns a setup into
the job the n + 1 ranks run. The CLIs (`decode`, `eval`, `serve`) and the server's backends start from here.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from inference.cycle.ar import target_eos
from inference.cycle.schedule import eos_set
from inference.processes.job import DecodeJob
from inference.prompts import PromptError, load_tokenizer, render
from inference.runtime.stages import meta_target
from inference.sampling import Sampling
from spd_lightning.eagle3.export import KIND as EAGLE3
from spd_lightning.eagle3.export import Eagle3Spec, load_eagle3
from spd_lightning.errors import UsageError
from spd_lightning.export import PDM_KIND, DrafterSpec, drafter_kind, read_drafter_spec
from spd_lightning.geometry import Geometry
from spd_lightning.target import Target, TargetInfo

if TYPE_CHECKING:  # transformers is imported lazily at run time
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("inference")


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
                f"{EAGLE3}, or a drafter trained with `fit --model SPDModule`"
            )
        return load_eagle3(ckpt)[1], mode or EAGLE3
    spec = read_drafter_spec(ckpt)[0] if ckpt else None
    if mode == EAGLE3 and spec is not None:
        raise UsageError(
            f"--mode {EAGLE3} needs an EAGLE-3 drafter, but {ckpt!r} is a PDM (SPD) drafter: pass --mode "
            f"{spec.geometry.mode}, or a drafter trained with `fit --model Eagle3Module`"
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
    trust = args.trust_remote_code
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
    k = args.k if mode == EAGLE3 else None
    if k is not None:
        check_k(k, info)
    return Setup(
        ckpt,
        spec,
        mode,
        target_path,
        info,
        skeleton,
        geometry,
        dtype,
        load_tokenizer(target_path, trust),
        eos,
        trust,
        k,
    )


def check_k(k: int | list[int], info: TargetInfo) -> None:
    """EAGLE-3's `--k` (one value, or eval's list) fits in the target's context: the caches are sized for k drafts."""
    context = info.max_position_embeddings
    for value in k if isinstance(k, list) else [k]:
        if context and value > context:
            raise UsageError(
                f"--k={value} is more than the target's context of {context} tokens: lower it (k drafts per verify "
                "forward; EAGLE-3 runs k = 3 to 7)"
            )


def _generation_config(path: str):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:
        return None


def encode_prompts(setup: Setup, texts: list[str], max_new_tokens: int) -> list[list[int]]:
    """Render each prompt with the chat template; a prompt longer than the target's context, or a `max_new_tokens`
    above it (its caches would be sized for them all), is an error; a prompt and answer that together exceed it
    are a warning."""
    context = setup.info.max_position_embeddings
    if context and max_new_tokens > context:
        raise UsageError(
            f"--max-new-tokens={max_new_tokens} is more than the target's context of {context} tokens: lower it "
            "(the prompt and its answer share the context)"
        )
    prompts = [render(setup.tokenizer, t) for t in texts]
    for text, ids in zip(texts, prompts):
        if context and len(ids) >= context:
            raise PromptError(f"the prompt {text[:40]!r} has {len(ids)} tokens; the target's context is {context}")
        if context and len(ids) + max_new_tokens > context:
            log.warning(
                "%d prompt tokens + %d new tokens exceed the target's context of %d", len(ids), max_new_tokens, context
            )
    return prompts


def decode_job(
    setup: Setup,
    args: argparse.Namespace,
    prompts: list[list[int]],
    sampling: Sampling,
    profile: bool,
    warm_up: bool = False,
) -> DecodeJob:
    """The distributed decoder's job for these prompts (`profile`: with per-cycle timing; `warm_up`: the ranks
    decode the longest prompt once, unreported, before them)."""
    if setup.mode == EAGLE3:
        raise UsageError(f"--mode {EAGLE3} decodes in one process, not on pipeline ranks: add --simulate")
    info = setup.info
    return DecodeJob(
        setup.target_path,
        setup.geometry,
        prompts,
        args.max_new_tokens,
        setup.eos,
        info.vocab_size,
        info.hidden_size,
        sampling,
        drafter_path=setup.ckpt,
        seed=args.seed,
        dtype=setup.dtype,
        device=args.device,
        timeout_s=args.timeout,
        debug=args.debug,
        profile=profile,
        trust_remote_code=setup.trust_remote_code,
        pdm_placement=args.pdm_placement,
        compile=args.compile,
        warm_up=warm_up,
    )
