"""Checkpoint files that are complete or absent: never a half-written `last.ckpt`.

Lightning's `TorchCheckpointIO` writes through an fsspec transaction whose temporary file lies in the system
temp dir (`tempfile.gettempdir()`), then *moves* it into place. That is a rename only when the temp dir and the
checkpoint directory are on the same filesystem; otherwise (`/tmp` on tmpfs or a local disk, checkpoints on
NFS/Lustre/another volume) `shutil.move` copies into the destination, and a kill during the copy leaves a
truncated checkpoint. Nothing is fsynced either. It also stages the whole checkpoint in the temp dir, which a
small `/tmp` may not hold.

Two guards both drafters' modules call keep a good checkpoint from being lost: a diverged run stops at its next
save instead of replacing the checkpoints before it (`check_weights_finite`), and a resume into a drafter of
another shape is one line, not a size mismatch inside `load_state_dict` (`check_resumed_shape`).

`AtomicCheckpointIO` writes local checkpoints to a temporary file in the checkpoint's own directory, fsyncs it,
renames it over the destination and fsyncs the directory; a write that fails (a full disk) is one line naming the
path, the reason and the free space, the checkpoint there before untouched. Remote paths (s3://, gs://, ...) keep
Lightning's write. The temporary name ends in `.tmp`, so Lightning's `ckpt_path="last"` never picks one a kill left
behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from typing import Any

import lightning as L
import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import nn

from ..errors import ConfigError, first_line


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = os.path.abspath(os.fspath(path))
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = f"{path}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
        try:
            with open(tmp, "xb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as e:
            free = shutil.disk_usage(directory).free if isinstance(e, (OSError, RuntimeError)) else None
            with contextlib.suppress(OSError):
                os.remove(tmp)
            if free is None:
                raise
            # A full disk reaches us as torch's RuntimeError "[enforce fail at inline_container.cc] unexpected pos".
            raise ConfigError(
                f"cannot write checkpoint {path!r} ({type(e).__name__}: {first_line(e)[:120]}; {free / 2**20:.1f} "
                f"MiB free on its disk): the checkpoints written before are kept; free space or set "
                f"checkpoint.dirpath, then resume with --ckpt_path last"
            ) from e
        with contextlib.suppress(OSError):  # make the rename itself durable (not possible on every filesystem)
            fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def check_weights_finite(module: L.LightningModule, drafter: nn.Module, name: str) -> None:
    """Before a save: a diverged run (a NaN or inf loss reached the weights) must not replace the checkpoints saved
    before it (`last.ckpt`, the kept step checkpoint). One device read per save; every rank checks its own weights
    (its shard under FSDP) and the decision is reduced over the ranks, so they all stop together. `name`: the
    drafter's, for the message."""
    diverged = not bool(torch.stack([torch.isfinite(p).all() for p in drafter.parameters()]).all())
    trainer = module._trainer
    if trainer is not None:
        diverged = trainer.strategy.reduce_boolean_decision(diverged, all=False)
    if diverged:
        step = trainer.global_step if trainer is not None else "?"
        raise ConfigError(
            f"training diverged by step {step}: the {name}'s weights are not finite (NaN or inf), so this checkpoint "
            f"is not saved and the ones before it are kept; start again from the last one with a lower model.lr "
            f"(--model.init_from CKPT) or a gradient_clip_val"
        )


def check_resumed_shape(built: dict, saved: dict) -> None:
    """One line when a checkpoint's drafter (`saved`, its config as a dict) is not the shape this run built
    (`built`). LightningCLI takes the model's settings from the checkpoint, but `V_d` comes from the data
    (`data.draft_vocab_size`, the sources), and loading the weights would fail on a size mismatch."""
    for field, value in saved.items():
        if built.get(field) != value:
            raise ConfigError(
                f"the checkpoint's drafter has {field}={value}, this run builds {field}={built.get(field)} (from its "
                f"data and target): resume with the data settings the run was trained with, or start a new run "
                f"from the checkpoint with --model.init_from CKPT"
            )
