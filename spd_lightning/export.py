"""The drafter directory (SPEC 4.6) and loading a drafter from it or from a Lightning `.ckpt`.

    DIR/config.json        {"format_version", "pdm": PDMConfig, "geometry": Geometry, "target": TargetInfo}
    DIR/model.safetensors  PDM weights, `d2t` included

A Lightning checkpoint carries the same description under `ckpt["spd_drafter"]` and the weights under
`state_dict["pdm.*"]`, so `inference/` loads either without importing Lightning. Checkpoints are read
with `torch.load(weights_only=True)`: loading a drafter never runs pickled code.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .geometry import Geometry
from .pdm import PDMConfig, PipelineDraftModule
from .target import TargetInfo
from .errors import UserError

FORMAT_VERSION = 1
CKPT_KEY = "spd_drafter"


class DrafterLoadError(UserError):
    """A drafter that cannot be loaded, or does not match its target; one line that says what to do."""


@dataclass
class DrafterSpec:
    pdm: PDMConfig
    geometry: Geometry
    target: TargetInfo

    def to_dict(self) -> dict:
        return {"format_version": FORMAT_VERSION, "pdm": self.pdm.to_dict(), "geometry": self.geometry.to_dict(),
                "target": self.target.to_dict()}

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "DrafterSpec":
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise DrafterLoadError(f"{where} has drafter format version {version!r}, this build reads version "
                                   f"{FORMAT_VERSION}: re-export it with this version (`python -m spd_lightning export`)")
        try:
            return cls(PDMConfig.from_dict(d["pdm"]), Geometry.from_dict(d["geometry"]), TargetInfo(**d["target"]))
        except (KeyError, TypeError) as e:
            raise DrafterLoadError(f"{where} has an incomplete drafter description ({e!r}): re-export the drafter") from e

    def check_target(self, target: TargetInfo) -> None:
        """Fail with one line when the loaded target is not the one this drafter was trained against."""
        mine = self.target
        for field, want, got in (("number of layers L", mine.num_layers, target.num_layers),
                                 ("hidden size", mine.hidden_size, target.hidden_size),
                                 ("vocabulary size", mine.vocab_size, target.vocab_size)):
            if want != got:
                raise DrafterLoadError(f"drafter/target mismatch: the drafter was trained on {mine.name_or_path!r} with "
                                       f"{field} {want}, the loaded target {target.name_or_path!r} has {got}; "
                                       f"pass the matching --target or retrain the drafter")
        self.geometry.check_target(target.num_layers)


def save_drafter(pdm: PipelineDraftModule, spec: DrafterSpec, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in pdm.state_dict().items()}
    tmp = os.path.join(out_dir, "model.safetensors.tmp")
    save_file(state, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(out_dir, "model.safetensors"))  # never leave a half-written file
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(spec.to_dict(), f, indent=2)
    return out_dir


def _build(spec: DrafterSpec, state: dict, where: str) -> PipelineDraftModule:
    pdm = PipelineDraftModule(spec.pdm)
    try:
        pdm.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise DrafterLoadError(f"{where}: weights do not match the drafter config "
                               f"({str(e).splitlines()[0]}); the file is corrupt or from another build") from e
    return pdm.eval()


def load_drafter(path: str, map_location: str | torch.device = "cpu") -> tuple[PipelineDraftModule, DrafterSpec]:
    """Load an exported drafter directory or a Lightning `.ckpt` of the PDM."""
    if not os.path.exists(path):
        raise DrafterLoadError(f"drafter {path!r} does not exist: pass a Lightning .ckpt or a directory written by "
                               f"`python -m spd_lightning export`")
    if os.path.isdir(path):
        cfg_path, weights = os.path.join(path, "config.json"), os.path.join(path, "model.safetensors")
        if not (os.path.isfile(cfg_path) and os.path.isfile(weights)):
            raise DrafterLoadError(f"{path!r} is not a drafter directory: it needs config.json and model.safetensors")
        try:
            with open(cfg_path) as f:
                spec = DrafterSpec.from_dict(json.load(f), cfg_path)
            state = load_file(weights, device=str(map_location))
        except (json.JSONDecodeError, SafetensorError, OSError) as e:
            raise DrafterLoadError(f"{path!r} is corrupt ({type(e).__name__}: {str(e).splitlines()[0][:120]}); re-export it") from e
        return _build(spec, state, path), spec
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many types for a bad file; all mean the same to a user
        raise DrafterLoadError(f"cannot read checkpoint {path!r} ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
                               f"it is corrupt, truncated, or not a checkpoint") from e
    if not isinstance(ckpt, dict) or CKPT_KEY not in ckpt:
        raise DrafterLoadError(f"{path!r} is not an SPD-Lightning checkpoint (no {CKPT_KEY!r} entry)")
    spec = DrafterSpec.from_dict(ckpt[CKPT_KEY], path)
    state = {k[len("pdm."):]: v for k, v in ckpt.get("state_dict", {}).items() if k.startswith("pdm.")}
    return _build(spec, state, path), spec
