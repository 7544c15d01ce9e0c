"""Checkpoint files that are complete or absent: never a half-written `last.ckpt`.

Lightning's `TorchCheckpointIO` writes through an fsspec transaction whose temporary file lies in the system
temp dir (`tempfile.gettempdir()`), then *moves* it into place. That is a rename only when the temp dir and the
checkpoint directory are on the same filesystem; otherwise (`/tmp` on tmpfs or a local disk, checkpoints on
NFS/Lustre/another volume) `shutil.move` copies into the destination, and a kill during the copy leaves a
truncated checkpoint. Nothing is fsynced either. It also stages the whole checkpoint in the temp dir, which a
small `/tmp` may not hold.

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

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO

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
