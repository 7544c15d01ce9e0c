"""`estimate`'s command line and its report: the table of bytes per GPU, the FLOPs, the step time, the verdict."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict

from .flops import deltanet_kernels_here, step_seconds
from .memory import estimate
from .shape import GIB, EstimateError, Shape, read_config, target_config

DESCRIPTION = "per-GPU memory and FLOPs of a `fit` config (its step time at an assumed MFU)"


def report(path: str, shape: Shape, est: dict, gpu_mem: float) -> str:
    gib = lambda x: f"{x / GIB:7.2f} GiB"  # noqa: E731
    rows = [
        ("target weights" + (" (not loaded: the state cache)" if shape.states_dtype else ""), est["target_weights"]),
        *([("the target head's V_d rows", est["cached_head"])] if "cached_head" in est else []),
        (
            f"PDM state ({est['pdm_params'] / 1e9:.2f} B params, "
            + (f"FSDP: 1/{est['gpus']} per GPU)" if shape.strategy == "fsdp" else "DDP: whole on every GPU)"),
            est["pdm_state"],
        ),
        (
            f"anchor + final-norm states ({shape.states_dtype} cache)" if shape.states_dtype else "anchor states",
            est["anchor_states"],
        ),
        ("teacher over V_d (+ fp32 loss copies)", est["teacher_vd"]),
        ("PDM activations, plain", est["activations_plain"]),
        ("PDM activations, checkpointed", est["activations_checkpointed"]),
        ("target forward (no grad, full-vocab logits)", est["target_forward"]),
    ]
    rows += [
        (label, est[key])
        for key, label in (
            ("autocast_weight_copies", "autocast bf16 weight copies"),
            ("ddp_grad_buckets", "DDP gradient buckets"),
            ("fsdp_full_params", "FSDP unsharded parameters (units in flight)"),
            ("fsdp_full_grads", "FSDP unsharded gradients (units in flight)"),
            ("cuda_context", "CUDA/NCCL context (outside the allocator)"),
        )
        if key in est
    ]
    lines = [
        f"estimate for {path}: B={shape.batch}, T={shape.length}, S={est['replicated_length']}, "
        f"precision {shape.precision}, target {est['target_params'] / 1e9:.2f} B params"
    ]
    lines += [f"  {name:<52} {gib(value)}" for name, value in rows]
    lines += [
        f"  {'peak per GPU, plain':<52} {gib(est['total_plain'])}",
        f"  {'peak per GPU, activation checkpointing':<52} {gib(est['total_checkpointed'])}",
        f"  {'training FLOPs per token':<52} {est['flops_per_token'] / 1e9:7.1f} GFLOP",
    ]
    if "step_s" in est:
        slow = (
            f"; the Gated DeltaNet torch fallback makes the target's forward {est['target_slowdown']:.2f}x slower "
            f"(its layers {est['fallback_factor']:.2f}x, a CPU proxy: pass --deltanet fast if the GPUs have the kernels)"
            if est["fallback_factor"]
            else ""
        )
        lines.append(
            f"  {'step time per GPU':<52} {est['step_s']:7.2f} s   (assumed {est['mfu']:.0%} MFU of "
            f"{est['gpu_tflops']:g} TFLOP/s{slow})"
        )
    chosen = est["total_device"]
    verdict = "fits" if chosen <= gpu_mem * GIB else "does NOT fit"
    lines.append(
        f"  this config ({'checkpointed' if shape.checkpointing else 'plain'}): {gib(chosen).strip()} "
        f"{verdict} a {gpu_mem:g} GiB GPU"
    )
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    """`estimate --config CFG [--gpus G] [--gpu-mem GiB] [--json]`; bad input raises a `UserError` (exit 2 through
    `python -m spd_lightning`)."""
    parser = argparse.ArgumentParser(prog="python -m spd_lightning estimate", description=DESCRIPTION)
    parser.add_argument("--config", required=True, action="append", help="a `fit` config (YAML), one")
    parser.add_argument(
        "--gpus",
        type=int,
        help="GPUs the run uses (FSDP shards the PDM state over them; default: the config's trainer.devices, else 8)",
    )
    parser.add_argument("--gpu-mem", type=float, default=80.0, help="memory of one GPU in GiB")
    parser.add_argument("--gpu-tflops", type=float, default=989.0, help="dense bf16 peak of one GPU (H200: 989)")
    parser.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilization for the step time")
    parser.add_argument(
        "--deltanet",
        choices=["auto", "fast", "fallback"],
        default="auto",
        help="Gated DeltaNet kernels on the GPUs (auto: whether this environment has flash-linear-attention)",
    )
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    opts = parser.parse_args(list(argv))
    if len(opts.config) > 1:  # `fit` stacks configs; this reads one file as written
        raise EstimateError("estimate reads one --config: merge the files (`fit ... --print_config > one.yaml`)")
    opts.config = opts.config[0]
    shape = read_config(opts.config)
    tcfg = target_config(shape.module_args["target"], shape.module_args["trust_remote_code"])
    est = estimate(shape, tcfg, opts.gpus or shape.devices or 8)
    fallback = opts.deltanet == "fallback" or (opts.deltanet == "auto" and not deltanet_kernels_here())
    est.update(step_seconds(est, shape, tcfg, opts.gpu_tflops, opts.mfu, fallback))
    print(
        json.dumps(
            {
                "shape": {k: v for k, v in asdict(shape).items() if k != "module_args"},
                **est,
                "gpu_mem_gib": opts.gpu_mem,
                "fits": est["total_device"] <= opts.gpu_mem * GIB,
            },
            indent=1,
        )
        if opts.json
        else report(opts.config, shape, est, opts.gpu_mem)
    )
    return 0
