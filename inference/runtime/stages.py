"""Pipeline stages built from the target by layer range (docs/DESIGN.md, "Terms", "Processes", "Pitfalls we avoid").

Stage `s` runs the HF decoder layers `e_{s-1}+1 .. e_s` (global indices `e_{s-1} .. e_s - 1`) directly,
with the target's rotary embedding and its own `StageCache`; stage 1 also owns the embedding, stage `n`
the final norm and the LM head. A stage returns the anchor states it produces (HF hidden-state indices:
`l < L` is the residual after layer `l`, `L` the final-norm output) so the PDM rank can read them.

Two ways to get the pieces: from an in-memory `Target` (the simulator, tests; no copy), or from a
checkpoint directory, loading ONLY the tensors of the requested pieces (a distributed rank never holds
another rank's layers): the model is built on the meta device, the pieces are materialized, and their
tensors are read one by one from the safetensors files.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from torch import nn

from inference.runtime.cache import StageCache
from inference.runtime.capture import CompiledStep
from inference.runtime.hf_compat import cache_kwargs, rotary_positions
from spd_lightning.errors import first_line
from spd_lightning.geometry import Geometry
from spd_lightning.target import Target, TargetError, resolve_dtype
from spd_lightning.target_source import resolve_target

# Checkpoint key prefixes of the text model: causal-LM checkpoints use `model.`, the Qwen3.5
# conditional-generation checkpoints `model.language_model.`.
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")


@dataclass
class TargetPieces:
    """The parts of a target one process needs; absent pieces are None, `layers` maps global index -> layer."""

    config: object  # the text config
    layers: dict[int, nn.Module]
    rotary_emb: nn.Module
    embed_tokens: nn.Module | None = None
    norm: nn.Module | None = None
    lm_head: nn.Module | None = None

    @classmethod
    def from_target(cls, target: Target, layers: range, embed: bool, head: bool) -> TargetPieces:
        return cls(
            target.config,
            {i: target.layers[i] for i in layers},
            target.rotary_emb,
            target.embed_tokens if embed else None,
            target.norm if head else None,
            target.lm_head if head else None,
        )


def meta_target(path: str, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False) -> Target:
    """The target's module tree on the meta device: shapes and names, no weights, no memory. `path` is a
    directory or a hub id (`resolve_target`); the Target's name is the resolved directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve_target(path)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise TargetError(f"cannot read the target config in {path!r}: {first_line(e)[:160]}") from e
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    return Target(model, path)


def _checkpoint_index(path: str) -> dict[str, tuple[str, str]]:
    """Normalized tensor name -> (file, name in file), over every safetensors shard of the checkpoint."""
    from safetensors import safe_open

    index_file = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_file):
        with open(index_file) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise TargetError(
            f"{path!r} has no model.safetensors (or index): the pipeline decoder loads safetensors checkpoints only"
        )
    index = {}
    for name in files:
        with safe_open(os.path.join(path, name), framework="pt") as f:
            for key in f.keys():
                index[_normalize(key)] = (os.path.join(path, name), key)
    return index


def _normalize(key: str) -> str:
    for prefix in TEXT_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def _copy_tensors(path: str, wanted: dict[str, nn.Module], tied: bool, device) -> None:
    """Fill the parameters and buffers of `wanted` (checkpoint prefix -> module on the meta device) from the
    checkpoint's safetensors files, reading only those tensors, straight onto `device`."""
    from safetensors import safe_open

    index = _checkpoint_index(path)
    by_file: dict[str, list[tuple[str, str, nn.Module]]] = {}
    for prefix, module in wanted.items():
        module.to_empty(device=device)
        for name, _ in list(module.named_parameters()) + list(module.named_buffers()):
            key = f"{prefix}.{name}"
            if key not in index and key == "lm_head.weight" and tied:
                key = "embed_tokens.weight"
            if key not in index:
                raise TargetError(
                    f"checkpoint {path!r} has no tensor for {prefix}.{name}: it is incomplete or not this architecture"
                )
            file, stored = index[key]
            by_file.setdefault(file, []).append((stored, name, module))
    with torch.no_grad():
        for file, entries in by_file.items():
            with safe_open(file, framework="pt", device=str(device)) as f:
                for stored, name, module in entries:
                    owner_name, _, leaf = name.rpartition(".")
                    owner = module.get_submodule(owner_name) if owner_name else module
                    getattr(owner, leaf).copy_(f.get_tensor(stored))


