"""The FlexAttention block mask of a training step, from a block structure built once per shape.

`create_block_mask` evaluates the step's predicate on every `(query, key)` pair to learn which `128 x 128`
blocks are empty, partial or full: `B * R * S` evaluations each step (`S = (n+1) * T`; 340 M at n = 8,
T = 2048). Yet a step's mask depends on the batch only through two things:

- the fill levels: a real row's keys are those of the same row at a uniform fill `a` (the row's own fill,
  `Replication.fill`), over unpadded sequences (`ShapeMasks.per_fill(a)`, `a = 1..n`);
- padding: a padded row attends to itself only, and no real row reads a padded key.

So, once per shape, for each fill `a` and block: does some row of the block touch it, do all rows fill it
(`Skeleton`, from strips of rows of the predicate: bounded memory, no compile). Per step, on `[B, R / 128]`
tensors: a block touches what the fills present among its real rows touch, plus its diagonal (every row
attends to itself); it is full where every one of those fills fills it and all its rows are real. A block
whose rows share one fill and are all real (every unpadded block of `type`, whose fill is per sample) gets
exactly the blocks of `create_block_mask`; a `depth` block mixing fills, or a block where a sample's padding
begins, gets a superset, and the kernel applies the step's exact `mask_mod` in every partial block: the
attention is the same (tests/test_block_sparsity.py; docs/BENCHMARKS.md counts the blocks).

Used when `T` is a multiple of the block size (`data.pad_to_multiple_of: 128`, as the GPU configs set): a
run then has at most `max_length / 128` shapes, each built once. With lengths padded to the longest sample
alone nearly every step is a new shape, and `create_block_mask` per step is cheaper than building one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
BLOCK = 128  # FlexAttention's default sparse block size
_CACHE_SIZE = 64  # every shape of a run at max_length 2048 (16 lengths x 2 row counts), twice over
_STRIP_ELEMENTS = 1 << 22  # predicate evaluations per strip of query rows (bounded memory at any S)


@dataclass(frozen=True)
class ShapeMasks:
    """What every step of one replicated shape shares: the layout's mask over unpadded rows at each uniform
    fill level, and what makes a row real (`q % length < lengths[b]`). `key` names the shape in the cache."""

    key: tuple
    levels: int  # n: fills 1..n
    length: int  # T
    per_fill: Callable[[int], MaskMod]


def worth_caching(length: int, block: int = BLOCK) -> bool:
    return length % block == 0


@dataclass(frozen=True)
class StepRows:
    """A step's rows as its block mask needs them: its shape, each sample's length, and each copy's rows' fills
    (`Replication.fill`, `[B, T]` per copy, in copy order: concatenated, the fill of every row)."""

    shape: ShapeMasks
    lengths: torch.Tensor
    fill: list[torch.Tensor]


@dataclass(frozen=True)
class Skeleton:
    """Per fill level and block `[n, R / Bq, S / Bk]`: does some row touch it (`touched`), do all fill it (`full`)."""

    touched: torch.Tensor
    full: torch.Tensor
    rows: int
    seq_len: int
    block: int


_SKELETONS: OrderedDict[tuple, Skeleton] = OrderedDict()


def skeleton(shape: ShapeMasks, rows: int, seq_len: int, device: torch.device, block: int = BLOCK) -> Skeleton:
    """The block structure of the first `rows` query rows against `seq_len` keys, cached per shape (LRU)."""
    key = (shape.key, rows, seq_len, str(device), block)
    if key in _SKELETONS:
        _SKELETONS.move_to_end(key)
        return _SKELETONS[key]
    built = _build(shape, rows, seq_len, device, block)
    _SKELETONS[key] = built
    if len(_SKELETONS) > _CACHE_SIZE:
        _SKELETONS.popitem(last=False)
    return built


@torch.inference_mode(False)  # the cache serves training and validation (layouts.replication.index_table)
def _build(shape: ShapeMasks, rows: int, seq_len: int, device: torch.device, block: int) -> Skeleton:
    num_q, num_k = -(-rows // block), -(-seq_len // block)
    touched = torch.zeros(shape.levels, num_q, num_k, dtype=torch.bool, device=device)
    full = torch.zeros_like(touched)
    kv = torch.arange(seq_len, device=device)[None, :]
    zero = torch.zeros((), dtype=torch.long, device=device)
    step = max(1, _STRIP_ELEMENTS // (block * max(seq_len, 1))) * block  # whole row blocks per strip
    for a in range(1, shape.levels + 1):
        mask_mod = shape.per_fill(a)
        for start in range(0, rows, step):
            q = torch.arange(start, min(start + step, rows), device=device)[:, None]
            pattern = mask_mod(zero, zero, q, kv)
            blocks = slice(start // block, start // block + -(-q.shape[0] // block))
            touched[a - 1, blocks] = _per_block(pattern, block, num_k, torch.any)
            full[a - 1, blocks] = _per_block(pattern, block, num_k, torch.all)
    return Skeleton(touched, full, rows, seq_len, block)


def _per_block(grid: torch.Tensor, block: int, num_k: int, reduce) -> torch.Tensor:
    """Reduce a `[r, S]` strip to `[r / block, S / block]`; the rows and keys past the ends count as False:
    a block that crosses an end is never claimed full (as `create_block_mask` does)."""
    r, s = grid.shape
    padded = torch.zeros((-(-r // block) * block, num_k * block), dtype=torch.bool, device=grid.device)
    padded[:r, :s] = grid
    per = padded.view(-1, block, num_k, block)
    return reduce(reduce(per, dim=3), dim=1)


def step_block_mask(skel: Skeleton, step: StepRows, mask_mod: MaskMod):
    """This step's `BlockMask` from the shape's structure: see the module docstring."""
    from torch.nn.attention.flex_attention import BlockMask

    levels, num_q, num_k = skel.touched.shape
    device, rows = step.lengths.device, num_q * skel.block
    q = torch.arange(rows, device=device)
    real = (q[None] % step.shape.length < step.lengths[:, None]) & (q[None] < skel.rows)
    fill = torch.nn.functional.pad(torch.cat(step.fill, dim=1)[:, : skel.rows], (0, rows - skel.rows), value=1)
    present = torch.zeros(real.shape[0], num_q, levels + 1, dtype=torch.bool, device=device)
    present.view(-1, levels + 1).scatter_(1, (fill * real).view(-1, skel.block), True)  # fill 0: no real row
    present = present[..., 1:].float()  # [B, Q, n]: the fills of each block's real rows
    touched = torch.einsum("bqa,aqk->bqk", present, skel.touched.float()) > 0
    touched |= torch.eye(num_q, num_k, dtype=torch.bool, device=device)  # every row attends to itself
    not_full = torch.einsum("bqa,aqk->bqk", present, (~skel.full).float()) > 0
    full = ~not_full & real.view(-1, num_q, skel.block).all(-1)[..., None]
    return BlockMask.from_kv_blocks(
        *_ordered(touched & ~full),
        *_ordered(full),
        BLOCK_SIZE=skel.block,
        mask_mod=mask_mod,
        seq_lengths=(skel.rows, skel.seq_len),
    )


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[B, Q, K]` block booleans as FlexAttention's `(num_blocks [B, 1, Q], indices [B, 1, Q, K])`: the
    touched key blocks of each query block first, in order."""
    num = dense.sum(-1, dtype=torch.int32)
    indices = torch.argsort((~dense).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num[:, None], indices[:, None]
