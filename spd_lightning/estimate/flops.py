"""Training FLOPs per token (the target's no-grad forward, the PDM's forward and backward) and the step time they
give at an assumed MFU."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .shape import Shape

if TYPE_CHECKING:
    from ..pdm import PipelineDraftModule


def flops_per_token(tcfg, c, target_params: int, pdm: PipelineDraftModule, layout, T: int, opts: dict) -> float:
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
        target_flops_per_token(tcfg, c, target_params, T, opts["full_vocab_every"], opts["cached"])
        + 4 * fusion
        + passes * layer_rows
        + pdm_attn
        + 6 * c.draft_vocab_size * c.hidden_size
    )


def layer_kinds(tcfg) -> tuple[int, int]:
    """(linear-attention layers, full-attention layers) of the target."""
    types = getattr(tcfg, "layer_types", None) or ["full_attention"] * tcfg.num_hidden_layers
    full = sum(t == "full_attention" for t in types)
    return len(types) - full, full


def target_flops_per_token(tcfg, c, target_params: int, T: int, every: int, cached: bool = False) -> float:
    """The target's no-grad forward per token: 2 per weight, its head over V_d (the full vocabulary only every
    `full_vocab_metric_every_n_steps`), plus causal attention over T/2 keys on its full-attention layers. From a
    state cache (`cached`) only the head over V_d runs, on the cached final-norm state."""
    if cached:
        return 2 * tcfg.hidden_size * c.draft_vocab_size
    target_attn = layer_kinds(tcfg)[1] * 4 * tcfg.num_attention_heads * getattr(tcfg, "head_dim", 128) * T / 2
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
    from ..training.deltanet_fallback import FALLBACK_SLOWDOWN, target_slowdown

    linear, full = layer_kinds(tcfg)
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
