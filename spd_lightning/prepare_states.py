"""`prepare --config CFG --states DIR`: run the target once over the data and store what drafters read.

The format is `spd_lightning/data/states.py`'s. Which hidden states: the union, over the config and every
`--states-configs` file, of the geometry's anchors, plus `L` (the final-norm state the teacher head reads) and any
`--states-layers`; which target layers for `init_layers_from`: the union of theirs. Every config must describe the
same data (one cache serves one sample set, and every draft vocabulary over it).

- Resumable: each shard is written to a private file and renamed into place, so a shard that exists is complete
  and a rerun of the same command keeps it; `manifest.json` (written first, `complete: false`) records the plan, and
  a rerun whose plan differs (another target, data, layer set, dtype, shard size) stops with one line.
- Idempotent: a complete cache that matches says so and does nothing (the target is not even loaded).
- The target runs in the config's `target_dtype`; the hidden states are stored in `--states-dtype` (default
  bfloat16: half of float32's bytes, and the loss it gives equals float32's to 1e-3 relative on the tiny target,
  tests/test_state_cache.py; float16 is refused where a state overflows it). `init.safetensors` (the head and
  the seed layers, small) keeps the target's dtype: the teacher's head and the seeds are exact.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .data import ChatDataModule
from .data.states import (
    DEFAULT_STATES_DTYPE,
    FORMAT_VERSION,
    INIT_FILE,
    MANIFEST,
    SPLITS,
    check_same,
    read_manifest,
    shard_name,
    target_identity,
    write_json_atomic,
)
from .errors import ConfigError
from .geometry import Geometry
from .target import Target, load_hf_config, resolve_dtype

log = logging.getLogger(__name__)


def states_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--states", metavar="DIR", help="write the target-state cache that `fit --data.states` reads")
    parser.add_argument("--states-configs", nargs="+", default=[], metavar="CFG", help="more fit configs it serves")
    parser.add_argument("--states-layers", nargs="+", type=int, default=[], help="more HF hidden-state indices")
    parser.add_argument(
        "--states-dtype",
        default=DEFAULT_STATES_DTYPE,
        help="dtype of the stored hidden states (bfloat16, float16, float32)",
    )
    parser.add_argument("--states-shard-size", type=int, default=256, help="samples per safetensors shard")
    parser.add_argument("--states-batch-size", type=int, default=None, help="samples per target forward")
    return parser


@dataclass(frozen=True)
class Needs:
    """What one `fit` config reads of the target: hidden states and the layers its PDM is seeded from."""

    target: str
    target_dtype: str
    trust_remote_code: bool
    layers: frozenset[int]
    init_layers: frozenset[int]


def config_needs(model: dict) -> Needs:
    """The hidden states (anchors + L) and init layers of a config's `SPDModule` options (`model.init_args`)."""
    config = load_hf_config(model["target"], model.get("trust_remote_code", False))
    L = (getattr(config, "text_config", None) or config).num_hidden_layers
    keys = ("split", "anchors", "schedule", "features")
    geometry = Geometry.build(L, model.get("n", 8), **{k: model[k] for k in keys if model.get(k) is not None})
    init = [int(b) for b in model.get("init_layers_from") or []]
    if any(not 0 <= b < L for b in init):
        raise ConfigError(f"init_layers_from={init}: target layers go from 0 to {L - 1}")
    return Needs(
        model["target"],
        model.get("target_dtype", "bfloat16"),
        model.get("trust_remote_code", False),
        frozenset([*geometry.anchors, L]),
        frozenset(init),
    )


def plan_manifest(data: ChatDataModule, needs: Needs, options: argparse.Namespace) -> dict:
    """The manifest this run writes (complete: false until every shard exists)."""
    if options.states_shard_size < 1:
        raise ConfigError(f"--states-shard-size={options.states_shard_size}: use a positive number of samples")
    if options.states_batch_size is not None and options.states_batch_size < 1:
        raise ConfigError(
            f"--states-batch-size={options.states_batch_size}: use a positive number of samples per target forward "
            f"(default: data.batch_size)"
        )
    dtype = options.states_dtype
    resolve_dtype(dtype)  # a one-line error for an unknown name, before anything runs
    target = target_identity(needs.target, needs.trust_remote_code)
    bad = sorted(b for b in needs.layers if not 0 <= b <= target["num_layers"])
    if bad:
        raise ConfigError(f"--states-layers {bad}: hidden-state indices go from 0 to L={target['num_layers']}")
    return {
        "format_version": FORMAT_VERSION,
        "complete": False,
        "target": target,
        "target_dtype": str(resolve_dtype(needs.target_dtype)).removeprefix("torch."),
        "dtype": str(resolve_dtype(dtype)).removeprefix("torch."),
        "data": data.data_identity(),
        "splits": {"train": len(data.train_dataset), "val": len(data.val_dataset)},
        "layers": sorted(needs.layers),
        "init_layers": sorted(needs.init_layers),
        "shard_size": options.states_shard_size,
    }


