"""The drafter directory (docs/DESIGN.md, "Export") and loading a drafter from it or from a Lightning `.ckpt`.

    DIR/config.json        {"format_version", "pdm": PDMConfig, "geometry": Geometry, "target": TargetInfo}
    DIR/model.safetensors  PDM weights, `d2t` included (the head too, unless the PDM reads the target's own:
                           `head_from_target`, whose loader takes the target's LM head rows of `d2t`); `export
                           --dtype bfloat16` stores the float weights, a trained head included, in bfloat16
                           (half the bytes), and every loader casts them back

A committed drafter is a plain git file of at most 20 MiB (tests/test_committed_drafter.py): what a clone fetches
without LFS, and the budget that V_d, a trained head and its dtype are chosen within.

A Lightning checkpoint carries the same description under `ckpt["spd_drafter"]` and the weights under
`state_dict["pdm.*"]`, so `inference/` loads either without importing Lightning. Checkpoints are read
with `torch.load(weights_only=True)`: loading a drafter never runs pickled code.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .errors import UserError, first_line
from .geometry import Geometry
from .pdm import PDMConfig, PipelineDraftModule
from .target import TargetInfo

FORMAT_VERSION = 1
CKPT_KEY = "spd_drafter"
PDM_KIND = "pdm"  # the `kind` of a description without one (the PDM's format predates the field)
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


def check_same_target(trained: TargetInfo, loaded: TargetInfo, kind: str) -> None:
    """One line when the `loaded` target is not the `trained` one that a drafter of `kind` was trained against."""
    for field, want, got in (
        ("number of layers L", trained.num_layers, loaded.num_layers),
        ("hidden size", trained.hidden_size, loaded.hidden_size),
        ("vocabulary size", trained.vocab_size, loaded.vocab_size),
    ):
        if want != got:
            raise DrafterLoadError(
                f"drafter/target mismatch: the {kind} was trained on {trained.name_or_path!r} with "
                f"{field} {want}, the loaded target {loaded.name_or_path!r} has {got}; "
                f"pass the matching --target or retrain the drafter"
            )


class DrafterLoadError(UserError):
    """A drafter that cannot be loaded, or does not match its target; one line that says what to do."""


@dataclass
class DrafterSpec:
    pdm: PDMConfig
    geometry: Geometry
    target: TargetInfo

    def to_dict(self) -> dict:
        return {
            "format_version": FORMAT_VERSION,
            "pdm": self.pdm.to_dict(),
            "geometry": self.geometry.to_dict(),
            "target": self.target.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict, where: str) -> DrafterSpec:
        kind = d.get("kind", PDM_KIND)
        if kind != PDM_KIND:
            raise DrafterLoadError(
                f"{where} holds a {kind!r} drafter, not a PDM (SPD) one: decode it with `--mode {kind}`"
            )
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise DrafterLoadError(
                f"{where} has drafter format version {version!r}, this build reads version "
                f"{FORMAT_VERSION}: re-export it with this version (`python -m spd_lightning export`)"
            )
        try:
            return cls(PDMConfig.from_dict(d["pdm"]), Geometry.from_dict(d["geometry"]), TargetInfo(**d["target"]))
        except (KeyError, TypeError) as e:
            raise DrafterLoadError(
                f"{where} has an incomplete drafter description ({e!r}): re-export the drafter"
            ) from e

    def check_target(self, target: TargetInfo) -> None:
        """Fail with one line when the loaded target is not the one this drafter was trained against."""
        check_same_target(self.target, target, "drafter")
        self.geometry.check_target(target.num_layers)


def save_drafter(pdm: PipelineDraftModule, spec: DrafterSpec, out_dir: str, dtype: torch.dtype | None = None) -> str:
    """The drafter directory of `pdm`. `dtype`: store its floating-point weights (a trained head included) in this
    dtype: bfloat16 halves the file, and every loader casts them back to the PDM's dtype (`load_state_dict`)."""
    state = pdm.stored_state_dict()
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    return write_drafter_dir(state, spec.to_dict(), out_dir)


