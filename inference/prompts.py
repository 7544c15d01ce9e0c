"""Prompts for the decoder: a text, an EAGLE-style jsonl file or a dataset, rendered with the chat template.

EAGLE-style benchmark files (MT-Bench, GSM8K, HumanEval question files) hold one JSON object per line
with a `turns` list; the decoder uses the first turn. They are read as UTF-8 (a leading byte-order mark is
skipped) whatever the locale; a line in another encoding is an error that names it, and so is a prompt that is not
Unicode text (a lone surrogate: a `--prompt` byte of another encoding, or a JSON `\\ud800` escape). Anything that
is not a file is read with `datasets.load_dataset` (a hub name when a hub is reachable, or a local dataset
directory), written `NAME[:CONFIG][@SPLIT]` (split `test` by default, e.g. `openai/gsm8k:main@test`); the prompt is
the first turn of its `turns` column, or its `prompt`, `question` or `instruction` column. Each prompt becomes one
user message, rendered with the target tokenizer's chat template, `add_generation_prompt=True` and thinking
disabled, by the renderer training uses (`spd_lightning/data/chat.py`). A tokenizer without a chat template
encodes the raw text.
"""

from __future__ import annotations

import json
import os

from spd_lightning.data.chat import load_tokenizer as load_tokenizer  # re-exported, as `render` below
from spd_lightning.data.chat import render_prompt
from spd_lightning.errors import UserError

render = render_prompt  # the decoder's name for it

DATASET_COLUMNS = ("turns", "prompt", "question", "instruction")


class PromptError(UserError):
    """Unusable prompt input; one line that says which and why."""


def read_prompts(text: str | None, path: str | None) -> list[str]:
    if (text is None) == (path is None):
        raise PromptError("give exactly one of --prompt TEXT or --prompts FILE")
    if text is not None:
        if not text.strip():
            raise PromptError("the prompt is empty")
        return [unicode_text(text, "--prompt")]
    if not os.path.isfile(path):
        if os.path.isdir(dataset_spec(path)[0]) or looks_like_hub_name(path):
            return read_dataset_prompts(path)
        raise PromptError(f"prompts file {path!r} does not exist")
    prompts = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:  # UTF-8 whatever the locale; a leading byte-order mark (Windows editors write one) is not text
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise PromptError(
                    f"{path}:{number}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                    "save the file as UTF-8"
                ) from e
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                turns = record["turns"]
                turn = turns[0] if isinstance(turns, list) else None  # a string's [0] would be its first letter
            except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
                raise PromptError(
                    f"{path}:{number}: expected a JSON object with a non-empty 'turns' list ({type(e).__name__})"
                ) from e
            if not isinstance(turns, list):
                raise PromptError(
                    f"{path}:{number}: 'turns' is a {type(turns).__name__}, expected a list of texts: "
                    'write {"turns": ["..."]}'
                )
            if not isinstance(turn, str) or not turn.strip():
                raise PromptError(f"{path}:{number}: the first turn is empty or not text")
            prompts.append(unicode_text(turn, f"{path}:{number}: the first turn"))
    if not prompts:
        raise PromptError(f"prompts file {path!r} holds no prompt")
    return prompts


def unicode_text(text: str, where: str) -> str:
    """`text` if the tokenizer can take it: no lone surrogate, which is what a command-line byte that is not UTF-8
    becomes (Python's surrogateescape) and what JSON's escapes \\ud800 to \\udfff alone decode to."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PromptError(
            f"{where} is not Unicode text: character {e.start + 1} is {text[e.start]!r}, a lone surrogate (a byte in "
            "another encoding than UTF-8 on the command line, or a \\ud800-\\udfff escape in JSON); pass UTF-8 text"
        ) from e
    return text


def dataset_spec(spec: str) -> tuple[str, str | None, str]:
    """`NAME[:CONFIG][@SPLIT]` -> (name, config or None, split, default `test`)."""
    name, _, split = spec.partition("@")
    name, _, config = name.partition(":")
    return name, config or None, split or "test"


def looks_like_hub_name(spec: str) -> bool:
    """`owner/name[:config][@split]`: relative, one slash, no file extension (a missing file is not a hub name)."""
    name = dataset_spec(spec)[0]
    return (
        name.count("/") == 1
        and not name.startswith((".", "/", "~"))
        and not os.path.splitext(name)[1]
        and all(name.split("/"))
    )


def read_dataset_prompts(spec: str) -> list[str]:
    """First turns of a dataset named `NAME[:CONFIG][@SPLIT]` (hub or local directory)."""
    import datasets

    try:
        name, config, split = dataset_spec(spec)
        data = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # hub, network and builder errors have many types; all mean "cannot read it"
        raise PromptError(
            f"prompts {spec!r}: cannot load the dataset ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:160]}); pass a local jsonl file when no hub is reachable"
        ) from e
    column = next((c for c in DATASET_COLUMNS if c in data.column_names), None)
    if column is None:
        raise PromptError(
            f"prompts {spec!r}: no prompt column; expected one of {DATASET_COLUMNS}, found {data.column_names}"
        )
    prompts = [row[0] if isinstance(row, list) and row else row for row in data[column]]
    if not prompts or not all(isinstance(t, str) and t.strip() for t in prompts):
        raise PromptError(f"prompts {spec!r}: column {column!r} is empty or holds a non-text prompt")
    return [unicode_text(t, f"prompts {spec!r}: row {i}") for i, t in enumerate(prompts)]