def load_pieces(
    path: str,
    layers: range,
    embed: bool,
    head: bool,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
) -> TargetPieces:
    """Materialize only the requested pieces of the checkpoint at `path` on `device`."""
    dtype = resolve_dtype(dtype)
    path = resolve_target(path)
    skeleton = meta_target(path, dtype, trust_remote_code)
    wanted: dict[str, nn.Module] = {f"layers.{i}": skeleton.layers[i] for i in layers}
    if embed:
        wanted["embed_tokens"] = skeleton.embed_tokens
    if head:
        wanted["norm"] = skeleton.norm
        wanted["lm_head"] = skeleton.lm_head
    _copy_tensors(path, wanted, bool(getattr(skeleton.model.config, "tie_word_embeddings", False)), device)
    config = skeleton.config
    rotary = type(skeleton.rotary_emb)(config=config).to(device)  # non-persistent buffers: rebuilt, not loaded
    return TargetPieces(
        config,
        {i: skeleton.layers[i].eval() for i in layers},
        rotary,
        skeleton.embed_tokens.eval() if embed else None,
        skeleton.norm.eval() if head else None,
        skeleton.lm_head.eval() if head else None,
    )


def stage_layers(geometry: Geometry, stage: int) -> range:
    """Global HF layer indices of stage `stage` (1..n)."""
    return range(geometry.split[stage - 1], geometry.split[stage])


@dataclass
class StageOutput:
    hidden: torch.Tensor  # [1, S, H] residual after the stage's last layer (the next stage's input)
    anchors: torch.Tensor  # [S, A, H] anchor states this stage produces (A may be 0)
    logits: torch.Tensor | None  # [V] at the last position, last stage only


class Stage(nn.Module):
    """One pipeline stage: layer range + its cache; stage 1 embeds tokens, stage n returns logits."""

    def __init__(self, geometry: Geometry, index: int, pieces: TargetPieces):
        super().__init__()
        self.geometry, self.index = geometry, index
        self.first = index == 1
        self.last = index == geometry.n
        self.layer_range = stage_layers(geometry, index)
        self.layers = nn.ModuleList(pieces.layers[i] for i in self.layer_range)
        self.rotary_emb = pieces.rotary_emb
        self.embed_tokens = pieces.embed_tokens if self.first else None
        self.norm = pieces.norm if self.last else None
        self.lm_head = pieces.lm_head if self.last else None
        if (self.first and self.embed_tokens is None) or (self.last and self.lm_head is None):
            raise ValueError(f"stage {index} needs the {'embedding' if self.first else 'final norm and LM head'}")
        self.config = pieces.config
        # Anchor 0 (the embedding output) is never sent: the PDM rank embeds tokens itself.
        self.anchor_layers = tuple(b for b in geometry.anchors_of_stage(index) if b > 0)
        # n + 1 snapshots: a rejection discards at most n positions on stage 1 (n - 1 in flight plus the
        # draft it ran optimistically before the verdict arrived).
        self.cache = StageCache(pieces.config, self.layer_range, window=geometry.n + 1)
        self._positions = torch.arange(0)  # 0, 1, 2, ... sliced per prefill; regrown when too short
        self._position = torch.zeros(1, 1, dtype=torch.long)  # the decoded token's position, written per token
        self.use_compiled_decode(False)

    @classmethod
    def from_target(cls, target: Target, geometry: Geometry, index: int) -> Stage:
        geometry.check_target(target.num_layers)
        return cls(
            geometry,
            index,
            TargetPieces.from_target(target, stage_layers(geometry, index), index == 1, index == geometry.n),
        )

    @classmethod
    def load(
        cls, path: str, geometry: Geometry, index: int, dtype="float32", device="cpu", trust_remote_code: bool = False
    ) -> Stage:
        pieces = load_pieces(
            path, stage_layers(geometry, index), index == 1, index == geometry.n, dtype, device, trust_remote_code
        )
        return cls(geometry, index, pieces)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def dtype(self) -> torch.dtype:
        return next(self.layers.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.layers.parameters()).device

    def use_compiled_decode(self, enabled: bool) -> None:
        """Run the one-token decode step through `torch.compile` (CUDA graphs on a GPU, inductor on the
        CPU) or eagerly; prefill is always eager."""
        self._decode_step = CompiledStep(self._step, self.device) if enabled else self._step
        self._compiled = enabled

    @torch.no_grad()
    def forward(self, inputs: torch.Tensor, start: int) -> StageOutput:
        """Run `inputs` (token ids [1, S] on stage 1, hidden states [1, S, H] otherwise) at positions
        `start..start+S-1`, appending to the cache. Position 0 starts a prefill of an empty cache (any S);
        after it, one token at a time."""
        S = inputs.shape[1]
        if start == 0:
            if self.cache.length != 0:
                raise RuntimeError(f"stage {self.index}: a prefill needs an empty cache (reset it first)")
            self.cache.reserve(S)
            if len(self._positions) < S or self._positions.device != inputs.device:
                self._positions = torch.arange(max(S, 1024), device=inputs.device)
            hidden, anchors, logits = self._step(inputs, self._positions[None, :S])
        elif S == 1:
            self.cache.before_token(start)
            if self._position.device != inputs.device:
                self._position = self._position.to(inputs.device)
            self._position.fill_(start)  # a device tensor: the step's shapes and code do not depend on it
            hidden, anchors, logits = self._decode_step(inputs, self._position)
            if self._compiled:  # the captured graph owns its outputs and rewrites them on the next replay
                hidden, anchors = hidden.clone(), anchors.clone()
                logits = logits.clone() if logits is not None else None
        else:
            raise RuntimeError(
                f"stage {self.index}: {S} tokens at position {start}: only a prefill runs several tokens"
            )
        self.cache.advance(S)
        return StageOutput(hidden, anchors, logits)

    def _step(
        self, inputs: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The stage on `positions` ([1, S], consecutive, the first one == the cache length): no host reads."""
        x = self.embed_tokens(inputs) if self.first else inputs
        mask = attention_mask(positions, self.cache.capacity, x.dtype) if self.cache.attention_layers else None
        x, anchors, normed = self.run_layers(x, positions, self.cache.hf, mask, self.cache.attention_layers)
        logits = self.lm_head(normed[:, -1])[0] if self.last else None
        return x, anchors[0], logits

    def run_layers(
        self, x: torch.Tensor, positions: torch.Tensor, cache, mask: torch.Tensor | None, attention_layers
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The stage's layers over `x[B, S, H]` at `positions[B, S]` with `cache` (any object with HF's cache
        interface; the batched decoder passes its slot cache): the output, the anchor states `[B, S, A, H]`, and
        on the last stage the final-norm output."""
        position_embeddings = self.rotary_emb(x, rotary_positions(self.rotary_emb, positions))
        L = self.geometry.num_layers
        captured = []
        for offset, layer in enumerate(self.layers):
            index = self.layer_range.start + offset
            x = layer(
                x,
                position_embeddings=position_embeddings,
                position_ids=positions,
                **cache_kwargs(layer, cache),
                attention_mask=mask if index in attention_layers else None,
                use_cache=True,
            )
            if index + 1 in self.anchor_layers and index + 1 < L:
                captured.append(x)
        normed = None
        if self.last:
            normed = self.norm(x)
            if L in self.anchor_layers:
                captured.append(normed)
        anchors = torch.stack(captured, dim=2) if captured else x.new_zeros(*x.shape[:2], 0, x.shape[-1])
        return x, anchors, normed


def attention_mask(positions: torch.Tensor, capacity: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive [B, 1, S, capacity] mask over static key storage: causal at each row's own positions, and the
    unwritten tail hidden."""
    keys = torch.arange(capacity, device=positions.device)
    allowed = keys[None, None, None, :] <= positions[:, None, :, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=positions.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )
