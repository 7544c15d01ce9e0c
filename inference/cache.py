"""A stage's target cache, with exact rollback (SPEC 5.1, hybrid targets).

Each stage keeps a Hugging Face `DynamicCache(config=...)` that holds state only for its own layers
(the HF layers are called with their global `layer_idx`). A rejection discards every position from
`rollback_to` on, and the cache must then equal, bit for bit, the cache of a run that never saw them:

- attention layers: keys/values are cropped along the sequence axis;
- linear-attention layers (Gated DeltaNet) fold every token into a conv state and a recurrent state
  that cannot be cropped, so before a stage runs a single token at position `p` it copies those states
  into slot `p % window` of a preallocated ring; a rollback to `p` copies them back. Tokens that can
  still be rejected are at most `n` positions behind the newest, so a ring of `n + 1` slots suffices.

The prompt is never rolled back (the first generated token is always verified), so prefill takes no
snapshot.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

from spd_lightning.errors import UserError


class CacheError(UserError):
    """A target whose cache the decoder cannot roll back (an unsupported layer type): the user picks another
    target. A broken cache invariant during decoding is a bug and raises `RuntimeError` instead."""


class StageCache:
    def __init__(self, config, layer_indices: range, window: int):
        self.config = config
        self.layer_indices = layer_indices
        self.window = window
        self.hf = DynamicCache(config=config)
        self._check_layer_types()
        self.length = 0  # positions held (the same for every layer of the stage)
        self._ring: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (conv ring, recurrent ring)

    def _check_layer_types(self) -> None:
        for i in self.layer_indices:
            layer = self.hf.layers[i]
            if type(layer) not in (DynamicLayer, LinearAttentionLayer):
                raise CacheError(f"target layer {i} uses a {type(layer).__name__} cache: the pipeline decoder supports "
                                 f"full attention and linear attention (Gated DeltaNet) layers only")

    @property
    def linear_layers(self) -> list[int]:
        return [i for i in self.layer_indices if isinstance(self.hf.layers[i], LinearAttentionLayer)]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i in self.layer_indices if isinstance(self.hf.layers[i], DynamicLayer)]

    def reset(self) -> None:
        """Forget everything (a new prompt); the next forward is a prefill."""
        self.hf = DynamicCache(config=self.config)
        self.length = 0
        self._ring = {}

    def _states(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.hf.layers[i]
        return layer.conv_states[0], layer.recurrent_states[0]

    def before_token(self, position: int) -> None:
        """Called before the stage runs the single token at `position` (== `length`)."""
        if position != self.length:
            raise RuntimeError(f"stage cache holds {self.length} positions but is asked to run position {position}")
        for i in self.linear_layers:
            conv, recurrent = self._states(i)
            if i not in self._ring:  # allocated once per prompt, after prefill made the states exist
                self._ring[i] = (conv.new_empty((self.window, *conv.shape)), recurrent.new_empty((self.window, *recurrent.shape)))
            conv_ring, recurrent_ring = self._ring[i]
            conv_ring[position % self.window].copy_(conv)
            recurrent_ring[position % self.window].copy_(recurrent)

    def advance(self, count: int) -> None:
        self.length += count

    def rollback(self, keep: int) -> None:
        """Discard every position `>= keep`; a no-op when the stage never ran them."""
        drop = self.length - keep
        if drop <= 0:
            return
        if drop >= self.window:
            raise RuntimeError(f"cannot roll back {drop} positions: snapshots cover the last {self.window - 1} only")
        for i in self.attention_layers:
            self.hf.layers[i].crop(-drop)
        for i in self.linear_layers:
            conv, recurrent = self._states(i)
            conv_ring, recurrent_ring = self._ring[i]
            conv.copy_(conv_ring[keep % self.window])  # in place: the HF layer keeps its tensors
            recurrent.copy_(recurrent_ring[keep % self.window])
        self.length = keep
