"""The drafter runtime on the PDM rank: the PDM with its KV cache over B slots, fed by the staircase (docs/DESIGN.md,
"Terms"); one body forward drafts the next token of every drafting slot.

Each slot keeps a row of anchor states per position (`states[B, capacity, m, H]`, filled as the stages send them;
anchor 0 is the embedding, which this rank computes itself from the token id) and the body keys/values of its
verified positions (`SlotDraftKV`, one length per slot): their depth-n view never changes, so they are cached once.
A draft of slot `b` covers the consecutive positions from its cached length up to its newest in-flight token: the
newly verified ones (read at depth n, committed to the cache afterwards) and the in-flight ones (at the depths of
its view, recomputed every cycle). The slots' segments are fused per slot (each its own depth types, one
projection per type present), laid left-aligned into one `[R, W]` batch over the step's leading rows (a bucket,
`slot_rows.batch_bucket`) and run through the body once; each slot's logits are read at its newest column.
`W = n + 1` is fixed: a cycle verifies at most one position, so a segment holds at most one newly verified
position and `n` in flight; a longer one (a join's prompt) first commits its oldest positions alone. Rows of slots
that do not draft this cycle, and the columns after a shorter segment, write keys past anything their slot holds:
masked, and overwritten before any draft reads them, as in-flight positions are.

Where each slot's segment starts (its cached length) and its newest column are device-resident (`DeviceInts`):
written on the device as the slots move, never copied from the host, so a draft makes no host sync.
`compile` (`--compile`): the body and head over the fixed `[R, W]` shape through `CompiledStep`, one graph per
bucket and capacity; the fusion and the commits stay eager.

Sampling is per slot: each slot's warp (its temperature, top-k, top-p) and its own generator, so a seeded
request draws exactly the randomness it draws alone (`slots.generator_seeds`).

`ReplayDrafter` proposes from a known continuation instead (always right, always wrong, or right by an exact
pattern): it measures the pipeline without a model (the closed forms of the schedule, oracle timing) and drives
it through chosen accept/reject sequences.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from inference.runtime.cache import round_capacity
from inference.runtime.capture import CompiledStep
from inference.runtime.slot_rows import DeviceInts, RowSets, batch_bucket, mark_static
from inference.sampling import Sampling, warp
from spd_lightning.export import DrafterLoadError
from spd_lightning.geometry import Geometry
from spd_lightning.pdm import PipelineDraftModule

Draft = tuple[torch.Tensor, torch.Tensor | None]  # (target id `[1]` on the drafter's device, `q` or None if greedy)


class Drafter(Protocol):
    """What the PDM rank runs, per slot. `draft` returns slot -> (target id, the draft distribution `q` over the
    draft vocabulary or None when that slot is greedy)."""

    def start(self, slot: int, prompt_ids: torch.Tensor, capacity: int) -> None: ...
    def set_token(self, slot: int, position: int, token: int) -> None: ...
    def store_anchors(self, slot: int, stage: int, start: int, states: torch.Tensor) -> None: ...
    def draft(
        self,
        views: Mapping[int, Sequence[tuple[int, int]]],
        samplings: Mapping[int, Sampling],
        generators: Mapping[int, torch.Generator],
        rows: int | None = None,
    ) -> dict[int, Draft]: ...


class SlotDraftKV:
    """The PDM's body keys/values per slot, the `attend` of its batched forward: row `b`'s `S` new keys are
    written at `[offsets_b, offsets_b + S)` and its queries attend causally over `[0, offsets_b + i]`; `offsets`
    is the drafter's device-resident vector of cached lengths."""

    def __init__(self, num_layers: int, slots: int, heads: int, head_dim: int, capacity: int, dtype, offsets):
        device = offsets.device
        self.keys = torch.zeros(num_layers, slots, heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.offsets = offsets
        self.rows = torch.arange(slots, device=device)
        self.slots = torch.arange(capacity, device=device)
        mark_static(self.keys, self.values, self.rows, self.slots)

    def grown(self, capacity: int) -> SlotDraftKV:
        L, B, heads, _, dim = self.keys.shape
        new = SlotDraftKV(L, B, heads, dim, capacity, self.keys.dtype, self.offsets)
        held = self.keys.shape[3]
        new.keys[:, :, :, :held], new.values[:, :, :, :held] = self.keys, self.values
        return new

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        R = q.shape[0]
        written = self.offsets[:R, None] + torch.arange(q.shape[-2], device=q.device)  # [R, S]
        rows = self.rows[:R, None].expand_as(written)
        keys, values = self.keys[layer][:R], self.values[layer][:R]
        keys[rows, :, written] = k.transpose(1, 2)  # [R, S, heads, dim] at (row, position)
        values[rows, :, written] = v.transpose(1, 2)
        mask = self.slots[None, None, None, :] <= written[:, None, :, None]  # [R, 1, S, capacity]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)

    def row_attend(self, slot: int, start: int) -> Callable:
        """The `attend` of slot `slot` alone, its new keys at `start..`: a commit of verified positions."""

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            S, end = q.shape[-2], start + q.shape[-2]
            keys, values = self.keys[layer, slot : slot + 1], self.values[layer, slot : slot + 1]
            keys[:, :, start:end], values[:, :, start:end] = k, v
            queries = start + torch.arange(S, device=q.device)
            mask = torch.arange(end, device=q.device)[None, :] <= queries[:, None]
            return F.scaled_dot_product_attention(
                q, keys[:, :, :end], values[:, :, :end], attn_mask=mask, enable_gqa=True
            )

        return attend


class PDMDrafter:
    def __init__(
        self,
        pdm: PipelineDraftModule,
        geometry: Geometry,
        embed_tokens: nn.Module,
        state_dtype,
        slots: int,
        compile: bool = False,
    ):
        check_drafter(pdm, geometry, embed_tokens)
        self.pdm, self.geometry, self.embed_tokens, self.slots = pdm, geometry, embed_tokens, slots
        p = next(pdm.parameters())
        self.device, self.dtype, self.state_dtype = p.device, p.dtype, state_dtype
        self.capacity, self.width = 0, geometry.n + 1
        self._seed = torch.zeros(1, dtype=torch.long, device=self.device)
        anchor_slot = {b: i for i, b in enumerate(geometry.anchors)}
        self._stage_slots = {
            s: [anchor_slot[b] for b in geometry.anchors_of_stage(s) if b > 0] for s in range(1, geometry.n + 1)
        }
        sets = RowSets(slots, self.device)
        self.offsets = DeviceInts(slots, self.device, sets)  # each slot's cached (verified) length
        self.newest = DeviceInts(slots, self.device, sets)  # each slot's newest column in its segment
        self._columns = torch.arange(self.width, device=self.device)
        self._row_ids = torch.arange(slots, device=self.device)
        self._g = torch.zeros(slots, self.width, pdm.cfg.hidden_size, dtype=self.dtype, device=self.device)
        mark_static(self._columns, self._row_ids, self._g)
        self.compiled = compile
        self._step = CompiledStep(self._logits, self.device) if compile else self._logits
        self._reserve(1)

    @property
    def lengths(self) -> list[int]:
        """Each slot's cached (verified) positions (the host mirror of `offsets`)."""
        return self.offsets.host

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
                cfg.num_layers, self.slots, cfg.num_kv_heads, cfg.head_dim, capacity, self.dtype, self.offsets.device
            )
        self.states, self.capacity = states, capacity

    @torch.no_grad()
    def start(self, slot: int, prompt_ids: torch.Tensor, capacity: int) -> None:
        """Slot `slot` starts a sequence of at most `capacity` positions: the prompt's own embeddings."""
        P = prompt_ids.shape[-1]
        self._reserve(capacity)
        self.offsets.assign({slot: 0})
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
        rows: int | None = None,
    ) -> dict[int, Draft]:
        """Draft the token after each view's newest position, for every slot in `views` (its (depth, position)
        pairs of in-flight tokens, oldest first), in one body forward over the leading `rows` rows (default: the
        bucket of the last drafting slot). Returns slot -> (target id `[1]`, `q` over the draft vocabulary or
        None when that slot is greedy)."""
        rows = rows or batch_bucket(max(views) + 1, self.slots)
        for b, view in views.items():
            self._commit_overflow(b, view)
        self._reserve(max(self.lengths[:rows]) + self.width + 1)
        self.newest.assign({b: self._write_segment(b, view) - 1 for b, view in views.items()})
        logits = self._step(self._g[:rows])
        if self.compiled:  # the captured graph owns its output
            logits = logits.clone()
        self.offsets.assign({b: view[0][1] for b, view in views.items()})  # newly verified: cached for good
        greedy = self.pdm.d2t[logits.argmax(-1)] if any(s.greedy for s in samplings.values()) else None
        drafts = {}
        for b, view in views.items():
            drafts[b] = self._choose(b, logits[b], greedy, samplings[b], generators.get(b))
            self.states[b, view[-1][1] + 1, 0] = self.embed_tokens(drafts[b][0])[0]  # H^0 of the new token
        return drafts

    def _commit_overflow(self, slot: int, view: Sequence[tuple[int, int]]) -> None:
        """A segment longer than `width` (a join's prompt) first commits its oldest verified positions alone."""
        start, first = self.lengths[slot], view[0][1]
        if first < start:
            raise RuntimeError(f"slot {slot}: position {first} is in flight but the PDM cache holds it as verified")
        count = first - start + len(view) - self.width
        if count <= 0:
            return
        pdm = self.pdm
        g = pdm.fuse(self.states[slot, start : start + count].to(self.dtype), self.geometry.type_of(self.geometry.n))
        positions = torch.arange(start, start + count, device=self.device)[None]
        pdm.body(g[None], positions, self.cache.row_attend(slot, start))
        self.offsets.assign({slot: start + count})

    def _write_segment(self, slot: int, view: Sequence[tuple[int, int]]) -> int:
        """Slot `slot`'s fused inputs into its row of the step: its newly verified positions at depth n, then its
        in-flight ones. Returns the segment's length."""
        geometry, pdm, start, g = self.geometry, self.pdm, self.lengths[slot], self._g[slot]
        first, last = view[0][1], view[-1][1]
        if first > start:
            g[: first - start] = pdm.fuse(self.states[slot, start:first].to(self.dtype), geometry.type_of(geometry.n))
        types = tuple(geometry.type_of(d) for d, _ in view)
        in_flight = self.states[slot, first : last + 1].to(self.dtype)[None]
        g[first - start : last + 1 - start] = pdm.fuse(in_flight, types)[0]
        return last + 1 - start

    def _logits(self, g: torch.Tensor) -> torch.Tensor:
        """Draft logits `[R, V_d]` at each row's newest column, from the fused segments `g[R, W, d]`."""
        R = g.shape[0]
        positions = self.offsets.device[:R, None] + self._columns
        hidden = self.pdm.body(g, positions, self.cache)  # [R, W, d]
        return self.pdm.lm_head(hidden[self._row_ids[:R], self.newest.device[:R]])

    def _choose(
        self,
        slot: int,
        logits: torch.Tensor,
        greedy: torch.Tensor | None,
        sampling: Sampling,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if sampling.greedy:
            return greedy[slot : slot + 1], None
        q = warp(logits, sampling)
        return self.pdm.d2t[torch.multinomial(q, 1, generator=generator)], q


def check_drafter(pdm: PipelineDraftModule, geometry: Geometry, embed_tokens: nn.Module) -> None:
    """The PDM fits the geometry and the target it drafts for."""
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


class ReplayDrafter:
    """Proposes a known continuation: the i-th `start` (the i-th request to join) replays `references[i]`, the
    continuation of its prompt. `oracle` proposes `reference[position - prompt_len]`, `adversary` a token that is
    surely not it, and a pattern of `R` (right) and `W` (wrong) letters, read cyclically by that index, chooses per
    position; greedy only (it has no draft distribution). Past the end of the reference it proposes token 0 (never
    judged then). Its tokens live on the device of the prompts it was started with (the runner's), like a PDM's
    drafts: the distributed decoder sends them as they are (NCCL cannot send a CPU tensor)."""

    def __init__(self, references: Sequence[Sequence[int]], policy: str, vocab_size: int):
        pattern = {"oracle": "R", "adversary": "W"}.get(policy, policy)
        if not pattern or set(pattern) - {"R", "W"}:
            raise ValueError(f"unknown replay policy {policy!r}: use 'oracle', 'adversary' or a pattern of R and W")
        self.references, self.pattern, self.vocab_size = [list(r) for r in references], pattern, vocab_size
        self._next = 0
        self._replaying: dict[int, tuple[list[int], int]] = {}  # slot -> (its reference, its prompt's length)
        self.device = torch.device("cpu")

    def start(self, slot: int, prompt_ids: torch.Tensor, capacity: int) -> None:
        if self._next >= len(self.references):
            raise ValueError(f"the replay drafter has {len(self.references)} references and no more prompts to replay")
        self._replaying[slot] = (self.references[self._next], prompt_ids.shape[-1])
        self.device = prompt_ids.device
        self._next += 1

    def set_token(self, slot: int, position: int, token: int) -> None:
        pass

    def store_anchors(self, slot: int, stage: int, start: int, states: torch.Tensor) -> None:
        pass

    def draft(self, views, samplings, generators, rows=None) -> dict[int, Draft]:
        if not all(sampling.greedy for sampling in samplings.values()):
            raise ValueError("a replay drafter has no draft distribution: use it with greedy decoding only")
        return {b: (self._propose(b, view[-1][1] + 1), None) for b, view in views.items()}

    def _propose(self, slot: int, position: int) -> torch.Tensor:
        reference, prompt_len = self._replaying[slot]
        index = position - prompt_len
        right = reference[index] if index < len(reference) else 0
        wrong = self.pattern[index % len(self.pattern)] == "W"
        return torch.tensor([(right + 1) % self.vocab_size if wrong else right], device=self.device)
