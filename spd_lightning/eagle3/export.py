"""The EAGLE-3 drafter directory and loading it from there or from a Lightning `.ckpt` (docs/DESIGN.md, "Export", "The EAGLE-3 baseline").

    DIR/config.json        {"format_version": 1, "kind": "eagle3", "eagle3": Eagle3Config, "target": TargetInfo}
    DIR/model.safetensors  drafter weights, `d2t` included (target ids, not EAGLE's offsets); no embedding:
                           the drafter uses the target's frozen table

A checkpoint of `Eagle3Module` carries the same description under `ckpt["spd_drafter"]` (the PDM's key; the
`kind` field tells the two apart) and the weights under `state_dict["drafter.*"]`. Nothing here imports
Lightning, so `inference/` can load either. The PDM's format (spd_lightning/export.py) has no `kind`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from spd_lightning.errors import first_line

from ..export import CKPT_KEY, DrafterLoadError, check_same_target, load_weights, write_drafter_dir
from ..target import TargetInfo
from .model import Eagle3Config, Eagle3Drafter

FORMAT_VERSION = 1
KIND = "eagle3"
STATE_PREFIX = "drafter."


@dataclass
class Eagle3Spec:
    drafter: Eagle3Config
    target: TargetInfo

    def to_dict(self) -> dict:
        return {
            "format_version": FORMAT_VERSION,
            "kind": KIND,
            "eagle3": self.drafter.to_dict(),
            "target": self.target.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict, where: str) -> Eagle3Spec:
        if d.get("kind") != KIND:
            raise DrafterLoadError(
                f"{where} holds a {d.get('kind', 'pdm')!r} drafter, not an EAGLE-3 one: pass it "
                f"to the matching decoding mode"
            )
        if d.get("format_version") != FORMAT_VERSION:
            raise DrafterLoadError(
                f"{where} has EAGLE-3 format version {d.get('format_version')!r}, this build reads "
                f"version {FORMAT_VERSION}: re-export it"
            )
        try:
            return cls(Eagle3Config.from_dict(d["eagle3"]), TargetInfo(**d["target"]))
        except (KeyError, TypeError) as e:
            raise DrafterLoadError(
                f"{where} has an incomplete EAGLE-3 description ({e!r}): re-export the drafter"
            ) from e

    def check_target(self, target: TargetInfo) -> None:
        """One line when the loaded target is not the one the drafter was trained against."""
        check_same_target(self.target, target, "EAGLE-3 drafter")


def save_eagle3(drafter: Eagle3Drafter, spec: Eagle3Spec, out_dir: str) -> str:
    return write_drafter_dir(drafter.state_dict(), spec.to_dict(), out_dir)


def _build(spec: Eagle3Spec, state: dict, where: str) -> Eagle3Drafter:
    return load_weights(Eagle3Drafter(spec.drafter), state, where)


def _read_dir(path: str, map_location) -> tuple[Eagle3Spec, dict]:
    cfg_path, weights = os.path.join(path, "config.json"), os.path.join(path, "model.safetensors")
    if not (os.path.isfile(cfg_path) and os.path.isfile(weights)):
        raise DrafterLoadError(f"{path!r} is not a drafter directory: it needs config.json and model.safetensors")
    try:
        with open(cfg_path) as f:
            spec = Eagle3Spec.from_dict(json.load(f), cfg_path)
        return spec, load_file(weights, device=str(map_location))
    except (json.JSONDecodeError, SafetensorError, OSError) as e:
        raise DrafterLoadError(f"{path!r} is corrupt ({type(e).__name__}: {first_line(e)[:120]}); re-export it") from e


def _read_ckpt(path: str, map_location) -> tuple[Eagle3Spec, dict]:
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many types for a bad file; all mean the same to a user
        raise DrafterLoadError(
            f"cannot read checkpoint {path!r} ({type(e).__name__}: {first_line(e)[:120]}); "
            f"it is corrupt, truncated, or not a checkpoint"
        ) from e
    if not isinstance(ckpt, dict) or CKPT_KEY not in ckpt:
        raise DrafterLoadError(f"{path!r} is not an SPD-Lightning checkpoint (no {CKPT_KEY!r} entry)")
    spec = Eagle3Spec.from_dict(ckpt[CKPT_KEY], path)
    state = {k[len(STATE_PREFIX) :]: v for k, v in ckpt.get("state_dict", {}).items() if k.startswith(STATE_PREFIX)}
    return spec, state


def load_eagle3(path: str, map_location: str | torch.device = "cpu") -> tuple[Eagle3Drafter, Eagle3Spec]:
    """Load an exported EAGLE-3 directory or an `Eagle3Module` `.ckpt`."""
    if not os.path.exists(path):
        raise DrafterLoadError(f"drafter {path!r} does not exist: pass a Lightning .ckpt or an exported directory")
    spec, state = _read_dir(path, map_location) if os.path.isdir(path) else _read_ckpt(path, map_location)
    return _build(spec, state, path), spec
