"""The lowest releases SPD-Lightning supports, checked when an entry point starts (docs/DESIGN.md, "Supported
versions").

pyproject.toml declares the same floors; this check exists for the environments pip never resolved (an image
that ships its own torch and transformers, an install with `--no-deps`): there an older release would fail deep
inside a decode step, or worse, run without its cache (a decoder layer that does not know our cache keyword
swallows it). The code itself adapts by feature (inference/runtime/hf_compat.py); this check reads only the
installed distributions' versions, because a release below the floor may not even import (transformers checks
its own dependency pins at import). It ends the command with one `error:` line naming the release found and
the one needed.

Standard library only, and no import of the packages it checks: it runs before anything else of ours.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
import sys
from dataclasses import dataclass

INFERENCE = ("torch", "transformers")
TRAINING = ("torch", "transformers", "lightning", "datasets")


@dataclass(frozen=True)
class Floor:
    minimum: str
    why: str  # what needs it, in a few words


FLOORS = {
    "torch": Floor("2.7", "torch._dynamo's recompile_limit settings"),
    "transformers": Floor("5.15", "the linear-attention cache API the decoder drives"),
    "lightning": Floor("2.6.6", "the training CLI"),
    "datasets": Floor("3.0", "the tokenized-data cache"),
}


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: `2.13.0+cpu` -> (2, 13, 0), `5.0.0rc1` -> (5, 0, 0)."""
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def unsupported(package: str) -> str | None:
    """Why the installed `package` is below its floor (one line), or None when it is supported."""
    floor = FLOORS[package]
    fix = f"pip install '{package}>={floor.minimum}'"
    try:
        found = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return f"{package} is not installed; SPD-Lightning needs {package} >= {floor.minimum}: {fix}"
    if release(found) >= release(floor.minimum):
        return None
    return f"{package} {found} is installed; SPD-Lightning needs {package} >= {floor.minimum} ({floor.why}): {fix}"


@functools.cache
def require_supported(packages: tuple[str, ...]) -> None:
    """End the process with one `error:` line (exit code 2) when one of `packages` is older than supported."""
    for package in packages:
        problem = unsupported(package)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            raise SystemExit(2)
