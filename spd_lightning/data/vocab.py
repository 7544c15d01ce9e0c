"""The draft vocabulary (docs/DESIGN.md, "The PDM"): the `V_d` target tokens the drafter can propose.

`d2t[j]` is the target id of draft id `j`: the `V_d` most frequent target tokens over the loss-masked
(assistant) tokens of the training split, most frequent first, ties broken by the smaller token id. When
the data has fewer distinct assistant tokens than `V_d` (tiny targets, tiny datasets), `V_d` is clamped
to that number with a logged line: a draft token that never occurs in training would only be a head
row that no loss ever touches. Consumers size the drafter head with `len(d2t)`.
"""

from __future__ import annotations

import os

import datasets
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from tqdm.auto import tqdm

from .formats import DataError

_BATCH_ROWS = 1024


def check_draft_vocab_size(draft_vocab_size: int) -> None:
    if draft_vocab_size < 1:
        raise DataError(
            f"draft_vocab_size={draft_vocab_size}: the draft vocabulary needs at least 1 token "
            f"(default 32000, docs/DESIGN.md 'The PDM'; a few thousand for tiny targets)"
        )


def count_assistant_tokens(samples: datasets.Dataset, vocab_size: int) -> np.ndarray:
    """How often each target token id is a loss-masked token in `samples` (repeated rows count every time)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    arrow_rows = samples.select_columns(["input_ids", "loss_mask"]).with_format("arrow")
    for table in tqdm(
        arrow_rows.iter(batch_size=_BATCH_ROWS),
        total=-(-len(samples) // _BATCH_ROWS),
        desc="Counting assistant tokens",
        unit="batch",
    ):
        ids = table.column("input_ids").combine_chunks().flatten().to_numpy()
        mask = table.column("loss_mask").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        masked = ids[mask]
        if masked.size and masked.max() >= vocab_size:
            raise DataError(
                f"token id {int(masked.max())} is outside the tokenizer's {vocab_size} ids: the cached "
                f"samples come from another tokenizer; clear the data cache_dir"
            )
        counts += np.bincount(masked, minlength=vocab_size)
    return counts


def select_draft_vocab(counts: np.ndarray, draft_vocab_size: int) -> torch.Tensor:
    """`d2t`: the `draft_vocab_size` most frequent ids (ties: smaller id first), clamped to the distinct ones."""
    check_draft_vocab_size(draft_vocab_size)
    seen = np.flatnonzero(counts)
    if len(seen) == 0:
        raise DataError("the training split has no loss-masked token, so no draft vocabulary can be chosen")
    if draft_vocab_size > len(seen):
        rank_zero_info(
            f"draft_vocab_size={draft_vocab_size} exceeds the {len(seen):,} distinct assistant tokens in "
            f"the training data: using V_d={len(seen):,}"
        )
        draft_vocab_size = len(seen)
    order = np.lexsort((seen, -counts[seen]))  # last key is primary: count descending, then id ascending
    return torch.from_numpy(seen[order[:draft_vocab_size]].astype(np.int64))


def load_or_build_d2t(samples: datasets.Dataset, vocab_size: int, draft_vocab_size: int, path: str) -> torch.Tensor:
    """`d2t` from `path` when a previous run computed it for the same data, else counted now and saved there."""
    check_draft_vocab_size(draft_vocab_size)
    if os.path.isfile(path):
        return torch.from_numpy(np.load(path))
    d2t = select_draft_vocab(count_assistant_tokens(samples, vocab_size), draft_vocab_size)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    staging = f"{path}.{os.getpid()}.partial.npy"  # per process: concurrent runs on one cache write their own
    np.save(staging, d2t.numpy())
    os.replace(staging, path)
    return d2t
