"""Where a target comes from: every command that takes a target resolves it here to one local checkpoint directory.

A target is given as
- a Hugging Face checkpoint directory (config.json + safetensors): used as it is;
- a `.gguf` file, or a directory holding exactly one `.gguf` and no config.json: converted once into a
  safetensors directory in the target cache (`gguf_target.py`) and read from there afterwards;
- a hub id `org/name[@revision]`: the local Hugging Face cache first (offline when cached), else a download.

Training (`fit`, `validate`, `prepare`, `estimate`) and inference (`inference.decode`, `eval`, `serve`) all go
through `resolve_target`, so a GGUF works everywhere a directory does (docs/DESIGN.md, "Files").
"""

from __future__ import annotations

import glob
import os

from .errors import TargetError
from .gguf_target import converted_gguf

# What a causal-LM checkpoint needs from a hub snapshot (no other weight formats, no images)
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py", "*.tiktoken"]


def gguf_file_of(path: str) -> str | None:
    """The GGUF file `path` names: the path itself when it ends in .gguf, the one .gguf of a directory that
    has no config.json; None when `path` is not a GGUF target. Several .gguf files in one directory: an error."""
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise TargetError(f"GGUF target {path!r} does not exist: pass an existing .gguf file")
        return path
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    found = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(found) > 1:
        names = ", ".join(os.path.basename(f) for f in found)
        raise TargetError(f"directory {path!r} holds several GGUF files ({names}): pass --target FILE.gguf")
    return found[0] if found else None


def resolve_target(name_or_path: str) -> str:
    """The local checkpoint directory of a target given as a directory, a GGUF file or a hub id (module doc).
    Neither: a `TargetError` that says what to pass."""
    path = os.path.expanduser(name_or_path)
    gguf = gguf_file_of(path)
    if gguf is not None:
        return converted_gguf(gguf)
    if os.path.isdir(path):
        return path
    return _hub_snapshot(name_or_path)


def _hub_snapshot(name_or_path: str) -> str:
    repo_id, _, revision = name_or_path.partition("@")
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/", "~")) or not all(repo_id.split("/")):
        raise TargetError(
            f"target {name_or_path!r} is not a local directory nor a hub id (ORG/NAME) nor a .gguf file: pass "
            f"--target DIR (a Hugging Face checkpoint directory), --target FILE.gguf or --target ORG/NAME"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, revision=revision or None, local_files_only=True, allow_patterns=HUB_PATTERNS)
    except LocalEntryNotFoundError:  # not in the cache: try the hub below
        pass
    try:
        return snapshot_download(repo_id, revision=revision or None, allow_patterns=HUB_PATTERNS)
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, gated: all mean "cannot get it"
        raise TargetError(
            f"target {name_or_path!r} is not in the Hugging Face cache and cannot be downloaded "
            f"({type(e).__name__}); download it where the hub is reachable "
            f"(`hf download {repo_id}`) or pass --target DIR"
        ) from e


def main(argv: list[str] | None = None) -> int:
    """`python -m spd_lightning.target_source TARGET`: resolve (and for a GGUF, convert) a target now, as every
    command would on first use; prints its checkpoint directory."""
    import argparse
    import logging
    import sys

    parser = argparse.ArgumentParser(prog="python -m spd_lightning.target_source", description=main.__doc__)
    parser.add_argument("target", help="a checkpoint directory, a .gguf file (or a directory holding one), a hub id")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(resolve_target(args.target))
    except TargetError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
