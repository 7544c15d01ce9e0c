"""The EAGLE-3 drafter at inference: committed rows cached, a chain of k drafts per verify (docs/DESIGN.md, "The EAGLE-3 baseline").

Row `p` of the drafter reads the target features of `x_p` and the embedding of `x_{p+1}`, so a row can be
computed once `x_{p+1}` is known and `x_p` went through the target. After each verify forward the
accepted positions are such rows: `commit` runs them teacher-forced (TTT step 0) and keeps their keys and
values for good. `draft` then chains from the last committed row `p`: its output drafts `d_1`; step
`j >= 1` feeds its own previous output with `embed(d_j)` at position `p + j` and drafts `d_{j+1}`. The
chain's keys are temporary (dropped before the next commit overwrites those positions). This is exactly
the attention of training-time test (spd_lightning/eagle3/ttt.py): committed rows `<= p`, then the
chain's own positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from inference.runtime.drafter import SlotDraftKV
from inference.sampling import Sampling, warp
from spd_lightning.eagle3.model import Eagle3Drafter


@dataclass
class Draft:
    tokens: list[int]  # target ids d_1..d_k
    q: list[torch.Tensor] | None  # k warped draft distributions over V_d (None when greedy)
    logits: list[torch.Tensor]  # k raw draft logits over V_d


class Eagle3Runtime:
    def __init__(self, drafter: Eagle3Drafter, embed_tokens: nn.Module, sampling: Sampling):
        if drafter.cfg.hidden_size != embed_tokens.weight.shape[1]:
            raise ValueError(
                f"the drafter has width {drafter.cfg.hidden_size} but the target embedding has width "
                f"{embed_tokens.weight.shape[1]}: load the drafter's own target"
            )
        self.drafter, self.embed_tokens, self.sampling = drafter.eval(), embed_tokens, sampling
        p = next(drafter.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.cache: SlotDraftKV | None = None  # one slot's body keys/values
        self.length = 0  # committed rows: the chain's keys past them are overwritten by the next commit
        self.last_out: torch.Tensor | None = None  # [1, 1, H] output of the last committed row

    def start(self, capacity: int) -> None:
        """A new sequence of at most `capacity` positions (prompt, generated tokens and a chain)."""
        cfg = self.drafter.cfg
        if self.cache is None or self.cache.keys.shape[-2] < capacity:
            offsets = torch.zeros(1, dtype=torch.long, device=self.device)  # read by the batched attend only
            self.cache = SlotDraftKV(1, 1, cfg.num_kv_heads, cfg.head_dim, capacity, self.dtype, offsets)
        self.length = 0
        self.last_out = None

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens.to(self.device)).to(self.dtype)

    @torch.no_grad()
    def commit(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Rows at the next `S` positions: `features[S, 3, H]` of their tokens and `next_tokens[S]`."""
        S, start = features.shape[0], self.length
        positions = torch.arange(start, start + S, device=self.device)[None]
        hidden = self.drafter.fuse(features.to(self.device, self.dtype)[None])
        out = self.drafter.step(hidden, self._embed(next_tokens)[None], positions, self.cache.row_attend(0, start))
        self.length += S
        self.last_out = out[:, -1:]

    @torch.no_grad()
    def draft(self, k: int, generator: torch.Generator | None = None) -> Draft:
        """Chain `k` drafts from the last committed row; leaves the committed cache as it was."""
        if self.last_out is None:
            raise RuntimeError("commit the prompt's rows before drafting")
        tokens, qs, logits_rows = [], [], []
        out = self.last_out
        for j in range(k):
            logits = self.drafter.logits(out)[0, -1]
            q = None if self.sampling.greedy else warp(logits, self.sampling)
            index = logits.argmax() if q is None else torch.multinomial(q, 1, generator=generator)
            tokens.append(int(self.drafter.d2t[index]))
            qs.append(q)
            logits_rows.append(logits)
            if j + 1 < k:  # chain step j + 1 at position length + j, attending to the chain steps before it
                position = self.length + j
                embeds = self._embed(torch.tensor([tokens[-1:]]))
                out = self.drafter.step(
                    out, embeds, torch.tensor([[position]], device=self.device), self.cache.row_attend(0, position)
                )
        return Draft(tokens, None if self.sampling.greedy else qs, logits_rows)
