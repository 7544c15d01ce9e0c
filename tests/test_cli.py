"""`python -m spd_lightning`: every shipped config parses, bad settings fail with one line, and a real fit
(ChatDataModule over embedded ShareGPT, a micro chat target) trains, validates, resumes and runs on 2-process
CPU DDP."""

import glob
import inspect
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
from kit import REPO, callback_args, csv_rows, fit_args, run_unless_hung

from spd_lightning import cli
from spd_lightning.errors import UserError

CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))


def run_main(args, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args)
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("config", CONFIGS, ids=os.path.basename)
def test_every_config_parses_without_loading_the_target(config, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--config", config, "--print_config"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "model:" in out and "target:" in out


def test_print_config_shows_the_linked_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["fit", "--config", os.path.join(REPO, "configs", "qwen35_9b.yaml"), "--print_config"])
    out = capsys.readouterr().out
    assert "target: Qwen/Qwen3.5-9B" in out and "num_layers: 3" in out and "n: 8" in out
    assert "save_last: true" in out and "WandbLogger" in out and "precision: bf16-mixed" in out
    assert "tokenizer:" not in out  # linked to model.target, not a second setting


GPU_CONFIGS = {"qwen35_9b": "Qwen/Qwen3.5-9B", "qwen35_4b": "Qwen/Qwen3.5-4B", "qwen3_8b": "Qwen/Qwen3-8B"}


def printed_config(capsys, *args) -> dict:
    import yaml

    with pytest.raises(SystemExit):
        cli.main(["fit", *args, "--print_config"])
    return yaml.safe_load(capsys.readouterr().out)


def without_run_names(config: dict) -> dict:
    """A config less what names one run: its target, logger name/save_dir, root and checkpoint directories."""
    config = {**config, "trainer": dict(config["trainer"]), "checkpoint": dict(config["checkpoint"])}
    config["model"] = {**config["model"], "init_args": {**config["model"]["init_args"], "target": None}}
    config["trainer"]["logger"] = {**config["trainer"]["logger"], "init_args": {}}
    config["trainer"]["default_root_dir"] = config["checkpoint"]["dirpath"] = config["data"]["tokenizer"] = None
    return config


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_target_configs_are_the_paper_recipe_with_their_own_target_and_run_names(name, tmp_path, monkeypatch, capsys):
    """Each real-target config is complete on its own (from any directory, in any `--config` form) and holds the
    paper's recipe; the three differ only in the target and the names of their runs, so the recipe cannot drift."""
    monkeypatch.chdir(tmp_path)
    config = printed_config(capsys, f"--config={os.path.join(REPO, 'configs', f'{name}.yaml')}")
    trainer, model, data = config["trainer"], config["model"]["init_args"], config["data"]
    assert config["model"]["class_path"] == "spd_lightning.training.module.SPDModule"
    assert (model["target"], model["n"], model["num_layers"], model["lr"]) == (GPU_CONFIGS[name], 8, 3, 1.0e-4)
    assert (trainer["strategy"], trainer["precision"], trainer["gradient_clip_val"]) == ("ddp", "bf16-mixed", 0.5)
    assert trainer["logger"]["init_args"]["name"] == f"{name}_n8_ls3"
    assert trainer["logger"]["init_args"]["project"] == "spd-lightning"
    assert (
        trainer["default_root_dir"] == f"runs/{name}" and config["checkpoint"]["dirpath"] == f"runs/{name}/checkpoints"
    )
    assert len(data["sources"]) == 4 and data["pad_to_multiple_of"] == 128
    assert trainer["callbacks"][0]["init_args"]["every_n_steps"] == 2000
    reference = printed_config(capsys, "--config", os.path.join(REPO, "configs", "qwen35_9b.yaml"))
    assert without_run_names(config) == without_run_names(reference)


