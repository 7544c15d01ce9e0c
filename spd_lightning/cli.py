"""Command line: `python -m spd_lightning fit|validate --config configs/X.yaml` and `... export`.

`fit` and `validate` are LightningCLI over a drafter module + `ChatDataModule`; the data module's tokenizer is
linked to the model's target, so a config names the target once. The model is chosen by LightningCLI's own
`class_path` (subclass mode): `SPDModule` (the PDM, the default, so a config may give its options directly under
`model:`) or `Eagle3Module` (the EAGLE-3 baseline, docs/EAGLE3.md): `model: {class_path: Eagle3Module, init_args:
{...}}` in the YAML or `--model Eagle3Module` on the command line, which keeps the options both modules share and
drops the others. Several `--config` files stack, later values winning (LightningCLI's own merge); every shipped
config is complete on its own. Defaults every run gets:
- a `WandbLogger`, offline when no W&B key is configured (no WANDB_API_KEY and no netrc entry);
- a `ModelCheckpoint` under `checkpoint.*` that keeps `last.ckpt` (resume: `--ckpt_path .../last.ckpt` or
  `--ckpt_path last`), also written when SIGTERM or ctrl-C stops the run;
- checkpoint files written atomically (`checkpoint_io.py`): a killed run never leaves a half-written one; a write
  that fails (a full disk) ends every rank with its one line (`SPDTrainer`).
`export --ckpt PATH --out DIR` writes the drafter directory that `inference/` loads, for either kind (the
checkpoint records it).

Errors: a `UserError` (a bad setting: geometry, target path, vocabulary, data, a flag) ends the run with one
line on stderr and exit code 2; anything else is a bug: one line and exit code 1. `--debug` or `SPD_DEBUG=1`
shows the traceback instead (`spd_lightning.errors.run_main`, the policy of every CLI of the project). A setting
Lightning itself rejects (e.g. `trainer.val_check_interval` above the batches of an epoch) is bad input too. SIGTERM
ends `fit` after the current step with exit code 143 (128 + SIGTERM), its checkpoint saved; a first ctrl-C does the
same with exit code 130 (128 + SIGINT), a second stops at once (130, the last periodic checkpoint kept), and so does
one outside the training steps (loading, the run's end). More subcommands: one line in `EXTRA_COMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import netrc
import os
import re
import signal
import sys
import traceback
import warnings
from collections.abc import Sequence

import lightning as L
import torch
import yaml
from jsonargparse import ArgumentError, DefaultHelpFormatter
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from .data import ChatDataModule
from .eagle3.export import KIND as EAGLE3
from .eagle3.export import load_eagle3, save_eagle3
from .eagle3.module import Eagle3Module
from .environment.versions import TRAINING, require_supported
from .errors import (
    ConfigError,
    Stopped,
    UserError,
    debug_requested,
    one_line,
    run_main,
    writing,
)
from .export import drafter_kind, load_drafter, save_drafter
from .training.checkpoint_io import AtomicCheckpointIO
from .training.checkpoints import CheckpointOnStop, SPDTrainer, check_ckpt_path
from .training.module import SPDModule
from .training.stopping import STOP

PROG = "python -m spd_lightning"
WANDB_HOST = "api.wandb.ai"
DEFAULT_LOGGER = {
    "class_path": "lightning.pytorch.loggers.WandbLogger",
    "init_args": {"project": "spd-lightning", "save_dir": "runs"},
}


# The model's class when a config gives none: the PDM's module. Either drafter module can be named by its class.
DEFAULT_MODEL = f"{SPDModule.__module__}.{SPDModule.__name__}"
DRAFTER_MODULES = (SPDModule, Eagle3Module)
# callbacks that decode with the PDM and so apply to `SPDModule` only
PDM_CALLBACKS = ("callbacks.StaircaseEvaluation", "callbacks.staircase.StaircaseEvaluation")


class SPDLightningCLI(LightningCLI):
    """LightningCLI in subclass mode for the model (`class_path`), `SPDModule` by default; see the module docstring."""

    def __init__(self, args: Sequence[str], run: bool = True, **kwargs):
        with warnings.catch_warnings():
            # Our mains parse the command line themselves (`--debug`, `prepare`'s own options) and hand LightningCLI
            # the rest; Lightning warns about `args` only to catch a script that also has a command line.
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
            super().__init__(
                L.LightningModule,
                ChatDataModule,
                subclass_mode_model=True,
                args=list(args),
                run=run,
                seed_everything_default=0,
                auto_configure_optimizers=False,  # the module's configure_optimizers owns AdamW + the linear schedule
                trainer_class=SPDTrainer,
                **kwargs,
            )

    @staticmethod
    def subcommands() -> dict:
        base = LightningCLI.subcommands()
        return {name: base[name] for name in ("fit", "validate")}

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("model.init_args.target", "data.tokenizer")
        parser.link_arguments("model.init_args.trust_remote_code", "data.trust_remote_code")  # its tokenizer's code too
        parser.add_lightning_class_args(CheckpointOnStop, "checkpoint")
        parser.set_defaults(
            {"model": {"class_path": DEFAULT_MODEL}, "checkpoint.save_last": True, "checkpoint.dirpath": None}
        )

    def _parse_ckpt_path(self) -> None:
        """Lightning reads the hyperparameters saved in `ckpt_path` here, before anything is built: a path that does
        not exist or holds no readable checkpoint is one line now, not a bug report (or one after the data and the
        target have loaded)."""
        subcommand = self.config.get("subcommand")
        check_ckpt_path(self.config[subcommand].get("ckpt_path") if subcommand else None)
        given = self.config[subcommand].model.clone() if subcommand else None
        super()._parse_ckpt_path()
        if given is not None:
            warn_overridden(given, self.config[subcommand].model, self.config[subcommand].ckpt_path)

    def instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        check_model(config.model.class_path, config.trainer.callbacks)
        if config.trainer.use_distributed_sampler is False:  # the data module's sampler shards whatever it says
            raise ConfigError(
                "trainer.use_distributed_sampler: false would not change the training data's sharding: the data "
                "module's resumable sampler splits the samples over the ranks itself; drop the setting"
            )
        super().instantiate_classes()

    def instantiate_trainer(self, **kwargs):
        trainer = super().instantiate_trainer(**kwargs)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # keep a user's or a strategy's own IO
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        return trainer


def warn_overridden(given, restored, ckpt_path) -> None:
    """A resume takes the model's settings from the checkpoint (LightningCLI's rule): one warning naming each one the
    config or the command line gave otherwise, which the run does not use."""
    given, restored = given.as_dict(), restored.as_dict()
    if given.get("class_path") != restored.get("class_path"):
        differ = ["class_path"]
    else:
        mine, theirs = given.get("init_args") or {}, restored.get("init_args") or {}
        differ = [f"init_args.{k}" for k in sorted(set(mine) & set(theirs)) if mine[k] != theirs[k]]
    if differ:
        settings = ", ".join(
            f"model.{k.removeprefix('init_args.')}={setting_value(given, k)} (checkpoint: {setting_value(restored, k)})"
            for k in differ
        )
        rank_zero_warn(
            f"--ckpt_path {ckpt_path}: a resume keeps the model settings saved in the checkpoint, so these given here "
            f"are not used: {settings}; to train with them, start a new run from its weights: --model.init_from "
            f"{ckpt_path} without --ckpt_path"
        )


def setting_value(config: dict, dotted: str) -> str:
    for key in dotted.split("."):
        config = config[key]
    text = str(config)
    return text if len(text) <= 60 else f"{text[:57]}..."


def check_model(class_path: str, callbacks) -> None:
    """One line for a model class that does not train a drafter, or a callback that cannot work with it (the
    staircase evaluation decodes a PDM)."""
    module, _, name = class_path.rpartition(".")
    model_class = getattr(importlib.import_module(module), name)
    if not issubclass(model_class, DRAFTER_MODULES):
        names = " or ".join(c.__name__ for c in DRAFTER_MODULES)
        raise ConfigError(f"model.class_path={class_path!r} does not train a drafter: use {names}")
    for callback in callbacks or []:
        path = str(getattr(callback, "class_path", f"{type(callback).__module__}.{type(callback).__name__}"))
        if not issubclass(model_class, SPDModule) and path in PDM_CALLBACKS:
            raise ConfigError(
                f"trainer.callbacks: {path} decodes with the PDM and does not apply to {model_class.__name__}: "
                f"remove it from the config's trainer.callbacks"
            )


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
    try:
        return SPDLightningCLI(
            args,
            trainer_defaults={"logger": DEFAULT_LOGGER, "max_epochs": 1},
            save_config_callback=LoggedConfigCallback,
            save_config_kwargs={"overwrite": True},
            parser_kwargs=parser_kwargs(),
        )
    except ArgumentError as e:  # a value the parser rejects (type, choice, unknown key, missing file)
        raise ConfigError(parser_reason(e)) from e
    except (MisconfigurationException, ValueError) as e:
        cause = user_error_in(e)
        if cause is not None and cause is not e:  # jsonargparse wraps what a module's __init__ raised
            raise cause from e
        if cause is None and raised_by_lightning(e):
            raise ConfigError(f"a setting Lightning rejects: {one_line(e)}") from e
        raise


# In subclass mode `model` is a union of the class and None, so jsonargparse reports a bad init argument as the
# union's failure: both subtypes' reasons on one long line. The class's own reason is the one a user needs.
_CLASS_REASON = re.compile(
    r"Problem with given class_path '[^']*': Parser key \"([^\"]+)\": (.*?)(?: - Expected a <class 'NoneType'>|$)"
)


def parser_reason(error: ArgumentError) -> str:
    """The parser's message on one line; for a bad argument of the model class, that argument's reason alone."""
    text = one_line(error)
    match = _CLASS_REASON.search(text)
    return f"model.{match[1]}: {match[2]}" if match else text


def user_error_in(error: BaseException) -> UserError | None:
    """The first `UserError` along an exception's chain of causes (the error itself included)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, UserError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def raised_by_lightning(error: BaseException) -> bool:
    """Lightning itself raised it (its innermost frame is in Lightning's code): a trainer setting it rejects, not a
    bug of ours (a ValueError of ours raised inside a Lightning hook has its innermost frame in our code)."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and f"{os.sep}lightning{os.sep}" in frames[-1].filename


def read_config_file(path: str) -> dict:
    """One `fit` config file as written (no defaults, no command-line overrides); `model.init_args` (a config that
    names the model's class) is read as the model's options."""
    try:
        with open(path) as f:
            config = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"cannot read config {path!r}: {e.strerror}; pass an existing YAML file") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config {path!r} is not valid YAML: {one_line(e)}") from e
    model = config.get("model") or {}
    if isinstance(model, dict) and "init_args" in model:
        config["model"] = {"class_path": model.get("class_path"), **(model["init_args"] or {})}
    return config


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
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of the PDM's float weights in the file, a trained head included (bfloat16: half the bytes)",
    )
    opts = parser.parse_args(list(args))
    if drafter_kind(opts.ckpt) == EAGLE3:
        if opts.dtype != "float32":
            parser.error(f"--dtype {opts.dtype} applies to PDM drafters; {opts.ckpt} holds an EAGLE-3 drafter")
        drafter, spec = load_eagle3(opts.ckpt)
        with writing(opts.out, "the drafter", "choose another --out"):
            out = save_eagle3(drafter, spec, opts.out)
        shape = f"EAGLE-3, features {list(spec.drafter.feature_layers)}, V_d={spec.drafter.draft_vocab_size}"
    else:
        pdm, spec = load_drafter(opts.ckpt)
        with writing(opts.out, "the drafter", "choose another --out"):
            out = save_drafter(pdm, spec, opts.out, getattr(torch, opts.dtype))
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
    try:
        run_cli(args)
    except SIGTERMException:  # a SystemExit without a code: it would exit 0 as if the run had finished
        by, code = (
            ("ctrl-C", 128 + signal.SIGINT) if STOP.signal == signal.SIGINT else ("SIGTERM", 128 + signal.SIGTERM)
        )
        if args[0] == "validate":
            raise Stopped(f"stopped by {by} during validation: no result", code) from None
        raise Stopped(
            f"stopped by {by} after a complete step, saved as last.ckpt: resume with `--ckpt_path last`", code
        ) from None
    except KeyboardInterrupt:  # before Lightning's fit began, which has its own handling
        raise Stopped("interrupted by ctrl-C before training began: no step to save", 128 + signal.SIGINT) from None
    except SystemExit as e:
        if not isinstance(e.__context__, KeyboardInterrupt):  # not Lightning's end for a ctrl-C (`sys.exit(1)`)
            raise
        if STOP.presses >= 2:
            raise Stopped(
                "stopped at once by a second ctrl-C: resume from the last periodic checkpoint with `--ckpt_path last`",
                128 + signal.SIGINT,
            ) from e
        raise Stopped(  # while no step runs: loading, validation, the run's end
            "interrupted by ctrl-C outside a training step: the checkpoints saved before are kept", 128 + signal.SIGINT
        ) from e
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    """Runs a subcommand and exits: 0 done, 2 a `UserError` (one line), 1 a bug (one line; the traceback with
    `--debug` or SPD_DEBUG=1), 143 stopped by SIGTERM after a saved step, 130 by ctrl-C. DDP starts each rank with
    this process's command line, so every rank takes `--debug` out the same way."""
    require_supported(TRAINING)  # `python -m spd_lightning.prepare` etc. come here without __main__.py
    args = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested("--debug" in args)
    sys.exit(run_main(lambda: dispatch([a for a in args if a != "--debug"]), debug))
