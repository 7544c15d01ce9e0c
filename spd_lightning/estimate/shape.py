"""What the estimate reads: a `fit` config's training shape (`Shape`, `read_config`), the target's architecture, and the
PDM `fit` would build from them (`pdm_config`)."""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

from ..errors import UserError
from ..geometry import Geometry

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


class EstimateError(UserError):
    """A config the estimate cannot read; one line that says why."""


def target_config(name_or_path: str, trust_remote_code: bool = False):
    """The target's text config: a local directory or the hub cache as `fit` reads it, except that a shipped
    architecture (`archs/<name>.json`) answers for a hub name without touching the network."""
    from ..archs import arch_config, arch_for_hub_id
    from ..target import load_hf_config, looks_local

    arch = None if looks_local(name_or_path) or os.path.isdir(name_or_path) else arch_for_hub_id(name_or_path)
    config = arch_config(arch) if arch else load_hf_config(name_or_path, trust_remote_code)
    return getattr(config, "text_config", None) or config


@dataclass
class Shape:
    """What the memory depends on, read from a `fit` config (or given directly by tests)."""

    batch: int
    length: int
    draft_vocab: int
    precision: str  # "bf16-mixed" or "32"
    strategy: str  # "ddp" or "fsdp"
    target_dtype: str
    checkpointing: bool
    backend: str  # attention backend: "flex" (GPU) or "dense" (CPU)
    module_args: dict
    accelerator: str = "gpu"  # "cpu": no CUDA/NCCL context
    devices: int | None = None  # `trainer.devices` when the config names a count
    states_dtype: str | None = None  # the state cache's dtype when fit reads one (`data.states`): no target loaded


def _defaults(cls) -> dict:
    return {
        k: p.default
        for k, p in inspect.signature(cls.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def read_config(path: str) -> Shape:
    from ..cli import read_config_file
    from ..data import ChatDataModule
    from ..training.module import SPDModule

    cfg = read_config_file(path)
    model = cfg.get("model") or {}
    class_path = model.pop("class_path", None) or SPDModule.__name__
    if class_path.rsplit(".", 1)[-1] != SPDModule.__name__:  # its PDM shape would be SPDModule's defaults
        raise EstimateError(f"config {path!r} trains {class_path}: estimate covers the PDM (SPDModule) only")
    model = {**_defaults(SPDModule), **model}
    if "target" not in model:
        raise EstimateError(f"config {path!r} has no model.target: name the target model")
    data = {**_defaults(ChatDataModule), **(cfg.get("data") or {})}  # fit's defaults where the config is silent
    trainer = cfg.get("trainer") or {}
    strategy = trainer.get("strategy", "ddp")
    strategy = strategy.get("class_path", "ddp") if isinstance(strategy, dict) else str(strategy)
    backend = model.get("attention_backend", "auto")
    return Shape(
        batch=int(data["batch_size"]),
        length=int(data["max_length"]),
        draft_vocab=int(data["draft_vocab_size"]),
        precision=str(trainer.get("precision", "32")),
        strategy="fsdp" if "fsdp" in strategy.lower() else "ddp",
        target_dtype=str(model["target_dtype"]),
        checkpointing=bool(model.get("activation_checkpointing")),
        backend="dense" if backend == "dense" else "flex",
        module_args=model,
        accelerator="cpu" if str(trainer.get("accelerator", "gpu")) == "cpu" else "gpu",
        devices=_device_count(trainer.get("devices")),
        states_dtype=_states_dtype(data.get("states")),
    )


def _states_dtype(directory: str | None) -> str | None:
    """The dtype of the cache at `directory` (its manifest's; `prepare --states-dtype`'s default before it is
    built), None without one."""
    from ..data.states import DEFAULT_STATES_DTYPE, read_manifest

    if not directory:
        return None
    manifest = read_manifest(directory) if os.path.isdir(directory) else None
    return str((manifest or {}).get("dtype", DEFAULT_STATES_DTYPE))


def _device_count(devices) -> int | None:
    """`trainer.devices` as a count (a list of indices, a number); None when the config leaves it to the node
    (`-1`, `auto`, absent)."""
    if isinstance(devices, list):
        return len(devices)
    if isinstance(devices, str) and devices.isdigit():
        devices = int(devices)
    return devices if isinstance(devices, int) and devices > 0 else None


def pdm_config(shape: Shape, tcfg):
    from ..pdm import PDMConfig, block_shape

    m = shape.module_args
    geometry = Geometry.build(tcfg.num_hidden_layers, m["n"], m["split"], m["anchors"], m["schedule"], m["features"])
    block = (m.get(k) for k in ("num_heads", "num_kv_heads", "head_dim", "intermediate_size"))
    cfg = PDMConfig(
        target_hidden_size=tcfg.hidden_size,
        num_types=geometry.num_types,
        draft_vocab_size=shape.draft_vocab,
        hidden_size=m.get("hidden_size") or tcfg.hidden_size,
        num_layers=m["num_layers"],
        head_from_target=bool(m.get("head_from_target")),
        **block_shape(tcfg, *block),
    )
    return cfg, geometry
