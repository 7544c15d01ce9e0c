"""The LightningModule: online distillation of the PDM from a frozen target (docs/DESIGN.md, "Training").

Per step: the frozen target (no grad, eval mode) returns anchor states and logits for the batch; the layout
replicates the sequence so that one PDM forward yields the draft of every drafting time under its
simulated fill level; the loss is the forward KL from the teacher restricted to the draft vocabulary.

The target is deliberately NOT a registered submodule: it never enters the optimizer, `state_dict`, the
checkpoints or Lightning's device moves; `setup` loads it on the strategy's device (the teacher's code is in
teacher.py beside this file; one copy's KL and agreement in distill.py; validation's figures in metrics.py). The
PDM is built in `configure_model` (inside the FSDP sharding context when that strategy is used) from the data
module's draft vocabulary `d2t`, or from a checkpoint's drafter description when loaded without a trainer.

Positions whose teacher argmax falls outside `V_d` are KEPT: the restricted, renormalized teacher is still a
valid target over what the drafter can propose; their share is logged as `*/teacher_top1_outside_vd`. That
share needs the full-vocabulary head (`[B, T, V]`, ~8 TFLOP per step at 9B); the training step runs only the
`V_d` rows of the target's head unless `full_vocab_metric_every_n_steps` asks for the metric on this step.

From a state cache (`fit --data.states DIR`, docs/DESIGN.md "The state cache") the target is never loaded: the
batches carry its anchor states and final-norm state, the teacher is the cached V_d rows of its head applied to the
latter (the product the online step computes), and `init_head` / `init_layers_from` read the cached tensors. Only
the source of (states, teacher) differs; everything after `_teacher_view` is the same code. The staircase
evaluation decodes with the target, which `evaluation_target` then loads for the evaluation and frees after.

A training step makes no host/device synchronization once its shape has been seen (tests/test_step_syncs.py):
the loss is a masked sum over fixed shapes (no boolean indexing), the right-padding check runs on the host
before the batch is moved (`on_before_batch_transfer`), and the logged values stay on the device.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Literal

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info

from ..errors import ConfigError
from ..export import CKPT_KEY, DrafterSpec, seed_from_drafter
from ..geometry import Features, Geometry, Schedule
from ..pdm import DecoderLayer, PDMConfig, PipelineDraftModule, block_shape
from ..target import (
    Target,
    TargetError,
    load_hf_config,
)
from .attention import Backend
from .checkpoint_io import check_resumed_shape, check_weights_finite
from .distill import (
    EveryFill,
    ReplicatedForward,
    ViewAgreement,
    auxiliary_kl,
    check_right_padded,
    distill,
    view_agreement,
)
from .fill_estimate import REFRESH_STEPS, AcceptanceEstimate
from .layouts import FillDistribution, LayoutName, build_layout
from .metrics import ValidationMetrics
from .optimizer import (
    ShardedGradientClipping,
    adamw_linear_schedule,
    check_optimizer_settings,
    matrix_names,
    plain_name,
)
from .teacher import DistillationTeacher, TeacherView

# Compiled flex graphs a run may need per code object: {grad, no_grad, inference_mode} x {every copy's rows, the
# loss copy's} x {a size specialized at 1 (one block, a last batch of 1) or not}, plus dynamo's own specializations
# of the block-mask sizes: 15-17 measured per layout with validation's per-fill forwards (tests/test_compile_budget.py,
# tests/test_recompile_limit.py), 11-13 without them.
FLEX_RECOMPILE_LIMIT = 24
FILL_ESTIMATE_KEY = "spd_fill_estimate"  # the running acceptance of `fill_probs: auto`, in a checkpoint
FILL_FULL_PROB = 0.5  # `fill_full_prob` unless set: a full pipeline in half the steps (with `fill_probs: null`)


def set_recompile_limit() -> tuple[int, bool]:
    """What `fit` needs of dynamo: room for every variant of a run's compiled flex, and an error instead of the
    silent fallback to eager flex (which builds the whole score matrix) if a run ever needs more. Returns the
    settings it replaced, which `SPDModule.teardown` puts back (dynamo's config is process-wide: a decoder in the
    same process keeps its own fallback)."""
    config = torch._dynamo.config
    before = (config.recompile_limit, config.fail_on_recompile_limit_hit)
    config.recompile_limit = max(config.recompile_limit, FLEX_RECOMPILE_LIMIT)
    config.fail_on_recompile_limit_hit = True
    return before


class SPDModule(DistillationTeacher, ShardedGradientClipping, L.LightningModule):
    """Distills the PDM from a frozen target (`fit`), measures its agreement (`validate`).

    Args:
        target: HF name or local directory of the frozen target.
        target_dtype: dtype the target runs in (bfloat16 on GPU; float32 for CPU runs).
        trust_remote_code: let transformers run the target repository's own modelling code.
        n: pipeline stages (the staircase geometry, spd_lightning/geometry.py).
        split: stage boundaries `e_0..e_n`: `uniform` (`e_s = round(s*L/n)`) or a list of n+1 layer indices.
        anchors: target hidden states the PDM reads: a preset (`quarters`, `n_scaled`) or a list of indices.
        layout: sequence replication: `depth` (exact for any `num_layers`) or `type` (the paper's; exact for
            `num_layers` 1).
        schedule: `pre_step` drafts before the pipeline step; `post_step` after it (every in-flight token one
            stage deeper).
        features: `spd` (every stage's states) or `first_stage` (PPSD: only what the first stage computed).
        num_layers: PDM decoder layers (`L_s`).
        hidden_size: PDM width; null takes the target's.
        num_heads: PDM attention heads; null takes the target's.
        num_kv_heads: PDM key/value heads; null takes the target's.
        head_dim: PDM head dimension; null takes the target's.
        intermediate_size: PDM MLP width; null takes the target's.
        init_layers_from: target layer index to seed each PDM layer from (one per PDM layer); null: random init.
        init_head: seed the draft head with the target LM-head rows of the draft vocabulary.
        head_from_target: the head IS those rows, frozen; the exported drafter does not store it and its loader
            takes it from the target, so a large V_d costs no file size (needs init_head).
        init_from: a drafter directory or `.ckpt` to warm-start from: every weight whose name and shape agree
            (the head's rows of the tokens both draft vocabularies hold); null: the initialization above alone.
        fill_probs: fill levels `a` the training views simulate (docs/DESIGN.md, "Simulated fill levels"): `auto`
            draws them as decoding meets them, from the drafter's running acceptance per fill; a list gives fixed
            weights of `a = 1..n`; null takes `fill_full_prob`.
        fill_full_prob: with `fill_probs: null`, the probability of a full pipeline (fill n); the other fill
            levels are uniform.
        teacher_temperature: temperature of the teacher distribution in the KL.
        aux_loss_weight: weight of the KL on the other active copies (depths > 0).
        lr: AdamW peak learning rate.
        weight_decay: AdamW weight decay (not on norms and biases).
        warmup_steps: linear warmup steps, then linear decay over the trainer's estimated stepping batches.
        min_lr_ratio: the final learning rate as a fraction of `lr`.
        attention_backend: `auto` (flex on CUDA, dense or two-part on CPU), `flex`, `flex_compiled` (compiled
            flex on any device, for a CPU rehearsal of the GPU path), `dense`, `two_part`.
        activation_checkpointing: recompute each PDM layer in the backward pass instead of storing its activations.
        full_vocab_metric_every_n_steps: log `train/teacher_top1_outside_vd` every this many training steps (it
            runs the target's full-vocabulary head); 0: on validation only.
        seed: seeds the per-step fill draws (deterministic, and identical after a resume).
    """

    def __init__(
        self,
        target: str,
        target_dtype: str = "bfloat16",
        trust_remote_code: bool = False,
        n: int = 8,
        split: Literal["uniform"] | list[int] = "uniform",
        anchors: Literal["quarters", "n_scaled"] | list[int] = "n_scaled",
        layout: LayoutName = "depth",
        schedule: Schedule = "pre_step",
        features: Features = "spd",
        num_layers: int = 1,
        hidden_size: int | None = None,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        intermediate_size: int | None = None,
        init_layers_from: list[int] | None = None,
        init_head: bool = True,
        head_from_target: bool = False,
        init_from: str | None = None,
        fill_probs: list[float] | Literal["auto"] | None = "auto",
        fill_full_prob: float = FILL_FULL_PROB,
        teacher_temperature: float = 1.0,
        aux_loss_weight: float = 0.0,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        min_lr_ratio: float = 0.0,
        attention_backend: Backend = "auto",
        activation_checkpointing: bool = False,
        full_vocab_metric_every_n_steps: int = 0,
        seed: int = 0,
    ):
        """Checks the settings and builds the metrics; the target loads in `setup`, the PDM in `configure_model`.
        Over 50 lines only because its 30 parameters stand one per line (each a `fit` option, documented in the
        class docstring); the body is short."""
        super().__init__()
        self.save_hyperparameters()
        check_optimizer_settings(lr, weight_decay, warmup_steps, min_lr_ratio)
        if teacher_temperature <= 0:
            raise ConfigError(f"teacher_temperature={teacher_temperature} must be positive")
        for name, value in (
            ("aux_loss_weight", aux_loss_weight),
            ("full_vocab_metric_every_n_steps", full_vocab_metric_every_n_steps),
        ):
            if value < 0:
                raise ConfigError(f"{name}={value} must be >= 0")
        config = load_hf_config(target, trust_remote_code)
        self.target_config = getattr(config, "text_config", None) or config
        self.geometry = Geometry.build(self.target_config.num_hidden_layers, n, split, anchors, schedule, features)
        self.fill_estimate = AcceptanceEstimate(n) if fill_probs == "auto" else None
        if isinstance(fill_probs, str) and self.fill_estimate is None:
            raise ConfigError(f"fill_probs={fill_probs!r}: use auto, a list of n={n} weights, or null")
        if fill_probs is not None and fill_full_prob != FILL_FULL_PROB:  # it would be dropped, silently
            raise ConfigError(
                f"fill_full_prob={fill_full_prob} applies with fill_probs: null, but fill_probs={fill_probs!r} sets "
                f"the fill weights: drop fill_full_prob, or set fill_probs: null"
            )
        fixed = FillDistribution(fill_full_prob, None if self.fill_estimate else fill_probs)
        self.layout = build_layout(layout, self.geometry, fixed)
        self.layout.fill_dist.probabilities(n)  # validates the fill settings now, not at the first step
        self._use_estimated_fills()
        self._check_init_args()
        self.pdm: PipelineDraftModule | None = None
        self._device_scalars: dict[str, torch.Tensor] = {}  # logged host numbers, on the device
        self.val_metrics = ValidationMetrics(n)

    def _pdm_config(self, draft_vocab_size: int, rope_theta: float) -> PDMConfig:
        """The PDM shape: the configured values, the target's where none is given."""
        hp, cfg = self.hparams, self.target_config
        return PDMConfig(
            target_hidden_size=cfg.hidden_size,
            num_types=self.geometry.num_types,
            draft_vocab_size=draft_vocab_size,
            hidden_size=hp.hidden_size or cfg.hidden_size,
            num_layers=hp.num_layers,
            rope_theta=rope_theta,
            head_from_target=hp.head_from_target,
            **block_shape(cfg, hp.num_heads, hp.num_kv_heads, hp.head_dim, hp.intermediate_size),
        )

    def _check_init_args(self) -> None:
        hp, cfg = self.hparams, self.target_config
        self._pdm_config(draft_vocab_size=1, rope_theta=1.0)  # shape errors now, before any data is processed
        width = hp.hidden_size or cfg.hidden_size
        if hp.init_head and width != cfg.hidden_size:
            raise ConfigError(
                f"init_head needs the PDM width to equal the target's ({cfg.hidden_size}), got "
                f"hidden_size={width}: drop hidden_size or set init_head: false"
            )
        if hp.head_from_target and not hp.init_head:
            raise ConfigError("head_from_target: true freezes the head at the target's rows: it needs init_head: true")
        if hp.init_layers_from is not None:
            idx = list(hp.init_layers_from)
            if len(idx) != hp.num_layers or any(not 0 <= i < cfg.num_hidden_layers for i in idx):
                raise ConfigError(
                    f"init_layers_from={idx} must name {hp.num_layers} target layer(s) (one per PDM "
                    f"layer) in 0..{cfg.num_hidden_layers - 1}"
                )

    # -- setup: the teacher (DistillationTeacher), dynamo, FSDP -------------------------------------
    def teardown(self, stage: str) -> None:
        before = getattr(self, "_dynamo_before", None)
        if before is not None:
            torch._dynamo.config.recompile_limit, torch._dynamo.config.fail_on_recompile_limit_hit = before
            self._dynamo_before = None

    def setup(self, stage: str) -> None:
        self._fsdp_unit_per_layer()
        self._dynamo_before = set_recompile_limit()
        self._prepare_teacher()

    def _fsdp_unit_per_layer(self) -> None:
        """Under FSDP each PDM decoder layer is its own unit (its parameters gathered only around its forward and
        backward) and the root unit holds the rest (fusion, norm, head). Set here, before the strategy wraps the
        module; a strategy given its own `auto_wrap_policy` keeps it."""
        from lightning.pytorch.strategies import FSDPStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        strategy = self._trainer.strategy if self._trainer is not None else None
        if isinstance(strategy, FSDPStrategy) and strategy.kwargs.get("auto_wrap_policy") is None:
            strategy.kwargs["auto_wrap_policy"] = ModuleWrapPolicy({DecoderLayer})

    @contextmanager
    def evaluation_pdm(self):
        """The PDM for code that calls it outside the wrapped forward (the staircase evaluation). Under FSDP the
        parameters are sharded between forwards and a wrapped layer's forward is a collective every rank must join,
        while the evaluation splits its prompts and batches over the ranks: a plain copy holding the gathered
        parameters stands in (one PDM's worth of memory while it runs). Under FSDP every rank must enter it."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrapped = self._trainer.strategy.model if self._trainer is not None else None
        if not isinstance(wrapped, FullyShardedDataParallel):
            yield self.pdm
            return
        with FullyShardedDataParallel.summon_full_params(wrapped, writeback=False, recurse=True):
            tensors = [*self.pdm.named_parameters(), *self.pdm.named_buffers()]
            gathered = {plain_name(name): t.detach().clone() for name, t in tensors}
        plain = PipelineDraftModule(self.pdm.cfg).to(self.device)
        plain.load_state_dict({name: gathered[name] for name in plain.state_dict()})
        yield plain.eval()

    def use_target(self, target: Target) -> None:
        """Train against this already-loaded target instead of loading `hparams.target` in `setup` (benchmarks
        and the GPU check build random-init targets of real shapes in memory)."""
        self.geometry.check_target(target.num_layers)
        self._hold_target(target)

    def configure_model(self) -> None:
        if self.pdm is not None or self._trainer is None:
            return  # without a trainer (`load_from_checkpoint`), on_load_checkpoint builds the PDM
        d2t = self._draft_vocab()
        hp = self.hparams
        self.pdm = PipelineDraftModule(self._pdm_config(d2t.numel(), self._target_info.rope_theta), d2t)
        self._freeze_unused_types()
        self._decayed = matrix_names(self.pdm)  # before a strategy wraps it (spd_lightning/training/optimizer.py)
        if hp.init_head:
            self.pdm.init_head_from_rows(self._head_rows())
        for i, layer in enumerate(hp.init_layers_from or []):
            copied = self.pdm.init_layer_from_target(i, self._target_layer(layer))
            rank_zero_info(
                f"PDM layer {i} seeded from target layer {layer}: {len(copied)} tensors ({', '.join(copied)})"
            )
        if hp.init_from:
            copied, skipped = seed_from_drafter(self.pdm, hp.init_from)
            partial = "".join(f" ({name})" for name in copied if name.endswith("rows]"))
            rank_zero_info(
                f"PDM warm-started from {hp.init_from}: {len(copied)} tensors{partial}, kept {skipped or 'none'}"
            )

    def _freeze_unused_types(self) -> None:
        """Fusion projections of aggregation types that no view uses would never receive a gradient (and
        DDP rejects such parameters): they stay at their initialization, outside the optimizer."""
        used = set(self.layout.copy_types)
        for tau, proj in enumerate(self.pdm.fusion.proj, start=1):
            proj.requires_grad_(tau in used)

    # -- one replicated forward ----------------------------------------------------------------
    def _fill_generator(self, phase: int, index: int) -> torch.Generator:
        """Fill draws are a function of (seed, phase, batch counter, rank): reproducible, and a resumed run
        draws what the uninterrupted run would have drawn (the training counter is restored on resume)."""
        key = (self.hparams.seed, phase, index, self.global_rank)
        return torch.Generator().manual_seed(hash(key) % (2**63))

    def _use_estimated_fills(self) -> None:
        """With `fill_probs: auto`, the layout draws from the estimate's current weights."""
        if self.fill_estimate is not None:
            self.layout.fill_dist = FillDistribution(probs=self.fill_estimate.weights)

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        """`fill_probs: auto`: every `REFRESH_STEPS` steps the fill weights follow the running acceptance (one
        device read, and under DDP one sum over the ranks, so that every rank draws from the same weights)."""
        step = self.trainer.fit_loop.epoch_loop.total_batch_idx
        if self.fill_estimate is None or step == 0 or step % REFRESH_STEPS:
            return
        totals = (self.fill_estimate.correct, self.fill_estimate.total)
        if self.trainer.world_size > 1:
            totals = tuple(self._over_ranks(t, "sum") for t in totals)
        logged = self.fill_estimate.refresh(totals)
        self._use_estimated_fills()
        self.log_dict(logged, batch_size=1)

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        """The right-padding check on the host, before the batch moves: on the device it would be a sync."""
        if isinstance(batch, dict) and "attention_mask" in batch:
            check_right_padded(batch["attention_mask"])
        return batch

    def _forward(
        self,
        batch: dict,
        generator: torch.Generator | None,
        every_copy: bool = True,
        full_vocab: bool = True,
        pdm: PipelineDraftModule | None = None,
        fill: torch.Tensor | None = None,
        teacher_view: TeacherView | None = None,
    ) -> ReplicatedForward:
        """The replicated forward. With `every_copy` False only the loss copy's outputs are computed (`hidden[B, T,
        d]`, the first `T` rows; the last PDM layer runs the other copies as keys and values only); otherwise every
        copy's (`hidden[B, S, d]`). With `full_vocab` False the target's head runs on the `V_d` rows only and
        `outside_vd` is None. `pdm`: another PDM than `self.pdm` (`evaluation_pdm`). `fill`: the fill levels to use
        (`layout.validation_fill`) instead of a draw from `generator`. `teacher_view`: `_teacher_view`'s result for
        this batch, when another forward already has it."""
        pdm = pdm or self.pdm
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
        states, teacher, outside_vd = teacher_view or self._teacher_view(batch, full_vocab)
        B, T = input_ids.shape
        fill = self.layout.draw_fill(B, T, generator) if fill is None else fill
        rep = self.layout.replicate(attention_mask.sum(1), T, fill)
        g = rep.features(pdm.fuse, states.to(pdm.lm_head.weight.dtype))
        hidden = pdm.body(
            g,
            rep.positions(),
            rep.attend(self.hparams.attention_backend),
            checkpointing=self.hparams.activation_checkpointing,
            outputs=None if every_copy else T,
        )
        return ReplicatedForward(
            rep=rep,
            pdm=pdm,
            hidden=hidden,
            teacher=teacher,
            outside_vd=outside_vd,
            # Output i of every copy drafts x_{i+1}: a loss position iff x_{i+1} is an assistant token.
            predicts_loss_token=F.pad(batch["loss_mask"][:, 1:].bool(), (0, 1), value=False),
        )

    def _full_vocab_due(self, step: int) -> bool:
        every = self.hparams.full_vocab_metric_every_n_steps
        return every > 0 and step % every == 0

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        step = self.trainer.fit_loop.epoch_loop.total_batch_idx  # counts every batch of every epoch
        every_copy = self.hparams.aux_loss_weight > 0  # the auxiliary loss reads every copy; the main loss, copy 0
        full_vocab = self._full_vocab_due(step)
        fwd = self._forward(batch, self._fill_generator(0, step), every_copy, full_vocab)
        temperature = self.hparams.teacher_temperature
        main = distill(fwd, fwd.rep.loss_copy, temperature)
        if self.fill_estimate is not None:
            self.fill_estimate.update(main.accepted(), main.counted, main.fill)
        loss = kl_draft = main.mean(main.kl)
        if every_copy:
            loss = loss + self.hparams.aux_loss_weight * auxiliary_kl(fwd, temperature)
        B = batch["input_ids"].shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=B)
        self.log("train/kl_draft", kl_draft, batch_size=B)
        self.log("train/agree", main.mean(main.agree()), prog_bar=True, batch_size=B)
        if main.outside_vd is not None:  # on the due steps online; on every step from a state cache (free there)
            self.log("train/teacher_top1_outside_vd", main.mean(main.outside_vd), batch_size=B)
        self.log("train/loss_tokens", main.counted.sum().float(), batch_size=B)
        self.log("train/lr", self._device_scalar("lr", self.optimizers().param_groups[0]["lr"]), batch_size=B)
        return loss

    def _device_scalar(self, name: str, value: float) -> torch.Tensor:
        """A logged host number as a device tensor filled in place: `self.log(float)` would copy it every step."""
        if name not in self._device_scalars:
            self._device_scalars[name] = torch.zeros((), device=self.device)
        return self._device_scalars[name].fill_(value)

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        B, T = batch["input_ids"].shape  # every fill level in turn, the same at every validation:
        view = self._teacher_view(batch, full_vocab=True)
        fwd = self._forward(batch, None, fill=self.layout.validation_fill(B, T, batch_idx * B), teacher_view=view)
        self.val_metrics.update(view_agreement(fwd, self.hparams.teacher_temperature))
        self.val_metrics.update_every_fill(self.every_fill(batch, view))

    @torch.no_grad()
    def every_fill(
        self, batch: dict, teacher_view: TeacherView | None = None, pdm: PipelineDraftModule | None = None
    ) -> EveryFill:
        """The loss copy's drafts at every fill of every sequence: one loss-copy forward per fill, the teacher's view
        computed once. A rotation of fills over the samples (`validation_fill`) would measure each fill on other
        sequences, and which sequences those are moves the per-fill figures more than the fill does
        (docs/SMOLLM2.md, "What validation predicts")."""
        B, T = batch["input_ids"].shape
        view = teacher_view or self._teacher_view(batch, full_vocab=True)
        shape = self.layout.validation_fill(B, T).shape
        agree, accepted = [], []
        for k in range(1, self.geometry.n + 1):
            fwd = self._forward(batch, None, every_copy=False, pdm=pdm, fill=torch.full(shape, k), teacher_view=view)
            loss = distill(fwd, fwd.rep.loss_copy, self.hparams.teacher_temperature)
            agree.append(loss.agree())
            accepted.append(loss.accepted())
        return EveryFill(torch.stack(agree, dim=-1), torch.stack(accepted, dim=-1), loss.counted)

    @torch.no_grad()
    def staircase_agreement(
        self, batch: dict, seed: int = 0, pdm: PipelineDraftModule | None = None
    ) -> tuple[ViewAgreement, EveryFill]:
        """Teacher-forced top-1 agreement of every view output of every copy on `batch` (the staircase evaluation's
        heatmap; every fill level in turn, `layout.validation_fill` offset by `seed`, whatever the training draws),
        and the loss copy's drafts at every fill (`every_fill`: what greedy decoding would accept, the prediction of
        `n*alpha`). `pdm`: the PDM to evaluate (`evaluation_pdm`), by default `self.pdm`."""
        check_right_padded(batch["attention_mask"])
        B, T = batch["input_ids"].shape
        view = self._teacher_view(batch, full_vocab=True)
        fwd = self._forward(batch, None, pdm=pdm, fill=self.layout.validation_fill(B, T, seed), teacher_view=view)
        return view_agreement(fwd, self.hparams.teacher_temperature), self.every_fill(batch, view, pdm)

    def on_validation_epoch_end(self) -> None:
        # compute() synchronizes across ranks, so every rank holds the same values and the same keys; the
        # sync_dist mean of identical values is a no-op that keeps Lightning's distributed bookkeeping happy.
        values = self.val_metrics.compute()
        shown = ("val/loss", "val/agree", "val/predicted_n_alpha")
        self.log_dict({k: v for k, v in values.items() if k in shown}, prog_bar=True, sync_dist=True)
        self.log_dict({k: v for k, v in values.items() if k not in shown}, sync_dist=True)
        self.val_metrics.reset()

    # -- optimizer -------------------------------------------------------------------------------
    def configure_optimizers(self):
        steps = int(self.trainer.estimated_stepping_batches)
        return adamw_linear_schedule(self.pdm, self._decayed, self.hparams, steps)

    # -- checkpoints -----------------------------------------------------------------------------
    def drafter_spec(self) -> DrafterSpec:
        if self.pdm is None or self._target_info is None:
            raise RuntimeError("the drafter is built in configure_model(); fit or load a checkpoint first")
        return DrafterSpec(self.pdm.cfg, self.geometry, self._target_info)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        check_weights_finite(self, self.pdm, "PDM")
        # What inference/ and `export` read; the frozen target is not in state_dict to begin with.
        checkpoint[CKPT_KEY] = self.drafter_spec().to_dict()
        if self.fill_estimate is not None:
            checkpoint[FILL_ESTIMATE_KEY] = self._fill_estimate_state()

    def _fill_estimate_state(self) -> dict:
        """The running acceptance to resume from. Each rank keeps its own and the fill weights come from their sum over
        the ranks, while every rank loads the one checkpoint: it holds their mean, so the ranks resume with the sum the
        uninterrupted run has (the estimate is linear in its counts). One reduce per save under DDP/FSDP."""
        state = self.fill_estimate.state_dict()
        if self._trainer is not None and self.trainer.world_size > 1:
            for key, counts in (("correct", self.fill_estimate.correct), ("total", self.fill_estimate.total)):
                state[key] = self._over_ranks(counts, "mean").cpu()
        return state

    def _over_ranks(self, counts: torch.Tensor, reduce_op: str) -> torch.Tensor:
        """The estimate's `counts` reduced over the ranks, from a copy on the strategy's device: NCCL serves only the
        GPU, and a resumed run's counts stay on the host (as saved) until its first training step moves them, while
        a refresh may come before it (a resume at a multiple of `REFRESH_STEPS`)."""
        return self.trainer.strategy.reduce(
            counts.to(self.trainer.strategy.root_device, copy=True), reduce_op=reduce_op
        )

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if CKPT_KEY not in checkpoint:
            raise TargetError("this checkpoint has no drafter description: it was not written by SPDModule")
        spec = DrafterSpec.from_dict(checkpoint[CKPT_KEY], "checkpoint")
        if self.pdm is not None:  # a resume (or `validate --ckpt_path`) into the PDM this run built
            check_resumed_shape(self.pdm.cfg.to_dict(), spec.pdm.to_dict())
        self._target_info = self._target_info or spec.target
        if self.fill_estimate is not None and FILL_ESTIMATE_KEY in checkpoint:  # a resume draws what the run would
            self.fill_estimate.load_state_dict(checkpoint[FILL_ESTIMATE_KEY])
            self._use_estimated_fills()
        if self.pdm is None:  # loaded without a trainer: build the PDM the checkpoint describes
            self.pdm = PipelineDraftModule(spec.pdm)
            self._freeze_unused_types()
            self._decayed = matrix_names(self.pdm)  # before a strategy wraps it (spd_lightning/training/optimizer.py)
