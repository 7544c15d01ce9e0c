"""Attention backends for a structural mask given ONCE as a FlexAttention-style predicate.

A training layout (spd_lightning/training/layouts/) describes its mask as `mask_mod(b, h, q_idx, kv_idx) -> bool`
over the replicated sequence of length `S`. The same predicate drives three backends:

- `flex`: a block mask + `flex_attention` (compiled on CUDA). The mask is never materialized as a
  dense `S x S` tensor, which at `S = (n+1) * 2048` would not fit next to a 9B target. A layout's steps
  take their block mask from its shape's block structure, built once (spd_lightning/training/block_sparsity.py). Both are compiled
  ONCE with dynamic shapes: with static shapes every (batch, length) recompiles, and past dynamo's
  recompile limit torch silently runs the unfused flex path that builds the whole `S x S` score matrix.
  `flex_compiled` is the same compiled path on any device (CPU included: rehearsals and tests).
- `two_part`: every SPD mask row is "a causal prefix of ONE block up to a per-query cutoff" plus "at most
  `W` staircase keys". The layout hands over that factorization (`TwoPartPlan`, derived from the same
  per-row quantities as its predicate); attention then costs `S * (T + W)` instead of `S^2`, with one
  joint softmax over both parts.
- `dense`: the plan written out as a boolean `[B, 1, R, S]` mask for SDPA (boolean ops only: evaluating the
  predicate on the grid would materialize several int64 `[B, S, S]` tensors); the simplest and fastest path on
  CPU for small `S`. Tests check that the plan is the predicate and that all backends agree.

Queries are the first `R <= S` rows of the replicated sequence: every row (`R = S`) in all but the last PDM
layer, where only the loss copy (the first `T` rows) is computed (`PipelineDraftModule.body(outputs=T)`). Each
`R`'s mask is built on its first use in a step and shared by the layers that use it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from ..pdm import Attend
from .block_sparsity import MaskMod, StepRows, skeleton, step_block_mask, worth_caching

Backend = Literal["auto", "flex", "flex_compiled", "dense", "two_part"]
BACKENDS = ("auto", "flex", "flex_compiled", "dense", "two_part")

# Above this replicated length the CPU path switches from a dense mask to the two-part factorization:
# a dense fp32 score matrix per head grows as S^2 (4096^2 * 4 B = 64 MiB per head and sample).
DENSE_MAX_LEN = 4096
# Query rows processed at once by the two-part path, sized so one chunk's prefix scores stay ~64 MiB.
_TWO_PART_SCORE_BUDGET = 16 * 1024 * 1024


@dataclass
class TwoPartPlan:
    """Per query row: keys `prefix_start + i` for `0 <= i <= cutoff` (a prefix of one block of length
    `prefix_len`; `cutoff = -1` for none) plus the explicit key indices `stair[b, q, :]` (`-1` = none)."""

    prefix_start: int
    prefix_len: int
    cutoff: torch.Tensor  # [B, R] long
    stair: torch.Tensor  # [B, R, W] long

    def dense(self, num_keys: int) -> torch.Tensor:
        """The mask this plan stands for over `num_keys` keys, `[B, R, num_keys]` bool (the CPU `dense` path)."""
        B, R = self.cutoff.shape
        rel = torch.arange(num_keys, device=self.cutoff.device) - self.prefix_start
        in_prefix = (rel >= 0) & (rel < self.prefix_len)
        mask = in_prefix & (rel <= self.cutoff[..., None])
        hits = torch.zeros(B, R, num_keys + 1, dtype=torch.bool, device=mask.device)
        hits.scatter_(2, torch.where(self.stair < 0, num_keys, self.stair), True)  # the last column: the "none"s
        return mask | hits[..., :num_keys]


def resolve_backend(backend: Backend, device: torch.device, seq_len: int) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}: use one of {BACKENDS}")
    if backend != "auto":
        return backend
    if device.type == "cuda":
        return "flex"
    return "dense" if seq_len <= DENSE_MAX_LEN else "two_part"


def dense_mask(mask_mod: MaskMod, batch: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """Evaluate the predicate on the full grid at once by broadcasting: `[B, S, S]` bool. The reference that
    tests hold the plans and the kernels to (training's `dense` path writes out the plan instead)."""
    b = torch.arange(batch, device=device)[:, None, None]
    q = torch.arange(seq_len, device=device)[None, :, None]
    kv = torch.arange(seq_len, device=device)[None, None, :]
    h = torch.zeros((), dtype=torch.long, device=device)
    return mask_mod(b, h, q, kv).expand(batch, seq_len, seq_len)


def dense_attend(mask: torch.Tensor) -> Attend:
    attn_mask = mask[:, None]  # one mask for every head

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=True)

    return attend


