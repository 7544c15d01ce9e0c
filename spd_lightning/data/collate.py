"""Batch samples of different lengths: right padding to the longest sample (optionally rounded up).

A batch is `{"input_ids": long [B, T], "attention_mask": long [B, T], "loss_mask": bool [B, T]}` where
`loss_mask[b, i]` is True iff token `i` is an assistant token, i.e. one the drafter must predict from
position `i - 1`. Padding has attention 0 and no loss; the pad id is the tokenizer's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .formats import DataError


class ChatCollator:
    def __init__(self, pad_token_id: int, pad_to_multiple_of: int = 1):
        if pad_to_multiple_of < 1:
            raise DataError(f"pad_to_multiple_of={pad_to_multiple_of}: use 1 (no rounding) or a positive block size")
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, samples: Sequence[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(sample["input_ids"]) for sample in samples)
        width = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((len(samples), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(samples), width), dtype=torch.long)
        loss_mask = torch.zeros((len(samples), width), dtype=torch.bool)
        for row, sample in enumerate(samples):
            length = len(sample["input_ids"])
            input_ids[row, :length] = torch.as_tensor(sample["input_ids"], dtype=torch.long)
            attention_mask[row, :length] = 1
            loss_mask[row, :length] = torch.as_tensor(sample["loss_mask"], dtype=torch.bool)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def answer_batch(prompt: Sequence[int], answer: Sequence[int], device: torch.device | str | None = None) -> dict:
    """One sequence, `prompt` then its answer, as a batch whose loss tokens are the answer's: what a decode of
    `prompt` judges drafts of (the staircase's and `scripts/replay_prediction.py`'s walks)."""
    input_ids = torch.tensor([[*prompt, *answer]], dtype=torch.long, device=device)
    loss_mask = (torch.arange(input_ids.shape[1], device=input_ids.device) >= len(prompt))[None]
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "loss_mask": loss_mask}