def write_drafter_dir(weights: dict[str, torch.Tensor], description: dict, out_dir: str) -> str:
    """`config.json` (the description) + `model.safetensors` (the weights, written atomically) in `out_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in weights.items()}
    tmp = os.path.join(out_dir, WEIGHTS_FILE + ".tmp")
    save_file(state, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(out_dir, WEIGHTS_FILE))  # never leave a half-written file
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(description, f, indent=2)
    return out_dir


def load_weights(module: torch.nn.Module, state: dict, where: str) -> torch.nn.Module:
    """`module` (built from its config) with the stored `state`, in eval mode; one line when they disagree."""
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise DrafterLoadError(
            f"{where}: weights do not match the drafter config "
            f"({first_line(e)}); the file is corrupt or from another build"
        ) from e
    return module.eval()


def _build(spec: DrafterSpec, state: dict, where: str, target_head: torch.Tensor | None) -> PipelineDraftModule:
    if spec.pdm.head_from_target and "lm_head.weight" not in state:
        if target_head is None:
            raise DrafterLoadError(
                f"{where} reads its head from the target's LM head (head_from_target): load it with the target's "
                f"head, load_drafter(path, target_head=target.lm_head.weight)"
            )
        if "d2t" not in state:
            raise DrafterLoadError(
                f"{where} has no d2t tensor: the file is corrupt or from another build; re-export it"
            )
        state = {**state, "lm_head.weight": target_head.detach().index_select(0, state["d2t"].to(target_head.device))}
    return load_weights(PipelineDraftModule(spec.pdm), state, where)


def _check_exists(path: str) -> None:
    """One message per missing piece: the path itself, or a file of a drafter directory."""
    if not os.path.exists(path):
        raise DrafterLoadError(
            f"drafter {path!r} does not exist: pass a Lightning .ckpt or a directory written by "
            f"`python -m spd_lightning export`"
        )
    if os.path.isdir(path):
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            if not os.path.isfile(os.path.join(path, name)):
                raise DrafterLoadError(
                    f"{path!r} is not a drafter directory: it has no {name} (an exported drafter "
                    f"holds {CONFIG_FILE} and {WEIGHTS_FILE})"
                )


def _read_directory(path: str, map_location: str, keys: tuple[str, ...] | None) -> tuple[DrafterSpec, dict]:
    cfg_path = os.path.join(path, CONFIG_FILE)
    with open(cfg_path) as f:
        spec = DrafterSpec.from_dict(json.load(f), cfg_path)
    with safe_open(os.path.join(path, WEIGHTS_FILE), framework="pt", device=map_location) as f:
        return spec, {k: f.get_tensor(k) for k in (keys or f.keys())}


def _read_checkpoint(path: str, map_location: str, keys: tuple[str, ...] | None) -> tuple[DrafterSpec, dict]:
    ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=keys is not None)
    if not isinstance(ckpt, dict) or CKPT_KEY not in ckpt:
        raise DrafterLoadError(f"{path!r} is not an SPD-Lightning checkpoint (no {CKPT_KEY!r} entry)")
    spec = DrafterSpec.from_dict(ckpt[CKPT_KEY], path)
    state = {k[len("pdm.") :]: v for k, v in ckpt.get("state_dict", {}).items() if k.startswith("pdm.")}
    return spec, state if keys is None else {k: state[k] for k in keys}


def read_drafter(
    path: str, map_location: str | torch.device = "cpu", keys: tuple[str, ...] | None = None
) -> tuple[DrafterSpec, dict[str, torch.Tensor]]:
    """The drafter's description and its PDM weights (only `keys` of them when given) from an exported
    directory or a Lightning `.ckpt`; the one reader of both formats, with one message per failure."""
    _check_exists(path)
    read = _read_directory if os.path.isdir(path) else _read_checkpoint
    try:
        return read(path, str(map_location), keys)
    except DrafterLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - torch and safetensors raise many types for a bad file; all mean one thing
        raise DrafterLoadError(
            f"drafter {path!r} is corrupt, truncated or incomplete ({type(e).__name__}: "
            f"{first_line(e)[:120]}); re-export it"
        ) from e


def drafter_kind(path: str) -> str:
    """The drafter kind an exported directory or a `.ckpt` holds: its description's `kind`, `pdm` when absent."""
    _check_exists(path)
    try:
        if os.path.isdir(path):
            with open(os.path.join(path, CONFIG_FILE)) as f:
                description = json.load(f)
        else:
            description = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get(CKPT_KEY)
    except Exception as e:  # noqa: BLE001 - as in read_drafter: every failure to read means one thing
        raise DrafterLoadError(
            f"drafter {path!r} is corrupt, truncated or incomplete ({type(e).__name__}); re-export it"
        ) from e
    if not isinstance(description, dict):
        raise DrafterLoadError(f"{path!r} is not an SPD-Lightning checkpoint (no {CKPT_KEY!r} entry)")
    return description.get("kind", PDM_KIND)


