"""The EAGLE-3 drafter and its training-time test: mask and shifts by hand, the two attention paths, the
module trains and checkpoints without the target, export round trip, feature-layer choice."""

import json
import os
import re

import pytest
import torch
from kit import TINY_VOCAB, make_data, make_tiny_model

from spd_lightning.eagle3.export import Eagle3Spec, load_eagle3, save_eagle3
from spd_lightning.eagle3.model import (
    Eagle3Config,
    Eagle3ConfigError,
    Eagle3Drafter,
    check_feature_layers,
    eagle_feature_layers,
)
from spd_lightning.eagle3.ttt import shift_left, step_targets, ttt_mask, ttt_outputs
from spd_lightning.export import DrafterLoadError
from spd_lightning.pdm import causal_attend
from spd_lightning.target import Target

H = 32


def small_drafter(d2t=None, seed=0, layers=(1, 2, 3)) -> Eagle3Drafter:
    torch.manual_seed(seed)
    cfg = Eagle3Config(
        H, 20 if d2t is None else len(d2t), layers, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64
    )
    return Eagle3Drafter(cfg, d2t)


def random_inputs(B=2, T=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, 3, H, generator=g), torch.randint(0, TINY_VOCAB, (B, T), generator=g)


def test_ttt_mask_by_hand():
    # 3 rows, step 2: keys are [step0 rows 0..2 | step1 rows 0..2 | step2 rows 0..2].
    expected = torch.tensor(
        [[1, 0, 0, 1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 1, 0, 0, 1]], dtype=torch.bool
    )
    assert torch.equal(ttt_mask(3, 2), expected)
    assert torch.equal(ttt_mask(3, 0), torch.tril(torch.ones(3, 3, dtype=torch.bool)))


def test_shifts_by_hand():
    ids = torch.tensor([[10, 11, 12, 13, 14]])
    assert shift_left(ids, 1).tolist() == [[11, 12, 13, 14, 0]]  # step 0 embeds x_{i+1}
    assert shift_left(ids, 2).tolist() == [[12, 13, 14, 0, 0]]  # step 1 embeds x_{i+2}
    loss_mask = torch.tensor([[0, 0, 1, 1, 1]])  # x_2, x_3, x_4 are assistant tokens
    b, rows, teacher = step_targets(loss_mask, 0)  # step 0, row i drafts x_{i+2} with teacher Z_{i+1}
    assert rows.tolist() == [0, 1, 2] and teacher.tolist() == [1, 2, 3] and b.tolist() == [0, 0, 0]
    _, rows, teacher = step_targets(loss_mask, 1)  # step 1, row i drafts x_{i+3} with teacher Z_{i+2}
    assert rows.tolist() == [0, 1] and teacher.tolist() == [2, 3]
    _, rows, _ = step_targets(loss_mask, 3)
    assert rows.numel() == 0


def test_two_part_attention_equals_the_dense_mask():
    drafter, (features, ids) = small_drafter(), random_inputs()
    embed = torch.nn.Embedding(TINY_VOCAB, H)
    dense = ttt_outputs(drafter, features, ids, embed, 4, dense=True)
    fast = ttt_outputs(drafter, features, ids, embed, 4)
    for a, b in zip(dense, fast):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_step0_is_the_teacher_forced_causal_forward():
    drafter, (features, ids) = small_drafter(), random_inputs()
    embed = torch.nn.Embedding(TINY_VOCAB, H)
    out0 = ttt_outputs(drafter, features, ids, embed, 3)[0]
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    plain = drafter.step(drafter.fuse(features), embed(shift_left(ids, 1)), positions, causal_attend)
    torch.testing.assert_close(out0, plain, atol=1e-5, rtol=1e-5)


def test_a_row_never_sees_later_rows_at_any_step():
    """Row p's chain reads committed rows <= p and its own drafts only: later features must not matter."""
    drafter, (features, ids) = small_drafter(), random_inputs(B=1)
    embed = torch.nn.Embedding(TINY_VOCAB, H)
    p = 4
    before = ttt_outputs(drafter, features, ids, embed, 4)
    changed = features.clone()
    changed[:, p + 1 :] += 1.0
    after = ttt_outputs(drafter, changed, ids, embed, 4)
    for a, b in zip(before, after):
        torch.testing.assert_close(a[:, : p + 1], b[:, : p + 1], atol=1e-6, rtol=1e-6)
        assert not torch.allclose(a[:, p + 1 :], b[:, p + 1 :])


def test_feature_layers():
    assert eagle_feature_layers(32) == [2, 16, 29]  # hidden_states indices = inputs of layers 2, L//2, L-3
    assert eagle_feature_layers(4) == [1, 2, 3]
    with pytest.raises(Eagle3ConfigError, match="L >= 4"):
        eagle_feature_layers(3)
    with pytest.raises(Eagle3ConfigError, match="out of range"):
        check_feature_layers([1, 2, 5], 4)
    with pytest.raises(Eagle3ConfigError, match="exactly 3"):
        check_feature_layers([1, 2], 4)


# -- Lightning module ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("eagle3_target") / "tiny_qwen35")
    make_tiny_model("qwen3_5").save_pretrained(path)
    return path


def fit_module(target_dir, root, steps: int):
    from kit import SyntheticChat, make_trainer

    from spd_lightning.eagle3.module import Eagle3Module

    module = Eagle3Module(target=target_dir, target_dtype="float32", ttt_steps=3, lr=3e-3, dense_attention=True)
    data = SyntheticChat(repeat_one=True)
    trainer = make_trainer(root, max_steps=steps, limit_val_batches=1)
    before = trainer.validate(module, datamodule=data, verbose=False)[0] if steps else None
    trainer.fit(module, datamodule=data)
    return module, trainer, before, dict(trainer.callback_metrics)


def test_module_trains_and_checkpoints_only_the_drafter(target_dir, tmp_path):
    module, trainer, before, after = fit_module(target_dir, tmp_path, steps=25)
    assert after["val/loss"] < 0.7 * before["val/loss"]
    assert after["val/agree_step0"] > before["val/agree_step0"]
    assert {"val/loss_step2", "val/agree_step2"} <= set(after)
    ckpt_path = str(tmp_path / "last.ckpt")
    trainer.save_checkpoint(ckpt_path)
    state = torch.load(ckpt_path, weights_only=True)["state_dict"]
    assert state and all(k.startswith("drafter.") for k in state)  # the frozen target is never checkpointed
    drafter, spec = load_eagle3(ckpt_path)
    assert spec.drafter.feature_layers == (1, 2, 3) and spec.target.num_layers == 4
    for name, value in module.drafter.state_dict().items():
        assert torch.equal(drafter.state_dict()[name], value)


def test_export_round_trip(tmp_path):
    target = Target(make_tiny_model("qwen3"), "tiny-qwen3")
    drafter = small_drafter(d2t=torch.arange(5, 25))
    spec = Eagle3Spec(drafter.cfg, target.info)
    save_eagle3(drafter, spec, str(tmp_path / "d"))
    loaded, loaded_spec = load_eagle3(str(tmp_path / "d"))
    assert loaded_spec == spec and torch.equal(loaded.d2t, drafter.d2t)
    features, ids = random_inputs()
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    embeds = target.embed_tokens(ids)
    with torch.no_grad():
        assert torch.equal(loaded(features, embeds, positions), drafter(features, embeds, positions))
    loaded_spec.check_target(target.info)
    with pytest.raises(DrafterLoadError, match="mismatch"):
        loaded_spec.check_target(Target(make_tiny_model("qwen3", num_layers=2), "other").info)
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["kind"] == "eagle3" and config["eagle3"]["feature_layers"] == [1, 2, 3]
    del config["kind"]
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterLoadError, match="not an EAGLE-3"):
        load_eagle3(str(tmp_path / "d"))


def test_module_trains_on_chat_data_module_batches(chat_target, tmp_path):
    """The batches ChatDataModule produces (rendered chats, assistant loss mask, its d2t) train the drafter."""
    from kit import make_trainer

    from spd_lightning.eagle3.module import Eagle3Module

    module = Eagle3Module(target=chat_target["target"], target_dtype="float32", ttt_steps=2, lr=3e-3)
    data = make_data(chat_target, val_size=4)
    trainer = make_trainer(tmp_path, max_steps=3, limit_val_batches=1)
    trainer.fit(module, datamodule=data)
    assert torch.equal(module.drafter.d2t, torch.as_tensor(data.d2t))
    metrics = trainer.callback_metrics
    assert torch.isfinite(metrics["val/loss"]) and 0 <= float(metrics["val/agree_step1"]) <= 1


def test_a_diverged_eagle3_run_stops_and_keeps_the_checkpoints_saved_before(target_dir, tmp_path):
    """As the PDM's: a NaN loss from step 3 on (a teacher temperature that overflows) stops the run at its next save
    with one line, instead of replacing `last.ckpt` and the kept step checkpoint with NaN weights."""
    import lightning as L
    from kit import SyntheticChat, make_trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from spd_lightning.eagle3.module import Eagle3Module
    from spd_lightning.errors import ConfigError

    class Diverge(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, *args):
            if trainer.global_step == 2:
                pl_module.hparams.teacher_temperature = 1e-40

    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True, every_n_train_steps=1)
    trainer = make_trainer(
        tmp_path, max_steps=4, enable_checkpointing=True, callbacks=[ckpt, Diverge()], limit_val_batches=0
    )
    module = Eagle3Module(target=target_dir, target_dtype="float32", ttt_steps=2, lr=3e-3)
    with pytest.raises(ConfigError, match="diverged by step 3: the EAGLE-3 drafter's weights are not finite"):
        trainer.fit(module, datamodule=SyntheticChat(num_samples=16, batch_size=2))
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 2 and all(torch.isfinite(v).all() for v in last["state_dict"].values())


