"""A stage's target cache over B slots: static storage with a slot dimension, per-slot positions, per-slot reset and
exact per-slot rollback. Batch 1 is one slot. docs/DESIGN.md, "One cycle over B slots" ("Caches", "No host sync per
step") gives the storage, the dummy rows of a decode step and the tests; "The decode step at GPU speed" the capacity
buckets (`CAPACITY_STEP`).

A decode step writes row `b`'s key at that row's own position (`index_put_` at the device-resident positions) and
the additive mask hides every key past it. Before the step every row's Gated DeltaNet states are copied into ring
entry `position_b % window`; a rollback of slot `b` to `p` copies ring entry `p % window` of row `b` back. Tokens
that can still be rejected are at most `n` positions behind the newest, so a ring of `n + 1` suffices. The prompt is
never rolled back (the first generated token is always verified), and a prefill starts from zero states.

The object is also the HF cache the decoder layers call (`update`, `get_conv_state`, ...): over all rows in a
decode step, over one row (`StageCache.row(b, start)`) in that slot's prefill or a block forward of the chain
decoder, whose per-token snapshots (`snapshot_row`) give the same exact rollback.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import StaticCache
from transformers.cache_utils import LinearAttentionLayer, StaticLayer

from inference.runtime.hf_compat import LegacyStateReads, NoPastRecording
from inference.runtime.slot_rows import DeviceInts, leading, mark_static
from spd_lightning.errors import UserError

CAPACITY_STEP = 256


class CacheError(UserError):
    """A target whose cache the decoder cannot roll back (an unsupported layer type): the user picks another
    target. A broken cache invariant during decoding is a bug and raises `RuntimeError` instead."""


def round_capacity(positions: int) -> int:
    """The capacity bucket of `positions`: the smallest power of two >= both (`CAPACITY_STEP` a power of two)."""
    return max(CAPACITY_STEP, 1 << max(0, positions - 1).bit_length())


class StageCache(NoPastRecording, LegacyStateReads):
    def __init__(self, config, layer_indices: range, window: int, slots: int, device: torch.device):
        self.window, self.slots = window, slots
        kinds = StaticCache(config=config, max_cache_len=1).layers  # which layers are attention / linear
        self.attention_layers: list[int] = []
        self.linear_layers: list[int] = []
        for i in layer_indices:
            kind = type(kinds[i])
            if kind not in (StaticLayer, LinearAttentionLayer):
                raise CacheError(
                    f"target layer {i} uses a {kind.__name__} cache: the pipeline decoder supports "
                    f"full attention and linear attention (Gated DeltaNet) layers only"
                )
            (self.attention_layers if kind is StaticLayer else self.linear_layers).append(i)
        self.capacity = 0
        self.positions = DeviceInts(slots, device)  # positions each slot holds = the one it runs next
        self.rows = slots  # the rows the current decode step runs (a bucket)
        self._rows = torch.arange(slots, device=device)
        self.keys: dict[int, torch.Tensor] = {}  # allocated at the first prefill (shapes come from the layer)
        self.values: dict[int, torch.Tensor] = {}
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        self.conv_ring: dict[int, torch.Tensor] = {}
        self.recurrent_ring: dict[int, torch.Tensor] = {}

    @property
    def lengths(self) -> list[int]:
        """Positions each slot holds (the host mirror of `positions`)."""
        return self.positions.host

    # -- per-slot bookkeeping -------------------------------------------------------------------
    def reset(self, slot: int, capacity: int) -> None:
        """Slot `slot` starts a new sequence of at most `capacity` positions (its prefill comes next)."""
        self.reserve(capacity)
        self.positions.set(slot, 0)

    def reserve(self, positions: int) -> None:
        """Room for `positions` positions in every slot, keeping what each holds (a power-of-two bucket)."""
        if positions <= self.capacity:
            return
        capacity = round_capacity(positions)
        for store in (self.keys, self.values):
            for i, old in store.items():
                new = old.new_zeros(*old.shape[:2], capacity, old.shape[-1])
                new[:, :, : old.shape[2]] = old
                store[i] = new
                mark_static(new)
        self.capacity = capacity

    def rollback(self, slot: int, keep: int) -> None:
        """Discard slot `slot`'s positions `>= keep`; a no-op when it never ran them."""
        drop = self.lengths[slot] - keep
        if drop <= 0:
            return
        if drop >= self.window:
            raise RuntimeError(f"cannot roll back {drop} positions: snapshots cover the last {self.window - 1} only")
        for i in self.linear_layers:
            self.conv[i][slot].copy_(self.conv_ring[i][keep % self.window, slot])
            self.recurrent[i][slot].copy_(self.recurrent_ring[i][keep % self.window, slot])
        self.positions.set(slot, keep)

    def row(self, slot: int, start: int = 0) -> RowView:
        return RowView(self, slot, start)

    def snapshot_row(self, slot: int, layer: int, position: int) -> None:
        """Slot `slot`'s states of linear-attention layer `layer` into ring entry `position % window`, before the
        layer runs the token at `position` (a block forward steps such layers token by token)."""
        self.conv_ring[layer][position % self.window, slot].copy_(self.conv[layer][slot])
        self.recurrent_ring[layer][position % self.window, slot].copy_(self.recurrent[layer][slot])

    # -- one decode step over the leading rows -------------------------------------------------------
    def before_step(self, rows: int, running: list[int]) -> None:
        """On the host, before a decode step over rows `0..rows-1` in which the slots `running` run a real token."""
        for b in running:
            self.reserve(self.lengths[b] + 1)
        self.rows = rows

    def snapshot(self) -> None:
        """Inside the step: every row's Gated DeltaNet states into its ring entry `position % window`."""
        if not self.linear_layers:
            return
        rows = leading(self._rows, self.rows)
        ring_entries = leading(self.positions.device, self.rows) % self.window
        for i in self.linear_layers:
            self.conv_ring[i].index_put_((ring_entries, rows), leading(self.conv[i], self.rows))
            self.recurrent_ring[i].index_put_((ring_entries, rows), leading(self.recurrent[i], self.rows))

    def keep_idle_rows(self, running_mask: torch.Tensor) -> None:
        """Inside the step, after the layers: the idle rows' Gated DeltaNet states back as they were."""
        rows = leading(self._rows, self.rows)
        ring_entries = leading(self.positions.device, self.rows) % self.window
        for i in self.linear_layers:
            for state, ring in ((self.conv[i], self.conv_ring[i]), (self.recurrent[i], self.recurrent_ring[i])):
                state = leading(state, self.rows)
                mask = running_mask.view(-1, *([1] * (state.dim() - 1)))
                state.copy_(torch.where(mask, state, ring[ring_entries, rows]))

    # HF cache interface, decode step (every row, one token each)
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = leading(self.keys[layer_idx], self.rows), leading(self.values[layer_idx], self.rows)
        rows, positions = leading(self._rows, self.rows), leading(self.positions.device, self.rows)
        keys[rows, :, positions] = key_states[:, :, 0]  # row b at its own position
        values[rows, :, positions] = value_states[:, :, 0]
        return keys, values

    def get_conv_state(self, layer_idx, state_idx=0):
        return leading(self.conv[layer_idx], self.rows)

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return leading(self.recurrent[layer_idx], self.rows)

    def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
        return leading(self.recurrent[layer_idx], self.rows).copy_(recurrent_states)

    def update_conv_state(self, conv_states, layer_idx, state_idx=0, **kwargs):
        raise RuntimeError("a one-token decode step updates the conv state in place (causal_conv1d_update)")

    # -- storage, allocated when the first prefill shows the shapes -----------------------------
    def _attention_storage(self, i: int, like: torch.Tensor) -> None:
        if i not in self.keys:
            shape = (self.slots, like.shape[1], self.capacity, like.shape[-1])
            self.keys[i], self.values[i] = like.new_zeros(shape), like.new_zeros(shape)
            mark_static(self.keys[i], self.values[i])

    def _linear_storage(self, store: dict, ring: dict, i: int, shape: torch.Size, like: torch.Tensor) -> None:
        if i not in store:
            store[i] = like.new_zeros(self.slots, *shape)
            ring[i] = like.new_zeros(self.window, self.slots, *shape)
            mark_static(store[i], ring[i])


