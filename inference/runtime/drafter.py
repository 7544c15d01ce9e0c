"""The drafter runtime on the PDM rank: the PDM with its KV cache over B slots, fed by the staircase (docs/DESIGN.md,
"Terms"); one body forward drafts the next token of every drafting slot. docs/DESIGN.md gives each slot's segment
and why `W = n + 1` columns hold it ("One cycle over B slots": "The PDM"), and the host table, the batched ops and
the counter-based draw ("The critical path": "The draft is batched tensor work").

Each slot keeps a row of anchor states per position (`states[B, capacity, m, H]`, filled as the stages send them;
anchor 0 is the embedding, which this rank computes itself from the token id) and the body keys/values of its
verified positions (`SlotDraftKV`, one length per slot). Rows that do not draft this cycle, and the columns after a
shorter segment, write keys past anything their slot holds: masked, and overwritten before any draft reads them,
as in-flight positions are.

`compile` (`--compile`): the gather, fusion, body and head over the fixed `[R, W]` shape through `CompiledStep`,
one graph per bucket and capacity (every type projected); eager steps project only the types present. `capture=False`
(the shared placement, whose draft runs beside stage 1's captured step): compiled without CUDA graphs.

`replay.ReplayDrafter` proposes from a known continuation instead, behind the same `Drafter` interface.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from inference.runtime.cache import round_capacity
from inference.runtime.capture import CompiledStep
from inference.runtime.slot_rows import HostTable, batch_bucket, leading, mark_static
from inference.sampling import Sampling, counter_uniforms, draw_rows, seed_keys, warp_rows
from spd_lightning.export import DrafterLoadError
from spd_lightning.geometry import Geometry
from spd_lightning.pdm import PipelineDraftModule

# The columns of the per-step table: where a row's segment starts (its cached length), its newest column, the
# position it drafts, whether it drafts, a seed token entering at a position (-1: none), then one type per column.
START, NEWEST, NEXT, DRAFTING, SEED_POSITION, SEED_TOKEN, TYPES = range(7)


class DraftBatch(NamedTuple):
    """One draft per row of the step's bucket: target ids `[R]` on the drafter's device, and the draft
    distributions `q[R, V_d]` (None when every drafting slot is greedy). Rows of slots that did not draft hold
    nothing to read."""

    tokens: torch.Tensor
    q: torch.Tensor | None


class Drafter(Protocol):
    """What the PDM rank runs over its slots."""

    def start(self, slot: int, prompt_ids: torch.Tensor, capacity: int, sampling: Sampling, seed: int) -> None: ...
    def set_token(self, slot: int, position: int, token: int) -> None: ...
    def store_anchors(self, slot: int, stage: int, start: int, states: torch.Tensor) -> None: ...
    def store_step_anchors(self, stage: int, positions: Mapping[int, int], states: torch.Tensor) -> None: ...
    def draft(self, views: Mapping[int, Sequence[tuple[int, int]]], rows: int | None = None) -> DraftBatch: ...


class SlotDraftKV:
    """The PDM's body keys/values per slot, the `attend` of its batched forward: row `b`'s `S` new keys are
    written at `[offsets_b, offsets_b + S)` and its queries attend causally over `[0, offsets_b + i]`; `offsets`
    is the device column of the step's table with each row's cached length."""

    def __init__(self, num_layers: int, slots: int, heads: int, head_dim: int, capacity: int, dtype, offsets):
        device = offsets.device
        self.keys = torch.zeros(num_layers, slots, heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.offsets = offsets
        self.rows = torch.arange(slots, device=device)
        self.positions = torch.arange(capacity, device=device)
        mark_static(self.keys, self.values, self.offsets, self.rows, self.positions)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        R = q.shape[0]
        written = self.offsets[:R, None] + torch.arange(q.shape[-2], device=q.device)  # [R, S]
        rows = self.rows[:R, None].expand_as(written)
        keys, values = leading(self.keys[layer], R), leading(self.values[layer], R)
        keys[rows, :, written] = k.transpose(1, 2)  # [R, S, heads, dim] at (row, position)
        values[rows, :, written] = v.transpose(1, 2)
        mask = self.positions[None, None, None, :] <= written[:, None, :, None]  # [R, 1, S, capacity]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)

    def row_attend(self, slot: int, start: int) -> Callable:
        """The `attend` of slot `slot` alone, its new keys at `start..` and causal over `[0, start + i]`: a commit
        of verified positions (the EAGLE-3 drafter's chain steps too, one position each)."""

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            S, end = q.shape[-2], start + q.shape[-2]
            keys, values = self.keys[layer, slot : slot + 1], self.values[layer, slot : slot + 1]
            keys[:, :, start:end], values[:, :, start:end] = k, v
            mask = None  # one query sees every key up to its own
            if S > 1:
                mask = torch.arange(end, device=q.device)[None, :] <= start + torch.arange(S, device=q.device)[:, None]
            return F.scaled_dot_product_attention(
                q, keys[:, :, :end], values[:, :, :end], attn_mask=mask, enable_gqa=True
            )

        return attend


class SlotSampling:
    """Each slot's sampling settings and seed keys as `[B]` device tensors, written when a request joins."""

    def __init__(self, slots: int, device: torch.device):
        self.temperature = torch.zeros(slots, device=device)
        self.top_k = torch.zeros(slots, dtype=torch.long, device=device)
        self.top_p = torch.ones(slots, device=device)
        self.keys = torch.zeros(2, slots, dtype=torch.long, device=device)
        self.greedy = [True] * slots  # the host's copy: a step of greedy slots only skips the warp
        mark_static(self.temperature, self.top_k, self.top_p, self.keys)

    def set(self, slot: int, sampling: Sampling, seed: int) -> None:
        # kernel arguments, no host memory copied; clamped to what the tensors hold, which `warp` treats alike
        # (a temperature above float32's largest is that largest; a top-k of 2**62 keeps every token)
        self.temperature[slot].fill_(min(sampling.temperature, torch.finfo(torch.float32).max))
        self.top_k[slot].fill_(min(sampling.top_k, 2**62))
        self.top_p[slot].fill_(sampling.top_p)
        for row, key in zip(self.keys, seed_keys(seed)):
            row[slot].fill_(key)
        self.greedy[slot] = sampling.greedy

    def choose(
        self, logits: torch.Tensor, drafted: torch.Tensor, sampled: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft ids `[R]` and `q[R, V_d]` (None when `sampled` is False: argmax) for the leading rows; `drafted`
        is each row's drafted position, the counter of its uniform."""
        if not sampled:
            return logits.argmax(-1), None
        R = logits.shape[0]
        q = warp_rows(logits, leading(self.temperature, R), leading(self.top_k, R), leading(self.top_p, R))
        return draw_rows(q, counter_uniforms(self.keys[0, :R], self.keys[1, :R], drafted)), q


class PDMDrafter:
    def __init__(
        self,
        pdm: PipelineDraftModule,
        geometry: Geometry,
        embed_tokens: nn.Module,
        state_dtype,
        slots: int,
        compile: bool = False,
        capture: bool = True,
    ):
        check_drafter(pdm, geometry, embed_tokens)
        self.pdm, self.geometry, self.embed_tokens, self.slots = pdm, geometry, embed_tokens, slots
        p = next(pdm.parameters())
        self.device, self.dtype, self.state_dtype = p.device, p.dtype, state_dtype
        self.capacity, self.width = 0, geometry.n + 1
        anchor_index = {b: i for i, b in enumerate(geometry.anchors)}
        self._stage_anchors = {
            s: [anchor_index[b] for b in geometry.anchors_of_stage(s) if b > 0] for s in range(1, geometry.n + 1)
        }
        self.lengths = [0] * slots  # each slot's cached (verified) positions
        self.table = HostTable(slots, TYPES + self.width, self.device)
        # per stage, the position each slot's row of a step's anchor message goes to (one table each: a table is
        # written again only a step later, when its copy is long done)
        self._anchor_rows = {s: HostTable(slots, 1, self.device) for s, a in self._stage_anchors.items() if a}
        self.sampling = SlotSampling(slots, self.device)
        self._seeds: dict[int, tuple[int, int]] = {}  # slot -> (position, token) entering before its next draft
        self._columns = torch.arange(self.width, device=self.device)
        self._row_ids = torch.arange(slots, device=self.device)
        mark_static(self._columns, self._row_ids)
        self.compiled = compile
        self._step = CompiledStep(self._logits, self.device, capture) if compile else self._logits
        self._reserve(1)

    def _reserve(self, positions: int) -> None:
        """Room for `positions` positions in every slot, keeping what each holds (a power-of-two bucket), and one
        spare last position that no sequence reaches: where a step's anchor rows of slots without anchors go."""
        if positions < self.capacity:
            return
        capacity, cfg = round_capacity(positions + 1), self.pdm.cfg
        shape = (self.slots, capacity, self.geometry.num_types, cfg.target_hidden_size)
        states = torch.zeros(shape, dtype=self.state_dtype, device=self.device)
        offsets = self.table.device[:, START]
        cache = SlotDraftKV(cfg.num_layers, self.slots, cfg.num_kv_heads, cfg.head_dim, capacity, self.dtype, offsets)
        if self.capacity:
            held = self.capacity
            states[:, :held] = self.states
            cache.keys[:, :, :, :held], cache.values[:, :, :, :held] = self.cache.keys, self.cache.values
        mark_static(states)  # unmarked, a CUDA graph would copy the whole store into a buffer of its own each replay
        self.states, self.cache, self.capacity = states, cache, capacity

    @torch.no_grad()
    def start(
        self, slot: int, prompt_ids: torch.Tensor, capacity: int, sampling: Sampling = Sampling(), seed: int = 0
    ) -> None:
        """Slot `slot` starts a sequence of at most `capacity` positions: the prompt's own embeddings; its draws
        follow `sampling` and `seed` (the request's draft seed)."""
        P = prompt_ids.shape[-1]
        self._reserve(capacity)
        self.lengths[slot] = 0
        self._seeds.pop(slot, None)
        self.states[slot].zero_()
        self.states[slot, :P, 0] = self.embed_tokens(prompt_ids.reshape(1, P).to(self.device))[0]
        self.sampling.set(slot, sampling, seed)

    def set_token(self, slot: int, position: int, token: int) -> None:
        """A seed token (a first token, a correction) enters at `position`: embedded with the next draft."""
        self._seeds[slot] = (position, token)

    def store_anchors(self, slot: int, stage: int, start: int, states: torch.Tensor) -> None:
        """`states[S, A, H]`: the anchors stage `stage` produced for slot `slot`'s positions `start..start+S-1`."""
        anchors = self._stage_anchors[stage]
        if anchors:
            self.states[slot, start : start + states.shape[0], anchors[0] : anchors[-1] + 1] = states

    def store_step_anchors(self, stage: int, positions: Mapping[int, int], states: torch.Tensor) -> None:
        """One step's anchors of stage `stage`: row `b` of the message `states[B, A, H]` at position `positions[b]`
        for each slot `b` listed (the other rows go to the spare position), in one write for any number of slots."""
        anchors = self._stage_anchors[stage]
        if not anchors or not positions:
            return
        table = self._anchor_rows[stage]
        host = table.writable()
        host[:, 0] = self.capacity - 1
        for b, position in positions.items():
            host[b, 0] = position
        R = states.shape[0]
        rows = table.upload(R)[:, 0]
        self.states[leading(self._row_ids, R), rows, anchors[0] : anchors[-1] + 1] = states

    @torch.no_grad()
    def draft(self, views: Mapping[int, Sequence[tuple[int, int]]], rows: int | None = None) -> DraftBatch:
        """Draft the token after each view's newest position, for every slot in `views` (its (depth, position)
        pairs of in-flight tokens, oldest first), in one forward over the leading `rows` rows (default: the
        bucket of the last drafting or seeded slot)."""
        rows = max(rows or 0, batch_bucket(max([*views, *self._seeds]) + 1, self.slots))
        for b, view in views.items():
            self._commit_overflow(b, view)
        self._reserve(max(self.lengths[:rows]) + self.width + 1)
        seeded = bool(self._seeds)
        present = self._write_table(views, rows)
        table = self.table.upload(rows)
        if seeded:  # the seed tokens' embeddings at their positions, in every row that has one
            self._embed_at(table[:, SEED_POSITION], table[:, SEED_TOKEN].clamp(min=0), table[:, SEED_TOKEN] >= 0)
        logits = self._step(table, present)
        if self.compiled:  # the captured graph owns its output
            logits = logits.clone()
        for b, view in views.items():
            self.lengths[b] = view[0][1]  # newly verified: cached for good
        ids, q = self.sampling.choose(logits, table[:, NEXT], not all(self.sampling.greedy[b] for b in views))
        tokens = self.pdm.d2t[ids]
        # each drafted token at the position it was drafted for (rows that did not draft keep theirs)
        self._embed_at(table[:, NEXT], tokens, None if len(views) == rows else table[:, DRAFTING].bool())
        return DraftBatch(tokens, q)

    def _write_table(self, views: Mapping[int, Sequence[tuple[int, int]]], rows: int) -> tuple[int, ...]:
        """Each row's segment into the host table (idle rows: an empty segment at their cached length). Returns
        the types the step runs: every type when compiled (one graph), else the types present. The step always
        runs every column: the shapes of a draft never depend on what the PDM knew of a verdict, so a draft it
        discards leaves the next one bit for bit as it would be."""
        geometry, table = self.geometry, self.table.writable()
        verified_type = geometry.type_of(geometry.n)
        table[:rows] = 0
        table[:rows, SEED_TOKEN] = -1
        table[:rows, TYPES:] = verified_type
        table[:rows, START] = self.lengths[:rows]
        table[:rows, NEXT] = self.lengths[:rows]
        present = {verified_type}
        for b, view in views.items():
            start, first, last = self.lengths[b], view[0][1], view[-1][1]
            types = [geometry.type_of(d) for d, _ in view]
            row = table[b]
            row[NEWEST], row[NEXT], row[DRAFTING] = last - start, last + 1, 1
            row[TYPES + first - start : TYPES + last + 1 - start] = types
            present.update(types)
        for b, (position, token) in self._seeds.items():
            table[b, SEED_POSITION], table[b, SEED_TOKEN] = position, token
        self._seeds.clear()
        return tuple(range(1, geometry.num_types + 1)) if self.compiled else tuple(sorted(present))

    def _embed_at(self, positions: torch.Tensor, tokens: torch.Tensor, writes: torch.Tensor | None) -> None:
        """H^0 (anchor 0) of each row's token `tokens[R]` at its position `positions[R]`; the rows where `writes`
        is False keep theirs (None: every row writes)."""
        rows = leading(self._row_ids, positions.shape[0])
        embedded = self.embed_tokens(tokens).to(self.state_dtype)
        if writes is not None:
            embedded = torch.where(writes[:, None], embedded, self.states[rows, positions, 0])
        self.states[rows, positions, 0] = embedded

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
        self.lengths[slot] = start + count

    def _logits(self, table: torch.Tensor, present: tuple[int, ...]) -> torch.Tensor:
        """Draft logits `[R, V_d]` at each row's newest column: its segment's states gathered and fused (each
        column at its type), through the body."""
        R = table.shape[0]
        positions = table[:, START, None] + self._columns  # [R, W]
        states = self.states[self._row_ids[:R, None], positions].to(self.dtype)  # [R, W, m, H]
        g = self.pdm.fusion.by_type(states, table[:, TYPES:], present)
        hidden = self.pdm.body(g, positions, self.cache)  # [R, W, d]
        return self.pdm.lm_head(hidden[leading(self._row_ids, R), table[:, NEWEST]])


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
