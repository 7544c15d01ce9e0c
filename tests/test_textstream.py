"""`TextStream` on its own: what each `feed` returns, what `finish` adds, and how many tokens an answer used."""

from inference.textstream import TextStream


class Chars:
    """Token i is chr(i)."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=None):
        return "".join(chr(i) for i in ids)


class Utf8Bytes:
    """Byte-level: token i is the byte i, so a character may take several tokens."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=None):
        return bytes(ids).decode("utf-8", errors="replace")


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_the_text_fed_with_a_stop_string_is_emitted_up_to_it():
    stream = TextStream(Chars(), stop=["STOP"])
    assert stream.feed(ids("hello wor")) == "hello wor"
    assert stream.feed(ids("ld, STOP and more")) == "ld, " and stream.stopped
    assert stream.text == "hello world, " and stream.finish() == ""


def test_a_stop_string_in_the_first_feed_keeps_what_precedes_it():
    stream = TextStream(Chars(), stop=["\n\n", "END"])
    assert stream.feed(ids("one END two")) == "one " and stream.stopped


def test_the_earliest_of_several_stop_strings_wins():
    stream = TextStream(Chars(), stop=["zz", "b"])
    assert stream.feed(ids("azzb")) == "a"


def test_the_held_back_tail_comes_out_at_the_end():
    """Text that may begin a stop string waits; when the decode ends (max_tokens) `finish` returns it."""
    stream = TextStream(Chars(), stop=["###"])
    assert stream.feed(ids("answer #")) == "answer "
    assert stream.feed(ids("#")) == ""  # "##" may still become "###"
    assert stream.finish() == "##"
    assert stream.text == "answer ##" and not stream.stopped


def test_a_held_back_tail_that_is_not_a_stop_string_is_emitted_with_the_next_text():
    stream = TextStream(Chars(), stop=["END"])
    assert stream.feed(ids("xE")) == "x"
    assert stream.feed(ids("Nd")) == "ENd"


def test_a_character_split_across_tokens_waits_for_its_last_byte():
    stream = TextStream(Utf8Bytes())
    snowman = list("☃".encode())  # three bytes
    assert stream.feed([ord("a"), snowman[0]]) == "a"
    assert stream.feed(snowman[1:2]) == ""
    assert stream.feed(snowman[2:]) == "☃"
    assert stream.finish() == "" and stream.text == "a☃"


def test_used_tokens_end_at_the_token_that_completed_the_stop_string():
    """A decoder that verifies several tokens per cycle may have made more; they are not the answer's."""
    stream = TextStream(Chars(), stop=["ca"])
    stream.feed(ids("ab"))
    stream.feed(ids("cabcab"))  # "ca" is complete at the 4th token
    assert stream.stopped and stream.text == "ab" and stream.used_tokens == 4
    plain = TextStream(Chars())
    plain.feed(ids("abc"))
    assert plain.used_tokens == 3


def test_a_stop_string_whose_next_character_is_still_partial_is_held_back():
    """ "问" may begin the stop string "问题" even while the bytes after it are an unfinished character: it waits
    (it was emitted, and the answer kept half a stop string, when a token ended inside "题")."""
    stream = TextStream(Utf8Bytes(), stop=["问题"])
    second = list("题".encode())
    assert stream.feed(list("x问".encode()) + second[:1]) == "x"
    assert stream.feed(second[1:]) == "" and stream.stopped
    assert stream.text == "x" and stream.finish() == ""
    plain = TextStream(Utf8Bytes(), stop=["问题"])
    assert plain.feed(list("x问".encode()) + second[:1]) == "x"
    assert plain.feed(list("好".encode())) == "问\ufffd好"  # half of "题" then "好": not the stop string
    assert plain.finish() == "" and not plain.stopped


def test_a_character_split_over_byte_fallback_tokens_waits_for_its_last_byte():
    """SentencePiece's byte fallback (Llama-2, Mistral, Gemma) decodes each byte of an unfinished character
    to its own U+FFFD: all of them wait. One was emitted, and as the finished character replaced it the
    text no longer began with what was emitted, so nothing more came, the rest of the answer lost."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "a": 1, "b": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    model = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    model.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>")  # as the targets load it
    zhong = [vocab[f"<0x{b:02X}>"] for b in "中".encode()]
    stream = TextStream(tokenizer)
    assert stream.feed([vocab["a"], zhong[0]]) == "a"
    assert stream.feed(zhong[1:2]) == ""  # "a\ufffd\ufffd" until the third byte
    assert stream.feed(zhong[2:]) == "中"
    assert stream.feed([vocab["b"]]) == "b"
    assert stream.finish() == "" and stream.text == "a中b"


def test_a_tokenizer_that_cleans_up_spaces_streams_every_token():
    """A WordPiece tokenizer (BERT's pre-tokenizer and decoder) with `clean_up_tokenization_spaces=True`, BERT's
    default: "it's" is ["it", "'", "s"], and the cleanup turns the decoded "it '" into "it'" once "s" comes. The
    stream decodes without the cleanup, so that no later token rewrites what it has sent: it went silent after
    "it '" for the rest of the answer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[SEP]", "it", "'", "s", "fine", ".", "isn", "t", "?", "yes"]
    model = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    model.pre_tokenizer, model.decoder = pre_tokenizers.BertPreTokenizer(), decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=model, unk_token="[UNK]", eos_token="[SEP]", clean_up_tokenization_spaces=True
    )
    tokens = tokenizer("it's fine. isn't it? yes", add_special_tokens=False)["input_ids"]
    stream = TextStream(tokenizer)
    text = "".join(stream.feed([t]) for t in tokens) + stream.finish()
    assert text == tokenizer.decode(tokens, clean_up_tokenization_spaces=False) == "it ' s fine. isn ' t it? yes"
