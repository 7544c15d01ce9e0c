"""Command line: `python -m spd_lightning fit|validate --config configs/X.yaml` and `... export`.

`fit` and `validate` are LightningCLI over a drafter module + `ChatDataModule`; the data module's tokenizer is
linked to the model's target, so a config names the target once. `model.drafter` picks the module (in the YAML
under `model:` or as `--model.drafter`): `pdm` (default, `SPDModule`) or `eagle3` (`Eagle3Module`, the EAGLE-3
baseline, docs/EAGLE3.md); `fit --model.drafter eagle3 --help` lists its options. Defaults every run gets:
- a `WandbLogger`, offline when no W&B key is configured (no WANDB_API_KEY and no netrc entry);
- a `ModelCheckpoint` under `checkpoint.*` that keeps `last.ckpt` (resume: `--ckpt_path .../last.ckpt` or
  `--ckpt_path last`), also written when SIGTERM stops the run;
- checkpoint files written atomically (`checkpoint_io.py`): a killed run never leaves a half-written one.
`export --ckpt PATH --out DIR` writes the drafter directory that `inference/` loads, for either kind (the
checkpoint records it).

Errors: a `UserError` (a bad setting: geometry, target path, vocabulary, data, a flag) ends the run with one
line on stderr and exit code 2; anything else is a bug: one line and exit code 1. `--debug` or `SPD_DEBUG=1`
shows the traceback instead. SIGTERM ends `fit` after the current step with exit code 143 (128 + SIGTERM), its
checkpoint saved. More subcommands: one line in `EXTRA_COMMANDS`. A config whose first line is `# base: FILE` is
stacked on FILE (see `with_base_configs`).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import netrc
import os
import re
import signal
import sys
import warnings
from collections.abc import Sequence

import yaml
from jsonargparse import ArgumentError, DefaultHelpFormatter
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

from .checkpoint_io import AtomicCheckpointIO
from .data import ChatDataModule
from .eagle3.export import KIND as EAGLE3
from .eagle3.export import load_eagle3, save_eagle3
from .eagle3.module import Eagle3Module
from .errors import ConfigError, UserError
from .export import drafter_kind, load_drafter, save_drafter
from .module import SPDModule

PROG = "python -m spd_lightning"
BASE_LINE = re.compile(r"#\s*base:\s*(\S+)\s*$")
WANDB_HOST = "api.wandb.ai"
DEFAULT_LOGGER = {
    "class_path": "lightning.pytorch.loggers.WandbLogger",
    "init_args": {"project": "spd-lightning", "save_dir": "runs"},
}


class CheckpointOnSigterm(ModelCheckpoint):
    """`ModelCheckpoint` that also saves (and updates last.ckpt) when SIGTERM stops the run: Lightning finishes
    the current step before it raises `SIGTERMException`, so the checkpoint lies on a step boundary and a resume
    loses no step. Other exceptions save only with `save_on_exception: true`."""

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException) and not self.save_on_exception:
            self.save_on_exception = True
            try:
                super().on_exception(trainer, pl_module, exception)
            finally:
                self.save_on_exception = False
        else:
            super().on_exception(trainer, pl_module, exception)


# `model.drafter` -> the LightningModule that trains it
DRAFTERS = {"pdm": SPDModule, EAGLE3: Eagle3Module}
# callbacks that decode with the PDM and so apply to `model.drafter: pdm` only
PDM_CALLBACKS = ("callbacks.StaircaseEvaluation", "callbacks.staircase.StaircaseEvaluation")


class SPDLightningCLI(LightningCLI):
    @staticmethod
    def subcommands() -> dict:
        base = LightningCLI.subcommands()
        return {name: base[name] for name in ("fit", "validate")}

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("model.target", "data.tokenizer")
        parser.add_lightning_class_args(CheckpointOnSigterm, "checkpoint")
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.dirpath": None})
        parser.add_argument(
            "--model.drafter",
            choices=list(DRAFTERS),
            default="pdm",
            help="the drafter to train: pdm (the Pipeline Draft Module of SPD) or eagle3 (the EAGLE-3 baseline); "
            "the other model.* options are those of the chosen drafter",
        )

    def instantiate_classes(self) -> None:
        """The drafter's module takes every `model.*` option but `drafter`, which chose the module itself."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        kind = config.model.pop("drafter")
        if DRAFTERS[kind] is not self.model_class:
            raise ConfigError(
                f"model.drafter={kind!r} was set where it cannot be read ahead of parsing: set it in a --config "
                f"file or as --model.drafter"
            )
        check_callbacks(kind, config.trainer.callbacks)
        try:
            super().instantiate_classes()
        finally:
            config.model["drafter"] = kind  # the saved config.yaml names it too

    def instantiate_trainer(self, **kwargs):
        trainer = super().instantiate_trainer(**kwargs)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # keep a user's or a strategy's own IO
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        return trainer


