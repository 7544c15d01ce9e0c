"""The target-state cache (docs/DESIGN.md, "The state cache"): what a drafter reads of the target, stored once.

`prepare --states DIR` (`spd_lightning/prepare_states.py`) runs the frozen target over the training and validation
samples of a data module and writes, per sample `i` of a split, into sharded safetensors files:

    DIR/manifest.json                 what the cache was built from (target, data, layers); `complete` last
    DIR/init.safetensors              `head` [V, H] (the target's output head) and `layer{l}.*` (the state dict
                                      of each target layer a PDM may be seeded from), in the target's dtype
    DIR/{train,val}-{k:05d}.safetensors   samples k*S .. (k+1)*S-1 of the split:
        {i}.input_ids   int32 [T]     the sample's tokens (checked against the data module's on every read)
        {i}.h{l}        dtype [T, H]  HF hidden state l (0 = embedding output, L = final-norm output), in the
                                      manifest's `dtype` (`prepare --states-dtype`, bfloat16 by default)
        {i}.teacher_top1 int32 [T]    the full-vocabulary argmax of the target's logits

The teacher is not stored as logits: `head[d2t](h{L})` IS the restricted teacher, the very product the online
training step computes (its head runs on the V_d rows only), so it is recomputed from `h{L}` by the same module:
H values per token instead of V_d (576 vs 2048 for SmolLM2, 4096 vs 32000 for a 9B target). Nothing in the cache
depends on the draft vocabulary: the head's `d2t` rows and `outside_vd` (the teacher's top-1 lies outside V_d) are
taken when it is read, so one cache serves every V_d (a V_d comparison, drafters of several sizes).

`StateCache` reads a complete cache memory-mapped (`safe_open`), checks it against the run (one line naming the
field that differs and the fix), and `CachedStates` / `StateCollator` add `states [B, T, A, H]`, `final_state
[B, T, H]` and `outside_vd [B, T]` to the batches of the data module.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence

import torch
from safetensors import SafetensorError, safe_open

from .formats import DataError

FORMAT_VERSION = 2  # 2: `teacher_top1` and the full head, where 1 stored one V_d's
MANIFEST = "manifest.json"
DEFAULT_STATES_DTYPE = "bfloat16"  # `prepare --states-dtype`'s default (tests/test_state_cache.py: the same loss)
INIT_FILE = "init.safetensors"
SPLITS = ("train", "val")


def shard_name(split: str, shard: int) -> str:
    return f"{split}-{shard:05d}.safetensors"


def target_fingerprint(directory: str) -> str:
    """Changes when the target's weights can have changed: each weight file's name, size and first 64 KiB (the
    safetensors header and the first tensors), so a retrained target in the same directory is not mistaken."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(directory)):
        if name.endswith((".safetensors", ".bin")):
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                digest.update(f"{name}:{os.path.getsize(path)}:".encode() + f.read(1 << 16))
    return digest.hexdigest()[:16]


def target_identity(name_or_path: str, trust_remote_code: bool = False) -> dict:
    """What the cache records of the target (without loading it): the weight fingerprint and `TargetInfo`'s
    fields from its config. `prepare --states` writes it, `fit --data.states` compares it."""
    from ..target import TargetInfo, load_hf_config, local_target

    config = load_hf_config(name_or_path, trust_remote_code)
    info = TargetInfo.from_config(getattr(config, "text_config", None) or config, name_or_path).to_dict()
    info.pop("name_or_path")  # a moved or renamed target is the same target
    return {"fingerprint": target_fingerprint(local_target(name_or_path)), **info}


def first_difference(expected: dict, found: dict, prefix: str = "") -> tuple[str, object, object] | None:
    """The first key (dotted path) whose value differs between two manifests' sections, with both values."""
    for key in sorted(set(expected) | set(found)):
        a, b = expected.get(key), found.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            inner = first_difference(a, b, f"{prefix}{key}.")
            if inner:
                return inner
        elif a != b:
            return f"{prefix}{key}", a, b
    return None


def check_same(directory: str, section: str, expected: dict, found: dict, fix: str) -> None:
    """One-line `DataError` naming the first field where the cache (`found`) and the run (`expected`) differ."""
    diff = first_difference(expected, found)
    if diff is not None:
        key, want, have = diff
        raise DataError(
            f"state cache {directory} does not match this run: {section}.{key} is {have!r} in the cache, {want!r} "
            f"here; {fix}"
        )