def start(directory: str, plan: dict) -> bool:
    """Write the plan, or check it against a previous run's; returns whether the cache is already complete."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:  # a file, a path under one: the --states the user gave
        raise ConfigError(
            f"cannot write the state cache {directory!r}: {e.strerror or e}; pass another --states DIR"
        ) from e
    found = read_manifest(directory)
    if found is None:
        write_json_atomic(os.path.join(directory, MANIFEST), plan)
        return False
    fix = "rerun with the settings that started it, or pass another --states DIR"
    check_same(directory, "manifest", {**plan, "complete": None}, {**found, "complete": None}, fix)
    return bool(found["complete"])


class StateWriter:
    """Runs the target over the samples of a split, shard by shard, skipping the shards already written."""

    def __init__(self, directory: str, data: ChatDataModule, needs: Needs, manifest: dict, batch_size: int):
        self.directory, self.data, self.needs, self.manifest = directory, data, needs, manifest
        self.batch_size = batch_size
        self.dtype = resolve_dtype(manifest["dtype"])
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self._target: Target | None = None

    @property
    def target(self) -> Target:
        if self._target is None:  # loaded only when something is left to compute
            self._target = Target.load(
                self.needs.target, self.needs.target_dtype, self.device, self.needs.trust_remote_code
            )
        return self._target

    def missing(self, split: str) -> list[int]:
        size, shard = self.manifest["splits"][split], self.manifest["shard_size"]
        shards = range(-(-size // shard))
        return [k for k in shards if not os.path.isfile(os.path.join(self.directory, shard_name(split, k)))]

    def write_init(self) -> None:
        """`init.safetensors`: the target's head and the state dict of every target layer a config seeds from."""
        path = os.path.join(self.directory, INIT_FILE)
        if os.path.isfile(path):
            return
        tensors = {"head": self.target.lm_head.weight.detach()}
        for layer in self.manifest["init_layers"]:
            state = self.target.layers[layer].state_dict()
            tensors.update({f"layer{layer}.{name}": t for name, t in state.items()})
        save_atomic(tensors, path)  # in the target's dtype: the teacher's head and the seeds stay exact

    def write_shard(self, split: str, shard: int, samples, bar: tqdm) -> None:
        size = self.manifest["shard_size"]
        first, stop = shard * size, min((shard + 1) * size, self.manifest["splits"][split])
        # The shard's samples by length, so that a batch pads to little more than its own lengths (in index order a
        # batch of 4 regenerated SmolLM2 chats pads 23 % of its positions, sorted 1 %); each keeps its own name.
        lengths = [len(ids) for ids in samples[first:stop]["input_ids"]]
        order = sorted(range(first, stop), key=lambda i: lengths[i - first])
        tensors: dict[str, torch.Tensor] = {}
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            tensors.update(self._run([samples[i] for i in batch], batch))
            bar.update(len(batch))
        save_atomic(tensors, os.path.join(self.directory, shard_name(split, shard)))

    @torch.no_grad()
    def _run(self, samples: list[dict], indices: list[int]) -> dict[str, torch.Tensor]:
        """One target forward over a right-padded batch; each sample's real positions, by name."""
        batch = self.data.collate(samples)
        ids, mask = batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device)
        layers = self.manifest["layers"]
        states, logits = self.target.anchor_states(ids, mask, layers)
        teacher_top1 = logits.argmax(-1).to(torch.int32).cpu()
        out = {}
        for row, index in enumerate(indices):
            T = int(mask[row].sum())
            out[f"{index}.input_ids"] = batch["input_ids"][row, :T].to(torch.int32)
            out[f"{index}.teacher_top1"] = teacher_top1[row, :T]
            for a, layer in enumerate(layers):
                out[f"{index}.h{layer}"] = states[row, :T, a].to(self.dtype).cpu()
        if self.dtype == torch.float16 and not all(t.isfinite().all() for k, t in out.items() if ".h" in k):
            raise ConfigError(
                "--states-dtype float16: a hidden state of the target overflows float16 (max 65504): use bfloat16"
            )
        return out


def save_atomic(tensors: dict[str, torch.Tensor], path: str) -> None:
    """A shard is complete iff its file exists: written under a private name, then renamed into place."""
    staging = f"{path}.{os.getpid()}.partial"
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, staging)
    os.replace(staging, path)


def write_states(data: ChatDataModule, needs: Needs, options: argparse.Namespace) -> str:
    """Build (or finish) the cache in `options.states`; returns what was done, in one line."""
    directory = os.path.abspath(os.path.expanduser(options.states))
    manifest = plan_manifest(data, needs, options)
    if start(directory, manifest):
        return f"state cache {directory} is complete, nothing to do"
    writer = StateWriter(directory, data, needs, manifest, options.states_batch_size or data.batch_size)
    splits = {"train": data.train_dataset, "val": data.val_dataset}
    todo = {split: writer.missing(split) for split in SPLITS}
    size = manifest["shard_size"]
    total = sum(min(size, manifest["splits"][s] - k * size) for s in SPLITS for k in todo[s])
    kept = sum(-(-manifest["splits"][s] // size) - len(todo[s]) for s in SPLITS)
    log.info("state cache %s: %d shards kept, %d samples to run through the target", directory, kept, total)
    writer.write_init()
    with tqdm(total=total, desc="Target states", unit="sample") as bar:
        for split in SPLITS:
            samples = splits[split].select_columns(["input_ids", "loss_mask"])
            for shard in todo[split]:
                writer.write_shard(split, shard, samples, bar)
    write_json_atomic(os.path.join(directory, MANIFEST), {**manifest, "complete": True})
    return (
        f"state cache {directory}: hidden states {manifest['layers']} of {sum(manifest['splits'].values()):,} "
        f"samples ({manifest['dtype']}), {kept} shards kept"
    )


def union_needs(needs: Sequence[Needs], extra_layers: Sequence[int]) -> Needs:
    """One cache for several configs of one target: the union of what they read."""
    first = needs[0]
    for other in needs[1:]:
        for field in ("target", "target_dtype", "trust_remote_code"):  # one target, run one way
            if getattr(other, field) != getattr(first, field):
                raise ConfigError(
                    f"--states-configs: a config has {field}={getattr(other, field)!r}, the first "
                    f"{getattr(first, field)!r}; a state cache serves one target run one way"
                )
    layers = frozenset().union(*(n.layers for n in needs), extra_layers)
    init = frozenset().union(*(n.init_layers for n in needs))
    return Needs(first.target, first.target_dtype, first.trust_remote_code, layers, init)