def check_callbacks(kind: str, callbacks) -> None:
    """One line for a callback that cannot work with this drafter (the staircase evaluation decodes a PDM)."""
    for callback in callbacks or []:
        class_path = str(getattr(callback, "class_path", f"{type(callback).__module__}.{type(callback).__name__}"))
        if kind != "pdm" and class_path in PDM_CALLBACKS:
            raise ConfigError(
                f"trainer.callbacks: {class_path} decodes with the PDM and does not apply to model.drafter={kind!r}: "
                f"remove it from the config's trainer.callbacks"
            )


def selected_drafter(args: Sequence[str]) -> str:
    """`model.drafter` as the parser will read it, ahead of parsing (it picks the module whose options the parser
    offers): the last value among the `--config` files (bases already expanded) and `--model.drafter` flags."""
    kind = "pdm"
    for i, arg in enumerate(args):
        value = arg.partition("=")[2] if arg.startswith(("--config=", "--model.drafter=")) else None
        following = args[i + 1] if i + 1 < len(args) else None
        if arg in ("-c", "--config") or arg.startswith("--config="):
            value = _drafter_in_config(value or following or "")
        elif arg == "--model.drafter":
            value = following
        if value is not None:
            kind = value
    if kind not in DRAFTERS:
        raise ConfigError(f"model.drafter={kind!r}: use one of {', '.join(DRAFTERS)}")
    return kind


def _drafter_in_config(path: str) -> str | None:
    try:
        with open(path) as f:
            config = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError):  # the parser reports a missing or broken file
        return None
    model = config.get("model") if isinstance(config, dict) else None
    return model.get("drafter") if isinstance(model, dict) else None


class LoggedConfigCallback(SaveConfigCallback):
    """Writes config.yaml next to the run (Lightning's default) and puts the resolved config into the
    logger's run config too, so a W&B run shows exactly what produced it."""

    def save_config(self, trainer, pl_module, stage: str) -> None:
        for logger in trainer.loggers:
            logger.log_hyperparams({"config": self.config.as_dict()})


def wandb_has_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(WANDB_HOST) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def default_wandb_offline() -> None:
    """W&B runs offline unless the user configured a key or chose a mode themselves."""
    if "WANDB_MODE" not in os.environ and not wandb_has_key():
        os.environ["WANDB_MODE"] = "offline"


def run_cli(args: Sequence[str]) -> SPDLightningCLI:
    """LightningCLI `fit` / `validate` over `args` (the command line without the program name)."""
    default_wandb_offline()
    args = with_base_configs(args)
    model_class = DRAFTERS[selected_drafter(args)]
    with warnings.catch_warnings():
        # main() parses the command line itself (to take --debug out of it without editing sys.argv) and hands
        # LightningCLI the rest; Lightning warns about `args` only to catch a script that also has a command line.
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        try:
            return SPDLightningCLI(
                model_class,
                ChatDataModule,
                args=args,
                seed_everything_default=0,
                auto_configure_optimizers=False,  # the module's configure_optimizers owns AdamW + the linear schedule
                trainer_defaults={"logger": DEFAULT_LOGGER, "max_epochs": 1},
                save_config_callback=LoggedConfigCallback,
                save_config_kwargs={"overwrite": True},
                parser_kwargs=parser_kwargs(),
            )
        except ArgumentError as e:  # a value the parser rejects (type, choice, unknown key, missing file)
            raise ConfigError(str(e)) from e


