"""A pipeline stage over B slots (issue 26): one slot's prefill, and one decode step over every slot at once.

`SlotStage` runs the layers of a `Stage` (the same modules, `Stage.run_layers`) over a `SlotCache`. A decode step
takes one token per row, `[B, 1]` ids on stage 1 or `[B, 1, H]` states, each row at its slot's own position;
the rows of slots that have no token at this stage this cycle run a dummy input and leave their caches as they
were (`SlotCache.keep_idle_rows`), so every step has the same shapes whatever the slots do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference.runtime.slot_cache import SlotCache
from inference.runtime.stages import Stage, attention_mask


@dataclass
class SlotStepOutput:
    hidden: torch.Tensor  # [B, 1, H] every row's output (idle rows: meaningless)
    anchors: torch.Tensor  # [B, A, H] the anchor states of each row's token
    logits: torch.Tensor | None  # [B, V] last stage only


class SlotStage:
    def __init__(self, stage: Stage, slots: int):
        self.stage, self.slots = stage, slots
        self.index, self.first, self.last = stage.index, stage.first, stage.last
        self.cache = SlotCache(stage.config, stage.layer_range, stage.geometry.n + 1, slots)
        self.positions = torch.zeros(slots, dtype=torch.long, device=stage.device)
        self.running = torch.zeros(slots, dtype=torch.bool, device=stage.device)

    @torch.no_grad()
    def prefill(
        self, slot: int, inputs: torch.Tensor, capacity: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Slot `slot` starts a new sequence: `inputs` (ids `[1, P]` or states `[1, P, H]`) at positions 0..P-1.
        Returns the output `[1, P, H]`, the anchors `[P, A, H]` and (last stage) the logits `[V]` of position P-1."""
        stage, P = self.stage, inputs.shape[1]
        self.cache.reset(slot, max(capacity, P))
        positions = torch.arange(P, device=inputs.device)[None]
        x = stage.embed_tokens(inputs) if self.first else inputs
        mask = attention_mask(positions, self.cache.capacity, x.dtype) if self.cache.attention_layers else None
        x, anchors, normed = stage.run_layers(x, positions, self.cache.row(slot), mask, self.cache.attention_layers)
        self.cache.lengths[slot] = P
        logits = stage.lm_head(normed[:, -1])[0] if self.last else None
        return x, anchors[0], logits

    @torch.no_grad()
    def step(self, inputs: torch.Tensor, tokens: dict[int, int]) -> SlotStepOutput:
        """One token per row: `tokens` maps each running slot to the position it runs (its cache length); every
        other row idles. `inputs`: ids `[B, 1]` on stage 1, states `[B, 1, H]` otherwise."""
        cache, stage = self.cache, self.stage
        lengths = list(cache.lengths)
        for b, position in tokens.items():
            if position != lengths[b] or position == 0:
                raise RuntimeError(
                    f"stage {self.index}, slot {b}: the cache holds {lengths[b]} positions but is asked to run "
                    f"position {position} as a single decoded token"
                )
        self.positions.copy_(torch.tensor(lengths))
        self.running.copy_(torch.tensor([b in tokens for b in range(self.slots)]))
        running = sorted(tokens)
        cache.before_step(self.positions, running)
        x = stage.embed_tokens(inputs) if self.first else inputs
        positions = self.positions[:, None]
        mask = attention_mask(positions, cache.capacity, x.dtype) if cache.attention_layers else None
        x, anchors, normed = stage.run_layers(x, positions, cache, mask, cache.attention_layers)
        cache.keep_idle_rows(self.running, running)
        logits = stage.lm_head(normed[:, -1]) if self.last else None
        return SlotStepOutput(x, anchors[:, 0], logits)
