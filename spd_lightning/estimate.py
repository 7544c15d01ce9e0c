"""`python -m spd_lightning estimate --config CFG [--gpus G] [--gpu-mem GiB]`: per-GPU memory and FLOPs of `fit`.

Reads a `fit` config the way `fit` does: the PDM shape from `model.*` (defaults from `SPDModule`; a config of
another model class is refused), batch and length from `data.*` (defaults from `ChatDataModule`), precision,
strategy and the GPU count (`devices`, unless `--gpus`) from `trainer.*`, and the target's architecture from its HF config
(a local directory or the hub cache; for the shipped configs' targets, `spd_lightning/archs/<name>.json` holds
the real architecture, since the hub may be unreachable). Parameters are counted exactly by building both models
on the meta device; activations are counted per saved tensor of one PDM layer (`_layer_saved_bytes`).

Per GPU, at the peak of a step (the PDM's backward):
  target weights + PDM training state (fp32 weights, grads, AdamW moments; sharded by G under FSDP)
  + anchor states + the teacher over V_d + PDM activations (with or without checkpointing) + the loss tensors.
The target's own no-grad forward peaks earlier (one layer's temporaries + full-vocabulary logits); the larger
of the two phases counts. Runtime buffers come on top (`_runtime_terms`): autocast's bf16 copies of the PDM's
weights (bf16-mixed), DDP's gradient buckets (a second copy of the gradients, G > 1), FSDP's unsharded parameters
and gradients of the units in flight, and, outside the allocator, the CUDA/NCCL context (`total_device`). Checked against measured peaks in tests/test_estimate.py and docs/BENCHMARKS.md.

A config that trains from a state cache (`data.states`) never loads the target: no target weights and no target
forward; the head's V_d rows instead, and the anchor and final-norm states in the cache's dtype (its manifest's,
else `prepare --states-dtype`'s default); its FLOPs are the V_d head's only.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from .errors import UserError
from .geometry import Geometry

if TYPE_CHECKING:
    from .pdm import PipelineDraftModule

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


class EstimateError(UserError):
    """A config the estimate cannot read; one line that says why."""


def target_config(name_or_path: str, trust_remote_code: bool = False):
    """The target's text config: a local directory or the hub cache as `fit` reads it, except that a shipped
    architecture (`archs/<name>.json`) answers for a hub name without touching the network."""
    from .archs import arch_config, arch_for_hub_id
    from .target import load_hf_config, looks_local

    arch = None if looks_local(name_or_path) or os.path.isdir(name_or_path) else arch_for_hub_id(name_or_path)
    config = arch_config(arch) if arch else load_hf_config(name_or_path, trust_remote_code)
    return getattr(config, "text_config", None) or config


def count_params(module_fn) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in module_fn().parameters())


@dataclass
class Shape:
    """What the memory depends on, read from a `fit` config (or given directly by tests)."""

    batch: int
    length: int
    draft_vocab: int
    precision: str  # "bf16-mixed" or "32"
    strategy: str  # "ddp" or "fsdp"
    target_dtype: str
    checkpointing: bool
    backend: str  # attention backend: "flex" (GPU) or "dense" (CPU)
    module_args: dict
    accelerator: str = "gpu"  # "cpu": no CUDA/NCCL context
    devices: int | None = None  # `trainer.devices` when the config names a count
    states_dtype: str | None = None  # the state cache's dtype when fit reads one (`data.states`): no target loaded


def _defaults(cls) -> dict:
    return {
        k: p.default
        for k, p in inspect.signature(cls.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def read_config(path: str) -> Shape:
    from .cli import read_config_file
    from .data import ChatDataModule
    from .training.module import SPDModule

    cfg = read_config_file(path)
    model = cfg.get("model") or {}
    class_path = model.pop("class_path", None) or SPDModule.__name__
    if class_path.rsplit(".", 1)[-1] != SPDModule.__name__:  # its PDM shape would be SPDModule's defaults
        raise EstimateError(f"config {path!r} trains {class_path}: estimate covers the PDM (SPDModule) only")
    model = {**_defaults(SPDModule), **model}
    if "target" not in model:
        raise EstimateError(f"config {path!r} has no model.target: name the target model")
    data = {**_defaults(ChatDataModule), **(cfg.get("data") or {})}  # fit's defaults where the config is silent
    trainer = cfg.get("trainer") or {}
    strategy = trainer.get("strategy", "ddp")
    strategy = strategy.get("class_path", "ddp") if isinstance(strategy, dict) else str(strategy)
    backend = model.get("attention_backend", "auto")
    return Shape(
        batch=int(data["batch_size"]),
        length=int(data["max_length"]),
        draft_vocab=int(data["draft_vocab_size"]),
        precision=str(trainer.get("precision", "32")),
        strategy="fsdp" if "fsdp" in strategy.lower() else "ddp",
        target_dtype=str(model["target_dtype"]),
        checkpointing=bool(model.get("activation_checkpointing")),
        backend="dense" if backend == "dense" else "flex",
        module_args=model,
        accelerator="cpu" if str(trainer.get("accelerator", "gpu")) == "cpu" else "gpu",
        devices=_device_count(trainer.get("devices")),
        states_dtype=_states_dtype(data.get("states")),
    )


def _states_dtype(directory: str | None) -> str | None:
    """The dtype of the cache at `directory` (its manifest's; `prepare --states-dtype`'s default before it is
    built), None without one."""
    from .data.states import DEFAULT_STATES_DTYPE, read_manifest

    if not directory:
        return None
    manifest = read_manifest(directory) if os.path.isdir(directory) else None
    return str((manifest or {}).get("dtype", DEFAULT_STATES_DTYPE))


def _device_count(devices) -> int | None:
    """`trainer.devices` as a count (a list of indices, a number); None when the config leaves it to the node
    (`-1`, `auto`, absent)."""
    if isinstance(devices, list):
        return len(devices)
    if isinstance(devices, str) and devices.isdigit():
        devices = int(devices)
    return devices if isinstance(devices, int) and devices > 0 else None


def pdm_config(shape: Shape, tcfg):
    from .pdm import PDMConfig, block_shape

    m = shape.module_args
    geometry = Geometry.build(tcfg.num_hidden_layers, m["n"], m["split"], m["anchors"], m["schedule"], m["features"])
    block = (m.get(k) for k in ("num_heads", "num_kv_heads", "head_dim", "intermediate_size"))
    cfg = PDMConfig(
        target_hidden_size=tcfg.hidden_size,
        num_types=geometry.num_types,
        draft_vocab_size=shape.draft_vocab,
        hidden_size=m.get("hidden_size") or tcfg.hidden_size,
        num_layers=m["num_layers"],
        head_from_target=bool(m.get("head_from_target")),
        **block_shape(tcfg, *block),
    )
    return cfg, geometry


def _layer_saved_bytes(c, act: int, mixed: bool) -> float:
    """Bytes autograd keeps per replicated token for one PDM layer (act = activation element size): the two
    RMSNorms (fp32 input + normalized copy), the linears' inputs (autocast casts the input once per linear; in
    fp32 the q/k/v and gate/up inputs ARE the norms' outputs),
    q/k norm and RoPE (fp32), attention's q and out (query heads), k and v (key/value heads: GQA is not expanded,
    `enable_gqa`) and log-sum-exp, SwiGLU's four."""
    f, d, i = 4, c.hidden_size, c.intermediate_size
    qk = (c.num_heads + c.num_kv_heads) * c.head_dim
    hd, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    linear_inputs = act * d * (5 if mixed else 0) + act * hd + act * i
    return (
        2 * (f + act) * d
        + linear_inputs
        + (f + act) * qk
        + 2 * f * qk
        + 2 * act * (hd + kv)
        + f * c.num_heads
        + 3 * act * i
    )


