"""The whole target as ONE verify stage for chain speculative decoding (docs/DESIGN.md, "The EAGLE-3 baseline"),
with exact rollback.

`ChainTarget` runs the whole target (embedding, every layer, final norm, LM head) over a block of tokens at
`start..start+S-1` on top of its cache and returns the logits of every position plus the EAGLE-3 feature states
(`hidden_states[l]` for the drafter's feature layers). Its cache is one slot of a `StageCache` over every layer
(docs/EAGLE3.md, "Chain decoding"): a prefill (`start == 0`) is one causal forward, the path of a stage's prefill
(and of AR); a verify block runs attention layers over all S tokens at once and steps linear-attention (Gated
DeltaNet) layers one token at a time, each token's states snapshotted first (`StageCache.snapshot_row`), so
`rollback(keep)` (`StageCache.rollback`) leaves exactly the accepted positions. The snapshot ring holds
`max_block + 1` entries: a rollback discards at most one block.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inference.runtime.cache import StageCache
from inference.runtime.hf_compat import cache_kwargs, rotary_positions
from inference.runtime.stages import attention_mask
from spd_lightning.eagle3.model import check_feature_layers
from spd_lightning.target import Target


class ChainTarget:
    def __init__(self, target: Target, feature_layers: Sequence[int], max_block: int):
        """`max_block`: the most tokens one verify forward runs (k + 1); the snapshot ring holds one more."""
        self.num_layers, self.layers = target.num_layers, list(target.layers)
        self.embed_tokens, self.norm, self.lm_head = target.embed_tokens, target.norm, target.lm_head
        self.rotary_emb = target.rotary_emb
        self.feature_layers = check_feature_layers(feature_layers, self.num_layers)
        self.cache = StageCache(target.config, range(self.num_layers), max_block + 1, 1, self.device)
        self.linear = set(self.cache.linear_layers)

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
        cos, sin = self.rotary_emb(x, rotary_positions(self.rotary_emb, positions))
        mask = attention_mask(positions, self.cache.capacity, x.dtype)  # causal, the unwritten tail hidden
        view = self.cache.row(0, start)
        step = start > 0  # a prefill is never rolled back: no snapshots, one chunked pass per layer
        wanted = set(self.feature_layers)
        captured = {0: x} if 0 in wanted else {}
        for i, layer in enumerate(self.layers):
            linear = i in self.linear
            spans = [(j, j + 1) for j in range(S)] if linear and step else [(0, S)]
            outs = []
            for a, b in spans:
                if linear and step:
                    self.cache.snapshot_row(0, i, start + a)
                # Gated DeltaNet reads attention_mask as a padding mask: only attention layers get the causal one.
                outs.append(
                    layer(
                        x[:, a:b],
                        position_embeddings=(cos[:, a:b], sin[:, a:b]),
                        attention_mask=None if linear else mask,
                        position_ids=positions[:, a:b],
                        **cache_kwargs(layer, view),
                        use_cache=True,
                    )
                )
            x = torch.cat(outs, dim=1)
            if i + 1 in wanted:
                captured[i + 1] = x
        normed = self.norm(x)
        captured[self.num_layers] = normed  # hidden_states[L] is the final-norm output (docs/DESIGN.md, "Terms")
        self.cache.positions.set(0, start + S)
        features = torch.stack([captured[b][0] for b in self.feature_layers], dim=1)
        return self.lm_head(normed)[0], features
