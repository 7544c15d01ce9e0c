"""Where a drafter's teacher comes from: the frozen target, online, or its state cache (docs/DESIGN.md, "Training",
"The state cache").

`FrozenTargetHolder` is what both drafter LightningModules share: the target is loaded in their `setup` on the
strategy's device and held with `object.__setattr__`, so it never becomes a submodule (no parameters, `state_dict`,
checkpoint or `.to()`), and the data module's draft vocabulary `d2t` is checked against it. `DistillationTeacher` adds
what `SPDModule` reads from it: anchor states and teacher logits over `V_d` (`_teacher_view`), from one target
forward or from the cache, whose batches carry the anchors and the final-norm state (the target is then never
loaded, and the staircase evaluation loads it for its decodes only: `evaluation_target`).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from lightning.pytorch.utilities import rank_zero_info

from ..data.states import StateCache, target_identity
from ..errors import ConfigError
from ..target import Target, TargetInfo, rebuilt_layer, resolve_dtype, restrict_to_draft_vocab
from .deltanet_fallback import announce_linear_attention

# What the PDM learns from, per batch (`DistillationTeacher._teacher_view`): anchor states, teacher logits over V_d,
# and `outside_vd` (None when not computed).
TeacherView = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


class FrozenTargetHolder:
    """The frozen target of a drafter LightningModule (`self.hparams`: `target`, `target_dtype`,
    `trust_remote_code`), out of nn.Module registration, and the draft vocabulary checked against it."""

    _target: Target | None = None
    _target_info: TargetInfo | None = None

    @property
    def target(self) -> Target:
        if self._target is None:
            raise RuntimeError("the target is loaded in setup(); run this module through a Lightning Trainer")
        return self._target

    def _hold_target(self, target: Target) -> None:
        object.__setattr__(self, "_target", target)  # not a submodule: no params, state_dict or .to()
        self._target_info = target.info

    def _load_target(self) -> Target:
        """The target on the strategy's device (`setup`), announced and held."""
        hp, device = self.hparams, self.trainer.strategy.root_device
        target = Target.load(hp.target, hp.target_dtype, device, hp.trust_remote_code)
        announce_linear_attention(target.linear_attention_path, device, hp.target)
        self._hold_target(target)
        return target

    def _draft_vocab(self) -> torch.Tensor:
        """The data module's draft vocabulary `d2t`, checked against the target's vocabulary (`configure_model`)."""
        d2t = getattr(self.trainer.datamodule, "d2t", None) if self.trainer.datamodule is not None else None
        name = type(self).__name__
        if d2t is None:
            raise ConfigError(
                f"{name} needs a data module with a draft vocabulary `d2t` (ChatDataModule): train through "
                f"`python -m spd_lightning fit --model {name}` or pass datamodule=ChatDataModule(...)"
            )
        d2t = torch.as_tensor(d2t, dtype=torch.long)
        vocab = self._target_info.vocab_size
        if d2t.ndim != 1 or d2t.numel() == 0 or int(d2t.max()) >= vocab or int(d2t.min()) < 0:
            raise ConfigError(
                f"the draft vocabulary ({d2t.numel()} ids, max {int(d2t.max()) if d2t.numel() else None}) "
                f"does not fit the target vocabulary of {vocab}: use the target's own tokenizer"
            )
        return d2t