def read_drafter_spec(path: str) -> tuple[DrafterSpec, torch.Tensor]:
    """The drafter's description and `d2t`, without loading its other weights (what the stage ranks need)."""
    spec, state = read_drafter(path, keys=("d2t",))
    return spec, state["d2t"]


def load_drafter(
    path: str, map_location: str | torch.device = "cpu", target_head: torch.Tensor | None = None
) -> tuple[PipelineDraftModule, DrafterSpec]:
    """Load an exported drafter directory or a Lightning `.ckpt` of the PDM. `target_head`: the target's LM-head
    weight `[vocab, H]`, which a `head_from_target` drafter directory needs (its rows of `d2t` are its head)."""
    spec, state = read_drafter(path, map_location)
    return _build(spec, state, path, target_head), spec


def seed_from_drafter(pdm: PipelineDraftModule, path: str) -> tuple[list[str], list[str]]:
    """Warm start: copy into `pdm` every weight of the drafter at `path` whose name and shape agree. A head row is
    a token, so when `pdm` trains its own head the rows are matched by target id through both `d2t`s: the tokens
    both vocabularies hold keep the source's row, the others keep `pdm`'s initialisation (grown or re-counted
    data changes `d2t`). Returns (copied, skipped) names; a head of which only some rows were copied is named
    `lm_head.weight[K/V_d rows]`."""
    _, state = read_drafter(path)
    copied, skipped = [], []
    for name, tensor in pdm.state_dict().items():
        if name == "lm_head.weight":
            rows = 0 if pdm.cfg.head_from_target or name not in state else _copy_shared_rows(pdm, state)
            if not rows:
                skipped.append(name)
            else:
                copied.append(name if rows == len(pdm.d2t) else f"{name}[{rows}/{len(pdm.d2t)} rows]")
        elif name in state and state[name].shape == tensor.shape and name != "d2t":
            with torch.no_grad():
                tensor.copy_(state[name].to(tensor))
            copied.append(name)
        else:
            skipped.append(name)
    return copied, skipped


def _copy_shared_rows(pdm: PipelineDraftModule, state: dict[str, torch.Tensor]) -> int:
    """Copy the source head's rows of the target tokens both `d2t`s hold into `pdm`'s head; returns how many."""
    source_head, source_d2t = state["lm_head.weight"], state["d2t"].cpu().long()
    if source_head.shape[1] != pdm.lm_head.weight.shape[1]:
        return 0
    row_of = torch.full((int(max(source_d2t.max(), pdm.d2t.max())) + 1,), -1, dtype=torch.long)
    row_of[source_d2t] = torch.arange(len(source_d2t))
    source_rows = row_of[pdm.d2t.cpu().long()]
    shared = (source_rows >= 0).nonzero().squeeze(1)
    with torch.no_grad():
        pdm.lm_head.weight[shared] = source_head[source_rows[shared]].to(pdm.lm_head.weight)
    return len(shared)
