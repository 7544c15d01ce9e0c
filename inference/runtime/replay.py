"""A drafter without a model: `ReplayDrafter` proposes from a known continuation (always right, always wrong, or
right by an exact pattern). It measures the pipeline without a PDM (the closed forms of the schedule, oracle
timing) and drives it through chosen accept/reject sequences, behind the same `Drafter` interface as the PDM's
(`drafter.py`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from inference.runtime.drafter import DraftBatch
from inference.sampling import Sampling


class ReplayDrafter:
    """Proposes a known continuation: the i-th `start` (the i-th request to join) replays `references[i]`, the
    continuation of its prompt. `oracle` proposes `reference[position - prompt_len]`, `adversary` a token that is
    surely not it, and a pattern of `R` (right) and `W` (wrong) letters, read cyclically by that index, chooses per
    position; greedy only (it has no draft distribution). Past the end of the reference it proposes token 0 (never
    judged then). Its tokens live on the device of the prompts it was started with (the runner's), like a PDM's
    drafts: the distributed decoder sends them as they are (NCCL cannot send a CPU tensor)."""

    def __init__(self, references: Sequence[Sequence[int]], policy: str, vocab_size: int):
        pattern = {"oracle": "R", "adversary": "W"}.get(policy, policy)
        if not pattern or set(pattern) - {"R", "W"}:
            raise ValueError(f"unknown replay policy {policy!r}: use 'oracle', 'adversary' or a pattern of R and W")
        self.references, self.pattern, self.vocab_size = [list(r) for r in references], pattern, vocab_size
        self._next = 0
        self._replaying: dict[int, tuple[list[int], int]] = {}  # slot -> (its reference, its prompt's length)
        self.device = torch.device("cpu")

    def start(
        self, slot: int, prompt_ids: torch.Tensor, capacity: int, sampling: Sampling = Sampling(), seed: int = 0
    ) -> None:
        if not sampling.greedy:
            raise ValueError("a replay drafter has no draft distribution: use it with greedy decoding only")
        if self._next >= len(self.references):
            raise ValueError(f"the replay drafter has {len(self.references)} references and no more prompts to replay")
        self._replaying[slot] = (self.references[self._next], prompt_ids.shape[-1])
        self.device = prompt_ids.device
        self._next += 1

    def set_token(self, slot: int, position: int, token: int) -> None:
        pass

    def store_anchors(self, slot: int, stage: int, start: int, states: torch.Tensor) -> None:
        pass

    def store_step_anchors(self, stage: int, positions: Mapping[int, int], states: torch.Tensor) -> None:
        pass

    def draft(self, views: Mapping[int, Sequence[tuple[int, int]]], rows: int | None = None) -> DraftBatch:
        proposals = [0] * max(rows or 0, max(views) + 1)
        for b, view in views.items():  # the token after the newest in-flight position
            reference, prompt_len = self._replaying[b]
            index = view[-1][1] + 1 - prompt_len
            right = reference[index] if index < len(reference) else 0
            wrong = self.pattern[index % len(self.pattern)] == "W"
            proposals[b] = (right + 1) % self.vocab_size if wrong else right
        return DraftBatch(torch.tensor(proposals, device=self.device), None)
