"""Pipeline stages built from the target by layer range (docs/DESIGN.md, "Terms", "Processes", "Pitfalls we avoid").

Stage `s` runs the HF decoder layers `e_{s-1}+1 .. e_s` (global indices `e_{s-1} .. e_s - 1`) directly,
with the target's rotary embedding and its own `StageCache` over B slots (batch 1: one slot); stage 1 also owns the embedding, stage `n`
the final norm and the LM head. A stage returns the anchor states it produces (HF hidden-state indices:
`l < L` is the residual after layer `l`, `L` the final-norm output) so the PDM rank can read them.

Two ways to get the pieces: from an in-memory `Target` (the simulator, tests; no copy), or from a
checkpoint directory, loading ONLY the tensors of the requested pieces (a distributed rank never holds
another rank's layers): the model is built on the meta device, the pieces are materialized, and their
tensors are read one by one from the safetensors files.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from inference.runtime.cache import RowView, StageCache
from inference.runtime.capture import CompiledStep
from inference.runtime.hf_compat import cache_kwargs, rotary_positions
from inference.runtime.slot_rows import RowSets, leading, mark_static
from spd_lightning.geometry import Geometry
from spd_lightning.target import (
    Target,
    TargetError,
    load_hf_config,
    reading_checkpoint,
    resolve_dtype,
    safetensors_weight_map,
)
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
    from transformers import AutoModelForCausalLM

    config = load_hf_config(path, trust_remote_code)  # the loader's one-line errors (a missing path, remote code)
    path = resolve_target(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    return Target(model, path)


def _checkpoint_index(path: str) -> dict[str, tuple[str, str]]:
    """Normalized tensor name -> (file, name in file), over every safetensors shard of the checkpoint."""
    files = safetensors_weight_map(path)
    if files is None:
        raise TargetError(
            f"{path!r} has no model.safetensors (or index): the pipeline decoder loads safetensors checkpoints only"
        )
    return {_normalize(key): (os.path.join(path, file), key) for key, file in files.items()}


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
            with reading_checkpoint(file), safe_open(file, framework="pt", device=str(device)) as f:
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
    pieces = TargetPieces.from_target(skeleton, layers, embed, head)  # in eval mode, as `Target` puts its model
    # the rotary embedding's buffers are not persistent: rebuilt, not loaded
    pieces.rotary_emb = type(skeleton.rotary_emb)(config=skeleton.config).to(device)
    return pieces


def stage_layers(geometry: Geometry, stage: int) -> range:
    """Global HF layer indices of stage `stage` (1..n)."""
    return range(geometry.split[stage - 1], geometry.split[stage])


@dataclass
class StepOutput:
    hidden: torch.Tensor  # [R, 1, H] every row's output (idle rows: meaningless)
    anchors: torch.Tensor  # [R, A, H] the anchor states of each row's token
    logits: torch.Tensor | None  # [R, V] last stage only


class Stage(nn.Module):
    """One pipeline stage over `slots` sequences: layer range + its cache; stage 1 embeds tokens, stage n returns
    logits. A slot's prefill runs its prompt alone; a decode step takes one token per row, `[R, 1]` ids on stage 1
    or `[R, 1, H]` states, over the leading `R` rows (a bucket, `slot_rows.batch_bucket`), each row at its slot's
    own position (device-resident: the step reads no host data); the rows of slots that have no token at this
    stage this cycle run a dummy input and leave their caches as they were (`StageCache.keep_idle_rows`), so every
    step of a bucket has the same shapes whatever the slots do.

    `compile` (`--compile`): the step (snapshot, layers, idle rows restored, head) through `CompiledStep`, one
    graph per bucket and cache capacity, eager from the first compile error on. Its outputs are cloned: a captured
    graph rewrites them on its next replay. Prefill is always eager."""

    def __init__(self, geometry: Geometry, index: int, pieces: TargetPieces, slots: int = 1, compile: bool = False):
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
        # Anchor 0 (the embedding output) is never sent: the PDM rank embeds tokens itself.
        self.anchor_layers = tuple(b for b in geometry.anchors_of_stage(index) if b > 0)
        # n + 1 snapshots: a rejection discards at most n positions on stage 1 (n - 1 in flight plus the
        # draft it ran optimistically before the verdict arrived).
        self.cache = StageCache(pieces.config, self.layer_range, geometry.n + 1, slots, self.device)
        self.sets = RowSets(slots, self.device)
        self.running = self.sets.mask()  # which rows run a real token this step
        mark_static(self.running)
        self.compiled = compile
        self._step = CompiledStep(self._decode_step, self.device) if compile else self._decode_step

    @classmethod
    def from_target(
        cls, target: Target, geometry: Geometry, index: int, slots: int = 1, compile: bool = False
    ) -> Stage:
        geometry.check_target(target.num_layers)
        pieces = TargetPieces.from_target(target, stage_layers(geometry, index), index == 1, index == geometry.n)
        return cls(geometry, index, pieces, slots, compile)

    @classmethod
    def load(
        cls,
        path: str,
        geometry: Geometry,
        index: int,
        dtype="float32",
        device="cpu",
        trust_remote_code: bool = False,
        slots: int = 1,
        compile: bool = False,
    ) -> Stage:
        pieces = load_pieces(
            path, stage_layers(geometry, index), index == 1, index == geometry.n, dtype, device, trust_remote_code
        )
        return cls(geometry, index, pieces, slots, compile)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.layers.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.layers.parameters()).device

    @torch.no_grad()
    def prefill(
        self, slot: int, inputs: torch.Tensor, capacity: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Slot `slot` starts a new sequence: `inputs` (ids `[1, P]` or states `[1, P, H]`) at positions 0..P-1.
        Returns the output `[1, P, H]`, the anchors `[P, A, H]` and (last stage) the logits `[V]` of position P-1."""
        P = inputs.shape[1]
        self.cache.reset(slot, max(capacity, P))
        x, anchors, logits = self._forward(inputs, torch.arange(P, device=inputs.device)[None], self.cache.row(slot))
        self.cache.positions.set(slot, P)
        return x, anchors[0], logits[0] if logits is not None else None

    @torch.no_grad()
    def step(self, inputs: torch.Tensor, tokens: dict[int, int]) -> StepOutput:
        """One token per row over the leading `inputs.shape[0]` rows: `tokens` maps each running slot to the
        position it runs (its cache length); every other row idles."""
        cache, rows = self.cache, inputs.shape[0]
        for b, position in tokens.items():
            if position != cache.lengths[b] or position == 0 or b >= rows:
                raise RuntimeError(
                    f"stage {self.index}, slot {b}: the cache holds {cache.lengths[b]} positions but is asked to run "
                    f"position {position} as a single decoded token in a step over {rows} rows"
                )
        running = sorted(tokens)
        cache.before_step(rows, running)
        # Eagerly a step in which every row runs needs no mask of the running rows: no idle row to restore, every
        # position advances. A compiled one always restores (one graph per bucket).
        mask = None
        if self.compiled or len(running) < rows:
            mask = leading(self.sets.write(running, self.running), rows)
        hidden, anchors, logits = self._step(inputs, mask)
        if self.compiled:  # the captured graph owns its outputs and rewrites them on the next replay
            hidden, anchors = hidden.clone(), anchors.clone()
            logits = logits.clone() if logits is not None else None
        cache.positions.add_one(running, rows if mask is None else mask)  # the running slots advance by one
        return StepOutput(hidden, anchors, logits)

    def _decode_step(
        self, inputs: torch.Tensor, running: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The step over `cache.rows` rows, all on the device: no host reads, fixed shapes per bucket; `running`
        (None: every row runs) masks the rows whose states it keeps."""
        cache = self.cache
        cache.snapshot()
        x, anchors, logits = self._forward(inputs, leading(cache.positions.device, cache.rows)[:, None])
        if running is not None:
            cache.keep_idle_rows(running)
        return x, anchors[:, 0], logits

    def _forward(
        self, inputs: torch.Tensor, positions: torch.Tensor, view: RowView | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The stage over `inputs` (ids `[B, S]` or states `[B, S, H]`) at `positions[B, S]`, over every row of its
        cache or one slot's `view`: the output, the anchor states `[B, S, A, H]`, and on the last stage the logits
        `[B, V]` of the last position."""
        x = self.embed_tokens(inputs) if self.first else inputs
        layers = zip(self.layer_range, self.layers)
        x, captured = run_layers(layers, x, positions, self.rotary_emb, self.cache, view, self.anchor_layers)
        logits = None
        if self.last:
            normed = self.norm(x)
            captured[self.geometry.num_layers] = normed  # hidden_states[L] is the final-norm output
            logits = self.lm_head(normed[:, -1])
        if not self.anchor_layers:
            return x, x.new_zeros(*x.shape[:2], 0, x.shape[-1]), logits
        return x, torch.stack([captured[b] for b in self.anchor_layers], dim=2), logits


def run_layers(
    layers: Iterable[tuple[int, nn.Module]],
    x: torch.Tensor,
    positions: torch.Tensor,
    rotary_emb: nn.Module,
    cache: StageCache,
    view: RowView | None,
    keep: Collection[int],
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """HF decoder layers (`(global index, layer)` pairs) over `x[B, S, H]` at `positions[B, S]`, over every row of
    `cache` or one slot's `view`: the output, and `captured[l]` for `l` in `keep`, the residual entering layer `l`
    (HF hidden-state index `l`). A view from a start > 0 (the chain decoder's verify block) steps linear-attention
    layers one token at a time, each token's states snapshotted first (`StageCache.snapshot_row`), so that a
    rollback can keep any prefix of the block."""
    mask = attention_mask(positions, cache.capacity, x.dtype) if cache.attention_layers else None
    cos, sin = rotary_emb(x, rotary_positions(rotary_emb, positions))
    held, stepped = (cache, False) if view is None else (view, view.start > 0)
    captured = {}
    for i, layer in layers:
        linear = i in cache.linear_layers
        # Gated DeltaNet reads attention_mask as a padding mask: only attention layers get the causal one.
        kwargs = {"attention_mask": None if linear else mask, **cache_kwargs(layer, held), "use_cache": True}
        if linear and stepped:
            outs = []
            for j in range(x.shape[1]):
                cache.snapshot_row(view.slot, i, view.start + j)
                token = slice(j, j + 1)
                pe = (cos[:, token], sin[:, token])
                outs.append(layer(x[:, token], position_embeddings=pe, position_ids=positions[:, token], **kwargs))
            x = torch.cat(outs, dim=1)
        else:
            x = layer(x, position_embeddings=(cos, sin), position_ids=positions, **kwargs)
        if i + 1 in keep:
            captured[i + 1] = x
    return x, captured


def attention_mask(positions: torch.Tensor, capacity: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive [B, 1, S, capacity] mask over static key storage: causal at each row's own positions, and the
    unwritten tail hidden."""
    keys = torch.arange(capacity, device=positions.device)
    allowed = keys[None, None, None, :] <= positions[:, None, :, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=positions.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )
