"""A run's checkpoints: saved when a signal stops the run (`CheckpointOnStop`), a failed write that ends every rank
together (`SPDTrainer`), a checkpoint directory made before the first step, and a `--ckpt_path` checked before
anything loads (docs/DESIGN.md, "Loss, optimizer, checkpoints"). How the bytes reach the disk is checkpoint_io.py's.
"""

from __future__ import annotations

import os

import lightning as L
import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ..errors import ConfigError, UserError, first_line, one_line
from ..export import CONFIG_FILE
from .stopping import STOP

SHARDED_METADATA = "meta.pt"  # what marks a directory as Lightning's sharded (FSDP) checkpoint


class CheckpointOnStop(ModelCheckpoint):
    """`ModelCheckpoint` that also saves (and updates last.ckpt) when SIGTERM or a first ctrl-C stops the run
    (`training/stopping.py`): Lightning finishes the current step before it raises `SIGTERMException`, so the
    checkpoint lies on a step boundary and a resume loses no step. Other exceptions save only with
    `save_on_exception: true`."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit":
            check_checkpoint_dir(trainer, self.dirpath)

    def on_sanity_check_start(self, trainer, pl_module) -> None:
        super().on_sanity_check_start(trainer, pl_module)
        STOP.install(trainer)  # Lightning's handlers are installed already: its SIGTERM one would break DDP here too

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        # not in `setup`: Lightning installs its own handlers after it, noting the ones it finds to put them back
        STOP.install(trainer)  # a run without a sanity check; after one, installed already

    # `validate` has no step to save, but its ranks too must stop together: they agree after every batch
    def on_validation_start(self, trainer, pl_module) -> None:
        super().on_validation_start(trainer, pl_module)
        if trainer.state.fn == TrainerFn.VALIDATING:
            STOP.install(trainer)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        super().on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)
        if trainer.state.fn == TrainerFn.VALIDATING:
            STOP.after_step()

    def on_validation_end(self, trainer, pl_module) -> None:
        super().on_validation_end(trainer, pl_module)
        if trainer.state.fn == TrainerFn.VALIDATING:
            STOP.uninstall()

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        STOP.uninstall()  # not in `teardown`: Lightning puts back the handlers it found before it calls that

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        STOP.after_step()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        try:
            if isinstance(exception, SIGTERMException) and not self.save_on_exception:
                self.save_on_exception = True
                try:
                    super().on_exception(trainer, pl_module, exception)
                finally:
                    self.save_on_exception = False
            else:
                super().on_exception(trainer, pl_module, exception)
        finally:
            STOP.uninstall()  # Lightning calls no `teardown` hook after an exception


class SPDTrainer(L.Trainer):
    """Lightning's `Trainer`, whose checkpoint write that fails (`AtomicCheckpointIO`'s one line) ends every rank."""

    def save_checkpoint(self, filepath, weights_only: bool | None = None, storage_options=None) -> None:
        """Rank 0 writes the checkpoint while the other ranks wait in Lightning's barrier after the write: a write
        that failed there (a full disk) raised on rank 0 alone and left the others in that barrier until rank 0's
        process was gone (gloo: 'unexpected RuntimeError: Connection closed by peer' on each, a bug report; NCCL: a
        hang until the process group's timeout). Now rank 0 joins the barrier anyway and every rank raises the line."""
        failed = None
        try:
            super().save_checkpoint(filepath, weights_only, storage_options)
        except UserError as e:
            if self.world_size == 1:
                raise
            failed = e
            self.strategy.barrier("Trainer.save_checkpoint")  # where the ranks whose part succeeded wait
        if self.world_size > 1:
            reason = self.strategy.broadcast(None if failed is None else one_line(failed))
            if failed is not None:
                raise failed
            if reason is not None:
                raise ConfigError(reason)


def check_checkpoint_dir(trainer, dirpath) -> None:
    """Before the first step, the checkpoint directory is made: a file there, or a path under one, would fail at the
    first save, `every_n_train_steps` into the run. Rank 0 writes the checkpoints and makes it; every rank learns
    whether it could, so they stop together."""
    reason = None
    if trainer.is_global_zero and dirpath and isinstance(get_filesystem(dirpath), LocalFileSystem):
        try:
            os.makedirs(dirpath, exist_ok=True)
        except OSError as e:
            reason = e.strerror or str(e)
    reason = trainer.strategy.broadcast(reason)
    if reason is not None:
        raise ConfigError(f"checkpoint.dirpath {dirpath!r} cannot be made: {reason}; pass another directory")


def check_ckpt_path(path) -> None:
    """One line for a local `--ckpt_path` that `fit` / `validate` cannot resume from: a missing path, a directory
    that is no sharded checkpoint (an exported drafter, a run's root), a file `torch.load` cannot read (truncated,
    corrupt, another format). Lightning's names (`last`, `best`, `hpc`, `registry:...`) and remote paths are its own."""
    if path is None or str(path) in ("last", "best", "hpc") or str(path).startswith("registry"):
        return
    if not isinstance(get_filesystem(path), LocalFileSystem):
        return
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ConfigError(
            f"ckpt_path {path!r} does not exist: pass a .ckpt that `fit` wrote (e.g. CHECKPOINT_DIR/last.ckpt), or "
            f"`--ckpt_path last` for the newest last.ckpt in checkpoint.dirpath"
        )
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, SHARDED_METADATA)):
            return  # a sharded (FSDP) checkpoint: Lightning reads the directory
        if os.path.isfile(os.path.join(path, CONFIG_FILE)):
            raise ConfigError(
                f"ckpt_path {path!r} is an exported drafter, which holds no optimizer or data position: resume from "
                f"the run's .ckpt, or warm-start a new run from it with --model.init_from {path}"
            )
        raise ConfigError(f"ckpt_path {path!r} is a directory: pass a checkpoint file in it (e.g. last.ckpt)")
    try:
        torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - torch raises many types for a bad file (OSError, RuntimeError, ...)
        raise ConfigError(
            f"ckpt_path {path!r} is not a readable checkpoint: truncated, corrupt or another format "
            f"({type(e).__name__}: {first_line(e)[:120]}); resume from another checkpoint of the run"
        ) from e
