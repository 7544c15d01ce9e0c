"""Text as tokens are verified: the new text each token adds, for `decode --stream` and the server.

A token may end inside a multi-byte character (byte-level BPE, or SentencePiece's byte fallback), so each step
decodes the whole output so far and emits only what is new and complete: trailing replacement characters
(one, or one per byte of the unfinished character) wait for the next token.
Stop strings are cut here too, so that no part of a stop string is ever emitted. The text is decoded without
transformers' `clean_up_tokenization_spaces` (BERT's tokenizers set it): that cleanup rewrites text already
sent once a later token comes ("it '" becomes "it'" when "s" follows), and the stream would have nothing
newer to emit from then on.
"""

from __future__ import annotations

from collections.abc import Sequence


class TextStream:
    """Feed verified tokens, get the text they add; `stop` strings end the text before them."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.tokens: list[int] = []
        self.text = ""  # emitted so far
        self.stopped = False  # a stop string was found: feed no more
        self._stop_tokens: int | None = None  # the tokens up to the one that completed the stop string

    @property
    def used_tokens(self) -> int:
        """The tokens the answer is made of: all fed, or after a stop string the ones up to the token that
        completed it (a decoder that verifies several tokens per cycle may have made more)."""
        return len(self.tokens) if self._stop_tokens is None else self._stop_tokens

    def feed(self, tokens: Sequence[int]) -> str:
        before = len(self.tokens)
        self.tokens.extend(tokens)
        full = self._decode(len(self.tokens))
        cut = self._stop_at(full)
        if cut >= 0:
            full, self.stopped = full[:cut], True
            self._stop_tokens = next(
                (k for k in range(before + 1, len(self.tokens)) if self._stop_at(self._decode(k)) >= 0),
                len(self.tokens),
            )
        else:  # hold back an unfinished last character and a tail that may be the start of a stop string
            full = full.rstrip("\ufffd")  # one U+FFFD, or one per byte of it with a byte fallback
            full = full[: len(full) - self._held_back(full)]
        if not full.startswith(self.text):  # a later token changed earlier text: emit nothing older again
            return ""
        delta, self.text = full[len(self.text) :], full
        return delta

    def finish(self) -> str:
        """The rest of the text once the decode has ended (what `feed` held back)."""
        if self.stopped:
            return ""
        full = self._decode(len(self.tokens))
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += delta
        return delta

    def _decode(self, count: int) -> str:
        return self.tokenizer.decode(self.tokens[:count], skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _stop_at(self, text: str) -> int:
        """Where the first stop string in `text` begins (-1: none)."""
        return min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)

    def _held_back(self, full: str) -> int:
        return max((k for s in self.stop for k in range(1, len(s)) if full.endswith(s[:k])), default=0)


class StreamPrinter:
    """`decode --stream`: each prompt's header, then its text as it is verified, on stdout."""

    def __init__(self, tokenizer, texts: Sequence[str]):
        self.tokenizer, self.texts = tokenizer, texts
        self.index: int | None = None
        self.stream: TextStream | None = None

    def __call__(self, index: int, tokens: Sequence[int]) -> None:
        if index != self.index:
            self.end()
            self.index, self.stream = index, TextStream(self.tokenizer)
            print(f"### prompt {index + 1}: {self.texts[index]}", flush=True)
        print(self.stream.feed(tokens), end="", flush=True)

    def end(self) -> None:
        if self.stream is not None:
            print(self.stream.finish(), flush=True)
            self.stream = None
