"""Chat record formats, normalized to one shape: a list of `{"role", "content"}` messages (docs/DESIGN.md, "Training data").

Two layouts are accepted:

- ShareGPT: `{"conversations": [{"from": "human"|"gpt"|..., "value": str}, ...]}`
- messages (UltraChat-200k, SmolTalk, SmolTalk-Chinese): `{"messages": [{"role": ..., "content": str}, ...]}`

Normalization also cleans the conversation the way chat-SFT pipelines (FastChat, EAGLE) do, so every
kept message is something the target could have said in that position:
- assistant messages before the first user message are dropped: the ShareGPT split keeps later parts of
  long chats as separate records that start with a reply to a prompt we no longer have;
- the conversation is cut at the first empty assistant reply (nothing to learn there, and the turns
  after it answer a reply that was lost);
- trailing non-assistant messages are dropped: nothing after them carries loss.

A record that cannot be read (an unknown role such as `tool` or `function`, a malformed turn) raises
`BadRecord`; the tokenizing map drops such records and counts them per reason (see `tokenized.py`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..errors import UserError

SYSTEM, USER, ASSISTANT = "system", "user", "assistant"

# ShareGPT dumps name speakers after the product that answered; FastChat's mapping, plus `bing`.
ROLE_ALIASES = {
    "system": SYSTEM,
    "human": USER,
    "user": USER,
    "gpt": ASSISTANT,
    "assistant": ASSISTANT,
    "chatgpt": ASSISTANT,
    "bard": ASSISTANT,
    "bing": ASSISTANT,
}
CONVERSATION_COLUMNS = {"conversations": ("from", "value"), "messages": ("role", "content")}


class DataError(UserError):
    """Unusable data or data settings; the one-line message names the value and the fix."""


class BadRecord(DataError):
    """One record that cannot be read (an unknown role such as `tool`, a malformed turn): the pipeline drops such
    records and counts them by `reason` instead of aborting on the first one."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def conversation_column(column_names: Iterable[str], where: str) -> str:
    """The column that holds the conversation, or a one-line error naming what was found instead."""
    names = list(column_names)
    for column in CONVERSATION_COLUMNS:
        if column in names:
            return column
    raise DataError(
        f"{where} has columns {names}, but a chat dataset needs `conversations` (ShareGPT: from/value) "
        f"or `messages` (role/content): convert it to one of these layouts"
    )


def _message(turn: Any, role_key: str, text_key: str, where: str) -> dict[str, str]:
    if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
        raise BadRecord(
            f"{where}: turn {turn!r:.80} is not a {{{role_key!r}, {text_key!r}}} object; "
            f"fix the record or the column layout",
            "malformed turn",
        )
    role = ROLE_ALIASES.get(str(turn[role_key]).lower())
    if role is None:
        raise BadRecord(
            f"{where}: unknown role {turn[role_key]!r}; supported roles are {sorted(ROLE_ALIASES)}: "
            f"rename it or drop such records",
            f"unknown role {turn[role_key]!r}",
        )
    content = turn[text_key]
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise BadRecord(
            f"{where}: message content {content!r:.80} is not text; only plain-text chats are supported",
            "non-text content",
        )
    return {"role": role, "content": content}


def normalize_conversation(turns: Any, column: str, where: str) -> list[dict[str, str]]:
    """One record's conversation column -> cleaned `[{"role", "content"}, ...]` (see the module docstring)."""
    if turns is None:
        return []
    if not isinstance(turns, list):
        raise BadRecord(
            f"{where}: `{column}` is {type(turns).__name__}, expected a list of turns", f"`{column}` not a list"
        )
    role_key, text_key = CONVERSATION_COLUMNS[column]
    messages = [_message(turn, role_key, text_key, where) for turn in turns]

    cleaned: list[dict[str, str]] = []
    seen_user = False
    for message in messages:
        if message["role"] == ASSISTANT:
            if not seen_user:
                continue
            if not message["content"].strip():
                break
        seen_user = seen_user or message["role"] == USER
        cleaned.append(message)
    while cleaned and cleaned[-1]["role"] != ASSISTANT:
        cleaned.pop()
    return cleaned


def first_user_turn(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The conversation up to and including its first user message (a leading system prompt stays)."""
    for index, message in enumerate(messages):
        if message["role"] == USER:
            return messages[: index + 1]
    return []
