"""Pretraining the tiny target on the embedded ShareGPT: the conversations rendered with its template and packed into
blocks, AdamW with warmup and cosine decay over a step or wall-clock budget, the held-out loss."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from ..data.formats import normalize_conversation
from ..data.sharegpt import load_embedded_sharegpt
from .tokenizer import ENDOFTEXT, TinyTargetError

WARMUP_FRACTION = 0.05
log = logging.getLogger(__name__)


def sharegpt_conversations(max_conversations: int | None) -> list[list[dict[str, str]]]:
    records = load_embedded_sharegpt(max_conversations)
    conversations = [
        normalize_conversation(r["conversations"], "conversations", f"ShareGPT record {i}")
        for i, r in enumerate(records)
    ]
    return [c for c in conversations if c]


def token_blocks(tokenizer, conversations: Sequence[list[dict[str, str]]], block: int) -> Iterator[list[int]]:
    """Rendered conversations, each followed by `<|endoftext|>`, packed into `block`-token pieces, in order."""
    separator = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    pending: list[int] = []
    for start in range(0, len(conversations), 64):
        texts = [
            tokenizer.apply_chat_template(c, tokenize=False, enable_thinking=False)
            for c in conversations[start : start + 64]
        ]
        for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            pending.extend(ids)
            pending.append(separator)
            while len(pending) >= block:
                yield pending[:block]
                pending = pending[block:]


def training_batches(tokenizer, conversations, block: int, batch_size: int) -> Iterator[torch.Tensor]:
    """Endless `[batch_size, block]` batches: the conversations in order, again and again."""
    rows: list[list[int]] = []
    while True:
        pieces = 0
        for piece in token_blocks(tokenizer, conversations, block):
            pieces += 1
            rows.append(piece)
            if len(rows) == batch_size:
                yield torch.tensor(rows)
                rows = []
        if pieces == 0:
            raise TinyTargetError(
                f"the training conversations hold fewer than seq_len={block} tokens: lower seq_len "
                f"or read more conversations"
            )


@torch.no_grad()
def heldout_loss(model, blocks: torch.Tensor, batch_size: int) -> float:
    model.eval()
    losses = [model(input_ids=chunk, labels=chunk).loss.item() for chunk in blocks.split(batch_size)]
    model.train()
    return float(np.mean(losses))


def split_conversations(max_conversations: int | None, heldout_conversations: int, seed: int):
    """(train, held-out) ShareGPT conversations, shuffled by `seed`."""
    conversations = sharegpt_conversations(max_conversations)
    if len(conversations) < 2:
        raise TinyTargetError(f"only {len(conversations)} usable ShareGPT conversations: raise max_conversations")
    order = np.random.default_rng(seed).permutation(len(conversations))
    heldout_count = min(heldout_conversations, len(conversations) // 5 or 1)
    return [conversations[i] for i in order[heldout_count:]], [conversations[i] for i in order[:heldout_count]]


def heldout_blocks_of(tokenizer, heldout: list, seq_len: int, count: int) -> torch.Tensor:
    """The first `count` `seq_len`-token blocks of the held-out conversations."""
    rows = list(token_blocks(tokenizer, heldout, seq_len))[:count]
    if not rows:
        raise TinyTargetError(f"the {len(heldout)} held-out conversations give no {seq_len}-token block: lower seq_len")
    return torch.tensor(rows)


@contextlib.contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """torch's CPU threads set to `count` for the build, restored afterwards (None: torch's choice)."""
    previous = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def pretrain(
    model, batches: Iterator[torch.Tensor], lr: float, minutes: float | None, max_steps: int | None
) -> tuple[int, int, float]:
    """AdamW with warmup over the first 5% of the budget, then cosine decay to 10% of `lr`; returns (steps, tokens
    seen, minutes). The schedule follows budget fractions (steps when given, else the clock), because a wall-clock
    budget fixes no step count."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    budget_s = minutes * 60.0 if minutes is not None else math.inf
    model.train()
    step, tokens_seen, started = 0, 0, time.time()
    progress = tqdm(total=max_steps, desc="tiny_target", unit="step")
    for batch in batches:
        elapsed = time.time() - started
        done = step / max_steps if max_steps else elapsed / budget_s
        if done >= 1.0 or elapsed >= budget_s:
            break
        warm = min(1.0, max(done, 0.01) / WARMUP_FRACTION)
        for group in optimizer.param_groups:
            group["lr"] = lr * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * done)))
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += batch.numel()
        progress.update(1)
        progress.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tokens_seen / (time.time() - started):.0f}")
    progress.close()
    if max_steps and step < max_steps:
        log.warning("the %g-minute cap stopped training at step %d of %d", minutes, step, max_steps)
    return step, tokens_seen, (time.time() - started) / 60.0