def with_base_configs(args: Sequence[str]) -> list[str]:
    """`--config FILE` whose first line is `# base: OTHER.yaml` (relative to FILE) becomes `--config OTHER --config
    FILE`: LightningCLI deep-merges stacked configs, later values winning, so a per-target file holds only what
    differs from the shared recipe and the user still names one file. A comment, not a key, because the parser
    would reject an unknown key; a base may itself name a base."""
    out: list[str] = []
    for i, arg in enumerate(args):
        path = args[i + 1] if arg in ("-c", "--config") and i + 1 < len(args) else None
        if arg.startswith("--config="):
            path = arg.partition("=")[2]
        for base in base_chain(path) if path else []:
            out += ["--config", base]
        out.append(arg)
    return out


def base_chain(path: str, seen: tuple[str, ...] = ()) -> list[str]:
    """The bases `path` stacks on, the deepest first."""
    try:
        with open(path) as f:
            match = BASE_LINE.match(f.readline())
    except OSError:  # a missing file (the parser reports it) or a YAML string given as --config
        return []
    if match is None:
        return []
    base = os.path.join(os.path.dirname(path), match.group(1))
    if os.path.abspath(base) in seen:
        raise ConfigError(f"config {path!r}: its `# base:` line makes a cycle through {base!r}")
    return base_chain(base, seen + (os.path.abspath(path),)) + [base]


def stacked_config(path: str) -> dict:
    """The YAML of `path` merged onto its bases, section by section, later values winning (what `fit` parses,
    before defaults and command-line overrides)."""

    def merge(base: dict, over: dict) -> dict:
        out = dict(base)
        for key, value in over.items():
            out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        return out

    cfg: dict = {}
    for file in [*base_chain(path), path]:
        try:
            with open(file) as f:
                cfg = merge(cfg, yaml.safe_load(f) or {})
        except OSError as e:
            raise ConfigError(f"cannot read config {file!r}: {e.strerror}; pass an existing YAML file") from e
    return cfg


def drafter_config(config: dict, kind: str) -> dict:
    """`config` (a stacked `fit` config) for the drafter `kind`: its `model` section keeps the options that
    drafter's module takes (the target, dtype and optimizer settings both share) and drops the others, and
    callbacks that need the PDM go. The same data, trainer and steps train either drafter."""
    if kind not in DRAFTERS:
        raise ConfigError(f"model.drafter={kind!r}: use one of {', '.join(DRAFTERS)}")
    options = set(inspect.signature(DRAFTERS[kind].__init__).parameters) - {"self"}
    model = {key: value for key, value in (config.get("model") or {}).items() if key in options}
    out = {**config, "model": {"drafter": kind, **model}}
    trainer = dict(config.get("trainer") or {})
    if kind != "pdm" and trainer.get("callbacks"):
        trainer["callbacks"] = [c for c in trainer["callbacks"] if c.get("class_path") not in PDM_CALLBACKS]
    return {**out, "trainer": trainer} if trainer else out


def parser_kwargs() -> dict:
    """The top-level parser: a bad value raises (one line in main) instead of usage text + exit; the help lists the
    extra subcommands."""
    extra = "\n".join(f"    {name:<20}{summary}" for name, (_, summary) in EXTRA_COMMANDS.items())
    return {
        "exit_on_error": False,
        "prog": PROG,
        "formatter_class": HelpWithRawEpilog,
        "description": "Train (fit), evaluate (validate) and export the Pipeline Draft Module of SPD.",
        "epilog": f"more subcommands (each with --help):\n{extra}",
    }


