"""Prompts for the decoder: a text, or an EAGLE-style jsonl file, rendered with the target's chat template.

EAGLE-style benchmark files (MT-Bench, GSM8K, HumanEval question files) hold one JSON object per line
with a `turns` list; the decoder uses the first turn. Each prompt becomes one user message, rendered
with the target tokenizer's chat template, `add_generation_prompt=True` and thinking disabled (SPEC 4.1
renders training data the same way). A tokenizer without a chat template encodes the raw text.
"""
from __future__ import annotations

import json
import os


class PromptError(ValueError):
    """Unusable prompt input; one line that says which and why."""


def read_prompts(text: str | None, path: str | None) -> list[str]:
    if (text is None) == (path is None):
        raise PromptError("give exactly one of --prompt TEXT or --prompts FILE")
    if text is not None:
        if not text.strip():
            raise PromptError("the prompt is empty")
        return [text]
    if not os.path.isfile(path):
        raise PromptError(f"prompts file {path!r} does not exist")
    prompts = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                turn = record["turns"][0]
            except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
                raise PromptError(f"{path}:{number}: expected a JSON object with a non-empty 'turns' list ({type(e).__name__})") from e
            if not isinstance(turn, str) or not turn.strip():
                raise PromptError(f"{path}:{number}: the first turn is empty or not text")
            prompts.append(turn)
    if not prompts:
        raise PromptError(f"prompts file {path!r} holds no prompt")
    return prompts


def load_tokenizer(target_path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(target_path)
    except (OSError, ValueError) as e:
        raise PromptError(f"cannot load a tokenizer from the target {target_path!r}: {str(e).splitlines()[0][:160]}") from e


def render(tokenizer, prompt: str) -> list[int]:
    """Token ids of one user turn, ready for the assistant's answer."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            enable_thinking=False, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    else:
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    ids = [int(i) for i in ids]
    if not ids:
        raise PromptError(f"the prompt {prompt[:40]!r} encodes to no token")
    return ids