def test_the_deep_benchmark_config_is_the_tiny_recipe_with_its_target_and_depth(capsys):
    deep = printed_config(capsys, "--config", os.path.join(REPO, "configs", "bench_deep.yaml"))
    tiny = printed_config(capsys, "--config", os.path.join(REPO, "configs", "bench_tiny.yaml"))
    assert deep["model"]["init_args"]["num_layers"] == 3 and tiny["model"]["init_args"]["num_layers"] == 1
    for config in (deep, tiny):
        config["model"]["init_args"]["num_layers"] = None
    assert without_run_names(deep) == without_run_names(tiny)


def test_several_configs_stack_later_values_winning(tmp_path, capsys):
    """LightningCLI's own stacking: a file with a few overrides on top of a shipped config."""
    override = tmp_path / "override.yaml"
    override.write_text("model:\n  num_layers: 2\ntrainer:\n  strategy: fsdp\n")
    config = printed_config(
        capsys, "--config", os.path.join(REPO, "configs", "qwen35_9b.yaml"), "--config", str(override)
    )
    assert config["model"]["init_args"]["num_layers"] == 2 and config["trainer"]["strategy"] == "fsdp"
    assert (
        config["model"]["init_args"]["target"] == "Qwen/Qwen3.5-9B" and config["trainer"]["precision"] == "bf16-mixed"
    )


def test_the_model_class_is_chosen_by_class_path_keeping_the_shared_options(capsys):
    """`--model Eagle3Module` on a PDM config trains EAGLE-3 on the same target with the same optimizer settings;
    the PDM-only options (n, num_layers, ...) are dropped, not an error."""
    config = printed_config(capsys, "--config", os.path.join(REPO, "configs", "tiny.yaml"), "--model", "Eagle3Module")
    model = config["model"]
    assert model["class_path"] == "spd_lightning.eagle3.module.Eagle3Module"
    assert model["init_args"]["target"] == "artifacts/tiny_target" and model["init_args"]["lr"] == 1.0e-3
    assert "n" not in model["init_args"] and "num_layers" not in model["init_args"]


def test_a_model_class_that_trains_no_drafter_is_one_line(micro_target, tmp_path, capsys):
    code, err = run_main(
        ["fit", *fit_args(micro_target, tmp_path), "--model", "lightning.pytorch.demos.boring_classes.BoringModel"],
        capsys,
    )
    assert code == 2 and "does not train a drafter" in err and "Traceback" not in err


def test_a_trainer_setting_lightning_rejects_is_bad_input(micro_target, tmp_path, capsys):
    """Lightning's own ValueError for a setting (validation interval beyond the epoch) is exit 2, not a bug."""
    code, err = run_main(["fit", *fit_args(micro_target, tmp_path), "--trainer.val_check_interval", "100000"], capsys)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert (
        code == 2 and len(lines) == 1 and "val_check_interval" in lines[0] and "a setting Lightning rejects" in lines[0]
    )


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--model.n", "9"], "n=9"),
        (["--model.anchors", "[0, 2, 9]"], "anchor 9 is out of range"),
        (["--model.split", "[0, 3, 3, 4]", "--model.n", "3"], "stage split"),
        (["--model.init_layers_from", "[5]"], "init_layers_from"),
        (["--data.max_length", "8"], "max_length"),
    ],
)
def test_bad_settings_print_one_line(micro_target, tmp_path, capsys, extra, expected):
    code, err = run_main(["fit", *fit_args(micro_target, tmp_path), *extra], capsys)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and expected in lines[0], err
    assert "Traceback" not in err


