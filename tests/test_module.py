"""SPDModule: training on a saved tiny target with synthetic chat batches, checkpoints, resume."""

import os

import lightning as L
import pytest
import torch
from kit import TINY_VOCAB, SyntheticChat, make_module, make_tiny_model, make_trainer

from spd_lightning.export import CKPT_KEY
from spd_lightning.training.module import SPDModule


def pdm_numel(module: SPDModule) -> int:
    return sum(t.numel() for t in module.pdm.state_dict().values())


@pytest.mark.hf_internals
def test_fit_learns_and_logs_agreement(tiny_target_dir, tmp_path):
    module, data = make_module(tiny_target_dir), SyntheticChat(repeat_one=True)
    trainer = make_trainer(tmp_path, max_steps=30)
    trainer.fit(module, datamodule=data)
    m = trainer.callback_metrics
    assert torch.isfinite(m["train/loss"])
    assert {
        "val/loss",
        "val/agree",
        "val/agree_depth0",
        "val/agree_depth2",
        "val/agree_fill1",
        "val/agree_fill2",
        "val/teacher_top1_outside_vd",
    } <= set(m)
    assert m["val/agree"] > 0.5  # one repeated sequence: the drafter must fit it
    assert not module.target.model.training and all(not p.requires_grad for p in module.target.parameters())
    assert all(not name.startswith("_target") for name, _ in module.named_parameters())


def test_loss_decreases_from_initialization(tiny_target_dir, tmp_path):
    module, data = make_module(tiny_target_dir), SyntheticChat(repeat_one=True)
    before = make_trainer(tmp_path, max_steps=1).validate(module, datamodule=data, verbose=False)[0]
    make_trainer(tmp_path, max_steps=20).fit(module, datamodule=data)
    after = make_trainer(tmp_path, max_steps=1).validate(module, datamodule=data, verbose=False)[0]
    assert after["val/loss"] < 0.5 * before["val/loss"]
    assert after["val/agree"] > before["val/agree"]


@pytest.mark.parametrize(
    "overrides",
    [
        dict(layout="type"),
        dict(aux_loss_weight=0.5, num_layers=2),
        dict(schedule="post_step", attention_backend="two_part"),
        dict(features="first_stage", init_layers_from=[3]),
    ],
)
def test_variants_train(tiny_target_dir, tmp_path, overrides):
    module = make_module(tiny_target_dir, **overrides)
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.fit(module, datamodule=SyntheticChat(num_samples=8))
    assert torch.isfinite(trainer.callback_metrics["train/loss"])


def test_checkpoint_holds_the_pdm_not_the_target(tiny_target_dir, tmp_path):
    # A wide target and a narrow PDM: a checkpoint that held the target would be many times the PDM.
    wide = str(tmp_path / "wide")
    make_tiny_model("qwen3_5", num_layers=8, hidden_size=128).save_pretrained(wide)
    module = make_module(
        wide, hidden_size=32, init_head=False, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32
    )
    trainer = make_trainer(tmp_path, max_steps=1, enable_checkpointing=True)
    trainer.fit(module, datamodule=SyntheticChat(num_samples=4))
    ckpt_path = trainer.checkpoint_callback.best_model_path or trainer.checkpoint_callback.last_model_path
    ckpt = torch.load(ckpt_path, weights_only=True)
    assert set(ckpt["state_dict"]) == {"pdm." + k for k in module.pdm.state_dict()}
    assert ckpt[CKPT_KEY]["target"]["name_or_path"] == wide and ckpt[CKPT_KEY]["geometry"]["n"] == 2
    assert ckpt["hyper_parameters"]["target"] == wide and ckpt["hyper_parameters"]["layout"] == "depth"
    target_numel = sum(p.numel() for p in module.target.parameters())
    assert target_numel > 10 * pdm_numel(module)
    # weights + two AdamW moments in fp32, plus pickling overhead; far below the target's own size.
    assert os.path.getsize(ckpt_path) < 3 * 4 * pdm_numel(module) + 200_000 < 4 * target_numel


def test_load_from_checkpoint_without_trainer(tiny_target_dir, tmp_path):
    module = make_module(tiny_target_dir)
    trainer = make_trainer(tmp_path, max_steps=2, enable_checkpointing=True)
    trainer.fit(module, datamodule=SyntheticChat(num_samples=8))
    loaded = SPDModule.load_from_checkpoint(
        trainer.checkpoint_callback.last_model_path or trainer.checkpoint_callback.best_model_path
    )
    for (name, a), (_, b) in zip(module.pdm.state_dict().items(), loaded.pdm.state_dict().items()):
        assert torch.equal(a, b), name


