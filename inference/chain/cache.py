"""The chain target's cache over every layer: static storage written in place, with exact rollback (docs/DESIGN.md,
"The EAGLE-3 baseline"; the pipeline's stages use inference/runtime/cache.py).

One Hugging Face `StaticCache(config=...)` holds every layer's state. Storage is allocated once and then only
written:

- attention layers (`StaticLayer`): keys/values preallocated to `capacity` positions (the prompt's context
  budget, rounded up to a power of two of at least `CAPACITY_STEP`, as the stages' caches do), written in place
  at the layer's device-side length; the target masks the unwritten tail. A rollback moves that length back
  and the next block overwrites the discarded positions. A new prompt reuses the storage when it fits; a
  forward past `capacity` (a caller that gave no budget) regrows it, doubling;
- linear-attention layers (Gated DeltaNet, `LinearAttentionLayer`) fold every token into a conv state and
  a recurrent state, updated in place, that cannot be cropped: before the verify forward runs the token at
  position `p` through such a layer it copies them into entry `p % window` of a ring allocated once per model;
  a rollback to `p` copies them back. A rollback discards at most the block of one verify forward (`k + 1`
  tokens), so a ring of `k + 2` entries suffices.

The prompt is never rolled back (the first generated token is always verified), so prefill takes no
snapshot, and position 0 is always a prefill (of one token or more).

A rejection discards every position from `rollback_to` on, and the cache must then equal, bit for bit
over the positions it holds, the cache of a run that never saw them.
"""

from __future__ import annotations

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from inference.runtime.cache import CAPACITY_STEP, layer_kinds, round_capacity
from inference.runtime.hf_compat import crop_static


class ChainCache:
    def __init__(self, config, window: int):
        self.window = window
        self.capacity = CAPACITY_STEP  # positions the attention storage holds (allocated at the first prefill)
        self.hf = StaticCache(config=config, max_cache_len=self.capacity)
        self.attention_layers, self.linear_layers = layer_kinds(self.hf.layers, range(len(self.hf.layers)), "chain")
        self.length = 0  # positions held (the same for every layer)
        self._ring: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (conv ring, recurrent ring)

    def reset(self, capacity: int = 0) -> None:
        """Forget everything (a new prompt of at most `capacity` positions); the next forward is a prefill.
        Storage is kept when it is large enough, regrown when not."""
        self.length = 0
        self.reserve(capacity)  # holds nothing: a regrow copies nothing
        for i in self.attention_layers:
            layer = self.hf.layers[i]
            if layer.is_initialized:
                layer.cumulative_length.zero_()  # stale keys stay: masked, then overwritten
        for i in self.linear_layers:
            self.hf.layers[i].reset()  # zeroes the states in place; the next update is a prefill

    def reserve(self, positions: int) -> None:
        """Make room for `positions` positions, keeping what is held."""
        if positions <= self.capacity:
            return
        capacity = round_capacity(max(positions, 2 * self.capacity))
        for i in self.attention_layers:
            old, new = self.hf.layers[i], StaticLayer(max_cache_len=capacity)
            if old.is_initialized:
                new.lazy_initialization(old.keys, old.values)
                new.keys[:, :, : self.length] = old.keys[:, :, : self.length]
                new.values[:, :, : self.length] = old.values[:, :, : self.length]
                new.cumulative_length.fill_(self.length)
            self.hf.layers[i] = new
        self.capacity = capacity

    def keys_values(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention layer `i`'s keys and values of the positions held."""
        layer = self.hf.layers[i]
        return layer.keys[:, :, : self.length], layer.values[:, :, : self.length]

    def states(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Linear-attention layer `i`'s conv and recurrent states."""
        layer = self.hf.layers[i]
        return layer.conv_states[0], layer.recurrent_states[0]

    def snapshot_layer(self, i: int, position: int) -> None:
        """Keep linear-attention layer `i`'s states as they are before it runs the token at `position`, so
        that `rollback(position)` restores them. The verify forward runs a block layer by layer and calls it per
        layer and token."""
        conv, recurrent = self.states(i)
        if i not in self._ring:  # once per model: the states' shapes never change
            self._ring[i] = (
                conv.new_empty((self.window, *conv.shape)),
                recurrent.new_empty((self.window, *recurrent.shape)),
            )
        conv_ring, recurrent_ring = self._ring[i]
        conv_ring[position % self.window].copy_(conv)
        recurrent_ring[position % self.window].copy_(recurrent)

    def rollback(self, keep: int) -> None:
        """Discard every position `>= keep`; a no-op when the stage never ran them."""
        drop = self.length - keep
        if drop <= 0:
            return
        if drop >= self.window:
            raise RuntimeError(f"cannot roll back {drop} positions: snapshots cover the last {self.window - 1} only")
        for i in self.attention_layers:
            crop_static(self.hf.layers[i], drop)  # moves the device-side length; the storage stays
        for i in self.linear_layers:
            conv, recurrent = self.states(i)
            conv_ring, recurrent_ring = self._ring[i]
            conv.copy_(conv_ring[keep % self.window])  # in place: the HF layer keeps its tensors
            recurrent.copy_(recurrent_ring[keep % self.window])
        self.length = keep
