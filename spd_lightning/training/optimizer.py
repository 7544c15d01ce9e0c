"""The optimizer of every drafter this package trains (the PDM, the EAGLE-3 baseline): AdamW with a linear warmup,
then a linear decay to a floor, stepped per optimizer step.

Weight decay applies to the matrices, not to norms or biases. They are named when the drafter is built
(`matrix_names`), before any wrapping: Lightning's FSDP wraps the model before it calls `configure_optimizers`, and
the parameters it sees then are flat 1-D shards, so their `ndim` says nothing (it once decayed none of them).
Gradient clipping by norm (`gradient_clip_val`, set by every shipped config) works under FSDP too
(`ShardedGradientClipping`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..errors import ConfigError

FSDP_PREFIX = "_fsdp_wrapped_module."


def plain_name(name: str) -> str:
    """A parameter's name as the unwrapped module has it (FSDP's units insert their wrapper's attribute)."""
    return name.replace(FSDP_PREFIX, "")


def matrix_names(module: nn.Module) -> frozenset[str]:
    """The parameters AdamW decays, by name; call it on the module as built, before a strategy wraps it."""
    return frozenset(name for name, p in module.named_parameters() if p.ndim >= 2)


def check_optimizer_settings(lr: float, weight_decay: float, warmup_steps: int, min_lr_ratio: float) -> None:
    """One line for a setting `adamw_linear_schedule` cannot use (AdamW's own error for a negative weight decay comes
    at the first step, as a traceback; a ratio above 1 would make the learning rate rise, silently)."""
    if lr <= 0:
        raise ConfigError(f"lr={lr} must be positive")
    for name, value in (("weight_decay", weight_decay), ("warmup_steps", warmup_steps)):
        if value < 0:
            raise ConfigError(f"{name}={value} must be >= 0")
    if not 0 <= min_lr_ratio <= 1:
        raise ConfigError(f"min_lr_ratio={min_lr_ratio} must lie in [0, 1] (the final lr as a fraction of lr)")


def adamw_linear_schedule(module: nn.Module, decayed: frozenset[str], settings: Mapping, total_steps: int) -> dict:
    """Lightning's `configure_optimizers` answer for `module`'s trainable parameters (wrapped or not). `settings`:
    the module's `lr`, `weight_decay`, `warmup_steps` and `min_lr_ratio` (its hparams)."""
    lr, weight_decay = settings["lr"], settings["weight_decay"]
    warmup_steps, min_lr_ratio = settings["warmup_steps"], settings["min_lr_ratio"]
    params = [(plain_name(name), p) for name, p in module.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for name, p in params if name in decayed], "weight_decay": weight_decay},
        {"params": [p for name, p in params if name not in decayed], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=lr)
    total = max(1, total_steps)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return max(min_lr_ratio, 1.0 - (1.0 - min_lr_ratio) * (step - warmup_steps) / max(1, total - warmup_steps))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class ShardedGradientClipping:
    """A LightningModule mixin: `gradient_clip_val` under DDP and FSDP alike. Under FSDP the gradients are sharded
    and Lightning's norm clipping refuses to run ("not supported for `FSDPPrecision`", at the first step); FSDP's
    own `clip_grad_norm_` takes the norm over all shards."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = self.trainer.strategy.model
        fsdp_norm = gradient_clip_algorithm in (None, "norm") and isinstance(model, FullyShardedDataParallel)
        if gradient_clip_val and fsdp_norm:
            model.clip_grad_norm_(gradient_clip_val)
        else:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