def _flops_per_token(tcfg, c, target_params: int, pdm: PipelineDraftModule, layout, T: int, opts: dict) -> float:
    """Training FLOPs per token of the data: the target's no-grad forward (2 per weight, its head over V_d, plus
    causal attention over T/2 keys on its full-attention layers) and the PDM's forward + backward (6 per weight per row, 8 with
    checkpointing's second forward; attention sees about T/2 keys per query). The PDM runs the fusion once per
    aggregation type (4 per weight: forward and the weights' gradient; the frozen states need no input gradient,
    `Fusion._one`), every copy through layers 0..L_s-2, and in its last layer every copy's keys and values
    but the loss copy's queries, output, MLP and head only (every copy when `aux_loss_weight` reads the others:
    `SPDModule._forward`)."""
    passes = 8 if opts["checkpointing"] else 6
    copies = len(layout.copy_types)
    fusion = sum(pdm.fusion.proj[tau - 1].weight.numel() for tau in set(layout.copy_types))
    layer = sum(p.numel() for p in pdm.layers[0].parameters())
    kv = sum(
        p.numel() for m in (pdm.layers[0].self_attn.k_proj, pdm.layers[0].self_attn.v_proj) for p in m.parameters()
    )
    rows_out = copies if opts["aux_loss_weight"] > 0 else 1  # rows the last layer computes past its keys/values
    layer_rows = (c.num_layers - 1) * copies * layer + copies * kv + rows_out * (layer - kv)
    query_rows = (c.num_layers - 1) * copies + rows_out
    pdm_attn = query_rows * 4 * c.num_heads * c.head_dim * T / 2 * passes / 2
    return (
        _target_flops_per_token(tcfg, c, target_params, T, opts["full_vocab_every"], opts["cached"])
        + 4 * fusion
        + passes * layer_rows
        + pdm_attn
        + 6 * c.draft_vocab_size * c.hidden_size
    )


