"""`serve --max-batch`: how many requests share the pipeline, checked and defaulted before anything loads.

The default and why (docs/SERVING.md, "Batched serving", Default): 1 on the CPU (SPD is a latency method,
batching is asked for); on GPUs up to `GPU_BATCH`, fewer when B slots' caches at the target's context would not
fit in `CACHE_SHARE` of one GPU's memory beside its stage's weights. The estimate counts every layer of the
largest stage as attention (a Gated DeltaNet layer's fixed state is smaller at long contexts), so it errs low.
"""

from __future__ import annotations

import argparse
import math

import torch

from inference.cli import UsageError
from inference.setup import Setup
from spd_lightning.target import resolve_dtype

GPU_BATCH = 8
CACHE_SHARE = 0.5  # of what a GPU has beside its stage's weights (the rest: activations, graphs, fragmentation)


def check_max_batch(args: argparse.Namespace, mode: str) -> None:
    """One line for what batched serving does not support (yet)."""
    B = args.max_batch
    if B is None or B == 1:
        return
    if B < 1:
        raise UsageError(f"--max-batch {B} must be >= 1 (1: one request at a time)")
    if mode in ("ar", "eagle3"):
        raise UsageError(f"--max-batch {B}: --mode {mode} serves one request at a time; use --max-batch 1")


def default_max_batch(args: argparse.Namespace, setup: Setup) -> int:
    """`--max-batch` when it is not given (see the module docstring); `check_args` made sure CUDA is there."""
    if not args.device.startswith("cuda") or setup.mode in ("ar", "eagle3"):
        return 1
    memory = min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    return batch_that_fits(memory, stage_weight_bytes(setup), slot_cache_bytes(setup))


def batch_that_fits(memory: int, weights: int, per_slot: int) -> int:
    """At most GPU_BATCH slots, at least 1, whose caches take at most CACHE_SHARE of what the weights leave."""
    if per_slot <= 0:
        return GPU_BATCH
    return max(1, min(GPU_BATCH, math.floor(CACHE_SHARE * max(0, memory - weights) / per_slot)))


def stage_weight_bytes(setup: Setup) -> int:
    """The largest stage's share of the target's weights (its layers; the ends' embedding and head counted whole)."""
    model = setup.skeleton.model
    element = resolve_dtype(setup.dtype).itemsize
    total = sum(p.numel() for p in model.parameters())
    return math.ceil(total / setup.geometry.n) * element


def slot_cache_bytes(setup: Setup) -> int:
    """One slot's keys and values on the largest stage, at the target's whole context."""
    config = setup.skeleton.model.config
    config = getattr(config, "text_config", config)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layers = math.ceil(config.num_hidden_layers / setup.geometry.n)
    positions = setup.info.max_position_embeddings or 32768
    element = resolve_dtype(setup.dtype).itemsize
    return layers * 2 * kv_heads * head_dim * positions * element