def test_an_eagle3_resume_with_another_draft_vocabulary_is_one_line(target_dir, tmp_path):
    """`fit --ckpt_path` with data that gives another V_d: a `ConfigError` naming the field (exit 2), not a
    `RuntimeError` from `load_state_dict` (exit 1)."""
    from kit import SyntheticChat, make_trainer

    from spd_lightning.eagle3.module import Eagle3Module
    from spd_lightning.errors import ConfigError

    def module():
        return Eagle3Module(target=target_dir, target_dtype="float32", ttt_steps=2, lr=3e-3)

    trainer = make_trainer(tmp_path, max_steps=1, limit_val_batches=0)
    trainer.fit(module(), datamodule=SyntheticChat(draft_vocab_size=64, batch_size=2))
    ckpt = str(tmp_path / "step1.ckpt")
    trainer.save_checkpoint(ckpt)
    resumed = make_trainer(tmp_path, max_steps=2, limit_val_batches=0)
    with pytest.raises(ConfigError, match="drafter has draft_vocab_size=64, this run builds draft_vocab_size=32"):
        resumed.fit(module(), datamodule=SyntheticChat(draft_vocab_size=32), ckpt_path=ckpt)


def test_an_eagle3_fit_says_which_gated_deltanet_path_its_target_runs(target_dir, tmp_path, caplog):
    """As the PDM's `fit`: the path of a hybrid target's linear-attention layers at start (on a GPU without the
    kernels, the SLOW line of `fallback_warning` beside it)."""
    import logging

    from kit import SyntheticChat, make_trainer

    from spd_lightning.eagle3.module import Eagle3Module

    module = Eagle3Module(target=target_dir, target_dtype="float32", ttt_steps=2, lr=3e-3)
    with caplog.at_level(logging.INFO):
        make_trainer(tmp_path, max_steps=1, limit_val_batches=0).fit(module, datamodule=SyntheticChat(batch_size=2))
    assert f"target {target_dir}: Gated DeltaNet layers run the torch fallback" in caplog.text


def test_an_eagle3_fit_refuses_the_state_cache_with_one_line(target_dir, tmp_path):
    """`--data.states` with `--model Eagle3Module`: the cache would be read for every batch and never used (the
    target runs online), a run slower for nothing; one line instead."""
    from kit import SyntheticChat, make_trainer

    from spd_lightning.eagle3.module import Eagle3Module
    from spd_lightning.errors import ConfigError

    data = SyntheticChat(batch_size=2)
    data.states = str(tmp_path / "states")
    module = Eagle3Module(target=target_dir, target_dtype="float32", ttt_steps=2, lr=3e-3)
    with pytest.raises(ConfigError, match="drop --data.states"):
        make_trainer(tmp_path, max_steps=1, limit_val_batches=0).fit(module, datamodule=data)


def test_the_head_is_seeded_with_the_target_rows_of_the_drafted_tokens():
    """Row j of the draft head is the target's LM-head row of token `d2t[j]`, not of token j: with a non-identity
    draft vocabulary a positional copy seeds every row with another token's."""
    d2t = torch.tensor([7, 3, 42, 0, 19])
    drafter = small_drafter(d2t)
    target_head = torch.randn(64, H)
    drafter.init_head_from_target(target_head)
    assert torch.equal(drafter.lm_head.weight, target_head[d2t])


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"lr": 0.0}, "lr=0.0 must be positive"),
        ({"weight_decay": -0.1}, "weight_decay=-0.1 must be >= 0"),  # AdamW's own error came at the first step
        ({"warmup_steps": -5}, "warmup_steps=-5 must be >= 0"),
        ({"min_lr_ratio": 2.0}, "min_lr_ratio=2.0 must lie in [0, 1]"),  # the lr rose, silently
    ],
)
@pytest.mark.parametrize("module", ["SPDModule", "Eagle3Module"])
def test_optimizer_settings_are_checked_alike_for_both_drafters(target_dir, module, setting, message):
    from kit import make_module

    from spd_lightning.eagle3.module import Eagle3Module
    from spd_lightning.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        if module == "SPDModule":
            make_module(target_dir, **setting)
        else:
            Eagle3Module(target=target_dir, target_dtype="float32", **setting)
