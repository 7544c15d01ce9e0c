"""What the torch fallback of Qwen3.5's Gated DeltaNet layers costs, for `fit`'s warning and `estimate`'s step time.

Without flash-linear-attention (`pip install .[gpu]`) transformers runs the Gated DeltaNet layers (three of every
four of a Qwen3.5 target) through a chunked torch loop. On a GPU the fast kernels run such a layer in about the
time of a full-attention layer of the same width (inferred from their design, not measured here: no GPU has run
this project yet). `FALLBACK_SLOWDOWN` is therefore measured as the time of a Qwen3.5 forward whose layers are all
Gated DeltaNet (fallback) over the time of the same forward with all full-attention layers, on the CPU, at tiny
width (`python -m spd_lightning.training.deltanet_fallback`): a CPU proxy of what a GPU run loses, to be replaced by the
GPU check's measurement.
"""

from __future__ import annotations

import statistics
import time

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

# `python -m spd_lightning.training.deltanet_fallback` on a 2-core CPU shared with other jobs (load 13), 2026-12-02: 3.25x and
# 5.40x in two runs; their mean. A CPU proxy (see the docstring), noisy on a loaded machine.
FALLBACK_SLOWDOWN = 4.3


def target_slowdown(linear_layers: int, full_layers: int, factor: float = FALLBACK_SLOWDOWN) -> float:
    """How much longer a target forward takes with the fallback: its linear-attention layers `factor` times
    slower, its full-attention layers unchanged."""
    return (linear_layers * factor + full_layers) / max(1, linear_layers + full_layers)


def announce_linear_attention(path: str | None, device: torch.device, target: str) -> None:
    """`fit`'s lines at start for a hybrid target (both drafters'): which Gated DeltaNet path it runs, and loudly
    when a CUDA run takes the slow fallback (a long run at a fraction of its speed)."""
    if path is not None:
        rank_zero_info(f"target {target}: Gated DeltaNet layers run the {path}")
    slow = fallback_warning(path, device, target)
    if slow is not None:
        rank_zero_warn(slow)


def fallback_warning(path: str | None, device: torch.device, target: str) -> str | None:
    """`fit`'s loud line at start when a CUDA run's Gated DeltaNet layers take the torch fallback, else None."""
    if device.type != "cuda" or path is None or not path.startswith("torch fallback"):
        return None
    return (
        f"SLOW: target {target}: its Gated DeltaNet layers run the {path}; each is about {FALLBACK_SLOWDOWN:.1f}x "
        "slower than with the fast kernels (a CPU proxy, spd_lightning/training/deltanet_fallback.py), so the target's "
        "forward is too: install flash-linear-attention and causal-conv1d before a long run"
    )


def _forward_seconds(layer_type: str, tokens: int, repeats: int, width: int) -> float:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    layers = 4
    config = Qwen3_5TextConfig(
        vocab_size=512,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        layer_types=[layer_type] * layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=width // 4,
        linear_key_head_dim=width // 4,
        linear_value_head_dim=width // 4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=4 * tokens,
    )
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config).eval()
    ids = torch.randint(0, 512, (1, tokens))
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            model.model(input_ids=ids, use_cache=False)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def measure(tokens: int = 1024, repeats: int = 5, width: int = 128) -> float:
    """The fallback's linear-attention forward time over the full-attention one, same shapes (CPU proxy)."""
    return _forward_seconds("linear_attention", tokens, repeats, width) / _forward_seconds(
        "full_attention", tokens, repeats, width
    )


if __name__ == "__main__":
    factor = measure()
    print(f"Gated DeltaNet torch fallback / full attention, forward over 1024 tokens at width 128: {factor:.2f}x")
