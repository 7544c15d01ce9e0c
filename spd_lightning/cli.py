"""Command line: `python -m spd_lightning fit|validate --config configs/X.yaml` and `... export`.

`fit` and `validate` are LightningCLI over `SPDModule` + `ChatDataModule`; the data module's tokenizer is
linked to the model's target, so a config names the target once. Defaults every run gets:
- a `WandbLogger`, offline when no W&B key is configured (no WANDB_API_KEY and no netrc entry);
- a `ModelCheckpoint` under `checkpoint.*` that keeps `last.ckpt` (resume: `--ckpt_path .../last.ckpt` or
  `--ckpt_path last`), also written when SIGTERM stops the run;
- checkpoint files written atomically (`checkpoint_io.py`): a killed run never leaves a half-written one.
`export --ckpt PATH --out DIR` writes the drafter directory that `inference/` loads.

Bad settings (geometry, target path, vocabulary, data) end the run with one line on stderr and exit code 2;
`--debug` or `SPD_DEBUG=1` shows the traceback instead. SIGTERM ends `fit` after the current step with exit
code 143 (128 + SIGTERM), its checkpoint saved.
"""
from __future__ import annotations

import argparse
import netrc
import os
import signal
import sys
from typing import Optional, Sequence

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

from .checkpoint_io import AtomicCheckpointIO
from .data import ChatDataModule
from .export import load_drafter, save_drafter
from .module import SPDModule

WANDB_HOST = "api.wandb.ai"
DEFAULT_LOGGER = {"class_path": "lightning.pytorch.loggers.WandbLogger",
                  "init_args": {"project": "spd-lightning", "save_dir": "runs"}}


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


class SPDLightningCLI(LightningCLI):
    @staticmethod
    def subcommands() -> dict:
        base = LightningCLI.subcommands()
        return {name: base[name] for name in ("fit", "validate")}

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("model.target", "data.tokenizer")
        parser.add_lightning_class_args(CheckpointOnSigterm, "checkpoint")
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.dirpath": None})

    def instantiate_trainer(self, **kwargs):
        trainer = super().instantiate_trainer(**kwargs)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # keep a user's or a strategy's own IO
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        return trainer


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


def run_cli(args: Optional[Sequence[str]] = None) -> SPDLightningCLI:
    """LightningCLI over `args`, or over `sys.argv` when None (DDP relaunches each rank with sys.argv)."""
    default_wandb_offline()
    return SPDLightningCLI(
        SPDModule, ChatDataModule, args=None if args is None else list(args), seed_everything_default=0,
        auto_configure_optimizers=False,  # SPDModule.configure_optimizers owns AdamW + the linear schedule
        trainer_defaults={"logger": DEFAULT_LOGGER, "max_epochs": 1},
        save_config_callback=LoggedConfigCallback, save_config_kwargs={"overwrite": True},
        parser_kwargs={"exit_on_error": False},  # a bad value raises (one line below), not usage text + exit
    )


def export(args: Sequence[str]) -> str:
    parser = argparse.ArgumentParser(prog="python -m spd_lightning export",
                                     description="Write a drafter directory (config.json + model.safetensors).")
    parser.add_argument("--ckpt", required=True, help="a Lightning .ckpt written by `fit` (or a drafter directory)")
    parser.add_argument("--out", required=True, help="output directory")
    opts = parser.parse_args(list(args))
    pdm, spec = load_drafter(opts.ckpt)
    out = save_drafter(pdm, spec, opts.out)
    print(f"exported the drafter of {opts.ckpt} to {out} (n={spec.geometry.n}, L_s={spec.pdm.num_layers}, "
          f"V_d={spec.pdm.draft_vocab_size}, target {spec.target.name_or_path})")
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in args:
        os.environ["SPD_DEBUG"] = "1"  # inherited by the processes a DDP launch starts
        args = [a for a in args if a != "--debug"]
        if argv is None:
            sys.argv = sys.argv[:1] + args
    debug = os.environ.get("SPD_DEBUG") == "1"
    try:
        if args and args[0] == "export":
            export(args[1:])
        else:
            run_cli(None if argv is None else args)
    except SIGTERMException:  # a SystemExit without a code: it would exit 0 as if the run had finished
        print("error: stopped by SIGTERM after a complete step, saved as last.ckpt: resume with `--ckpt_path last`",
              file=sys.stderr)
        sys.exit(128 + signal.SIGTERM)
    except (ValueError, FileNotFoundError, argparse.ArgumentError) as e:  # project errors are ValueErrors
        if debug:
            raise
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"error: {message} (rerun with --debug for the traceback)", file=sys.stderr)
        sys.exit(2)
