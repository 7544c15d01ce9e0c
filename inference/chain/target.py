"""The whole target as ONE verify stage for chain speculative decoding (docs/DESIGN.md, "The EAGLE-3 baseline"),
with exact rollback.

`ChainTarget` runs the whole target (embedding, every layer, final norm, LM head) over a block of tokens at
`start..start+S-1` on top of its cache and returns the logits of every position plus the EAGLE-3 feature states
(`hidden_states[l]` for the drafter's feature layers). Its cache is one slot of a `StageCache` over every layer, and
its layers run as a stage's (`stages.run_layers`): a prefill (`start == 0`) is one causal forward, a verify block
steps linear-attention layers token by token with a snapshot each, so `rollback(keep)` leaves exactly the accepted
positions (docs/EAGLE3.md, "Chain decoding"). A rollback discards at most one block: the snapshot ring holds
`max_block + 1` entries.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inference.runtime.cache import StageCache
from inference.runtime.stages import run_layers
from spd_lightning.eagle3.model import check_feature_layers
from spd_lightning.target import Target


class ChainTarget:
    def __init__(self, target: Target, feature_layers: Sequence[int], max_block: int):
        """`max_block`: the most tokens one verify forward runs (k + 1)."""
        self.num_layers, self.layers = target.num_layers, list(target.layers)
        self.embed_tokens, self.norm, self.lm_head = target.embed_tokens, target.norm, target.lm_head
        self.rotary_emb = target.rotary_emb
        self.feature_layers = check_feature_layers(feature_layers, self.num_layers)
        self.cache = StageCache(target.config, range(self.num_layers), max_block + 1, 1, self.device)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def reset(self, capacity: int = 0) -> None:
        """Forget everything before a prompt of at most `capacity` positions (0: grow when needed)."""
        self.cache.reset(0, capacity)

    def rollback(self, keep: int) -> None:
        """Keep positions `< keep` (the accepted ones), discard the rest."""
        self.cache.rollback(0, keep)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run `tokens[1, S]` at positions `start..`; returns logits `[S, V]` and features `[S, 3, H]`."""
        S, held = tokens.shape[1], self.cache.lengths[0]
        if start != held:
            raise RuntimeError(f"the target cache holds {held} positions but is asked to run position {start}")
        self.cache.reserve(start + S)  # before the mask: a regrow changes the capacity
        x = self.embed_tokens(tokens.to(self.device))
        positions = torch.arange(start, start + S, device=self.device)[None]
        view = self.cache.row(0, start)  # a prefill (start 0) is never rolled back: no snapshots, one pass per layer
        out, captured = run_layers(
            enumerate(self.layers), x, positions, self.rotary_emb, self.cache, view, self.feature_layers
        )
        normed = self.norm(out)
        # hidden_states[0] is the embedding output, [L] the final-norm output (docs/DESIGN.md, "Terms")
        captured |= {0: x, self.num_layers: normed}
        self.cache.positions.set(0, start + S)
        features = torch.stack([captured[b][0] for b in self.feature_layers], dim=1)
        return self.lm_head(normed)[0], features
