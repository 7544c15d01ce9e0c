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

from .flops import deltanet_kernels_here, step_seconds
from .memory import estimate
from .report import main, report
from .shape import GIB, EstimateError, Shape, pdm_config, read_config, target_config

__all__ = [
    "GIB",
    "EstimateError",
    "Shape",
    "deltanet_kernels_here",
    "estimate",
    "main",
    "pdm_config",
    "read_config",
    "report",
    "step_seconds",
    "target_config",
]