class DistillationTeacher(FrozenTargetHolder):
    """`SPDModule`'s teacher: the target online, or its state cache (`fit --data.states DIR`). Needs `self.pdm`
    (its `d2t`), `self.geometry` and `self.target_config`."""

    _head_vd: torch.nn.Module | None = None  # the V_d rows of the target's head, built on first use

    def _prepare_teacher(self) -> None:
        """`setup`: check the state cache against this run, or load the target (once: `use_target` may have set it)."""
        if self.state_cache is not None:
            self._use_state_cache()
        elif self._target is None:
            self.geometry.check_target(self._load_target().num_layers)

    @property
    def state_cache(self) -> StateCache | None:
        """The data module's target-state cache when training from one (`--data.states`), else None."""
        trainer = self._trainer
        datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
        return getattr(datamodule, "state_cache", None)

    def _use_state_cache(self) -> None:
        """Train from the cache: check it was made by this target and holds this geometry's states, and have the
        data module's batches carry exactly the anchors (the target itself is not loaded)."""
        cache, hp = self.state_cache, self.hparams
        cache.check_target(target_identity(hp.target, hp.trust_remote_code))
        cache.check_target_dtype(resolve_dtype(hp.target_dtype))
        cache.check_layers([*self.geometry.anchors, self.geometry.num_layers], f"anchors {list(self.geometry.anchors)}")
        self.trainer.datamodule.state_layers = self.geometry.anchors
        self._target_info = TargetInfo.from_config(self.target_config, hp.target)
        rank_zero_info(f"training from the state cache {cache.directory}: the target {hp.target} is not loaded")

    @contextmanager
    def evaluation_target(self):
        """The target for code that decodes (the staircase evaluation): the resident one, or, when training from a
        state cache, one loaded for the evaluation and freed after it (the training itself never holds it)."""
        if self._target is not None:
            yield self._target
            return
        hp = self.hparams
        rank_zero_info(f"staircase evaluation: loading the target {hp.target} to decode (freed after it)")
        target = Target.load(hp.target, hp.target_dtype, self.device, hp.trust_remote_code)
        try:
            yield target
        finally:
            del target
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _head_rows(self) -> torch.Tensor:
        """`[V_d, H]`: the target head's rows of the draft vocabulary (the cached copy when training from states)."""
        if self.state_cache is not None:
            return self.state_cache.head_rows(self.pdm.d2t).to(self.device, resolve_dtype(self.hparams.target_dtype))
        return self.target.lm_head.weight.detach().index_select(0, self.pdm.d2t.to(self.target.lm_head.weight.device))

    def _target_layer(self, layer: int) -> torch.nn.Module:
        """Target decoder layer `layer`: the loaded target's, or rebuilt from the cached state dict."""
        if self.state_cache is None:
            return self.target.layers[layer]
        return rebuilt_layer(
            self.hparams.target, self.hparams.trust_remote_code, layer, self.state_cache.layer_state(layer)
        )

    def _teacher_view(self, batch: dict, full_vocab: bool) -> TeacherView:
        """What the PDM learns from: anchor states `[B, T, m, H]`, teacher logits over `V_d` `[B, T, V_d]` (the
        target's dtype) and `outside_vd` `[B, T]` (None when not computed). Online, from one target forward; from
        a state cache (the batch carries `states`), the same V_d head applied to the cached final-norm state, and
        the cached `outside_vd`, which costs nothing there and so is always given."""
        if "states" in batch:
            if batch["states"].shape[2] != len(self.geometry.anchors):  # a shape, read on the host: no sync
                raise ConfigError(
                    f"the batch carries {batch['states'].shape[2]} cached hidden states, the geometry reads anchors "
                    f"{list(self.geometry.anchors)}: build the loaders after the module's setup (the Trainer does)"
                )
            head = self._vd_head()  # the target's dtype, whatever the cache stores the states in (bfloat16 by default)
            return batch["states"], head(batch["final_state"].to(head.weight.dtype)), batch["outside_vd"]
        if full_vocab:
            return self.teacher_view_of(self.target, batch)
        with self._teacher_head(full_vocab):
            states, logits = self.target.anchor_states(
                batch["input_ids"], batch["attention_mask"], self.geometry.anchors
            )
        return states, logits, None

    def teacher_view_of(self, target: Target, batch: dict) -> TeacherView:
        """The online teacher's view of `batch` from `target` (the resident one, or `evaluation_target`'s when
        training from a state cache), over the full vocabulary: `outside_vd` is known."""
        states, logits = target.anchor_states(batch["input_ids"], batch["attention_mask"], self.geometry.anchors)
        teacher, outside_vd = restrict_to_draft_vocab(logits, self.pdm.d2t)
        return states, teacher, outside_vd  # the full-vocabulary logits are freed before the PDM's activations

    def _vd_head(self) -> torch.nn.Module:
        """The target's head restricted to the `V_d` rows (the teacher's head), built once (the target is frozen)."""
        if self._head_vd is None:
            rows = self._head_rows()
            head = torch.nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
            head.weight = torch.nn.Parameter(rows, requires_grad=False)
            object.__setattr__(self, "_head_vd", head)  # like the target: not a submodule, not in checkpoints
        return self._head_vd

    @contextmanager
    def _teacher_head(self, full_vocab: bool):
        """Without `full_vocab`, the target's head is its `V_d` rows for the forward (its logits are then `[B, T,
        V_d]`, what `restrict_to_draft_vocab` would select)."""
        if full_vocab:
            yield
            return
        model = self.target.model
        full = model.get_output_embeddings()
        model.set_output_embeddings(self._vd_head())
        try:
            yield
        finally:
            model.set_output_embeddings(full)