class RecordStart(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.global_step = trainer.global_step
        opt = trainer.optimizers[0]
        self.state = {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state_dict()["state"].items()}
        self.lr = opt.param_groups[0]["lr"]


def test_resume_continues_at_the_same_step_with_the_same_optimizer_state(tiny_target_dir, tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    class StopAt(L.Callback):  # an interruption: same run length (so same LR schedule), stopped early
        def __init__(self, step):
            self.step = step

        def on_train_batch_end(self, trainer, *args):
            trainer.should_stop = trainer.global_step >= self.step

    def run(root, stop_at, ckpt_path=None):
        L.seed_everything(0)
        module = make_module(tiny_target_dir)
        record = RecordStart()
        ckpt = ModelCheckpoint(dirpath=str(root), save_last=True, every_n_train_steps=1)
        trainer = make_trainer(
            root, max_steps=6, enable_checkpointing=True, callbacks=[ckpt, record, StopAt(stop_at)], limit_val_batches=0
        )
        trainer.fit(
            module, datamodule=SyntheticChat(num_samples=32, batch_size=2, repeat_one=True), ckpt_path=ckpt_path
        )
        return module, trainer, record

    _, first, _ = run(tmp_path / "a", 3)
    last = os.path.join(tmp_path / "a", "last.ckpt")
    saved = torch.load(last, weights_only=True)
    resumed, trainer, record = run(tmp_path / "b", 6, ckpt_path=last)
    assert record.global_step == 3 == saved["global_step"]
    saved_state = saved["optimizer_states"][0]["state"]
    assert record.state.keys() == saved_state.keys() and len(saved_state) > 0
    for k, moments in saved_state.items():
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(record.state[k][name], moments[name]), (k, name)
    assert record.lr == pytest.approx(saved["lr_schedulers"][0]["_last_lr"][0])
    assert trainer.global_step == 6
    straight, _, _ = run(tmp_path / "c", 6)  # the uninterrupted run ends with the same weights
    for (name, a), (_, b) in zip(resumed.pdm.state_dict().items(), straight.pdm.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)


def test_resume_with_another_draft_vocabulary_is_one_line(tiny_target_dir, tmp_path):
    """`fit --ckpt_path` with data that gives another V_d (`data.draft_vocab_size` changed): LightningCLI restores the
    model's settings from the checkpoint but not the data's, so the PDM built from the data does not fit the saved
    weights. A `ConfigError` naming the field (exit 2), not a `RuntimeError` from `load_state_dict` (exit 1)."""
    from spd_lightning.errors import ConfigError

    trainer = make_trainer(tmp_path, max_steps=1, limit_val_batches=0)
    trainer.fit(make_module(tiny_target_dir), datamodule=SyntheticChat(draft_vocab_size=64, batch_size=2))
    ckpt = str(tmp_path / "step1.ckpt")
    trainer.save_checkpoint(ckpt)
    resumed = make_trainer(tmp_path, max_steps=2, limit_val_batches=0)
    with pytest.raises(ConfigError, match="drafter has draft_vocab_size=64, this run builds draft_vocab_size=32"):
        resumed.fit(make_module(tiny_target_dir), datamodule=SyntheticChat(draft_vocab_size=32), ckpt_path=ckpt)


def test_a_diverged_run_stops_and_keeps_the_checkpoints_saved_before(tiny_target_dir, tmp_path):
    """A NaN loss (here a teacher temperature that overflows, from step 3 on) makes the weights NaN: the run stops
    with one line at the next save instead of replacing `last.ckpt` and the kept step checkpoint with NaN weights
    (it finished with exit 0 and every checkpoint NaN)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from spd_lightning.errors import ConfigError

    class Diverge(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, *args):
            if trainer.global_step == 2:
                pl_module.hparams.teacher_temperature = 1e-40

    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True, every_n_train_steps=1)
    trainer = make_trainer(
        tmp_path, max_steps=4, enable_checkpointing=True, callbacks=[ckpt, Diverge()], limit_val_batches=0
    )
    with pytest.raises(ConfigError, match="diverged by step 3: the PDM's weights are not finite"):
        trainer.fit(make_module(tiny_target_dir), datamodule=SyntheticChat(num_samples=16, batch_size=2))
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 2 and all(torch.isfinite(v).all() for v in last["state_dict"].values())


def test_bad_settings_fail_with_one_line(tiny_target_dir, tmp_path):
    from spd_lightning.geometry import GeometryError
    from spd_lightning.target import TargetError

    with pytest.raises(GeometryError, match="n=9"):
        make_module(tiny_target_dir, n=9)
    with pytest.raises(GeometryError, match="anchor"):
        make_module(tiny_target_dir, anchors=[0, 2, 9])
    with pytest.raises(GeometryError, match="split"):
        make_module(tiny_target_dir, split=[0, 3, 3, 4], n=3)
    with pytest.raises(TargetError, match="does not exist"):
        make_module(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="init_layers_from"):
        make_module(tiny_target_dir, init_layers_from=[7])
    with pytest.raises(ValueError, match="num_heads=3 must be a multiple of num_kv_heads=2"):
        make_module(tiny_target_dir, num_heads=3)
    with pytest.raises(ValueError, match="fill_probs"):
        make_module(tiny_target_dir, fill_probs=[1.0])
    data = SyntheticChat()
    data.setup("fit")
    module = make_module(tiny_target_dir)
    bad = SyntheticChat()
    bad.setup = lambda stage: (
        setattr(bad, "d2t", torch.tensor([0, TINY_VOCAB + 5])) or setattr(bad, "samples", data.samples)
    )
    with pytest.raises(ValueError, match="does not fit the target vocabulary"):
        make_trainer(tmp_path, max_steps=1).fit(module, datamodule=bad)