REBUILD = "prepare the cache again: `python -m spd_lightning prepare --config CFG --states NEW_DIR`"


def read_manifest(directory: str) -> dict | None:
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
    except ValueError as e:  # not JSON (a hand edit, a file cut short), not UTF-8
        raise DataError(f"state cache manifest {path} is not valid JSON ({e}); {REBUILD}") from e
    if not isinstance(manifest, dict):
        raise DataError(f"state cache manifest {path} holds a {type(manifest).__name__}, not an object; {REBUILD}")
    return manifest


def write_json_atomic(path: str, payload: dict) -> None:
    staging = f"{path}.{os.getpid()}.partial"
    with open(staging, "w") as f:
        json.dump(payload, f, indent=1, sort_keys=True)
    os.replace(staging, path)


class StateCache:
    """A complete state cache, read memory-mapped; `check_*` compare it with the run that reads it."""

    def __init__(self, directory: str):
        self.directory = os.path.abspath(os.path.expanduser(directory))
        manifest = read_manifest(self.directory)
        if manifest is None:
            raise DataError(
                f"--data.states {directory}: no {MANIFEST} there; build the cache with "
                f"`python -m spd_lightning prepare --config CFG --states {directory}`"
            )
        if manifest.get("format_version") != FORMAT_VERSION:
            raise DataError(
                f"state cache {directory} has format {manifest.get('format_version')}, this version reads "
                f"{FORMAT_VERSION}: prepare it again with `prepare --states`"
            )
        if not manifest.get("complete"):
            raise DataError(
                f"state cache {directory} is incomplete (an interrupted prepare): rerun the same "
                f"`prepare --config CFG --states {directory}` to finish it (finished shards are kept)"
            )
        self.manifest = manifest
        self.layers: tuple[int, ...] = tuple(manifest["layers"])
        self._handles: dict[str, object] = {}
        # every file read now, so a shard missing or cut short (an interrupted copy) is one line before the first
        # step, not an error the first time a batch reads it
        for name in (INIT_FILE, *(shard_name(s, k) for s in SPLITS for k in range(-(-self.size(s) // self.shard)))):
            self._open(name)

    @property
    def final_layer(self) -> int:
        return self.manifest["target"]["num_layers"]

    @property
    def vocab_size(self) -> int:
        """The target head's rows (its logits' width, which `teacher_top1` indexes)."""
        return self._open(INIT_FILE).get_slice("head").get_shape()[0]

    def size(self, split: str) -> int:
        return self.manifest["splits"][split]

    @property
    def shard(self) -> int:
        """Samples per shard file."""
        return self.manifest["shard_size"]

    def check_data(self, data: dict) -> None:
        fix = "prepare a cache for this data with `prepare --config CFG --states NEW_DIR`, or fit with the data config that prepared it"
        check_same(self.directory, "data", data, self.manifest["data"], fix)

    def check_target(self, target: dict) -> None:
        fix = "prepare a cache for this target with `prepare --config CFG --states NEW_DIR`"
        check_same(self.directory, "target", target, self.manifest["target"], fix)

    def check_target_dtype(self, dtype: torch.dtype) -> None:
        """The states were computed by the target in `dtype`, as this run's would be (a bf16 cache under a float32
        run trains on other numbers, silently)."""
        found = self.manifest["target_dtype"]
        if found != str(dtype).removeprefix("torch."):
            raise DataError(
                f"state cache {self.directory} holds the target's states in {found}, this run's target_dtype is "
                f"{str(dtype).removeprefix('torch.')}: fit with model.target_dtype {found}, or prepare a cache for it"
            )

    def check_layers(self, layers: Sequence[int], what: str) -> None:
        missing = sorted(set(layers) - set(self.layers))
        if missing:
            raise DataError(
                f"state cache {self.directory} holds hidden states {list(self.layers)}, {what} also needs {missing}: "
                f"prepare it with `prepare --config CFG --states NEW_DIR --states-configs` naming every config it serves"
            )

    # -- reading ----------------------------------------------------------------------------------
    def _open(self, name: str):
        if name not in self._handles:
            path = os.path.join(self.directory, name)
            try:
                self._handles[name] = safe_open(path, framework="pt")
            except (OSError, SafetensorError) as e:  # missing, or cut short (its header names more bytes)
                reason = "no such file" if isinstance(e, FileNotFoundError) else getattr(e, "strerror", None) or str(e)
                raise DataError(f"state cache file {path} cannot be read ({reason}); {REBUILD}") from e
        return self._handles[name]

    def __getstate__(self) -> dict:  # DataLoader workers open their own memory maps
        return {**self.__dict__, "_handles": {}}

    def sample(self, split: str, index: int, layers: Sequence[int], in_vd: torch.Tensor) -> dict[str, torch.Tensor]:
        """Sample `index` of `split`: its token ids, the hidden states at `layers` `[T, A, H]`, the final-norm
        state `[T, H]` and `outside_vd` `[T]` for the draft vocabulary whose membership `in_vd` `[V]` marks."""
        shard = self._open(shard_name(split, index // self.shard))
        return {
            "input_ids": shard.get_tensor(f"{index}.input_ids"),
            "states": torch.stack([shard.get_tensor(f"{index}.h{layer}") for layer in layers], dim=1),
            "final_state": shard.get_tensor(f"{index}.h{self.final_layer}"),
            "outside_vd": ~in_vd[shard.get_tensor(f"{index}.teacher_top1").long()],
        }

    def head_rows(self, d2t: torch.Tensor) -> torch.Tensor:
        """`[V_d, H]` on the host: the target head's rows of the draft vocabulary `d2t` (the teacher's head, the PDM
        head's seed). `d2t` may be on any device: the teacher's head is built after the PDM (its `d2t`) moved to the
        GPU, while the cached head is read into host memory."""
        index = torch.as_tensor(d2t, dtype=torch.long, device="cpu")
        return self._open(INIT_FILE).get_tensor("head").index_select(0, index)

    def layer_state(self, layer: int) -> dict[str, torch.Tensor]:
        """The state dict of target decoder layer `layer` (0-based), stored for `init_layers_from`."""
        if layer not in self.manifest["init_layers"]:
            raise DataError(
                f"state cache {self.directory} stores target layers {self.manifest['init_layers']} for "
                f"init_layers_from, not {layer}: prepare it with the config that seeds from it (`--states-configs`)"
            )
        init = self._open(INIT_FILE)
        prefix = f"layer{layer}."
        return {key[len(prefix) :]: init.get_tensor(key) for key in init.keys() if key.startswith(prefix)}


class CachedStates(torch.utils.data.Dataset):
    """A split of the data module with the cached states of each sample added (memory-mapped reads), `outside_vd`
    for the draft vocabulary `d2t`."""

    def __init__(self, samples, cache: StateCache, split: str, layers: Sequence[int], d2t: torch.Tensor):
        if len(samples) != cache.size(split):
            raise DataError(
                f"state cache {cache.directory} holds {cache.size(split)} {split} samples, the data module has "
                f"{len(samples)}: prepare the cache again for this data (`prepare --states NEW_DIR`)"
            )
        self.samples, self.cache, self.split, self.layers = samples, cache, split, tuple(layers)
        self.in_vd = torch.zeros(cache.vocab_size, dtype=torch.bool)
        self.in_vd[torch.as_tensor(d2t, dtype=torch.long)] = True

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        sample = dict(self.samples[int(index)])
        cached = self.cache.sample(self.split, int(index), self.layers, self.in_vd)
        if cached.pop("input_ids").tolist() != list(sample["input_ids"]):
            raise DataError(
                f"state cache {self.cache.directory}: {self.split} sample {index} holds other tokens than the data "
                f"module's (the data changed since `prepare --states`): prepare the cache again"
            )
        return {**sample, **cached}


class StateCollator:
    """The data module's collator, plus the cached tensors right-padded with zeros to the batch width (padding
    carries no loss and no query attends to it, so its value never matters)."""

    KEYS = ("states", "final_state", "outside_vd")

    def __init__(self, collate):
        self.collate = collate

    def __call__(self, samples: Sequence[dict]) -> dict[str, torch.Tensor]:
        batch = self.collate([{k: v for k, v in s.items() if k not in self.KEYS} for s in samples])
        width = batch["input_ids"].shape[1]
        for key in self.KEYS:
            first = samples[0][key]
            out = torch.zeros((len(samples), width, *first.shape[1:]), dtype=first.dtype)
            for row, sample in enumerate(samples):
                out[row, : sample[key].shape[0]] = sample[key]
            batch[key] = out
        return batch
