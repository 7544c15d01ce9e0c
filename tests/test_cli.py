"""`python -m spd_lightning`: every shipped config parses, bad settings fail with one line, and a real fit
(ChatDataModule over embedded ShareGPT, a micro chat target) trains, validates, resumes and runs on 2-process
CPU DDP."""

import glob
import inspect
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import fit_args

from spd_lightning import cli
from spd_lightning.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended")
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


@pytest.mark.parametrize(
    "name, target", [("qwen35_9b", "Qwen/Qwen3.5-9B"), ("qwen35_4b", "Qwen/Qwen3.5-4B"), ("qwen3_8b", "Qwen/Qwen3-8B")]
)
def test_target_configs_are_the_shared_recipe_plus_their_own_values(name, target, tmp_path, monkeypatch, capsys):
    """Each real-target config names its base in its first line; from any directory, in any `--config` form, it
    resolves to the base's recipe with its own target and run directories on top."""
    monkeypatch.chdir(tmp_path)
    path = os.path.join(REPO, "configs", f"{name}.yaml")
    with pytest.raises(SystemExit):
        cli.main(["fit", f"--config={path}", "--print_config"])
    import yaml

    config = yaml.safe_load(capsys.readouterr().out)
    trainer, model, data = config["trainer"], config["model"], config["data"]
    assert (model["target"], model["n"], model["num_layers"], model["lr"]) == (target, 8, 3, 1.0e-4)
    assert (trainer["strategy"], trainer["precision"], trainer["gradient_clip_val"]) == ("ddp", "bf16-mixed", 0.5)
    assert trainer["logger"]["init_args"]["name"] == f"{name}_n8_ls3"
    assert trainer["logger"]["init_args"]["project"] == "spd-lightning"  # from the base, merged with the target's
    assert (
        trainer["default_root_dir"] == f"runs/{name}" and config["checkpoint"]["dirpath"] == f"runs/{name}/checkpoints"
    )
    assert len(data["sources"]) == 4 and data["pad_to_multiple_of"] == 128
    assert trainer["callbacks"][0]["init_args"]["every_n_steps"] == 2000


def test_a_base_line_that_makes_a_cycle_is_a_user_error(tmp_path, capsys):
    (tmp_path / "a.yaml").write_text("# base: b.yaml\nmodel: {n: 2}\n")
    (tmp_path / "b.yaml").write_text("# base: a.yaml\nmodel: {n: 3}\n")
    code, err = run_main(["fit", "--config", str(tmp_path / "a.yaml"), "--print_config"], capsys)
    assert code == 2 and "cycle" in err


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


def test_fit_help_documents_every_model_and_data_option():
    """jsonargparse reads each option's help from the class's Google-style `Args:` (via docstring-parser)."""
    import docstring_parser

    from spd_lightning.data import ChatDataModule
    from spd_lightning.module import SPDModule

    result = subprocess.run(
        [sys.executable, "-m", "spd_lightning", "fit", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO, "COLUMNS": "10000"},
        timeout=120,
    )
    help_text = " ".join(result.stdout.split())
    for prefix, cls in (("model", SPDModule), ("data", ChatDataModule)):
        documented = {p.arg_name: " ".join(p.description.split()) for p in docstring_parser.parse(cls.__doc__).params}
        parameters = [name for name in inspect.signature(cls.__init__).parameters if name != "self"]
        assert sorted(documented) == sorted(parameters), cls.__name__
        for name in parameters:
            if f"{prefix}.{name}" == "data.tokenizer":
                continue  # linked to model.target: not an option of its own
            assert f"--{prefix}.{name} " in help_text and documented[name] in help_text, f"{prefix}.{name}"


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


@pytest.mark.timeout(300)
def test_ddp_two_cpu_processes(micro_target, tmp_path):
    """Lightning's own DDP strategy (gloo on CPU), launched the way a user launches it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
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
        ),
    ]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 2 and "spd_drafter" in ckpt
    assert "distributed_backend=gloo" in result.stderr + result.stdout
    assert "Starting with 2 processes" in result.stderr + result.stdout
