"""Plain autoregressive decoding through the same stage modules (docs/DESIGN.md, "Baselines and ablations" for `ar`, "Lossless" for the reference).

The lossless reference: the stages run in sequence on one device, one token at a time after the prefill, with
exactly the cache path of the pipeline (the same `Stage.prefill` and `Stage.step` of one slot, same dtype). Greedy
SPD must reproduce these tokens exactly; under sampling it must match their distribution. Its first token uses the
same generator seed as the pipeline's verifier, so the two agree on it for a given seed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from inference.cycle.result import DecodeResult
from inference.cycle.schedule import eos_set
from inference.cycle.slots import generator_seeds
from inference.runtime.stages import Stage
from inference.sampling import Sampling, sample_token
from spd_lightning.geometry import Geometry
from spd_lightning.target import Target


def target_eos(target_config, generation_config=None) -> int | list[int] | None:
    """The target's EOS id(s): the generation config's when it has one, else the model config's."""
    eos = getattr(generation_config, "eos_token_id", None)
    return eos if eos is not None else getattr(target_config, "eos_token_id", None)


def run_slot_zero(stages: Sequence[Stage], x: torch.Tensor, start: int, capacity: int = 0) -> torch.Tensor | None:
    """The stages in sequence on slot 0: the prefill of `x` (ids, caches for `capacity` positions) at `start` 0,
    else one token at position `start`; the last stage's logits of the newest position."""
    logits = None
    for stage in stages:
        if start == 0:
            x, _, logits = stage.prefill(0, x, capacity)
        else:
            out = stage.step(x, {0: start})
            x, logits = out.hidden, None if out.logits is None else out.logits[0]
    return logits


@torch.no_grad()
def ar_decode_stages(
    stages: Sequence[Stage],
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    eos_token_id: int | Sequence[int] | None = None,
    seed: int = 0,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> DecodeResult:
    """`on_tokens([token])` after each token (streaming; an exception it raises ends the decode)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    eos = eos_set(eos_token_id)
    on_tokens = on_tokens or (lambda new: None)
    device = stages[0].device
    generator = torch.Generator(device=device)
    generator.manual_seed(generator_seeds(seed)[0])

    t0 = time.perf_counter()
    prompt = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    tokens = [sample_token(run_slot_zero(stages, prompt, 0, len(prompt_ids) + max_new_tokens), sampling, generator)]
    prefill_s = time.perf_counter() - t0
    on_tokens(tokens[-1:])
    t_start = time.perf_counter()
    while tokens[-1] not in eos and len(tokens) < max_new_tokens:
        logits = run_slot_zero(stages, torch.tensor([[tokens[-1]]], device=device), prompt.shape[1] + len(tokens) - 1)
        tokens.append(sample_token(logits, sampling, generator))
        on_tokens(tokens[-1:])
    stop = "eos" if tokens[-1] in eos else "max_new_tokens"
    # wall-clock of the whole decode (tokens/s); sample_token's host sync makes it real on a GPU too
    return DecodeResult(
        mode="ar",
        n=len(stages),
        prompt_len=prompt.shape[1],
        tokens=tokens,
        K=len(tokens) - 1,
        stop_reason=stop,
        prefill_s=prefill_s,
        decode_s=time.perf_counter() - t_start,
    )


def ar_stages(target: Target, geometry: Geometry | None = None, compile: bool = False) -> list[Stage]:
    """The target as stages in sequence, split like `geometry` (one stage when omitted: the same math)."""
    geometry = geometry or Geometry.build(target.num_layers, 1)
    return [Stage.from_target(target, geometry, s, compile=compile) for s in range(1, geometry.n + 1)]


def ar_decode(
    target: Target,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    eos_token_id: int | Sequence[int] | None = None,
    seed: int = 0,
    geometry: Geometry | None = None,
) -> DecodeResult:
    """AR decoding of an in-memory target, split like `geometry` (`ar_stages`)."""
    return ar_decode_stages(ar_stages(target, geometry), prompt_ids, max_new_tokens, sampling, eos_token_id, seed)