def _layer_kinds(tcfg) -> tuple[int, int]:
    """(linear-attention layers, full-attention layers) of the target."""
    types = getattr(tcfg, "layer_types", None) or ["full_attention"] * tcfg.num_hidden_layers
    full = sum(t == "full_attention" for t in types)
    return len(types) - full, full


def _target_flops_per_token(tcfg, c, target_params: int, T: int, every: int, cached: bool = False) -> float:
    """The target's no-grad forward per token: 2 per weight, its head over V_d (the full vocabulary only every
    `full_vocab_metric_every_n_steps`), plus causal attention over T/2 keys on its full-attention layers. From a
    state cache (`cached`) only the head over V_d runs, on the cached final-norm state."""
    if cached:
        return 2 * tcfg.hidden_size * c.draft_vocab_size
    target_attn = _layer_kinds(tcfg)[1] * 4 * tcfg.num_attention_heads * getattr(tcfg, "head_dim", 128) * T / 2
    head = tcfg.hidden_size * (c.draft_vocab_size + (tcfg.vocab_size / every if every else 0))
    return 2 * (target_params - tcfg.vocab_size * tcfg.hidden_size + head) + target_attn


def deltanet_kernels_here() -> bool:
    """Whether this environment has the fast Gated DeltaNet kernels (flash-linear-attention, causal-conv1d)."""
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("fla", "causal_conv1d"))


def step_seconds(est: dict, shape: Shape, tcfg, tflops: float, mfu: float, fallback: bool) -> dict:
    """A training step's time on one GPU of `tflops` dense peak at `mfu` (an assumption, not a measurement), with
    the target's forward slowed by the Gated DeltaNet torch fallback when `fallback` and the target has such
    layers (`deltanet_fallback.FALLBACK_SLOWDOWN`, a CPU proxy)."""
    from .training.deltanet_fallback import FALLBACK_SLOWDOWN, target_slowdown

    linear, full = _layer_kinds(tcfg)
    fallback = fallback and linear and shape.states_dtype is None  # from a cache no target layer runs
    slowdown = target_slowdown(linear, full) if fallback else 1.0
    flops = est["flops_per_token"] + (slowdown - 1.0) * est["target_flops_per_token"]
    return {
        "step_s": shape.batch * shape.length * flops / (tflops * 1e12 * mfu),
        "target_slowdown": slowdown,
        "fallback_factor": FALLBACK_SLOWDOWN if fallback else None,
        "mfu": mfu,
        "gpu_tflops": tflops,
    }


