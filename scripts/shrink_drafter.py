"""Store an exported drafter's floating-point weights in bfloat16 (half the file; loading casts them back into the
drafter's own dtype), so a committed drafter stays small.

    python scripts/shrink_drafter.py drafters/smollm2-135m
"""

from __future__ import annotations

import argparse
import os

import torch
from safetensors.torch import load_file, save_file


def shrink(directory: str, dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
    """Rewrite DIR/model.safetensors with its float tensors in `dtype` (atomically); returns (bytes before, after)."""
    path = os.path.join(directory, "model.safetensors")
    before = os.path.getsize(path)
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in load_file(path).items()}
    save_file(state, path + ".tmp", metadata={"format": "pt"})
    os.replace(path + ".tmp", path)
    return before, os.path.getsize(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="a drafter directory written by `python -m spd_lightning export`")
    args = parser.parse_args(argv)
    before, after = shrink(args.directory)
    print(f"{args.directory}/model.safetensors: {before / 2**20:.1f} MB -> {after / 2**20:.1f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
