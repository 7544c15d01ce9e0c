"""`decode --stream` and the per-cycle token hook: the streamed text is the final text, in every backend."""

import pytest

from inference.decode import main
from inference.textstream import TextStream

pytestmark = pytest.mark.timeout(180)


def _text(out: str) -> str:
    """The text printed after the first `### prompt` header, up to the counters."""
    body = out.split("### prompt 1: hello world\n", 1)[1]
    return body.split("\n(N=", 1)[0]


@pytest.mark.parametrize("backend", [["--simulate"], ["--mode", "ar"], []], ids=["simulate", "ar", "ranks"])
def test_streamed_text_is_the_final_text(drafter_dir, backend, capsys):
    args = ["--ckpt", drafter_dir, "--prompt", "hello world", "--max-new-tokens", "12", "--timeout", "60", *backend]
    assert main(args) == 0
    plain = _text(capsys.readouterr().out)
    assert main([*args, "--stream"]) == 0
    streamed = _text(capsys.readouterr().out)
    assert streamed == plain and plain.strip()


class Chars:
    """A tokenizer whose token i is chr(i); 0xFFFD stands for half a character."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=None):
        return "".join(chr(i) for i in ids)


def test_text_stream_holds_back_partial_characters_and_stop_strings():
    stream = TextStream(Chars(), stop=["END"])
    assert stream.feed([ord("a"), 0xFFFD]) == "a"
    assert stream.feed([ord("b"), ord("E")]) == "\ufffdb"  # "E" may begin "END": held back
    assert stream.feed([ord("x")]) == "Ex"
    assert stream.feed([ord("E"), ord("N"), ord("D"), ord("z")]) == "" and stream.stopped
    assert stream.text == "a\ufffdbEx" and stream.finish() == ""