# The CUDA context plus NCCL's communicator buffers per rank, outside PyTorch's allocator (inferred: a CUDA 12
# context with torch's kernels loaded takes about 0.5 GiB, NCCL's buffers for 8 ranks a few hundred MiB).
CUDA_CONTEXT_BYTES = 1.0 * GIB


def _runtime_terms(shape: Shape, pdm: PipelineDraftModule, gpus: int, mixed: bool) -> dict:
    """Buffers the runtime adds at the backward's peak, by the PDM's parameters (meta tensors)."""
    params = [p.numel() for p in pdm.parameters()]
    layer = sum(p.numel() for p in pdm.layers[0].parameters()) if len(pdm.layers) else 0
    root = sum(params) - len(pdm.layers) * layer
    out = {}
    if mixed:  # autocast caches a bf16 copy of every matmul weight for the step; backward reads them
        out["autocast_weight_copies"] = 2 * sum(p.numel() for p in pdm.parameters() if p.ndim >= 2)
    if gpus > 1 and shape.strategy == "ddp":  # DDP's buckets hold a second fp32 copy of the gradients
        out["ddp_grad_buckets"] = 4 * sum(params)
    if gpus > 1 and shape.strategy == "fsdp":
        # The root unit (fusion, norm, head) stays unsharded through the step; a layer unit and the next one
        # (prefetched) are unsharded in the backward; a unit's full gradient exists until its reduce-scatter.
        out["fsdp_full_params"] = 4 * (root + 2 * layer)
        out["fsdp_full_grads"] = 4 * (root + layer)
    if shape.accelerator == "gpu":
        out["cuda_context"] = CUDA_CONTEXT_BYTES
    return out


