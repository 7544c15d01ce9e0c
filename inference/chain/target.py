"""The whole target as ONE verify stage for chain speculative decoding (docs/DESIGN.md, "The EAGLE-3 baseline"), with exact rollback.

`ChainTarget` runs the target's pieces (inference/runtime/stages.py `TargetPieces`: embedding, every layer, final
norm, LM head) over a block of tokens at `start..start+S-1` on top of its cache and returns the logits of
every position plus the EAGLE-3 feature states (`hidden_states[l]` for the drafter's feature layers).

The cache is a `ChainCache` (cache.py) over every layer: static storage written in place, so
every forward passes attention layers the additive mask of `stages.attention_mask`, over the storage's
whole capacity (causal, the unwritten tail hidden).

- Prefill (`start == 0`): one causal forward, the path of a stage's prefill (and of AR).
- Verify (`start > 0`, the last committed token plus k drafts): attention layers run all S tokens at once;
  linear-attention (Gated DeltaNet) layers step through the block one token at a time, each token's conv
  and recurrent states snapshotted first with `ChainCache.snapshot_layer` (the per-token states SGLang's
  verify kernel keeps). `rollback(keep)` is `ChainCache.rollback`: it moves the attention length back
  (the next forward overwrites the rejected positions) and restores the linear states of position `keep`, so
  the cache holds exactly the accepted positions, as if the rejected drafts had never been run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inference.chain.cache import ChainCache
from inference.runtime.hf_compat import cache_kwargs, rotary_positions
from inference.runtime.stages import TargetPieces, attention_mask
from spd_lightning.target import Target


class ChainTarget:
    def __init__(self, pieces: TargetPieces, feature_layers: Sequence[int], max_block: int):
        """`max_block`: the most tokens one verify forward runs (k + 1); the snapshot ring holds one more."""
        self.config = pieces.config
        L = self.num_layers = len(pieces.layers)
        if sorted(pieces.layers) != list(range(L)) or pieces.embed_tokens is None or pieces.lm_head is None:
            raise ValueError("a chain target needs every layer, the embedding, the final norm and the LM head")
        self.layers = [pieces.layers[i] for i in range(L)]
        self.embed_tokens, self.norm, self.lm_head = pieces.embed_tokens, pieces.norm, pieces.lm_head
        self.rotary_emb = pieces.rotary_emb
        self.feature_layers = [int(b) for b in feature_layers]
        if any(not 0 <= b <= L for b in self.feature_layers):
            raise ValueError(f"feature layers {self.feature_layers} are outside 0..L={L}")
        self.cache = ChainCache(pieces.config, range(L), window=max_block + 1)
        self.linear = set(self.cache.linear_layers)

    @classmethod
    def from_target(cls, target: Target, feature_layers: Sequence[int], max_block: int) -> ChainTarget:
        return cls(TargetPieces.from_target(target, range(target.num_layers), True, True), feature_layers, max_block)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    def reset(self, capacity: int = 0) -> None:
        """Forget everything before a prompt of at most `capacity` positions (0: grow when needed)."""
        self.cache.reset(capacity)

    def rollback(self, keep: int) -> None:
        """Keep positions `< keep` (the accepted ones), discard the rest."""
        self.cache.rollback(keep)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run `tokens[1, S]` at positions `start..`; returns logits `[S, V]` and features `[S, 3, H]`."""
        S = tokens.shape[1]
        if start != self.cache.length:
            raise RuntimeError(
                f"the target cache holds {self.cache.length} positions but is asked to run position {start}"
            )
        self.cache.reserve(start + S)  # before the mask: a regrow changes the capacity
        x = self.embed_tokens(tokens.to(self.device))
        positions = torch.arange(start, start + S, device=self.device)[None]
        position_embeddings = self.rotary_emb(x, rotary_positions(self.rotary_emb, positions))
        mask = attention_mask(positions, self.cache.capacity, x.dtype)  # causal, the unwritten tail hidden
        step = start > 0  # a prefill is never rolled back: no snapshots, one chunked pass per layer
        wanted = set(self.feature_layers)
        captured = {0: x} if 0 in wanted else {}
        for i, layer in enumerate(self.layers):
            if i in self.linear and step:
                x = torch.cat(
                    [
                        self._linear_token(layer, i, x[:, j : j + 1], start + j, position_embeddings, positions, j)
                        for j in range(S)
                    ],
                    dim=1,
                )
            else:
                # Gated DeltaNet reads attention_mask as a padding mask: only attention layers get the causal one.
                x = layer(
                    x,
                    position_embeddings=position_embeddings,
                    attention_mask=None if i in self.linear else mask,
                    position_ids=positions,
                    **cache_kwargs(layer, self.cache.hf),
                    use_cache=True,
                )
            if i + 1 in wanted:
                captured[i + 1] = x
        normed = self.norm(x)
        captured[self.num_layers] = normed  # hidden_states[L] is the final-norm output (docs/DESIGN.md, "Terms")
        self.cache.advance(S)
        features = torch.stack([captured[b][0] for b in self.feature_layers], dim=1)
        return self.lm_head(normed)[0], features

    def _linear_token(
        self, layer, index: int, x: torch.Tensor, position: int, position_embeddings, positions, j: int
    ) -> torch.Tensor:
        self.cache.snapshot_layer(index, position)
        cos, sin = position_embeddings
        return layer(
            x,
            position_embeddings=(cos[:, j : j + 1], sin[:, j : j + 1]),
            attention_mask=None,
            position_ids=positions[:, j : j + 1],
            **cache_kwargs(layer, self.cache.hf),
            use_cache=True,
        )
