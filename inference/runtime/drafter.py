"""The drafter runtime on the PDM rank: the PDM with its KV cache, fed by the staircase (docs/DESIGN.md, "Terms").

The PDM keeps one row of anchor states per position (filled as the stages send them; anchor 0 is the
embedding, which this rank computes itself from the token id). Positions older than the in-flight
window are verified and complete: their depth-n view never changes, so their body keys/values are
cached once. Every draft appends the newly verified positions to that cache and recomputes the
in-flight positions, at the depths the schedule gives, on top of it.

`ReplayDrafter` proposes from a known continuation instead (always right, always wrong, or right by an
exact pattern): it measures the pipeline without a model (the closed forms of the schedule, oracle timing) and
drives it through chosen accept/reject sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from inference.runtime.cache import round_capacity
from inference.runtime.capture import CompiledStep
from inference.sampling import Sampling, warp
from spd_lightning.export import DrafterLoadError
from spd_lightning.geometry import Geometry
from spd_lightning.pdm import PipelineDraftModule


class Drafter(Protocol):
    """What the PDM rank runs. `draft` returns the target id as a one-element tensor on the drafter's device
    (it goes straight into the message buffer) and `q`, the draft distribution over the draft vocabulary
    (None when greedy)."""

    def start(self, prompt_ids: torch.Tensor, capacity: int) -> None: ...
    def set_token(self, position: int, token: int) -> None: ...
    def store_anchors(self, stage: int, start: int, states: torch.Tensor) -> None: ...
    def draft(
        self, view: Sequence[tuple[int, int]], generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


class DraftKVCache:
    """Preallocated body keys/values of the verified positions, used as the PDM's `attend`.

    Each call writes the new keys/values at `[length, length + S)` and attends causally over
    `[0, length + S)`; `commit` makes them part of the cache (verified positions), otherwise the next
    call overwrites them (in-flight positions). `static` (the compiled draft): the offset is the device
    tensor `offset` (the caller writes `length` into it) and attention runs over the whole storage with the
    unwritten tail masked, so a call's shapes depend on `S` only."""

    def __init__(
        self, num_layers: int, heads: int, head_dim: int, max_len: int, dtype: torch.dtype, device, static: bool = False
    ):
        self.keys = torch.zeros(num_layers, 1, heads, max_len, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.length = 0
        self.static = static
        self.offset = torch.zeros(1, dtype=torch.long, device=device)
        self.slots = torch.arange(max_len, device=device)
        for tensor in (self.keys, self.values, self.offset, self.slots):  # fixed addresses for a CUDA graph
            torch._dynamo.mark_static_address(tensor)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.static:
            return self._static_attend(layer, q, k, v)
        S, end = q.shape[-2], self.length + q.shape[-2]
        if end > self.keys.shape[-2]:
            raise RuntimeError(f"PDM cache holds {self.keys.shape[-2]} positions; position {end - 1} does not fit")
        self.keys[layer, :, :, self.length : end] = k
        self.values[layer, :, :, self.length : end] = v
        keys, values = self.keys[layer, :, :, :end], self.values[layer, :, :, :end]
        if S == 1:
            return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
        mask = torch.arange(end, device=q.device)[None, :] <= (self.length + torch.arange(S, device=q.device))[:, None]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)

    def _static_attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        written = self.offset + torch.arange(q.shape[-2], device=q.device)
        self.keys[layer].index_copy_(2, written, k)
        self.values[layer].index_copy_(2, written, v)
        mask = self.slots[None, :] <= written[:, None]
        return F.scaled_dot_product_attention(q, self.keys[layer], self.values[layer], attn_mask=mask, enable_gqa=True)

    def commit(self, count: int) -> None:
        self.length += count


