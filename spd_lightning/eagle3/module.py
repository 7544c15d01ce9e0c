"""`Eagle3Module`: online distillation of the EAGLE-3 drafter with training-time test (docs/DESIGN.md, "Training", "The EAGLE-3 baseline").

The same contract as `SPDModule` (spd_lightning/training/module.py): the frozen target is loaded in `setup` and is
NOT a submodule (never in the optimizer, the `state_dict` or a checkpoint); the drafter is built in
`configure_model` from the data module's draft vocabulary `d2t` (ChatDataModule's batches: right-padded
`input_ids`, `attention_mask`, `loss_mask`); AdamW with linear warmup and decay. Per step the target returns
the three feature states and its logits; `ttt_steps` steps of TTT (spd_lightning/eagle3/ttt.py) give one
KL per step. Validation logs the loss and the top-1 agreement of every TTT step (`val/agree_step{j}`:
step j drafts the (j+1)-th token of a chain, so its agreement bounds the acceptance of that draft).
"""

from __future__ import annotations

from typing import Literal

import lightning as L
import torch
import torchmetrics
from torch import nn

from ..errors import ConfigError
from ..export import CKPT_KEY
from ..pdm import block_shape
from ..target import TargetError, load_hf_config
from ..training.checkpoint_io import check_resumed_shape, check_weights_finite
from ..training.optimizer import (
    ShardedGradientClipping,
    adamw_linear_schedule,
    check_optimizer_settings,
    matrix_names,
)
from ..training.teacher import FrozenTargetHolder
from .export import Eagle3Spec
from .model import Eagle3Config, Eagle3Drafter, check_feature_layers, eagle_feature_layers
from .ttt import ttt_outputs, ttt_step_losses, ttt_total


class Eagle3Module(FrozenTargetHolder, ShardedGradientClipping, L.LightningModule):
    """Trains the EAGLE-3 baseline drafter by training-time test against a frozen target (docs/DESIGN.md, "The EAGLE-3 baseline").

    Args:
        target: HF name or local directory of the frozen target.
        target_dtype: dtype the target runs in (bfloat16 on GPU; float32 for CPU runs).
        trust_remote_code: let transformers run the target repository's own modelling code.
        feature_layers: `eagle` (`hidden_states[2, L//2, L-3]`) or three HF hidden-state indices.
        ttt_steps: training-time test length k (EAGLE-3 uses 7).
        step_weight: step j's KL is weighted `step_weight ** j`.
        num_heads: the layer's attention heads; null takes the target's.
        num_kv_heads: the layer's key/value heads; null takes the target's.
        head_dim: the layer's head dimension; null takes the target's.
        intermediate_size: the layer's MLP width; null takes the target's.
        init_head: seed the draft head with the target LM-head rows of the draft vocabulary.
        teacher_temperature: temperature of the teacher distribution in the KL.
        lr: AdamW peak learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: linear warmup steps, then linear decay.
        min_lr_ratio: the final learning rate as a fraction of `lr`.
        dense_attention: evaluate the TTT mask densely (small CPU runs) instead of the two-part path.
    """

    def __init__(
        self,
        target: str,
        target_dtype: str = "bfloat16",
        trust_remote_code: bool = False,
        feature_layers: Literal["eagle"] | list[int] = "eagle",
        ttt_steps: int = 7,
        step_weight: float = 0.8,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        intermediate_size: int | None = None,
        init_head: bool = True,
        teacher_temperature: float = 1.0,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        min_lr_ratio: float = 0.0,
        dense_attention: bool = False,
    ):
        super().__init__()
        self.save_hyperparameters()
        if ttt_steps < 1:
            raise ConfigError(f"ttt_steps={ttt_steps} must be >= 1")
        check_optimizer_settings(lr, weight_decay, warmup_steps, min_lr_ratio)
        for name, value in (("teacher_temperature", teacher_temperature), ("step_weight", step_weight)):
            if value <= 0:
                raise ConfigError(f"{name}={value} must be positive")
        config = load_hf_config(target, trust_remote_code)
        self.target_config = getattr(config, "text_config", None) or config
        L_ = self.target_config.num_hidden_layers
        self.feature_layers = (
            eagle_feature_layers(L_) if feature_layers == "eagle" else check_feature_layers(feature_layers, L_)
        )
        self.drafter: Eagle3Drafter | None = None
        self.train_agree = torchmetrics.MeanMetric()
        self.val_loss = torchmetrics.MeanMetric()
        self.val_step_loss = nn.ModuleList(torchmetrics.MeanMetric() for _ in range(ttt_steps))
        self.val_step_agree = nn.ModuleList(torchmetrics.MeanMetric() for _ in range(ttt_steps))

    def drafter_config(self, draft_vocab_size: int, rope_theta: float) -> Eagle3Config:
        hp, cfg = self.hparams, self.target_config
        return Eagle3Config(
            hidden_size=cfg.hidden_size,
            draft_vocab_size=draft_vocab_size,
            feature_layers=tuple(self.feature_layers),
            rope_theta=rope_theta,
            **block_shape(cfg, hp.num_heads, hp.num_kv_heads, hp.head_dim, hp.intermediate_size),
        )

    # -- the frozen target (FrozenTargetHolder, spd_lightning/training/teacher.py) and the drafter --------
    def setup(self, stage: str) -> None:
        if getattr(self.trainer.datamodule, "states", None) is not None:  # before the target's minutes of loading
            raise ConfigError(
                "Eagle3Module runs the target online and cannot read the state cache (it holds the PDM's anchor "
                "layers, not EAGLE-3's feature layers): drop --data.states"
            )
        if self._target is None:
            self._load_target()

    def configure_model(self) -> None:
        if self.drafter is not None or self._trainer is None:
            return  # without a trainer, on_load_checkpoint builds the drafter
        d2t = self._draft_vocab()
        self.drafter = Eagle3Drafter(self.drafter_config(d2t.numel(), self._target_info.rope_theta), d2t)
        self._decayed = matrix_names(self.drafter)  # before a strategy wraps it (spd_lightning/training/optimizer.py)
        if self.hparams.init_head:
            self.drafter.init_head_from_target(self.target.lm_head.weight)

    # -- training-time test ----------------------------------------------------------------------
    def _step_losses(self, batch: dict):
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
        features, teacher = self.target.anchor_states(input_ids, attention_mask, self.feature_layers)
        dtype = self.drafter.lm_head.weight.dtype
        outs = ttt_outputs(
            self.drafter,
            features.to(dtype),
            input_ids,
            self.target.embed_tokens,
            self.hparams.ttt_steps,
            self.hparams.dense_attention,
        )
        loss_mask = batch["loss_mask"].bool() & attention_mask.bool()
        return ttt_step_losses(self.drafter, outs, teacher, loss_mask, self.hparams.teacher_temperature)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        losses = self._step_losses(batch)
        loss = ttt_total(losses, self.hparams.step_weight)
        B = batch["input_ids"].shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=B)
        if losses[0].agree.numel():
            self.train_agree(losses[0].agree.float())
            self.log("train/agree", self.train_agree, prog_bar=True, batch_size=B)
        self.log("train/lr", self.optimizers().param_groups[0]["lr"], batch_size=B)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        losses = self._step_losses(batch)
        self.val_loss.update(ttt_total(losses, self.hparams.step_weight))
        for j, step in enumerate(losses):
            if step.kl.numel():
                self.val_step_loss[j].update(step.kl)
                self.val_step_agree[j].update(step.agree.float())

    def on_validation_epoch_end(self) -> None:
        values = {"val/loss": self.val_loss.compute()}
        for j in range(self.hparams.ttt_steps):
            values[f"val/loss_step{j}"] = self.val_step_loss[j].compute()
            values[f"val/agree_step{j}"] = self.val_step_agree[j].compute()
        values = {k: v for k, v in values.items() if torch.isfinite(v)}  # NaN: no counted row was seen
        self.log_dict(values, sync_dist=True)
        with torch.inference_mode(False):  # see SPDModule.on_validation_epoch_end
            for metric in (self.val_loss, *self.val_step_loss, *self.val_step_agree):
                metric.reset()

    def configure_optimizers(self):
        steps = int(self.trainer.estimated_stepping_batches)
        return adamw_linear_schedule(self.drafter, self._decayed, self.hparams, steps)

    # -- checkpoints -----------------------------------------------------------------------------
    def drafter_spec(self) -> Eagle3Spec:
        if self.drafter is None or self._target_info is None:
            raise RuntimeError("the drafter is built in configure_model(); fit or load a checkpoint first")
        return Eagle3Spec(self.drafter.cfg, self._target_info)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        check_weights_finite(self, self.drafter, "EAGLE-3 drafter")
        checkpoint[CKPT_KEY] = self.drafter_spec().to_dict()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if CKPT_KEY not in checkpoint:
            raise TargetError("this checkpoint has no drafter description: it was not written by Eagle3Module")
        spec = Eagle3Spec.from_dict(checkpoint[CKPT_KEY], "checkpoint")
        if self.drafter is not None:  # a resume into the drafter this run built (its V_d from this run's data)
            check_resumed_shape(self.drafter.cfg.to_dict(), spec.drafter.to_dict())
        self._target_info = self._target_info or spec.target
        if self.drafter is None:
            self.drafter = Eagle3Drafter(spec.drafter)
            self._decayed = matrix_names(self.drafter)
