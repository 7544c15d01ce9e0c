"""`spd_lightning.estimate`: the per-GPU memory estimate against the measured peak of CPU training steps, and the
shipped configs by their estimate (the 9B config fits an 80 GB GPU)."""

import dataclasses
import json
import os

import lightning as L
import pytest
import yaml
from kit import REPO, SyntheticChat, make_module, make_tiny_model, make_trainer

from spd_lightning.estimate import GIB, Shape, estimate, main, pdm_config, target_config
from spd_lightning.training.memory_meter import PeakMemory

BATCH, LENGTH = 2, 64


class MeasurePeak(L.Callback):
    """Peak live tensor bytes of the second training step (AdamW's moments exist by then), counting the target,
    the PDM weights and the optimizer state as already allocated."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == 1:
            state = [t for s in trainer.optimizers[0].state.values() for t in s.values()]
            self.meter = PeakMemory("cpu", [*module.target.parameters(), *module.pdm.parameters(), *state])
            self.meter.__enter__()
            self.length = batch["input_ids"].shape[1]  # padded to the batch's longest sequence

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == 1:
            self.meter.__exit__(None, None, None)
            self.peak = self.meter.peak_bytes


@pytest.fixture(scope="module")
def wide_target(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("targets") / "wide_qwen35")
    make_tiny_model("qwen3_5", hidden_size=128, vocab_size=2048).save_pretrained(path)
    return path


@pytest.mark.parametrize("checkpointing", [False, True])
def test_estimate_is_within_25_percent_of_measured_peak(wide_target, tmp_path, checkpointing):
    overrides = dict(num_layers=2, attention_backend="dense", activation_checkpointing=checkpointing)
    callback = MeasurePeak()
    trainer = make_trainer(tmp_path, max_steps=2, limit_val_batches=0, callbacks=[callback])
    module = make_module(wide_target, **overrides)
    trainer.fit(module, SyntheticChat(batch_size=BATCH, max_length=LENGTH, num_samples=4))
    args = {**module.hparams}
    shape = Shape(
        batch=BATCH,
        length=LENGTH,
        draft_vocab=64,
        precision="32",
        strategy="ddp",
        target_dtype="float32",
        checkpointing=checkpointing,
        backend="dense",
        module_args=args,
    )
    predicted = estimate(dataclasses.replace(shape, length=callback.length), target_config(wide_target))
    print(f"estimate {predicted['total'] / 1e6:.2f} MB, measured {callback.peak / 1e6:.2f} MB")
    assert abs(predicted["total"] - callback.peak) <= 0.25 * callback.peak, (predicted["total"], callback.peak)


def measured_and_estimated(target: str, tmp_path, **module_args) -> tuple[int, float]:
    """The peak of a second training step on the wide target at V_d 1024 (the synthetic ids drawn below its
    vocabulary), and the estimate of that step."""
    callback = MeasurePeak()
    trainer = make_trainer(tmp_path, max_steps=2, limit_val_batches=0, callbacks=[callback])
    module = make_module(target, num_layers=2, attention_backend="dense", **module_args)
    data = SyntheticChat(draft_vocab_size=1024, vocab_size=2048, batch_size=BATCH, max_length=LENGTH, num_samples=4)
    trainer.fit(module, data)
    shape = Shape(BATCH, callback.length, 1024, "32", "ddp", "float32", False, "dense", {**module.hparams})
    return callback.peak, estimate(shape, target_config(target))["total"]


def test_the_auxiliary_loss_costs_what_the_estimate_says(wide_target, tmp_path):
    """`aux_loss_weight` distills every copy, not the loss copy alone: each keeps its logits over V_d and their
    fp32 loss copies for the backward. The estimate left that out, so its figure did not move with the weight (on
    the shipped shapes several GiB at V_d 32,000); the step's measured growth and the estimate's agree to 25 %."""
    plain, plain_estimate = measured_and_estimated(wide_target, tmp_path / "plain")
    aux, aux_estimate = measured_and_estimated(wide_target, tmp_path / "aux", aux_loss_weight=0.5)
    print(
        f"aux_loss_weight 0.5 adds {(aux - plain) / 1e6:.2f} MB, estimated {(aux_estimate - plain_estimate) / 1e6:.2f}"
    )
    assert abs((aux_estimate - plain_estimate) - (aux - plain)) <= 0.25 * (aux - plain)
    assert abs(aux_estimate - aux) <= 0.25 * aux


def test_shipped_9b_config_fits_an_80gb_gpu(capsys):
    config = os.path.join(REPO, "configs", "qwen35_9b.yaml")
    assert main(["--config", config, "--gpus", "8", "--gpu-mem", "80", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert est["target_params"] == pytest.approx(8.95e9, rel=0.01)
    assert est["total"] < 80 * GIB and est["total_checkpointed"] < est["total_plain"]
    assert main(["--config", config]) == 0
    assert "fits a 80 GiB GPU" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["qwen35_4b", "qwen3_8b"])
def test_other_shipped_configs_have_an_estimate(name, capsys):
    assert main(["--config", os.path.join(REPO, "configs", f"{name}.yaml"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total"] > 0


def test_unreadable_config_is_a_user_error(tmp_path, capsys):
    from spd_lightning import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["estimate", "--config", str(tmp_path / "missing.yaml")])
    assert exit_.value.code == 2
    assert "missing.yaml" in capsys.readouterr().err


def test_fsdp_shards_the_pdm_state(tmp_path, capsys):
    shipped = os.path.join(REPO, "configs", "qwen35_9b.yaml")
    fsdp = tmp_path / "fsdp.yaml"  # the shipped config with the strategy switched
    config = yaml.safe_load(open(shipped))
    config["trainer"]["strategy"] = "fsdp"
    fsdp.write_text(yaml.safe_dump(config))
    estimates = []
    for config in (os.path.join(REPO, "configs", "qwen35_9b.yaml"), str(fsdp)):
        assert main(["--config", config, "--gpus", "8", "--json"]) == 0
        estimates.append(json.loads(capsys.readouterr().out))
    ddp, sharded = estimates
    assert sharded["pdm_state"] == pytest.approx(ddp["pdm_state"] / 8)
    assert sharded["target_weights"] == ddp["target_weights"]  # every rank holds the whole frozen target


def test_runtime_buffers_by_strategy_and_precision(tmp_path, capsys):
    """DDP's gradient buckets (G > 1), FSDP's unsharded units, autocast's bf16 weight copies and the CUDA context."""
    shipped = os.path.join(REPO, "configs", "qwen35_9b.yaml")
    fsdp, fp32 = tmp_path / "fsdp.yaml", tmp_path / "fp32.yaml"
    for path, trainer in ((fsdp, {"strategy": "fsdp"}), (fp32, {"precision": 32, "accelerator": "cpu"})):
        config = yaml.safe_load(open(shipped))  # the shipped config with these trainer settings changed
        config["trainer"].update(trainer)
        path.write_text(yaml.safe_dump(config))

    def run(config, gpus):
        assert main(["--config", str(config), "--gpus", str(gpus), "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    ddp8, ddp1, sharded, plain = run(shipped, 8), run(shipped, 1), run(fsdp, 8), run(fp32, 8)
    assert ddp8["ddp_grad_buckets"] == pytest.approx(4 * ddp8["pdm_params"])  # +3.6 GiB at 9B
    assert "ddp_grad_buckets" not in ddp1 and "ddp_grad_buckets" not in sharded
    assert ddp8["total"] == pytest.approx(ddp1["total"] + ddp8["ddp_grad_buckets"])
    assert 0 < sharded["fsdp_full_grads"] < sharded["fsdp_full_params"] < 4 * sharded["pdm_params"]
    assert 0 < ddp8["autocast_weight_copies"] <= 2 * ddp8["pdm_params"] and "autocast_weight_copies" not in plain
    assert ddp8["total_device"] == ddp8["total"] + ddp8["cuda_context"] and "cuda_context" not in plain


def test_estimate_reads_what_fit_would_run(tmp_path, capsys):
    """Settings estimate dropped, silently: `trainer.devices` (the GPUs, DDP's buckets on one), fit's data defaults
    (batch 4 where the config is silent, not 1), `head_from_target` (a frozen head holds no gradient nor AdamW
    state), the fit verdict in `--json`; and an EAGLE-3 config (estimated as a default PDM) or two `--config`
    files (the first dropped) are one line."""
    from spd_lightning import cli

    shipped = yaml.safe_load(open(os.path.join(REPO, "configs", "qwen35_9b.yaml")))

    def run(name, edit, *extra):
        config = yaml.safe_load(yaml.safe_dump(shipped))
        edit(config)
        (tmp_path / name).write_text(yaml.safe_dump(config))
        assert main(["--config", str(tmp_path / name), "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    base = run("base.yaml", lambda c: None)
    one = run("one.yaml", lambda c: c["trainer"].update(devices=1))
    assert base["gpus"] == 8 and one["gpus"] == 1 and "ddp_grad_buckets" not in one
    silent = run("silent.yaml", lambda c: c["data"].pop("batch_size"))
    assert silent["shape"]["batch"] == 4  # ChatDataModule's default
    frozen = run("frozen.yaml", lambda c: c["model"].update(head_from_target=True))
    head = base["shape"]["draft_vocab"] * 4096  # V_d x H rows of Qwen3.5-9B's width
    assert base["pdm_state"] - frozen["pdm_state"] == pytest.approx(12 * head)
    assert base["fits"] is (base["total_device"] <= base["gpu_mem_gib"] * 1024**3)
    eagle3 = tmp_path / "eagle3.yaml"
    eagle3.write_text(
        yaml.safe_dump({**shipped, "model": {"class_path": "Eagle3Module", "init_args": {"target": "x"}}})
    )
    for argv, message in (
        (["--config", str(eagle3)], "trains Eagle3Module: estimate covers the PDM (SPDModule) only"),
        (["--config", str(tmp_path / "base.yaml"), "--config", str(tmp_path / "one.yaml")], "reads one --config"),
    ):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["estimate", *argv])
        assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides",
    [{}, {"num_heads": 2, "num_kv_heads": 1, "head_dim": 16, "intermediate_size": 96, "hidden_size": 64}],
)
def test_the_estimate_builds_the_drafter_fit_builds(wide_target, overrides):
    """`estimate` sizes the PDM that `fit` would build from the same settings (their shape defaults are one
    function, `pdm.block_shape`): the same config, the target's values where none is given."""
    module = make_module(wide_target, num_layers=2, init_head=not overrides, **overrides)
    shape = Shape(BATCH, LENGTH, 64, "32", "ddp", "float32", False, "dense", {**module.hparams})
    built, _ = pdm_config(shape, target_config(wide_target))
    assert built == module._pdm_config(64, built.rope_theta)