class PDMDrafter:
    def __init__(
        self,
        pdm: PipelineDraftModule,
        geometry: Geometry,
        embed_tokens: nn.Module,
        sampling: Sampling,
        state_dtype: torch.dtype,
        compile: bool = False,
    ):
        """`compile`: the in-flight draft's body and head through `torch.compile`, one graph per fill level
        (the fusion, one projection per type present, and the verified positions' append, whose length varies,
        stay eager)."""
        cfg = pdm.cfg
        if cfg.num_types != geometry.num_types:
            raise DrafterLoadError(
                f"the PDM fuses {cfg.num_types} aggregation types but the geometry has "
                f"{geometry.num_types} anchors {list(geometry.anchors)}: use the drafter's own geometry"
            )
        if cfg.target_hidden_size != embed_tokens.weight.shape[1]:
            raise DrafterLoadError(
                f"the PDM reads target states of width {cfg.target_hidden_size} but the target "
                f"embedding has width {embed_tokens.weight.shape[1]}"
            )
        if int(pdm.d2t.max()) >= embed_tokens.weight.shape[0]:
            raise DrafterLoadError(
                f"the draft vocabulary maps to target id {int(pdm.d2t.max())}, beyond the target "
                f"vocabulary of {embed_tokens.weight.shape[0]}"
            )
        self.pdm, self.geometry, self.embed_tokens, self.sampling = pdm, geometry, embed_tokens, sampling
        p = next(pdm.parameters())
        self.device, self.dtype, self.state_dtype = p.device, p.dtype, state_dtype
        self.capacity = 0
        self.compiled = compile
        self._in_flight = CompiledStep(self._in_flight_logits, self.device) if compile else self._in_flight_logits
        self._seed = torch.zeros(1, dtype=torch.long, device=self.device)
        self._slots = {b: i for i, b in enumerate(geometry.anchors)}
        self._stage_slots = {
            s: [self._slots[b] for b in geometry.anchors_of_stage(s) if b > 0] for s in range(1, geometry.n + 1)
        }

    @torch.no_grad()
    def start(self, prompt_ids: torch.Tensor, capacity: int) -> None:
        """A new sequence of at most `capacity` positions: the prompt's own embeddings (the stages send
        its other anchors); the state rows and the KV cache grow only when a longer sequence comes, to its
        power-of-two bucket (`cache.round_capacity`), so the compiled draft sees one shape per bucket."""
        P = prompt_ids.shape[-1]
        capacity = round_capacity(capacity)  # a bucket: a longer request reuses the compiled graphs
        if capacity > self.capacity:
            cfg = self.pdm.cfg
            self.states = torch.zeros(
                capacity, self.geometry.num_types, cfg.target_hidden_size, dtype=self.state_dtype, device=self.device
            )
            self.cache = DraftKVCache(
                cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, capacity, self.dtype, self.device, static=self.compiled
            )
            self.positions = torch.arange(capacity, device=self.device)[None]  # sliced per draft, never rebuilt
            self.capacity = capacity
        self.cache.length = 0
        self.states.zero_()
        self.states[:P, 0] = self.embed_tokens(prompt_ids.reshape(1, P).to(self.device))[0]

    @torch.no_grad()
    def set_token(self, position: int, token: int) -> None:
        """The seed token's embedding, looked up from a device buffer written with `fill_` (a kernel argument,
        not a copy of host memory)."""
        self.states[position, 0] = self.embed_tokens(self._seed.fill_(token))[0]

    def store_anchors(self, stage: int, start: int, states: torch.Tensor) -> None:
        """`states[S, A, H]`: the anchors stage `stage` produced for positions `start..start+S-1`."""
        slots = self._stage_slots[stage]
        if slots:
            self.states[start : start + states.shape[0], slots[0] : slots[-1] + 1] = states

    @torch.no_grad()
    def draft(
        self, view: Sequence[tuple[int, int]], generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft the token after `view[-1]`; `view` lists (depth, position) of the in-flight tokens."""
        geometry, pdm = self.geometry, self.pdm
        verified = view[0][1]
        if verified < self.cache.length:
            raise RuntimeError(f"position {verified} is in flight but the PDM cache already holds it as verified")
        if verified > self.cache.length:  # newly verified positions: depth n, cached for good
            start = self.cache.length
            self._write_offset(start)
            g = pdm.fuse(self.states[start:verified].to(self.dtype)[None], geometry.type_of(geometry.n))
            pdm.body(g, self.positions[:, start:verified], self.cache)
            self.cache.commit(verified - start)
        first, last = view[0][1], view[-1][1]  # in-flight positions are consecutive
        depths = tuple(d for d, _ in view)
        types = tuple(geometry.type_of(d) for d in depths)
        if last >= self.capacity:
            raise RuntimeError(f"PDM cache holds {self.capacity} positions; position {last} does not fit")
        self._write_offset(self.cache.length)
        g = pdm.fuse(self.states[first : last + 1].to(self.dtype)[None], types)  # eager: one projection per type
        logits = self._in_flight(g, self.positions[:, first : last + 1])
        if self.sampling.greedy:
            token, q = pdm.d2t[logits.argmax(-1, keepdim=True)], None
        else:
            q = warp(logits, self.sampling)
            token = pdm.d2t[torch.multinomial(q, 1, generator=generator)]
        self.states[last + 1, 0] = self.embed_tokens(token)[0]  # H^0 of the new token, no host sync
        return token, q

    def _write_offset(self, offset: int) -> None:
        if self.cache.static:  # the compiled attention reads where to write from the device
            self.cache.offset.fill_(offset)

    def _in_flight_logits(self, g: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Draft logits after the in-flight positions (fused inputs `g[1, a, d]`, `positions[1, a]`)."""
        return self.pdm.lm_head(self.pdm.body(g, positions, self.cache)[0, -1])


class ReplayDrafter:
    """Proposes a known continuation: the i-th `start` replays `references[i]`, the continuation of the
    i-th prompt. `oracle` proposes `reference[position - prompt_len]`, `adversary` a token that is surely
    not it, and a pattern of `R` (right) and `W` (wrong) letters, read cyclically by that index, chooses
    per position; greedy only. Past the end of the reference it proposes token 0 (never judged then).
    Its tokens live on the device of the prompt it was started with (the runner's), like a PDM's drafts: the
    distributed decoder sends them as they are (NCCL cannot send a CPU tensor)."""

    def __init__(self, references: Sequence[Sequence[int]], policy: str, vocab_size: int):
        pattern = {"oracle": "R", "adversary": "W"}.get(policy, policy)
        if not pattern or set(pattern) - {"R", "W"}:
            raise ValueError(f"unknown replay policy {policy!r}: use 'oracle', 'adversary' or a pattern of R and W")
        self.references, self.pattern, self.vocab_size = [list(r) for r in references], pattern, vocab_size
        self._next, self.reference, self.prompt_len = 0, [], 0
        self.device = torch.device("cpu")

    def start(self, prompt_ids: torch.Tensor, capacity: int) -> None:
        if self._next >= len(self.references):
            raise ValueError(f"the replay drafter has {len(self.references)} references and no more prompts to replay")
        self.reference, self.prompt_len = self.references[self._next], prompt_ids.shape[-1]
        self.device = prompt_ids.device
        self._next += 1

    def set_token(self, position: int, token: int) -> None:
        pass

    def store_anchors(self, stage: int, start: int, states: torch.Tensor) -> None:
        pass

    def draft(self, view, generator) -> tuple[torch.Tensor, None]:
        index = view[-1][1] + 1 - self.prompt_len
        right = self.reference[index] if index < len(self.reference) else 0
        wrong = self.pattern[index % len(self.pattern)] == "W"
        return torch.tensor([(right + 1) % self.vocab_size if wrong else right], device=self.device), None
