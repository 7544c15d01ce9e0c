"""The staircase-evaluation callback: keys and values with CSV and offline W&B loggers, equality with the
decoder CLI, checkpointed state, and a 2-process DDP fit that logs once per evaluation."""

import glob
import json
import logging
import math
import os
import subprocess
import sys

import pytest
import torch
import wandb
from kit import DEMO_PROMPTS, REPO, callback_args, csv_rows, fit_args

from callbacks import StaircaseEvaluation
from inference.decode import main as decode_main
from spd_lightning import cli
from spd_lightning.errors import ConfigError


@pytest.fixture(scope="module")
def csv_run(micro_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("csv_run")
    args = fit_args(
        micro_target,
        root,
        "--trainer.max_steps",
        "4",
        "--trainer.logger",
        "lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.init_args.save_dir={root}",
        *callback_args(),
    )
    console = ConsoleLines()
    logging.getLogger("lightning.pytorch").addHandler(console)
    try:
        trained = cli.run_cli(["fit", *args])
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(console)
    return root, trained, console.lines


class ConsoleLines(logging.Handler):
    """What Lightning's console logger printed."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_csv_logger_gets_plausible_staircase_metrics(csv_run):
    root, trained, console = csv_run
    rows = [r for r in csv_rows(root) if r.get("staircase/alpha")]
    assert [int(r["step"]) for r in rows] == [2, 4]  # every 2 steps; the end of fit at step 4 is not repeated
    n = trained.model.geometry.n
    for r in rows:
        alpha = float(r["staircase/alpha"])
        assert 1.0 / n - 1e-9 <= alpha <= 1.0 + 1e-9  # between always-wrong and always-right
        assert math.isclose(float(r["staircase/speedup"]), n * alpha, rel_tol=1e-6)
        for key in ("staircase/mean_accept_run", "staircase/accept_fill1", "staircase/agree_d0_f1"):
            assert math.isfinite(float(r[key])), key
        assert 0.0 <= float(r["staircase/agree_d0_f1"]) <= 1.0
        assert 1.0 <= float(r["staircase/predicted_n_alpha"]) <= n  # the refill chain's range
    pictures = os.listdir(os.path.join(trained.trainer.log_dir, "staircase"))
    assert "alpha_vs_step.png" in pictures and "agreement_step4.png" in pictures
    assert float(trained.trainer.callback_metrics["staircase/alpha"]) == float(rows[-1]["staircase/alpha"])
    said = [line for line in console if line.startswith("staircase evaluation at step")]
    assert [line.split(":")[0] for line in said] == ["staircase evaluation at step 2", "staircase evaluation at step 4"]
    assert f"alpha {float(rows[-1]['staircase/alpha']):.3f}," in said[-1]  # the console says what the loggers got
    assert f"{float(rows[-1]['staircase/predicted_n_alpha']):.2f} predicted" in said[-1]


def test_alpha_equals_the_decoder_cli(csv_run, micro_target, tmp_path):
    root, trained, _ = csv_run
    [callback] = [c for c in trained.trainer.callbacks if isinstance(c, StaircaseEvaluation)]
    ckpt = str(tmp_path / "now.ckpt")
    trained.trainer.save_checkpoint(ckpt)
    report = tmp_path / "decode.json"
    code = decode_main(
        [
            "--ckpt",
            ckpt,
            "--target",
            micro_target,
            "--simulate",
            "--prompts",
            DEMO_PROMPTS,
            "--max-new-tokens",
            "12",
            "--json",
            str(report),
        ]
    )
    assert code == 0  # in this process: the same `main` as `python -m inference.decode`
    with open(report) as f:
        totals = json.load(f)["totals"]
    # The callback evaluates 3 of the file's prompts; evaluate it now on all of them for the same set.
    callback.num_prompts, callback._prompt_ids = 10**6, None
    metrics = callback.evaluate(trained.trainer, trained.model)
    assert metrics["staircase/N"] == totals["N"] and metrics["staircase/K"] == totals["K"]
    assert metrics["staircase/alpha"] == pytest.approx(totals["alpha"], rel=1e-12)


def test_state_round_trips_through_a_checkpoint(csv_run, tmp_path):
    _, trained, _ = csv_run
    [callback] = [c for c in trained.trainer.callbacks if isinstance(c, StaircaseEvaluation)]
    path = str(tmp_path / "c.ckpt")
    trained.trainer.save_checkpoint(path)
    states = torch.load(path, weights_only=True)["callbacks"]
    [state] = [v for k, v in states.items() if k.startswith("StaircaseEvaluation")]
    fresh = StaircaseEvaluation()
    fresh.load_state_dict(state)
    assert fresh.history == callback.history and len(fresh.history) >= 2


def test_offline_wandb_run_gets_scalars_table_and_images(micro_target, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    args = fit_args(
        micro_target,
        tmp_path,
        "--trainer.max_steps",
        "2",
        "--trainer.logger",
        "lightning.pytorch.loggers.WandbLogger",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--trainer.logger.init_args.project=spd-test",
        *callback_args(every=0),
    )
    trained = cli.run_cli(["fit", *args])
    trained.trainer.logger.experiment.finish()
    # finish() returns before wandb-core's writer has flushed and closed the run's transaction log (run-*.wandb):
    # read right away it may hold the header alone. teardown() ends the service, which closes every stream first.
    wandb.teardown()
    [run_dir] = glob.glob(os.path.join(str(tmp_path), "**", "offline-run-*"), recursive=True)
    media = os.path.join(run_dir, "files", "media")
    assert glob.glob(os.path.join(media, "table", "staircase", "prompts_*.table.json"))
    assert glob.glob(os.path.join(media, "images", "staircase", "agreement_heatmap_*.png"))
    assert glob.glob(os.path.join(media, "images", "staircase", "alpha_vs_step_*.png"))
    with open(glob.glob(os.path.join(run_dir, "run-*.wandb"))[0], "rb") as f:
        records = f.read()  # offline runs keep history and config only in this protobuf log
    assert b"staircase/alpha" in records and b"staircase/accept_fill1" in records
    assert b"StaircaseEvaluation" in records  # the resolved config is in the run config
    with open(glob.glob(os.path.join(media, "table", "staircase", "prompts_*.table.json"))[0]) as f:
        table = json.load(f)
    assert table["columns"] == ["index", "prompt", "output", "N", "K", "alpha"] and len(table["data"]) == 3


def test_model_checkpoint_can_keep_the_best_alpha(micro_target, tmp_path):
    args = fit_args(
        micro_target,
        tmp_path,
        "--trainer.max_steps",
        "4",
        *callback_args(),
        "--checkpoint.monitor",
        "staircase/alpha",
        "--checkpoint.mode",
        "max",
        "--checkpoint.every_n_train_steps",
        "2",
        "--checkpoint.save_top_k",
        "1",
    )
    trained = cli.run_cli(["fit", *args])
    best = trained.trainer.checkpoint_callback
    assert best.best_model_path and best.best_model_score is not None
    assert 0.0 < float(best.best_model_score) <= 1.0


def test_bad_callback_settings_fail_with_one_line():
    with pytest.raises(ValueError, match="num_prompts=0"):
        StaircaseEvaluation(num_prompts=0)


@pytest.mark.parametrize(
    "extra, expected",
    [
        ({"prompts": "{root}/none.jsonl"}, "does not exist"),
        ({"prompts": "null", "__val_size": "0"}, "no held-out prompt"),
    ],
    ids=["missing_prompts_file", "no_validation_split"],
)
def test_unreadable_prompts_stop_the_run_before_its_first_step(micro_target, tmp_path, monkeypatch, extra, expected):
    """A prompts file that does not exist, or no held-out conversation to take prompts from, is one line when the
    run starts: it used to surface at the first evaluation, `every_n_steps` into the run, dropping the steps trained
    since the last checkpoint."""
    from spd_lightning.errors import UserError
    from spd_lightning.training.module import SPDModule

    steps = []
    step = SPDModule.training_step
    monkeypatch.setattr(SPDModule, "training_step", lambda self, *a: steps.append(1) or step(self, *a))
    settings = {k: v.format(root=tmp_path) for k, v in extra.items() if not k.startswith("__")}
    val_size = ["--data.val_size", extra["__val_size"]] if "__val_size" in extra else []
    args = fit_args(micro_target, tmp_path, "--trainer.max_steps", "2", *val_size, *callback_args(1, **settings))
    with pytest.raises(UserError, match=expected):
        cli.run_cli(["fit", *args])
    assert steps == []


@pytest.mark.slow  # fast: test_cli.py's test_ddp_two_cpu_processes logs one evaluation over 2 DDP processes
@pytest.mark.timeout(240)
def test_ddp_fit_with_the_callback_logs_once_per_evaluation(micro_target, tmp_path):
    args = fit_args(
        micro_target,
        tmp_path,
        "--trainer.max_steps",
        "2",
        "--trainer.strategy",
        "ddp",
        "--trainer.devices",
        "2",
        "--trainer.accelerator",
        "cpu",
        "--trainer.logger",
        "lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        *callback_args(every=0),
    )
    env = {**os.environ, "PL_DISABLE_FORK": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "spd_lightning", "fit", *args],
        cwd=REPO,
        env=env,
        timeout=220,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [r for r in csv_rows(tmp_path) if r.get("staircase/alpha")]
    assert len(rows) == 1 and int(rows[0]["step"]) == 2
    assert 0.0 < float(rows[0]["staircase/alpha"]) <= 1.0


def test_resume_restores_the_history_and_repeats_the_numbers(micro_target, tmp_path):
    """Resuming from a mid-epoch checkpoint keeps the callback's history, and the evaluation after the
    resume reports what the uninterrupted run reported (exact resume of weights, data order and decoding)."""

    def run(root, *extra):
        args = fit_args(
            micro_target,
            root,
            "--trainer.max_steps",
            "4",
            "--checkpoint.every_n_train_steps",
            "2",
            "--checkpoint.save_top_k",
            "-1",
            *callback_args(),
            *extra,
        )
        trainer = cli.run_cli(["fit", *args]).trainer
        return [c for c in trainer.callbacks if isinstance(c, StaircaseEvaluation)][0].history

    straight = run(tmp_path / "a")
    [mid] = glob.glob(os.path.join(str(tmp_path / "a" / "ckpt"), "*step=2.ckpt"))
    resumed = run(tmp_path / "b", "--ckpt_path", mid)
    assert [s for s, _ in straight] == [2, 4]
    assert resumed[0] == straight[0]  # restored from the checkpoint, not re-evaluated
    assert resumed[1][0] == 4 and resumed[1][1] == pytest.approx(straight[1][1], abs=1e-12)


@pytest.mark.parametrize("layout,num_layers", [("depth", 2), ("type", 1)])
def test_a_walk_gives_the_decodes_numbers(micro_target, tmp_path, layout, num_layers):
    """`method: walk` reports exactly what the simulator's decodes report, counters and table rows included."""
    extra = ("--model.layout", layout, "--model.num_layers", str(num_layers), "--trainer.max_steps", "3")
    trained = cli.run_cli(["fit", *fit_args(micro_target, tmp_path, *extra)])
    settings = dict(num_prompts=4, max_new_tokens=12, prompts=DEMO_PROMPTS, num_batches=0, log_table=False)
    measured = {}
    for method in ("decode", "walk"):
        callback = StaircaseEvaluation(method=method, **settings)
        callback.setup(trained.trainer, trained.model, "fit")
        measured[method] = callback.evaluate(trained.trainer, trained.model)
    assert measured["walk"] == measured["decode"]
    assert 0 < measured["walk"]["staircase/alpha"] < 1  # accepts and rejects: not a trivial match


def test_a_walk_refuses_what_it_cannot_reproduce(micro_target, tmp_path):
    with pytest.raises(ConfigError, match="walk at temperature 0"):
        StaircaseEvaluation(method="walk", temperature=1.0)
    trained = cli.run_cli(
        ["fit", *fit_args(micro_target, tmp_path, "--model.layout", "type", "--model.num_layers", "2")]
    )
    with pytest.raises(ConfigError, match="type layout at num_layers=2"):
        StaircaseEvaluation(method="walk", prompts=DEMO_PROMPTS).setup(trained.trainer, trained.model, "fit")