def bad_ckpt_path(kind: str, tmp_path) -> str:
    """A `--ckpt_path` that no run can resume from, of the given kind."""
    if kind == "missing":
        return str(tmp_path / "nope.ckpt")
    if kind in ("truncated", "random_bytes"):
        path = tmp_path / "last.ckpt"
        torch.save({"state_dict": {"w": torch.zeros(1000)}, "global_step": 3}, path)
        path.write_bytes(path.read_bytes()[:5000] if kind == "truncated" else os.urandom(5000))
        return str(path)
    if kind == "drafter_dir":
        (tmp_path / "drafter").mkdir()
        (tmp_path / "drafter" / "config.json").write_text("{}")
        return str(tmp_path / "drafter")
    return str(tmp_path)  # a run's root directory


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("missing", "does not exist"),
        ("truncated", "not a readable checkpoint"),
        ("random_bytes", "not a readable checkpoint"),
        ("drafter_dir", "exported drafter"),
        ("run_dir", "is a directory"),
    ],
)
def test_a_ckpt_path_that_holds_no_checkpoint_is_one_line(micro_target, tmp_path, capsys, kind, expected):
    """A missing, truncated or corrupt `--ckpt_path`, or a directory, is bad input (exit 2, one line naming it),
    found before the data and the target load; it was an `unexpected OSError` / `FileNotFoundError` /
    `IsADirectoryError` (exit 1, a bug) after them."""
    path = bad_ckpt_path(kind, tmp_path)
    code, err = run_main(["fit", *fit_args(micro_target, tmp_path / "run"), "--ckpt_path", path], capsys)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and expected in lines[0] and repr(path) in lines[0], err
    assert "Traceback" not in err and "Loading weights" not in err


@pytest.mark.parametrize("under", ["", "ckpt"], ids=["a_file", "under_a_file"])
def test_a_checkpoint_dir_that_cannot_be_made_is_one_line_before_training(micro_target, tmp_path, capsys, under):
    """`checkpoint.dirpath` naming a file, or a path under one, failed at the first save, `every_n_train_steps` into
    the run, as an unexpected FileExistsError / NotADirectoryError (exit 1); now one line as the run starts."""
    taken = tmp_path / "taken"
    taken.write_text("")
    dirpath = str(taken / under if under else taken)
    args = ["--trainer.callbacks", "[]", "--trainer.max_steps", "1", "--checkpoint.dirpath", dirpath]
    code, err = run_main(["fit", *fit_args(micro_target, tmp_path / "run"), *args], capsys)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and f"checkpoint.dirpath {dirpath!r} cannot be made" in lines[0], err
    assert "Loading weights" not in err  # before the target loads


def test_missing_target_path(tmp_path, capsys):
    code, err = run_main(["fit", *fit_args(str(tmp_path / "no_target"), tmp_path)], capsys)
    assert code == 2 and "does not exist" in err and "Traceback" not in err


