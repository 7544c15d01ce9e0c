"""The one place that knows how transformers' decoder-layer cache API differs between the supported releases
(transformers >= 5.15, `spd_lightning.environment.versions`): the keyword a layer takes its cache by
(`cache_kwargs`), the Gated DeltaNet state reads of releases before 5.23 (`LegacyStateReads`), the past-recording
questions of 5.25 (`NoPastRecording`) and the positions a multimodal rotary embedding takes (`rotary_positions`),
each decided by what the installed code offers, never by a version string (docs/DESIGN.md, "Supported versions":
"One adapter, chosen by feature").
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import torch
from torch import nn

from spd_lightning.errors import TargetError

# layer class -> the keyword its forward takes the cache by (filled on a layer's first, eager, call: a prefill)
_KEYWORDS: dict[type, str] = {}


@torch.compiler.disable
def _detect_keyword(kind: type) -> str:
    parameters = inspect.signature(kind.forward).parameters  # follows the wrappers' __wrapped__ (deprecate_kwarg)
    for keyword in ("cache", "past_key_values"):
        if keyword in parameters:
            _KEYWORDS[kind] = keyword
            return keyword
    raise TargetError(
        f"{kind.__name__}.forward takes neither `cache` nor `past_key_values`: the pipeline decoder cannot hand "
        f"this target's layers a cache; use a transformers model class with a standard decoder layer"
    )


def cache_kwargs(layer: nn.Module, cache) -> dict:
    """`{keyword: cache}` for calling HF decoder layer `layer` with `cache`: `layer(x, **cache_kwargs(layer, c))`."""
    kind = type(layer)
    return {_KEYWORDS.get(kind) or _detect_keyword(kind): cache}


def rotary_positions(rotary_emb: nn.Module, positions: torch.Tensor) -> torch.Tensor:
    """The position ids to call `rotary_emb` with for text positions `positions` `[B, S]`: the same positions on
    each of the three mRoPE axes for a multimodal rotary embedding (what its model does for text), else as given."""
    return positions[None].expand(3, -1, -1) if hasattr(rotary_emb, "mrope_section") else positions


class NoPastRecording:
    """A Gated DeltaNet cache that never records past states: ours roll back by their own snapshot ring
    (docs/DESIGN.md, "One cycle over B slots"). From 5.23 a layer asks `is_recording_past`; from 5.25 it also asks
    how many intermediate recurrent states to return (`get_recurrent_states_to_keep`: 0, the final state alone) and
    reports a one-token conv update it made in place (`increase_count`: our caches count positions themselves)."""

    def is_recording_past(self, layer_idx) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx=None) -> int:
        return 0

    def increase_count(self, layer_idx, state_idx=0) -> None:
        pass


class LegacyStateReads:
    """The Gated DeltaNet state reads of transformers < 5.23, answered from the methods of 5.23 and later that
    the class implements (`get_conv_state`, `get_recurrent_state`, `is_recording_past`)."""

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = 0) -> bool:
        return self.get_conv_state(layer_idx, state_idx or 0) is not None

    @property
    def layers(self) -> _LayerStates:
        return _LayerStates(self)


class _LayerStates:
    """`cache.layers[i]` as the older releases read it: one linear-attention layer's flag and states."""

    def __init__(self, cache: LegacyStateReads):
        self.cache = cache

    def __getitem__(self, layer_idx: int) -> SimpleNamespace:
        c = self.cache
        return SimpleNamespace(
            record_past=c.is_recording_past(layer_idx),
            conv_states={0: c.get_conv_state(layer_idx, 0)},
            recurrent_states={0: c.get_recurrent_state(layer_idx, 0)},
        )