def two_part_attend(plan: TwoPartPlan) -> Attend:
    """Keys and values unexpanded (GQA): the query heads of one key head are a group dimension that
    broadcasts against it, so no key or value is copied per query head."""

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, heads, S, hd = q.shape
        kv_heads = k.shape[1]
        groups = heads // kv_heads
        qg = q.view(B, kv_heads, groups, S, hd)
        start, T = plan.prefix_start, plan.prefix_len
        k_pre, v_pre = k[:, :, None, start : start + T], v[:, :, None, start : start + T]  # [B, kvh, 1, T, hd]
        W = plan.stair.shape[-1]
        chunk = max(1, _TWO_PART_SCORE_BUDGET // max(1, B * heads * (T + W)))
        key_pos = torch.arange(T, device=q.device)
        outs = []
        for lo in range(0, S, chunk):
            hi = min(S, lo + chunk)
            qc = qg[:, :, :, lo:hi]  # [B, kvh, g, C, hd]
            pre = torch.matmul(qc, k_pre.transpose(-1, -2)) / math.sqrt(hd)  # [B, kvh, g, C, T]
            pre = pre.masked_fill((key_pos > plan.cutoff[:, None, None, lo:hi, None]), float("-inf"))
            idx = plan.stair[:, lo:hi]  # [B, C, W]
            gather = idx.clamp(min=0).reshape(B, 1, -1, 1).expand(B, kv_heads, -1, hd)
            k_st = k.gather(2, gather).view(B, kv_heads, 1, hi - lo, W, hd)
            v_st = v.gather(2, gather).view(B, kv_heads, 1, hi - lo, W, hd)
            st = (qc.unsqueeze(-2) * k_st).sum(-1) / math.sqrt(hd)  # [B, kvh, g, C, W]
            st = st.masked_fill((idx < 0)[:, None, None], float("-inf"))
            probs = torch.softmax(torch.cat([pre, st], dim=-1).float(), dim=-1).to(v.dtype)
            out = torch.matmul(probs[..., :T], v_pre) + (probs[..., T:, None] * v_st).sum(-2)
            outs.append(out.reshape(B, heads, hi - lo, hd))
        return torch.cat(outs, dim=2)

    return attend


_COMPILED: dict = {}


def compiled_flex() -> tuple[Callable, Callable]:
    """`(create_block_mask, flex_attention)` compiled once per process with `dynamic=True`: one graph serves
    every batch size and length (a size of 1 is specialized once), so padded lengths, validation and the
    staircase callback stay far below dynamo's recompile limit."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if not _COMPILED:
        _COMPILED["mask"] = torch.compile(create_block_mask, dynamic=True)
        _COMPILED["flex"] = torch.compile(flex_attention, dynamic=True)
    return _COMPILED["mask"], _COMPILED["flex"]


def flex_attend(
    mask_mod: MaskMod,
    batch: int,
    rows: int,
    seq_len: int,
    device: torch.device,
    compiled: bool | None = None,
    step: StepRows | None = None,
) -> Attend:
    """FlexAttention for the first `rows` query rows against all `seq_len` keys, with one block mask per step
    shared by every layer with those queries. With the `step`'s rows and a block-aligned length the block mask
    comes from the shape's block structure, built once (spd_lightning/training/block_sparsity.py); else
    `create_block_mask` evaluates the predicate everywhere. Compiled (default: on CUDA), the kernel does not materialize the `rows x S` grid;
    eager flex (CPU tests of the predicate) does."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if compiled is None:
        compiled = device.type == "cuda"
    make_mask, kernel = compiled_flex() if compiled else (create_block_mask, flex_attention)
    if step is not None and worth_caching(step.shape.length):
        block_mask = step_block_mask(skeleton(step.shape, rows, seq_len, device), step, mask_mod)
    else:
        block_mask = make_mask(mask_mod, batch, None, rows, seq_len, device=device)

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return kernel(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])

    return attend


def make_attend(
    backend: Backend,
    mask_mod: MaskMod,
    plan: Callable[[int], TwoPartPlan],
    batch: int,
    seq_len: int,
    device: torch.device,
    step: StepRows | None = None,
) -> Attend:
    """The attend callable for the PDM body. Its queries are the first `R` rows (`R = q.shape[-2]`); the mask of
    each `R` is built on first use (`plan(R)`, the plan of those rows, only on the CPU paths) and then reused.
    `step`: the step's rows, for the flex paths' block structure cached per shape."""
    chosen = resolve_backend(backend, device, seq_len)
    compiled = True if chosen == "flex_compiled" else None
    build: dict[str, Callable[[int], Attend]] = {
        "flex": lambda rows: flex_attend(mask_mod, batch, rows, seq_len, device, compiled, step),
        "flex_compiled": lambda rows: flex_attend(mask_mod, batch, rows, seq_len, device, compiled, step),
        "dense": lambda rows: dense_attend(plan(rows).dense(seq_len)),
        "two_part": lambda rows: two_part_attend(plan(rows)),
    }
    by_rows: dict[int, Attend] = {}

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rows = q.shape[-2]
        if rows not in by_rows:
            by_rows[rows] = build[chosen](rows)
        return by_rows[rows](layer, q, k, v)

    return attend
