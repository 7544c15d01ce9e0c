"""Render a conversation with the target's chat template and mark its assistant tokens (docs/DESIGN.md, "Training data", "Pitfalls we avoid").

The loss mask is computed here, on tokens, never taken from `return_assistant_tokens_mask` (which is all
zeros unless the template has `{% generation %}` blocks). The whole conversation is rendered as
inference sees it (thinking disabled); tokens whose characters overlap an assistant reply are assistant
tokens, and so is the end-of-turn special token that closes the reply (`<|im_end|>`, `<|eot_id|>`, ...):
the drafter must predict where a reply ends. The template's scaffolding (`<|im_start|>assistant\\n`, the
empty `<think></think>` block) is prompt, not reply, and carries no loss.

Finding the replies in the rendered text: the conversation is rendered a second time with every reply
replaced by a unique placeholder. The text between placeholders is exactly the template's scaffolding
and the other messages, so the real rendering is matched against it piece by piece, and each reply's
span is known exactly, whatever it contains (a reply "a" is not mistaken for the "a" of "assistant").
Rendering whole conversations (rather than concatenating per-turn prefixes) matters for Qwen3-style
templates, which show the empty think block only on the last reply.

`load_tokenizer`, `render_chat` and `render_prompt` are the one copy of tokenizer loading and chat rendering
that training, the staircase callback and the decoder (`inference/prompts.py`) share; this module imports neither
Lightning nor `datasets`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from spd_lightning.errors import first_line

from .formats import ASSISTANT, BadRecord, DataError, first_user_turn, normalize_conversation

OK, TOO_LONG, NO_ASSISTANT = "ok", "too_long", "no_assistant"
# the template transformed a reply beyond whitespace trimming, or refused the conversation (role order)
REPLY_NOT_FOUND, TEMPLATE_REJECTED = "reply_not_found", "template_rejected"
BAD_RECORD = "bad_record: "  # + the reason (an unknown role, a malformed turn): the record could not be read

_PLACEHOLDER = "\ue000{}\ue001"  # private-use characters: never produced by a chat template
_PLACEHOLDER_PATTERN = re.compile("\ue000(\\d+)\ue001")


@dataclass
class RenderedChat:
    input_ids: list[int]
    loss_mask: list[bool]
    status: str


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> Any:
    """`AutoTokenizer` for a local directory, a GGUF target (target_source.py) or a hub name, with one-line errors (training also checks it with
    `check_chat_tokenizer`; the decoder encodes raw text when a target has no chat template). `trust_remote_code`:
    the target repository's own tokenizer class may run (as its model's, under the same flag)."""
    from transformers import AutoTokenizer

    from ..target import looks_local
    from ..target_source import gguf_file_of, resolve_target

    path = os.path.expanduser(name_or_path)
    if looks_local(name_or_path) and not os.path.exists(path):
        raise DataError(
            f"tokenizer path {name_or_path!r} does not exist: pass the target's directory (build the tiny "
            f"one with `python -m spd_lightning.tiny_target --out {name_or_path}`), a .gguf file or a hub name"
        )
    if gguf_file_of(path) is not None:  # the tokenizer and chat template of the converted GGUF
        path = resolve_target(path)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise DataError(
            f"cannot load tokenizer {name_or_path!r} ({type(e).__name__}: {first_line(e)[:160]}); "
            f"pass an existing directory or a reachable hub name"
        ) from e


def render_chat(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """A conversation as the target sees it: its chat template, thinking disabled (docs/DESIGN.md, "Training data")."""
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, enable_thinking=False
    )


def render_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of one user turn, ready for the assistant's answer; a tokenizer without a chat template encodes the
    raw text (with its special tokens)."""
    if getattr(tokenizer, "chat_template", None):
        try:
            text = render_chat(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True)
        except TemplateError as e:  # the template's raise_exception, e.g. Qwen3's for a lone tool response
            raise DataError(f"the chat template refuses the prompt {prompt[:40]!r}: {first_line(e)}") from e
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if not ids:
        raise DataError(f"the prompt {prompt[:40]!r} encodes to no token")
    return [int(i) for i in ids]


def check_chat_tokenizer(tokenizer: Any, name: str) -> None:
    """The tokenizer must render chats and report character offsets (a Rust-backed "fast" tokenizer)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"tokenizer {name!r} has no chat template: use the chat/instruct tokenizer of the target "
            f"(the one it was fine-tuned with), not a base-model tokenizer"
        )
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(
            f"tokenizer {name!r} is a slow (Python) tokenizer without offset mapping: "
            f"install `tokenizers` and load its fast version"
        )


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Every special token id: the named ones and special added tokens such as `<|im_end|>`."""
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, token in tokenizer.added_tokens_decoder.items() if getattr(token, "special", False))
    return frozenset(ids)


def _rendered_forms(content: str) -> list[str]:
    """What a template may have made of a reply: verbatim, or with whitespace trimmed (Jinja `trim`, Qwen's
    `lstrip('\\n')`, ...)."""
    forms = [content, content.strip(), content.lstrip(), content.rstrip(), content.strip("\n"), content.lstrip("\n")]
    return list(dict.fromkeys(forms))


