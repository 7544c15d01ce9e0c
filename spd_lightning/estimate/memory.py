"""Per-GPU bytes of a training step by component: the target, the PDM's training state, the step's tensors at the
backward's peak, and what the runtime adds (autocast, DDP, FSDP, the CUDA context)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .flops import flops_per_token, target_flops_per_token
from .shape import DTYPE_BYTES, GIB, Shape, pdm_config

if TYPE_CHECKING:
    from ..pdm import PipelineDraftModule


def count_params(module_fn) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in module_fn().parameters())


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

    from ..pdm import PipelineDraftModule
    from ..training.layouts import build_layout

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
    out["flops_per_token"] = flops_per_token(tcfg, c, target_params, pdm, layout, T, opts)
    out["target_flops_per_token"] = target_flops_per_token(tcfg, c, target_params, T, opts["full_vocab_every"], cached)
    out.update(target_params=target_params, pdm_params=pdm_params, gpus=gpus, replicated_length=S)
    return out