class RowView(NoPastRecording, LegacyStateReads):
    """Slot `slot`'s rows of a `StageCache` as the HF cache of a forward over that slot alone from position `start`:
    its prefill (`start` 0, the whole prompt from zero states), or a block on top of what it holds (the chain
    decoder's verify forward, which runs linear-attention layers one token at a time)."""

    def __init__(self, cache: StageCache, slot: int, start: int = 0):
        self.cache, self.slot, self.start = cache, slot, start

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        c, b, start = self.cache, self.slot, self.start
        c._attention_storage(layer_idx, key_states)
        end = start + key_states.shape[-2]
        c.keys[layer_idx][b, :, start:end] = key_states[0]
        c.values[layer_idx][b, :, start:end] = value_states[0]
        return c.keys[layer_idx][b : b + 1], c.values[layer_idx][b : b + 1]

    def get_conv_state(self, layer_idx, state_idx=0):
        return self.cache.conv[layer_idx][self.slot : self.slot + 1] if self.start else None  # a view: updated in place

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return self.cache.recurrent[layer_idx][self.slot : self.slot + 1] if self.start else None

    def update_conv_state(self, conv_states, layer_idx, state_idx=0, conv_kernel_size=None, **kwargs):
        """As HF's `LinearAttentionLayer`: keep the last `conv_kernel_size` inputs (zero-padded on the left) and
        return the inputs the causal conv runs over."""
        c, b = self.cache, self.slot
        if self.start:
            raise RuntimeError("a block forward must step linear-attention layers one token at a time")
        width = conv_kernel_size or conv_states.shape[-1]
        c._linear_storage(c.conv, c.conv_ring, layer_idx, (*conv_states.shape[1:-1], width), conv_states)
        full = conv_states
        if full.shape[-1] < width:
            full = F.pad(full, (width - full.shape[-1], 0))
        c.conv[layer_idx][b].copy_(full[0, ..., -width:])
        return full

    def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
        c, b = self.cache, self.slot
        c._linear_storage(c.recurrent, c.recurrent_ring, layer_idx, recurrent_states.shape[1:], recurrent_states)
        return c.recurrent[layer_idx][b].copy_(recurrent_states[0])