def assistant_char_spans(
    render: Callable[[list[dict[str, str]]], str], text: str, messages: Sequence[dict[str, str]]
) -> list[tuple[int, int]] | None:
    """Character spans `[start, end)` of the replies in `text` (= `render(messages)`), or None when the
    template changed a reply beyond whitespace trimming (e.g. moved a `</think>` part into a think block)."""
    replies = [m["content"] for m in messages if m["role"] == ASSISTANT]
    if any("\ue000" in m["content"] or "\ue001" in m["content"] for m in messages):
        return None
    probe_messages, reply_index = [], 0
    for message in messages:
        if message["role"] == ASSISTANT:
            message = {**message, "content": _PLACEHOLDER.format(reply_index)}
            reply_index += 1
        probe_messages.append(message)
    pieces = _PLACEHOLDER_PATTERN.split(render(probe_messages))
    scaffolding, order = pieces[0::2], pieces[1::2]
    if order != [str(i) for i in range(len(replies))] or not text.startswith(scaffolding[0]):
        return None
    spans, position = [], len(scaffolding[0])
    for reply, following in zip(replies, scaffolding[1:]):
        form = next((f for f in _rendered_forms(reply) if text.startswith(f + following, position)), None)
        if form is None:
            return None
        spans.append((position, position + len(form)))
        position += len(form) + len(following)
    return spans if position == len(text) else None


def mark_assistant_tokens(
    text: str,
    offsets: Sequence[tuple[int, int]],
    input_ids: Sequence[int],
    spans: Sequence[tuple[int, int]],
    special_ids: frozenset[int],
) -> list[bool]:
    """`mask[i]` is True iff token i overlaps an assistant span, or is the special token that ends one
    (only whitespace may separate them)."""
    mask = [False] * len(input_ids)
    token = 0
    for start, end in spans:
        while token < len(offsets) and offsets[token][1] <= start:
            token += 1
        while token < len(offsets) and offsets[token][0] < end:
            mask[token] = True
            token += 1
        if token < len(offsets) and input_ids[token] in special_ids and not text[end : offsets[token][0]].strip():
            mask[token] = True
            token += 1
    return mask


class ChatRenderer:
    """Turns raw records into `input_ids`, `loss_mask` and the first-turn prompt text (a `datasets.map` batch
    function). Samples that cannot train are kept with a `status` so the caller can count and drop them."""

    def __init__(self, tokenizer: Any, max_length: int, column: str, source_name: str):
        if max_length < 2:
            raise DataError(f"max_length={max_length}: a training sample needs at least 2 tokens")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.column = column
        self.source_name = source_name
        self.special_ids = special_token_ids(tokenizer)

    def render_text(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        return render_chat(self.tokenizer, messages, add_generation_prompt)

    def _render_or_none(self, messages: list[dict[str, str]]) -> str | None:
        """None for an empty conversation, or one the template refuses (`raise_exception(...)` on role order)."""
        if not messages:
            return None
        try:
            return self.render_text(messages)
        except TemplateError:
            return None

    def encode(
        self, messages: list[dict[str, str]], text: str | None, input_ids: list[int], offsets: list[tuple[int, int]]
    ) -> RenderedChat:
        """`input_ids` and character `offsets` are the tokenization of `text`, the rendering of `messages`."""
        if not messages:
            return RenderedChat([], [], NO_ASSISTANT)
        if text is None:
            return RenderedChat([], [], TEMPLATE_REJECTED)
        if len(input_ids) > self.max_length:
            return RenderedChat([], [], TOO_LONG)
        try:
            spans = assistant_char_spans(self.render_text, text, messages)
        except TemplateError:
            spans = None
        if spans is None:
            return RenderedChat([], [], REPLY_NOT_FOUND)
        mask = mark_assistant_tokens(text, offsets, input_ids, spans, self.special_ids)
        if not any(mask):
            return RenderedChat([], [], NO_ASSISTANT)
        return RenderedChat(input_ids, mask, OK)

    def encode_messages(self, messages: list[dict[str, str]]) -> RenderedChat:
        text = self._render_or_none(messages)
        encoding = self.tokenizer(text or "", add_special_tokens=False, return_offsets_mapping=True)
        return self.encode(messages, text, encoding["input_ids"], encoding["offset_mapping"])

    def _normalize(self, turns: Any, index: int) -> list[dict[str, str]] | BadRecord:
        try:
            return normalize_conversation(turns, self.column, f"{self.source_name} record {index}")
        except BadRecord as bad:  # one unreadable record must not abort the whole map: counted and dropped
            return bad

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        normalized = [self._normalize(turns, index) for turns, index in zip(batch[self.column], indices)]
        conversations = [[] if isinstance(n, BadRecord) else n for n in normalized]
        texts = [self._render_or_none(messages) for messages in conversations]
        # One tokenizer call per batch lets the Rust tokenizer use every core.
        encodings = self.tokenizer(
            [text or "" for text in texts], add_special_tokens=False, return_offsets_mapping=True
        )
        out: dict[str, list] = {"input_ids": [], "loss_mask": [], "status": [], "prompt": []}
        for i, (messages, text) in enumerate(zip(conversations, texts)):
            rendered = self.encode(messages, text, encodings["input_ids"][i], encodings["offset_mapping"][i])
            if isinstance(normalized[i], BadRecord):
                rendered.status = BAD_RECORD + normalized[i].reason
            prompt = first_user_turn(messages) if rendered.status == OK else []
            try:
                prompt_text = self.render_text(prompt, add_generation_prompt=True) if prompt else ""
            except TemplateError:  # the first turn alone (the held-out prompt) refused: Qwen3's tool-response scan
                rendered, prompt_text = RenderedChat([], [], TEMPLATE_REJECTED), ""
            out["input_ids"].append(rendered.input_ids)
            out["loss_mask"].append(rendered.loss_mask)
            out["status"].append(rendered.status)
            out["prompt"].append(prompt_text)
        return out