def test_debug_flag_shows_the_traceback(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        cli.main(["fit", *fit_args(str(tmp_path / "no_target"), tmp_path), "--debug"])


def test_a_bug_exits_1_with_one_line_and_debug_raises_it(monkeypatch, capsys):
    def broken(args):
        raise KeyError("internal")

    monkeypatch.setattr(cli, "run_cli", broken)
    code, err = run_main(["fit"], capsys)
    assert code == 1 and err.count("error:") == 1 and "KeyError" in err and "Traceback" not in err
    with pytest.raises(KeyError):
        cli.main(["fit", "--debug"])
    monkeypatch.setenv("SPD_DEBUG", "1")
    with pytest.raises(KeyError):
        cli.main(["fit"])


def test_debug_is_taken_out_of_the_command_line_without_editing_sys_argv(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "run_cli", seen.append)
    argv = ["python -m spd_lightning", "fit", "--config", "x.yaml", "--debug"]
    monkeypatch.setattr(sys, "argv", list(argv))
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 0 and seen == [["fit", "--config", "x.yaml"]] and sys.argv == argv


def test_a_parser_error_is_a_user_error(capsys):
    code, err = run_main(["fit", "--config", CONFIGS[0], "--model.no_such_option", "1"], capsys)
    assert code == 2 and err.count("error:") == 1 and "no_such_option" in err and "Traceback" not in err


def echo_subcommand(args) -> int:
    print("echo", *args)
    return 3


def test_a_subcommand_is_one_table_entry_and_shows_in_the_help(monkeypatch, capsys):
    monkeypatch.setitem(cli.EXTRA_COMMANDS, "echo", ("test_cli:echo_subcommand", "print the arguments"))
    code, _ = run_main(["echo", "a", "b"], capsys)
    assert code == 3
    code, err = run_main([], capsys)
    assert code == 2 and "fit, validate, export, prepare, estimate, echo" in err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    help_text = capsys.readouterr().out
    assert exit_info.value.code == 0
    for name in ("fit", "validate", "export", "prepare", "estimate", "echo"):
        assert re.search(rf"^ +{name} +\S", help_text, re.MULTILINE), name


def help_text(capsys, *args: str) -> str:
    """What `fit ARGS` prints and exits 0 with, in this process (COLUMNS is set wide by the caller)."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", *args])
    assert exit_info.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_fit_help_documents_every_model_and_data_option(monkeypatch, capsys):
    """jsonargparse reads each option's help from the class's Google-style `Args:` (via docstring-parser): `fit
    --help` lists the data module's, `fit --model.help CLASS` each drafter module's."""
    import docstring_parser

    from spd_lightning.data import ChatDataModule
    from spd_lightning.eagle3.module import Eagle3Module
    from spd_lightning.training.module import SPDModule

    monkeypatch.setenv("COLUMNS", "10000")  # one option per line: its help unbroken
    for prefix, cls, text in (
        ("model", SPDModule, help_text(capsys, "--model.help", "SPDModule")),
        ("model", Eagle3Module, help_text(capsys, "--model.help", "Eagle3Module")),
        ("data", ChatDataModule, help_text(capsys, "--help")),
    ):
        documented = {p.arg_name: " ".join(p.description.split()) for p in docstring_parser.parse(cls.__doc__).params}
        parameters = [name for name in inspect.signature(cls.__init__).parameters if name != "self"]
        assert sorted(documented) == sorted(parameters), cls.__name__
        for name in parameters:
            if f"{prefix}.{name}" in ("data.tokenizer", "data.trust_remote_code"):
                continue  # linked to model.target and model.trust_remote_code: not options of their own
            assert f"--{prefix}.{name} " in text and documented[name] in text, f"{cls.__name__}: {prefix}.{name}"


def test_wandb_runs_offline_without_a_key(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / ".netrc"))
    cli.default_wandb_offline()
    assert os.environ["WANDB_MODE"] == "offline"
    monkeypatch.delenv("WANDB_MODE")
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    (tmp_path / ".netrc").chmod(0o600)
    cli.default_wandb_offline()
    assert "WANDB_MODE" not in os.environ


def test_fit_validate_resume_and_export(micro_target, tmp_path):
    # a periodic last.ckpt, as an interrupted run leaves it (a run that reached max_steps has finished its epoch)
    trained = cli.run_cli(
        ["fit", *fit_args(micro_target, tmp_path, "--trainer.max_steps", "3", "--checkpoint.every_n_train_steps", "1")]
    )
    assert trained.trainer.global_step == 3
    last = tmp_path / "ckpt" / "last.ckpt"
    assert last.exists()
    assert {"val/loss", "val/agree", "val/agree_depth0", "val/agree_fill1"} <= set(trained.trainer.callback_metrics)

    resumed = cli.run_cli(
        ["fit", *fit_args(micro_target, tmp_path, "--trainer.max_steps", "5"), "--ckpt_path", str(last)]
    )
    assert resumed.trainer.global_step == 5

    validated = cli.run_cli(["validate", *fit_args(micro_target, tmp_path), "--ckpt_path", str(last)])
    assert "val/agree" in validated.trainer.callback_metrics

    out = cli.export(["--ckpt", str(last), "--out", str(tmp_path / "drafter")])
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]


def test_a_resume_names_the_model_settings_it_takes_from_the_checkpoint(micro_target, tmp_path):
    """A resume takes the model's settings from the checkpoint (LightningCLI's rule, docs/DESIGN.md): a `--model.*`
    flag that differs from them was ignored without a word. Now one warning names each one and the way to train
    with it (`--model.init_from`, a new run); the same settings resume without it."""
    args = fit_args(micro_target, tmp_path, "--trainer.callbacks", "[]", "--checkpoint.every_n_train_steps", "1")
    cli.run_cli(["fit", *args, "--trainer.max_steps", "1"])
    last = str(tmp_path / "ckpt" / "last.ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = cli.run_cli(["fit", *args, "--trainer.max_steps", "2", "--ckpt_path", last, "--model.lr", "0.5"])
        cli.run_cli(["fit", *args, "--trainer.max_steps", "3", "--ckpt_path", last])
    assert resumed.model.hparams.lr != 0.5 and resumed.trainer.global_step == 2  # Lightning's rule stands
    ignored = [str(w.message) for w in caught if "--ckpt_path" in str(w.message)]
    assert len(ignored) == 1 and "model.lr=0.5" in ignored[0] and "--model.init_from" in ignored[0], ignored


@pytest.mark.timeout(300)
def test_ddp_two_cpu_processes(micro_target, tmp_path):
    """Lightning's own DDP strategy (gloo on CPU), launched the way a user launches it; the staircase evaluation
    at the end of the fit is logged once (tests/test_staircase.py checks its numbers in one process)."""
    env = {**os.environ, "PYTHONPATH": REPO}
    cmd = [
        sys.executable,
        "-m",
        "spd_lightning",
        "fit",
        *fit_args(
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
            *callback_args(every=0, num_prompts=2, max_new_tokens=4),
        ),
    ]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 2 and "spd_drafter" in ckpt
    assert "distributed_backend=gloo" in result.stderr + result.stdout
    assert "Starting with 2 processes" in result.stderr + result.stdout
    rows = [r for r in csv_rows(tmp_path) if r.get("staircase/alpha")]
    assert len(rows) == 1 and int(rows[0]["step"]) == 2
    assert 0.0 < float(rows[0]["staircase/alpha"]) <= 1.0


@pytest.mark.slow  # fast: test_data::test_on_several_ranks_a_source_that_prepare_data_cannot_read_is_raised_by_setup
@pytest.mark.timeout(150)
def test_a_bad_data_file_ends_every_ddp_rank_with_its_line(micro_target, tmp_path):
    """Lightning reads the data on one process per node (`prepare_data`) while the others wait in a barrier: a source
    that cannot be read ended that rank with the one line, and rank 1 left the barrier only when rank 0 was gone
    (gloo: 'unexpected RuntimeError: ... Connection closed by peer (a bug ...)', seen; NCCL: a hang until the process
    group's timeout). Now every rank ends with the line, exit 2."""
    bad = tmp_path / "chats.jsonl"
    bad.write_text('{"conversations": [{"from": "human", "value": "hi"}]}\n{"conversations": [\n')
    args = ["-m", "spd_lightning", "fit", *fit_args(micro_target, tmp_path)]
    args += ["--data.sources", f"[{{path: {bad}}}]", "--trainer.strategy", "ddp", "--trainer.devices", "2"]
    proc = run_unless_hung([*args, "--trainer.accelerator", "cpu"], 120, "a rank hung after the bad data file")
    err = proc.stderr
    # each rank's line (both write to one pipe, so the two may run together)
    assert proc.returncode == 2 and "error: unexpected" not in err, err[-3000:]
    assert err.count(f"error: cannot read '{bad}' as json") == 2, err[-3000:]


def test_a_distributed_sampler_switched_off_is_one_line(capsys):
    """`trainer.use_distributed_sampler: false` changed only validation: the data module's resumable sampler shards
    the training samples over the ranks itself. One line before anything loads."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(
            [
                "fit",
                "--config",
                os.path.join(REPO, "configs", "tiny.yaml"),
                "--trainer.use_distributed_sampler",
                "false",
            ]
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "use_distributed_sampler: false would not change" in err, err
