"""The PDM over B slots (issue 26): one body forward drafts the next token of every drafting slot.

Each slot has what `PDMDrafter` keeps for its one sequence (drafter.py): a row of anchor states per position
(`states[B, capacity, m, H]`) and the body keys/values of its verified positions (`SlotDraftKV`, one length per
slot). A draft of slot `b` covers the consecutive positions from its cached length up to its newest in-flight
token: the newly verified ones (read at depth n, committed to the cache afterwards) and the in-flight ones (at
the depths of its view, recomputed every cycle). The slots' segments are fused per slot (each its own depth
types, one projection per type present, as `PDMDrafter` does), laid left-aligned into one `[B, W]` batch and
run through the body once; each slot's logits are read at its newest position. Rows of slots that do not draft
this cycle, and the padding after a shorter segment, write keys past anything their slot holds: masked, and
overwritten before any draft reads them, as in-flight positions are.

Sampling is per slot: each slot's warp (its temperature, top-k, top-p) and its own generator, so a seeded
request draws exactly the randomness it draws alone (`generator_seeds`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from inference.runtime.cache import round_capacity
from inference.sampling import Sampling, warp
from spd_lightning.geometry import Geometry
from spd_lightning.pdm import PipelineDraftModule


class SlotDraftKV:
    """The PDM's body keys/values per slot, the `attend` of its batched forward: row `b`'s `S` new keys are
    written at `[offsets_b, offsets_b + S)` and its queries attend causally over `[0, offsets_b + i]`."""

    def __init__(self, num_layers: int, slots: int, heads: int, head_dim: int, capacity: int, dtype, device):
        self.keys = torch.zeros(num_layers, slots, heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.lengths = [0] * slots
        self.offsets = torch.zeros(slots, dtype=torch.long, device=device)  # written before each forward
        self.rows = torch.arange(slots, device=device)
        self.slots = torch.arange(capacity, device=device)

    def grown(self, capacity: int) -> SlotDraftKV:
        L, B, heads, _, dim = self.keys.shape
        new = SlotDraftKV(L, B, heads, dim, capacity, self.keys.dtype, self.keys.device)
        held = self.keys.shape[3]
        new.keys[:, :, :, :held], new.values[:, :, :, :held] = self.keys, self.values
        new.lengths = self.lengths
        return new

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        written = self.offsets[:, None] + torch.arange(q.shape[-2], device=q.device)  # [B, S]
        rows = self.rows[:, None].expand_as(written)
        self.keys[layer][rows, :, written] = k.transpose(1, 2)  # [B, S, heads, dim] at (row, position)
        self.values[layer][rows, :, written] = v.transpose(1, 2)
        mask = self.slots[None, None, None, :] <= written[:, None, :, None]  # [B, 1, S, capacity]
        return F.scaled_dot_product_attention(q, self.keys[layer], self.values[layer], attn_mask=mask, enable_gqa=True)


class SlotDrafter:
    def __init__(self, pdm: PipelineDraftModule, geometry: Geometry, embed_tokens: nn.Module, state_dtype, slots: int):
        self.pdm, self.geometry, self.embed_tokens, self.slots = pdm, geometry, embed_tokens, slots
        p = next(pdm.parameters())
        self.device, self.dtype, self.state_dtype = p.device, p.dtype, state_dtype
        self.capacity = 0
        self._seed = torch.zeros(1, dtype=torch.long, device=self.device)
        anchor_slot = {b: i for i, b in enumerate(geometry.anchors)}
        self._stage_slots = {
            s: [anchor_slot[b] for b in geometry.anchors_of_stage(s) if b > 0] for s in range(1, geometry.n + 1)
        }
        self._reserve(1)

    def _reserve(self, positions: int) -> None:
        """Room for `positions` positions in every slot, keeping what each holds (a power-of-two bucket)."""
        if positions <= self.capacity:
            return
        capacity, cfg = round_capacity(positions), self.pdm.cfg
        states = torch.zeros(
            self.slots,
            capacity,
            self.geometry.num_types,
            cfg.target_hidden_size,
            dtype=self.state_dtype,
            device=self.device,
        )
        if self.capacity:
            states[:, : self.capacity] = self.states
            self.cache = self.cache.grown(capacity)
        else:
            self.cache = SlotDraftKV(
                cfg.num_layers, self.slots, cfg.num_kv_heads, cfg.head_dim, capacity, self.dtype, self.device
            )
        self.states, self.capacity = states, capacity

    @torch.no_grad()
    def start(self, slot: int, prompt_ids: torch.Tensor, capacity: int) -> None:
        """Slot `slot` starts a sequence of at most `capacity` positions: the prompt's own embeddings."""
        P = prompt_ids.shape[-1]
        self._reserve(capacity)
        self.cache.lengths[slot] = 0
        self.states[slot].zero_()
        self.states[slot, :P, 0] = self.embed_tokens(prompt_ids.reshape(1, P).to(self.device))[0]

    @torch.no_grad()
    def set_token(self, slot: int, position: int, token: int) -> None:
        self.states[slot, position, 0] = self.embed_tokens(self._seed.fill_(token))[0]

    def store_anchors(self, slot: int, stage: int, start: int, states: torch.Tensor) -> None:
        """`states[S, A, H]`: the anchors stage `stage` produced for slot `slot`'s positions `start..start+S-1`."""
        anchors = self._stage_slots[stage]
        if anchors:
            self.states[slot, start : start + states.shape[0], anchors[0] : anchors[-1] + 1] = states

    @torch.no_grad()
    def draft(
        self,
        views: Mapping[int, Sequence[tuple[int, int]]],
        samplings: Mapping[int, Sampling],
        generators: Mapping[int, torch.Generator],
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
        """Draft the token after each view's newest position, for every slot in `views` (its (depth, position)
        pairs of in-flight tokens, oldest first), in one body forward. Returns slot -> (target id `[1]`, `q`
        over the draft vocabulary or None when that slot is greedy)."""
        lengths = self.cache.lengths
        segments = {b: self._segment(b, view) for b, view in views.items()}
        width = max(g.shape[0] for g in segments.values())
        self._reserve(max(lengths) + width)
        g = torch.zeros(self.slots, width, self.pdm.cfg.hidden_size, dtype=self.dtype, device=self.device)
        last_row = [0] * self.slots
        for b, segment in segments.items():
            g[b, : segment.shape[0]] = segment
            last_row[b] = segment.shape[0] - 1
        offsets = torch.tensor(lengths, device=self.device)
        self.cache.offsets.copy_(offsets)
        positions = offsets[:, None] + torch.arange(width, device=self.device)
        hidden = self.pdm.body(g, positions, self.cache)  # [B, W, d]
        newest = hidden[torch.arange(self.slots, device=self.device), torch.tensor(last_row, device=self.device)]
        logits = self.pdm.lm_head(newest)  # [B, V_d]
        drafts = {}
        for b, view in views.items():
            lengths[b] = view[0][1]  # the newly verified positions are cached for good
            drafts[b] = self._choose(logits[b], samplings[b], generators.get(b))
            self.states[b, view[-1][1] + 1, 0] = self.embed_tokens(drafts[b][0])[0]  # H^0 of the new token
        return drafts

    def _segment(self, slot: int, view: Sequence[tuple[int, int]]) -> torch.Tensor:
        """Slot `slot`'s fused inputs `[S, d]`: its newly verified positions at depth n, then its in-flight ones."""
        geometry, pdm, start = self.geometry, self.pdm, self.cache.lengths[slot]
        first, last = view[0][1], view[-1][1]
        if first < start:
            raise RuntimeError(f"slot {slot}: position {first} is in flight but the PDM cache holds it as verified")
        parts = []
        if first > start:
            parts.append(pdm.fuse(self.states[slot, start:first].to(self.dtype), geometry.type_of(geometry.n)))
        types = tuple(geometry.type_of(d) for d, _ in view)
        parts.append(pdm.fuse(self.states[slot, first : last + 1].to(self.dtype)[None], types)[0])
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _choose(
        self, logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        d2t = self.pdm.d2t
        if sampling.greedy:
            return d2t[logits.argmax(-1, keepdim=True)], None
        q = warp(logits, sampling)
        return d2t[torch.multinomial(q, 1, generator=generator)], q
