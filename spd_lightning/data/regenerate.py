"""Training data from the target itself: the target answers the first user turn of every training chat.

A drafter is accepted when it predicts what the *target* would say, so EAGLE, Medusa and SpecForge train on the
target's own answers rather than on the dataset's (written by other models). `prepare --regenerate OUT.jsonl`
renders each conversation's first user turn (a leading system prompt kept) with the target's chat template,
lets the target answer in batches (`generate`, greedy at temperature 0, sampled otherwise), and appends one
`{"messages": [...], "index": i}` record per prompt to OUT.jsonl, which is then an ordinary data source.

Resumable: records are appended in prompt order and flushed per batch; a rerun keeps the complete records
already written (a line cut by a crash is dropped) and continues after them, and sampling is seeded per batch,
so an interrupted run and an uninterrupted one write the same file.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from jinja2 import TemplateError
from tqdm.auto import tqdm

from .chat import render_chat
from .formats import ASSISTANT, BadRecord, DataError, conversation_column, first_user_turn, normalize_conversation
from .sources import DataSource, load_source

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Generation:
    """How the target answers: sampling temperature (0: greedy), answer length, prompts per `generate` call."""

    temperature: float = 0.0
    max_new_tokens: int = 256
    batch_size: int = 8
    max_prompt_tokens: int = 512
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise DataError(f"--temperature {self.temperature}: use 0 (greedy) or a positive temperature")
        for name in ("max_new_tokens", "batch_size", "max_prompt_tokens"):
            if getattr(self, name) < 1:
                raise DataError(f"--{name.replace('_', '-')} {getattr(self, name)}: use a positive number")


def first_turns(sources: list[DataSource], raw_cache_dir: str, limit: int | None) -> list[list[dict[str, str]]]:
    """The first user turn (system prompt kept) of each readable conversation of the sources, in order: with a
    `limit`, the first sources fill it, whatever the mixture's weights (said in a warning)."""
    if limit is not None and len(sources) > 1:
        log.warning(
            "--limit %d takes the first prompts of the sources in order (%s), not by their mixture weights",
            limit,
            ", ".join(s.path for s in sources),
        )
    prompts: list[list[dict[str, str]]] = []
    for source in sources:
        raw = load_source(source, raw_cache_dir)
        column = conversation_column(raw.column_names, source.path)
        for record in raw[column]:
            try:
                turn = first_user_turn(normalize_conversation(record, column, source.path))
            except BadRecord:
                continue
            if turn and turn[-1]["content"].strip():
                prompts.append(turn)
            if limit is not None and len(prompts) >= limit:
                return prompts
    return prompts


def fitting_prompts(tokenizer: Any, prompts: list[list[dict[str, str]]], gen: Generation) -> list:
    """The prompts whose rendered length is at most `max_prompt_tokens` (a clipped prompt would pair an answer
    with a question the target never saw) and that the chat template renders (Qwen3's refuses a lone tool
    response: training drops such a conversation too)."""
    rendered = [(turn, _rendered_or_none(tokenizer, turn)) for turn in prompts]
    rendered = [(turn, text) for turn, text in rendered if text is not None]
    texts = [text for _, text in rendered]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []
    return [turn for (turn, _), length in zip(rendered, lengths) if length <= gen.max_prompt_tokens]


def _rendered_or_none(tokenizer: Any, turn: list[dict[str, str]]) -> str | None:
    try:
        return render_chat(tokenizer, turn, add_generation_prompt=True)
    except TemplateError:  # the template's raise_exception
        return None


def complete_records(path: str) -> int:
    """How many complete records `path` holds; a last line cut by a crash is removed so appending continues cleanly."""
    if not os.path.isfile(path):
        return 0
    with open(path, "rb") as f:
        data = f.read()
    keep = data[: data.rfind(b"\n") + 1]
    if len(keep) != len(data):
        with open(path, "wb") as f:
            f.write(keep)
    return keep.count(b"\n")


def _answers(model: Any, tokenizer: Any, texts: list[str], gen: Generation, seed: int) -> list[str]:
    """One batched `generate` over rendered prompts (left-padded), decoded without special tokens."""
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    kwargs: dict[str, Any] = {"max_new_tokens": gen.max_new_tokens, "pad_token_id": tokenizer.pad_token_id}
    if gen.temperature > 0:
        kwargs.update(do_sample=True, temperature=gen.temperature, top_k=0, top_p=1.0)
    else:
        kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(**batch, **kwargs)
    new = out[:, batch["input_ids"].shape[1] :]
    return [tokenizer.decode(row, skip_special_tokens=True).strip() for row in new]


def regenerate(
    model: Any, tokenizer: Any, prompts: list[list[dict[str, str]]], out_path: str, gen: Generation
) -> tuple[int, int]:
    """Append the target's answer to every prompt not yet in `out_path`; returns (records written now, total)."""
    tokenizer.padding_side = "left"  # generation continues every row from its last prompt token
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    done = complete_records(out_path)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    bar = tqdm(total=len(prompts), initial=min(done, len(prompts)), desc="regenerating", unit="prompt")
    written = 0
    with open(out_path, "a") as out:
        for start in range(done, len(prompts), gen.batch_size):
            turns = prompts[start : start + gen.batch_size]
            texts = [render_chat(tokenizer, t, add_generation_prompt=True) for t in turns]
            for offset, (turn, answer) in enumerate(
                zip(turns, _answers(model, tokenizer, texts, gen, gen.seed + start))
            ):
                record = {"messages": [*turn, {"role": ASSISTANT, "content": answer}], "index": start + offset}
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
            out.flush()
            written += len(turns)
            bar.update(len(turns))
    bar.close()
    return written, done + written