def estimate(shape: Shape, tcfg, gpus: int = 1) -> dict:
    """Per-GPU bytes by component, and FLOPs per training token."""
    from transformers import AutoModelForCausalLM

    from .pdm import PipelineDraftModule
    from .training.layouts import build_layout

    c, geometry = pdm_config(shape, tcfg)
    layout = build_layout(shape.module_args["layout"], geometry)
    copies, B, T = len(layout.copy_types), shape.batch, shape.length
    S, tokens = copies * T, B * T
    mixed = shape.precision.startswith("bf16") or shape.precision.startswith("16")
    act, tgt = (2 if mixed else 4), DTYPE_BYTES[shape.target_dtype]
    target_params = count_params(lambda: AutoModelForCausalLM.from_config(tcfg))
    pdm_params = count_params(lambda: PipelineDraftModule(c))
    vocab, H = tcfg.vocab_size, tcfg.hidden_size
    shard = gpus if shape.strategy == "fsdp" else 1
    frozen = c.draft_vocab_size * c.hidden_size if c.head_from_target else 0  # the target's rows: fp32, no state
    out = {"target_weights": target_params * tgt, "pdm_state": (16 * (pdm_params - frozen) + 4 * frozen) / shard}
    cached = shape.states_dtype is not None
    if cached:  # the target is never loaded: the batch brings its states, the head's V_d rows are kept
        out["target_weights"] = 0
        out["cached_head"] = shape.draft_vocab * H * tgt
    per_layer = B * S * _layer_saved_bytes(c, act, mixed)
    types = sorted(set(layout.copy_types))
    # from a cache: the anchors and the final-norm state, in the cache's dtype
    out["anchor_states"] = (
        tokens * (len(geometry.anchors) + cached) * H * DTYPE_BYTES[shape.states_dtype or shape.target_dtype]
    )
    # per type, the projection's input (the normalized states, in the activation dtype; with the norms' scales
    # folded into the weights, `Fusion._one`, nothing else of the norms is kept), and the fused output of every copy
    out["fusion"] = tokens * sum(act * tau * H for tau in types) + B * S * c.hidden_size * act
    out["activations_plain"] = c.num_layers * per_layer
    out["activations_checkpointed"] = c.num_layers * B * S * c.hidden_size * act + per_layer
    if shape.backend == "dense":  # the CPU path: a [B, S, S] bool mask (SDPA's CPU kernel is blockwise)
        out["dense_attention"] = B * S * S
    out["teacher_vd"] = tokens * shape.draft_vocab * (tgt + 3 * 4)  # kept in target dtype + fp32, log p, p
    # the student's logits over V_d with their fp32 loss copies (log-softmax, the teacher's p), of the loss copy, or
    # of every copy when `aux_loss_weight` distills them all (`SPDModule.training_step`)
    distilled = copies if shape.module_args.get("aux_loss_weight", 0.0) > 0 else 1
    out["student_logits"] = distilled * tokens * shape.draft_vocab * (act + 3 * 4) + B * S * c.hidden_size * (4 + act)
    out["teacher_full_fp32_before_fix"] = tokens * vocab * 4  # what restricting after `.float()` cost
    # the target's head runs over V_d on training steps; the full vocabulary only every
    # `full_vocab_metric_every_n_steps` (and on validation), so a step's peak is the V_d head unless that is 1
    every = shape.module_args.get("full_vocab_metric_every_n_steps", 0)
    head = vocab if every == 1 else shape.draft_vocab
    out["target_forward"] = 0 if cached else tokens * (head * tgt + 4 * max(tcfg.intermediate_size, 2 * H) * tgt)
    pdm_phase = sum(
        out[k] for k in ("anchor_states", "fusion", "teacher_vd", "student_logits", "dense_attention") if k in out
    )
    acts = out["activations_checkpointed" if shape.checkpointing else "activations_plain"]
    with torch.device("meta"):
        pdm = PipelineDraftModule(c)
    runtime = _runtime_terms(shape, pdm, gpus, mixed)
    out.update(runtime)
    persistent = (
        out["target_weights"]
        + out.get("cached_head", 0)
        + out["pdm_state"]
        + sum(v for k, v in runtime.items() if k != "cuda_context")
    )
    out["total"] = persistent + max(out["target_forward"] + out["anchor_states"], pdm_phase + acts)
    out["total_plain"] = persistent + max(
        out["target_forward"] + out["anchor_states"], pdm_phase + out["activations_plain"]
    )
    out["total_checkpointed"] = persistent + max(
        out["target_forward"] + out["anchor_states"], pdm_phase + out["activations_checkpointed"]
    )
    out["total_device"] = out["total"] + runtime.get("cuda_context", 0.0)  # what the GPU must hold
    opts = {
        "checkpointing": shape.checkpointing,
        "aux_loss_weight": shape.module_args.get("aux_loss_weight", 0.0),
        "full_vocab_every": shape.module_args.get("full_vocab_metric_every_n_steps", 0),
        "cached": cached,
    }
    out["flops_per_token"] = _flops_per_token(tcfg, c, target_params, pdm, layout, T, opts)
    out["target_flops_per_token"] = _target_flops_per_token(tcfg, c, target_params, T, opts["full_vocab_every"], cached)
    out.update(target_params=target_params, pdm_params=pdm_params, gpus=gpus, replicated_length=S)
    return out


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
    parser = argparse.ArgumentParser(prog="python -m spd_lightning estimate", description=__doc__.splitlines()[0])
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


if __name__ == "__main__":
    from .cli import main as cli_main

    cli_main(["estimate", *sys.argv[1:]])