class HelpWithRawEpilog(DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """jsonargparse's help, with the epilog (the table of extra subcommands) printed as written."""


def export(args: Sequence[str]) -> str:
    """`export --ckpt PATH --out DIR`: writes the drafter directory that `inference/` loads, of the drafter kind
    the checkpoint records (PDM or EAGLE-3); returns its path."""
    parser = argparse.ArgumentParser(prog=f"{PROG} export", description=EXTRA_COMMANDS["export"][1])
    parser.add_argument("--ckpt", required=True, help="a Lightning .ckpt written by `fit` (or a drafter directory)")
    parser.add_argument("--out", required=True, help="output directory")
    opts = parser.parse_args(list(args))
    if drafter_kind(opts.ckpt) == EAGLE3:
        drafter, spec = load_eagle3(opts.ckpt)
        out = save_eagle3(drafter, spec, opts.out)
        shape = f"EAGLE-3, features {list(spec.drafter.feature_layers)}, V_d={spec.drafter.draft_vocab_size}"
    else:
        pdm, spec = load_drafter(opts.ckpt)
        out = save_drafter(pdm, spec, opts.out)
        shape = f"n={spec.geometry.n}, L_s={spec.pdm.num_layers}, V_d={spec.pdm.draft_vocab_size}"
    print(f"exported the drafter of {opts.ckpt} to {out} ({shape}, target {spec.target.name_or_path})")
    return out


def export_main(args: Sequence[str]) -> int:
    export(args)
    return 0


# Subcommands beside LightningCLI's fit/validate: name -> ("module:function", one-line summary). The function takes
# the arguments after the name and returns the exit code; it is imported only when its subcommand runs.
EXTRA_COMMANDS: dict[str, tuple[str, str]] = {
    "export": (
        "spd_lightning.cli:export_main",
        "write the drafter directory (config.json + model.safetensors) that inference/ loads",
    ),
    "prepare": ("spd_lightning.prepare:main", "tokenize a `fit` config's data and count its d2t, ahead of the job"),
    "estimate": ("spd_lightning.estimate:main", "per-GPU memory and FLOPs per token of a `fit` config"),
}


def dispatch(args: Sequence[str]) -> int:
    if not args:
        names = ", ".join(["fit", "validate", *EXTRA_COMMANDS])
        raise ConfigError(f"give a subcommand: one of {names} (`{PROG} --help` describes them)")
    if args[0] in EXTRA_COMMANDS:
        module, _, function = EXTRA_COMMANDS[args[0]][0].partition(":")
        return getattr(importlib.import_module(module), function)(args[1:])
    run_cli(args)
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    """Runs a subcommand and exits: 0 done, 2 a `UserError` (one line), 1 a bug (one line; the traceback with
    `--debug` or SPD_DEBUG=1), 143 stopped by SIGTERM after a saved step. DDP starts each rank with this process's
    command line, so every rank takes `--debug` out the same way."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("SPD_DEBUG") == "1"
    args = [a for a in args if a != "--debug"]
    try:
        code = dispatch(args)
    except SIGTERMException:  # a SystemExit without a code: it would exit 0 as if the run had finished
        fail(
            "stopped by SIGTERM after a complete step, saved as last.ckpt: resume with `--ckpt_path last`",
            128 + signal.SIGTERM,
        )
    except UserError as e:
        if debug:
            raise
        fail(f"{one_line(e)} (rerun with --debug for the traceback)", e.exit_code)
    except Exception as e:  # noqa: BLE001 - the last line of defence: any other exception is a bug
        if debug:
            raise
        fail(
            f"unexpected {type(e).__name__}: {one_line(e)} (a bug: rerun with --debug for the traceback and report it)",
            1,
        )
    sys.exit(code)


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def fail(message: str, code: int) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)
