"""Text as tokens are verified: the new text each token adds, for `decode --stream` and the server.

A token may end inside a multi-byte character (byte-level BPE), so each step decodes the whole output so
far and emits only what is new and complete: a trailing replacement character waits for the next token.
Stop strings are cut here too, so that no part of a stop string is ever emitted.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TextIO


class TextStream:
    """Feed verified tokens, get the text they add; `stop` strings end the text before them."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.tokens: list[int] = []
        self.text = ""  # emitted so far
        self.stopped = False  # a stop string was found: feed no more

    def feed(self, tokens: Sequence[int]) -> str:
        self.tokens.extend(tokens)
        full = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = min((i for i in (full.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            full, self.stopped = full[:cut], True
        elif full.endswith("\ufffd"):
            full = full[:-1]
        else:  # hold back a tail that may be the start of a stop string
            full = full[: len(full) - self._held_back(full)]
        if not full.startswith(self.text):  # a later token changed earlier text: emit nothing older again
            return ""
        delta, self.text = full[len(self.text) :], full
        return delta

    def finish(self) -> str:
        """The rest of the text once the decode has ended (what `feed` held back)."""
        if self.stopped:
            return ""
        full = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += delta
        return delta

    def _held_back(self, full: str) -> int:
        return max((k for s in self.stop for k in range(1, len(s)) if full.endswith(s[:k])), default=0)


class StreamPrinter:
    """`decode --stream`: each prompt's header, then its text as it is verified, on `out`."""

    def __init__(self, tokenizer, texts: Sequence[str], out: TextIO | None = None):
        self.tokenizer, self.texts, self.out = tokenizer, texts, out or sys.stdout
        self.index: int | None = None
        self.stream: TextStream | None = None

    def __call__(self, index: int, tokens: Sequence[int]) -> None:
        if index != self.index:
            self.end()
            self.index, self.stream = index, TextStream(self.tokenizer)
            print(f"### prompt {index + 1}: {self.texts[index]}", file=self.out, flush=True)
        self.out.write(self.stream.feed(tokens))
        self.out.flush()

    def end(self) -> None:
        if self.stream is not None:
            print(self.stream.finish(), file=self.out, flush=True)
            self.stream = None
