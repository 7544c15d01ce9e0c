"""A pipeline stage over B slots (issue 26): one slot's prefill, and one decode step over the slots at once.

`SlotStage` runs the layers of a `Stage` (the same modules, `Stage.run_layers`) over a `SlotCache`. A decode step
takes one token per row, `[R, 1]` ids on stage 1 or `[R, 1, H]` states, over the leading `R` rows (a bucket,
`slot_rows.batch_bucket`), each row at its slot's own position (device-resident: the step reads no host data);
the rows of slots that have no token at this stage this cycle run a dummy input and leave their caches as they
were (`SlotCache.keep_idle_rows`), so every step of a bucket has the same shapes whatever the slots do.

`compile` (`--compile`, by default the `Stage`'s own setting, `Stage.use_compiled_decode`): the step (snapshot,
layers, idle rows restored, head) through `CompiledStep`, one graph per bucket and cache capacity, eager from the
first compile error on. Its outputs are cloned: a captured graph rewrites them on its next replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference.runtime.capture import CompiledStep
from inference.runtime.slot_cache import SlotCache
from inference.runtime.slot_rows import mark_static
from inference.runtime.stages import Stage, attention_mask


@dataclass
class SlotStepOutput:
    hidden: torch.Tensor  # [R, 1, H] every row's output (idle rows: meaningless)
    anchors: torch.Tensor  # [R, A, H] the anchor states of each row's token
    logits: torch.Tensor | None  # [R, V] last stage only


class SlotStage:
    def __init__(self, stage: Stage, slots: int, compile: bool | None = None):
        self.stage, self.slots = stage, slots
        self.index, self.first, self.last = stage.index, stage.first, stage.last
        self.cache = SlotCache(stage.config, stage.layer_range, stage.geometry.n + 1, slots, stage.device)
        self.running = self.cache.sets.mask()  # which rows run a real token this step
        mark_static(self.running)
        self.compiled = stage._compiled if compile is None else compile
        self._step = CompiledStep(self._decode_step, stage.device) if self.compiled else self._decode_step

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
        self.cache.positions.assign({slot: P})
        logits = stage.lm_head(normed[:, -1])[0] if self.last else None
        return x, anchors[0], logits

    @torch.no_grad()
    def step(self, inputs: torch.Tensor, tokens: dict[int, int]) -> SlotStepOutput:
        """One token per row over the leading `inputs.shape[0]` rows: `tokens` maps each running slot to the
        position it runs (its cache length); every other row idles. `inputs`: ids `[R, 1]` on stage 1, states
        `[R, 1, H]` otherwise."""
        cache, rows = self.cache, inputs.shape[0]
        for b, position in tokens.items():
            if position != cache.lengths[b] or position == 0 or b >= rows:
                raise RuntimeError(
                    f"stage {self.index}, slot {b}: the cache holds {cache.lengths[b]} positions but is asked to run "
                    f"position {position} as a single decoded token in a step over {rows} rows"
                )
        running = sorted(tokens)
        cache.before_step(rows, running)
        mask = cache.sets.write(running, self.running)[:rows]
        hidden, anchors, logits = self._step(inputs, mask)
        if self.compiled:  # the captured graph owns its outputs and rewrites them on the next replay
            hidden, anchors = hidden.clone(), anchors.clone()
            logits = logits.clone() if logits is not None else None
        cache.after_step(running, mask)
        return SlotStepOutput(hidden, anchors, logits)

    def _decode_step(
        self, inputs: torch.Tensor, running: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The step over `cache.rows` rows, all on the device: no host reads, fixed shapes per bucket."""
        cache, stage = self.cache, self.stage
        cache.snapshot()
        x = stage.embed_tokens(inputs) if self.first else inputs
        positions = cache.positions.device[: cache.rows, None]
        mask = attention_mask(positions, cache.capacity, x.dtype) if cache.attention_layers else None
        x, anchors, normed = stage.run_layers(x, positions, cache, mask, cache.attention_layers)
        cache.keep_idle_rows(running)
        logits = stage.lm_head(normed[:, -1]) if self.last else None
        return x, anchors[:, 0], logits
