"""The chat data pipeline: formats, loss mask on tokens, filters, mixing, split, draft vocabulary, batches."""

import copy
import io
import json
import os
import subprocess
import sys
import warnings
from types import SimpleNamespace

import datasets
import numpy as np
import pytest
import torch
from kit import QWEN3_NO_USER_QUERY, REPO

from spd_lightning.data import (
    ChatCollator,
    ChatDataModule,
    ChatRenderer,
    DataError,
    DataSource,
    allocate,
    count_assistant_tokens,
    iter_json_array_records,
    load_embedded_sharegpt,
    load_source,
    normalize_conversation,
    plan_mixture,
    select_draft_vocab,
    tokenize_source,
)
from spd_lightning.tiny_target import sharegpt_conversations, train_chat_tokenizer

END_OF_TURN = "<|im_end|>"
GEN_PROMPT_NO_THINKING = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """A small chat tokenizer (512 ids) trained on a few hundred ShareGPT conversations, saved like a target's."""
    texts = (m["content"] for c in sharegpt_conversations(300) for m in c)
    tokenizer = train_chat_tokenizer(texts, vocab_size=512, show_progress=False)
    path = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def sharegpt_record(*turns):
    return {"conversations": [{"from": role, "value": text} for role, text in turns]}


def messages_record(*turns):
    return {"messages": [{"role": role, "content": text} for role, text in turns]}


def chat_records(count, tag="", fmt="sharegpt"):
    make = sharegpt_record if fmt == "sharegpt" else messages_record
    user, assistant = ("human", "gpt") if fmt == "sharegpt" else ("user", "assistant")
    return [
        make(
            (user, f"{tag}question {i} about apples"),
            (assistant, f"{tag}answer {i}: apples are red."),
            (user, "why?"),
            (assistant, f"{tag}because {i} of them said so."),
        )
        for i in range(count)
    ]


def masked_runs(tokenizer, ids, mask):
    """Decoded text of each maximal run of loss-masked tokens."""
    runs, current = [], []
    for token, on in zip(ids, mask):
        if on:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


def make_datamodule(tokenizer_dir, tmp_path, sources, **kwargs):
    kwargs = {"val_size": 2, "draft_vocab_size": 64, "batch_size": 3, **kwargs}
    return ChatDataModule(tokenizer=tokenizer_dir, sources=sources, cache_dir=str(tmp_path / "cache"), **kwargs)


# -- formats and the loss mask ------------------------------------------------------------------------
def test_normalize_cleans_conversations():
    turns = [
        {"from": "gpt", "value": "orphan reply"},
        {"from": "system", "value": "sys"},
        {"from": "human", "value": "q1"},
        {"from": "chatgpt", "value": "a1"},
        {"from": "human", "value": "q2"},
        {"from": "gpt", "value": "  "},
        {"from": "human", "value": "q3"},
        {"from": "gpt", "value": "a3"},
    ]
    assert normalize_conversation(turns, "conversations", "t") == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
    ]
    trailing_user = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "unanswered"},
    ]
    assert [m["content"] for m in normalize_conversation(trailing_user, "messages", "t")] == ["q", "a"]


@pytest.mark.parametrize("fmt", ["sharegpt", "messages"])
def test_loss_mask_covers_exactly_the_assistant_replies(tokenizer, fmt):
    make = sharegpt_record if fmt == "sharegpt" else messages_record
    user, assistant, system = ("human", "gpt", "system") if fmt == "sharegpt" else ("user", "assistant", "system")
    replies = ["Hello! How can I help you today?", "Sure:\n1. apples\n2. pears", "It is 4 (four)."]
    record = make(
        (system, "You are terse."),
        (user, "hi"),
        (assistant, replies[0]),
        (user, "list fruit"),
        (assistant, replies[1]),
        (user, "2+2? say Hello! How can I help you today?"),
        (assistant, replies[2]),
    )
    column = "conversations" if fmt == "sharegpt" else "messages"
    renderer = ChatRenderer(tokenizer, max_length=4096, column=column, source_name="test")
    messages = normalize_conversation(record[column], column, "test")
    rendered = renderer.encode_messages(messages)
    assert rendered.status == "ok"
    assert masked_runs(tokenizer, rendered.input_ids, rendered.loss_mask) == [r + END_OF_TURN for r in replies]
    # the template's scaffolding, including the empty think block of the last reply, is prompt, not reply
    text = tokenizer.decode(rendered.input_ids)
    assert text.count("<think>") == 1 and "</think>\n\n" + replies[2] in text
    # the batched map path gives the same sample and the first-turn prompt
    out = renderer({column: [record[column]]}, [0])
    assert out["input_ids"][0] == rendered.input_ids and out["loss_mask"][0] == rendered.loss_mask
    assert out["prompt"][0].endswith("<|im_start|>user\nhi<|im_end|>\n" + GEN_PROMPT_NO_THINKING)


def test_loss_mask_is_exact_for_other_templates(tokenizer):
    """A trimming template, and replies that also occur in the template's scaffolding ("a" of "assistant")."""
    trimming = copy.deepcopy(tokenizer)
    trimming.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n\\n' + m.content | trim + "
        "'<|im_end|>' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\\n\\n' }}{% endif %}"
    )
    messages = [
        {"role": "user", "content": "assistant"},
        {"role": "assistant", "content": "  padded reply \n"},
        {"role": "user", "content": "say a"},
        {"role": "assistant", "content": "a"},
    ]
    for renderer_tokenizer, expected in ((trimming, ["padded reply", "a"]), (tokenizer, ["  padded reply \n", "a"])):
        renderer = ChatRenderer(renderer_tokenizer, max_length=512, column="messages", source_name="test")
        rendered = renderer.encode_messages(messages)
        assert masked_runs(tokenizer, rendered.input_ids, rendered.loss_mask) == [e + END_OF_TURN for e in expected]


def test_rewritten_and_refused_conversations_are_counted(tokenizer):
    renderer = ChatRenderer(tokenizer, max_length=512, column="messages", source_name="test")
    # Qwen3's template moves a reply's `<think>...</think>` part into the think block: not the reply we have
    rewritten = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>hm</think>answer"}]
    assert renderer.encode_messages(rewritten).status == "reply_not_found"
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('must start with user') }}{% endif %}"
        "{% for m in messages %}{{ m.role + ': ' + m.content + '<|im_end|>' }}{% endfor %}"
    )
    strict_renderer = ChatRenderer(strict, max_length=512, column="messages", source_name="test")
    refused = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]
    assert strict_renderer.encode_messages(refused).status == "template_rejected"
    assert strict_renderer.encode_messages(refused[1:]).status == "ok"


def test_a_first_turn_the_template_refuses_is_one_line_or_a_dropped_sample(tokenizer):
    """Qwen3's template refuses a user turn that is a tool response when no real query follows: a prompt of the
    decoder or the staircase evaluation is then one line naming it (it was jinja2's TemplateError, a bug), and a
    conversation whose whole rendering it accepts but whose first turn alone (the held-out prompt) it refuses is
    dropped and counted with the refused ones (it aborted the whole tokenization)."""
    from spd_lightning.data.chat import render_prompt

    qwen = copy.deepcopy(tokenizer)
    qwen.chat_template = QWEN3_NO_USER_QUERY + qwen.chat_template
    with pytest.raises(DataError, match="the chat template refuses the prompt .*No user query found in messages"):
        render_prompt(qwen, "<tool_response>42</tool_response>")
    assert render_prompt(qwen, "what is 6 x 7?") == render_prompt(tokenizer, "what is 6 x 7?")
    renderer = ChatRenderer(qwen, max_length=512, column="messages", source_name="test")
    tool_first = [
        ("user", "<tool_response>42</tool_response>"),
        ("assistant", "noted"),
        ("user", "q"),
        ("assistant", "a"),
    ]
    plain = [("user", "q"), ("assistant", "a")]
    batch = {"messages": [messages_record(*tool_first)["messages"], messages_record(*plain)["messages"]]}
    out = renderer(batch, [0, 1])
    assert out["status"] == ["template_rejected", "ok"] and out["prompt"][0] == "" and out["input_ids"][0] == []


def test_filter_counts(tokenizer, tokenizer_dir, tmp_path):
    records = chat_records(4) + [
        sharegpt_record(("human", "only a question")),
        sharegpt_record(("human", "long"), ("gpt", "word " * 400)),
        sharegpt_record(("gpt", "a reply to nothing")),
    ]
    source = DataSource(path=write_jsonl(tmp_path / "mixed.jsonl", records))
    part = tokenize_source(source, tokenizer, tokenizer_dir, max_length=128, cache_dir=str(tmp_path / "cache"))
    stats = part.stats
    assert (stats.records, stats.kept, stats.too_long, stats.no_assistant) == (7, 4, 1, 2)
    assert part.usable.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("name", ["empty.jsonl", "empty.jsonl.gz"])
def test_an_empty_data_file_is_one_line(tokenizer, tokenizer_dir, tmp_path, name):
    """An empty jsonl (a regeneration that answered nothing, a filter that kept nothing) made `datasets` raise a bare
    StopIteration: 'unexpected StopIteration' (exit 1)."""
    import gzip

    path = tmp_path / name
    path.write_bytes(gzip.compress(b"") if name.endswith(".gz") else b"")
    source = DataSource(path=str(path))
    with pytest.raises(DataError, match=f"data file '{path}' holds no record"):
        tokenize_source(source, tokenizer, tokenizer_dir, max_length=128, cache_dir=str(tmp_path / "cache"))


def test_no_usable_sample_fails_loudly(tokenizer, tokenizer_dir, tmp_path):
    source = DataSource(path=write_jsonl(tmp_path / "q.jsonl", [sharegpt_record(("human", "q"))] * 3))
    with pytest.raises(DataError, match="yields no usable sample") as error:
        tokenize_source(source, tokenizer, tokenizer_dir, max_length=128, cache_dir=str(tmp_path / "cache"))
    assert "\n" not in str(error.value)


def test_tokenized_source_is_cached(tokenizer, tokenizer_dir, tmp_path, monkeypatch):
    source = DataSource(path=write_jsonl(tmp_path / "a.jsonl", chat_records(5)))
    first = tokenize_source(source, tokenizer, tokenizer_dir, 256, str(tmp_path / "cache"))

    def no_reading(*_args):
        raise AssertionError("the raw source was read again despite a complete cache")

    monkeypatch.setattr("spd_lightning.data.tokenized.load_source", no_reading)
    again = tokenize_source(source, tokenizer, tokenizer_dir, 256, str(tmp_path / "cache"))
    assert again.rows["input_ids"] == first.rows["input_ids"] and again.stats == first.stats


CONCURRENT_BUILD = """
import json, sys
from transformers import AutoTokenizer
from spd_lightning.data import DataSource
from spd_lightning.data import tokenized

tokenizer_dir, source_path, cache, log = sys.argv[1:]
build = tokenized._build
def logged(*args, **kwargs):
    with open(log, "a") as f:
        f.write("build\\n")
    return build(*args, **kwargs)
tokenized._build = logged
out = tokenized.tokenize_source(DataSource(path=source_path), AutoTokenizer.from_pretrained(tokenizer_dir),
                                tokenizer_dir, 256, cache)
print(json.dumps({"rows": len(out.rows), "usable": len(out.usable)}))
"""


def test_runs_sharing_a_cache_build_it_once(tokenizer_dir, tmp_path):
    """Two jobs started together on one cache: one builds, the other waits for it and reads the same rows."""
    import subprocess
    import sys

    source = write_jsonl(tmp_path / "a.jsonl", chat_records(400))
    log = tmp_path / "builds.log"
    jobs = [
        subprocess.Popen(
            [sys.executable, "-c", CONCURRENT_BUILD, tokenizer_dir, source, str(tmp_path / "cache"), str(log)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [job.communicate(timeout=120) for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], [err[-800:] for _, err in outs]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert results[0] == results[1] and results[0]["usable"] > 0
    assert log.read_text() == "build\n"  # exactly one of them tokenized


def test_qwen_reply_that_begins_with_a_newline_keeps_its_loss_mask(tokenizer):
    """The Qwen template renders the last reply as `content.lstrip('\\n')`: a reply that opens with a newline and
    then indentation (code, a list) must still be found in the rendering, not dropped as `reply_not_found`."""
    renderer = ChatRenderer(tokenizer, max_length=512, column="messages", source_name="test")
    reply = "\n    def f():\n        return 1"
    messages = [{"role": "user", "content": "write f"}, {"role": "assistant", "content": reply}]
    assert GEN_PROMPT_NO_THINKING + reply.lstrip("\n") in renderer.render_text(messages)
    rendered = renderer.encode_messages(messages)
    assert rendered.status == "ok"
    assert masked_runs(tokenizer, rendered.input_ids, rendered.loss_mask) == [reply.lstrip("\n") + END_OF_TURN]


def test_unreadable_records_are_counted_dropped_and_summarized_in_one_line(tokenizer, tokenizer_dir, tmp_path, caplog):
    """Tool calls and other unknown roles, malformed turns: the record is dropped and counted per reason; the map
    goes on, and the source's summary reports them in its one line."""
    bad = [
        messages_record(("user", "q"), ("tool", "{}"), ("assistant", "a")),
        messages_record(("user", "q"), ("function", "{}"), ("assistant", "a")),
        messages_record(("user", "q"), ("tool", "[]"), ("assistant", "b")),
        {"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]},
    ]
    records = chat_records(2, fmt="messages") + bad + chat_records(2, tag="x", fmt="messages")
    source = DataSource(path=write_jsonl(tmp_path / "tools.jsonl", records))
    with caplog.at_level("INFO"):
        part = tokenize_source(source, tokenizer, tokenizer_dir, max_length=256, cache_dir=str(tmp_path / "cache"))
    assert (part.stats.records, part.stats.kept) == (8, 4)
    assert part.stats.bad_records == {"unknown role 'tool'": 2, "unknown role 'function'": 1, "malformed turn": 1}
    assert part.usable.tolist() == [0, 1, 6, 7]
    lines = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "4 unreadable records (malformed turn: 1, unknown role 'function': 1, unknown role 'tool': 2)" in lines[0]


def test_num_proc_tokenizes_in_several_processes_with_identical_rows(tokenizer, tokenizer_dir, tmp_path):
    source = DataSource(path=write_jsonl(tmp_path / "a.jsonl", chat_records(40)))
    one = tokenize_source(source, tokenizer, tokenizer_dir, 256, str(tmp_path / "one"))
    two = tokenize_source(source, tokenizer, tokenizer_dir, 256, str(tmp_path / "two"), num_proc=2)
    assert len(two.rows.cache_files) == 2  # one shard per worker process
    assert two.rows["input_ids"] == one.rows["input_ids"] and two.rows["loss_mask"] == one.rows["loss_mask"]
    assert two.stats == one.stats


# -- sources -------------------------------------------------------------------------------------------
def test_embedded_sharegpt_reads_only_what_is_asked():
    records = load_embedded_sharegpt(max_samples=5)
    assert len(records) == 5
    assert all(set(turn) == {"from", "value"} for r in records for turn in r["conversations"])
    assert records[0]["conversations"][0]["from"] == "human"


def test_cut_json_array_keeps_complete_records_and_warns():
    complete = [sharegpt_record(("human", f"q{i}"), ("gpt", f"a{i}")) for i in range(3)]
    text = json.dumps(complete, indent=2)
    cut = text[: text.rindex('"a2"') + 2]
    with pytest.warns(UserWarning, match="cut off .* kept the 2 complete records"):
        assert list(iter_json_array_records(io.StringIO(cut), "test file")) == complete[:2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(iter_json_array_records(io.StringIO(text), "test file")) == complete


def test_jsonl_and_parquet_sources_load(tokenizer_dir, tmp_path):
    parquet = tmp_path / "chats.parquet"
    datasets.Dataset.from_list(chat_records(6, "P", fmt="messages")).to_parquet(str(parquet))
    sources = [DataSource(path=write_jsonl(tmp_path / "a.jsonl", chat_records(6, "J"))), DataSource(path=str(parquet))]
    dm = make_datamodule(tokenizer_dir, tmp_path, sources)
    dm.setup()
    assert [s.kept for s in dm.stats] == [6, 6]
    assert len(dm.train_dataset) + len(dm.val_dataset) == 12


def test_gzipped_jsonl_reads_like_the_plain_file(tmp_path):
    """The regenerated answers are committed as .jsonl.gz: the same records as the plain file; other .gz refused."""
    import gzip
    import shutil

    plain = write_jsonl(tmp_path / "a.jsonl", chat_records(6, "G"))
    with open(plain, "rb") as f, gzip.open(tmp_path / "a.jsonl.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    gz = DataSource(path=str(tmp_path / "a.jsonl.gz"))
    assert gz.kind == "file"
    assert load_source(gz, str(tmp_path / "raw"))[:] == load_source(DataSource(path=plain), str(tmp_path / "raw"))[:]
    (tmp_path / "b.parquet.gz").write_bytes(b"")
    with pytest.raises(DataError, match="unsupported extension"):
        load_source(DataSource(path=str(tmp_path / "b.parquet.gz")), str(tmp_path / "raw"))


# -- mixing and the split ------------------------------------------------------------------------------
def test_allocate_is_exact_and_proportional():
    assert allocate(10, [3, 1]) == [8, 2]
    assert allocate(7, [1, 1, 1]) == [3, 2, 2]
    assert sum(allocate(1001, [0.2, 0.5, 0.3])) == 1001


def test_mixture_proportions_and_no_leakage():
    plan = plan_mixture(["big", "small"], sizes=[60, 20], weights=[1.0, 3.0], val_size=8, seed=0)
    train_counts = [len(t) for t in plan.train]
    assert sum(train_counts) == 72 and train_counts == [18, 54]  # 1:3 of all 72 training samples
    assert [len(v) for v in plan.val] == [2, 6]
    small_train, small_val = set(plan.train[1].tolist()), set(plan.val[1].tolist())
    assert not small_train & small_val and len(small_train) == 14  # repeated, never a validation sample
    assert "3.86x its 14" in plan.summary


def test_datamodule_mixes_sources_by_weight(tokenizer_dir, tmp_path):
    sources = [
        DataSource(path=write_jsonl(tmp_path / "a.jsonl", chat_records(30, "A")), weight=1.0),
        DataSource(path=write_jsonl(tmp_path / "b.jsonl", chat_records(10, "B", fmt="messages")), weight=1.0),
    ]
    dm = make_datamodule(tokenizer_dir, tmp_path, sources, val_size=0)
    dm.setup()
    texts = [dm.tokenizer.decode(ids) for ids in dm.train_dataset["input_ids"]]
    from_b = sum("Bquestion" in t for t in texts)
    assert len(texts) == 40 and from_b == 20


def test_split_is_deterministic(tokenizer_dir, tmp_path):
    sources = [DataSource(path=write_jsonl(tmp_path / "a.jsonl", chat_records(20)))]
    first, again = (make_datamodule(tokenizer_dir, tmp_path, sources, val_size=0.25, seed=1) for _ in range(2))
    other = make_datamodule(tokenizer_dir, tmp_path, sources, val_size=0.25, seed=2)
    for dm in (first, again, other):
        dm.setup()
    assert len(first.val_dataset) == 5 and len(first.train_dataset) == 15
    assert first.val_dataset["input_ids"] == again.val_dataset["input_ids"]
    assert first.train_dataset["input_ids"] == again.train_dataset["input_ids"]
    assert first.val_dataset["input_ids"] != other.val_dataset["input_ids"]
    assert not {tuple(x) for x in first.val_dataset["input_ids"]} & {tuple(x) for x in first.train_dataset["input_ids"]}


# -- draft vocabulary ----------------------------------------------------------------------------------
def test_d2t_on_a_hand_made_corpus():
    samples = datasets.Dataset.from_dict(
        {
            "input_ids": [[5, 7, 7, 9, 3], [7, 9, 2, 7, 4]],
            "loss_mask": [[False, True, True, True, True], [False, True, False, True, True]],
        }
    )
    counts = count_assistant_tokens(samples, vocab_size=10)
    assert counts.tolist() == [0, 0, 0, 1, 1, 0, 0, 3, 0, 2]  # unmasked tokens (5, 2, the first 7) do not count
    assert select_draft_vocab(counts, 3).tolist() == [7, 9, 3]  # by count, then the smaller id among equals
    assert select_draft_vocab(counts, 100).tolist() == [7, 9, 3, 4]  # clamped to the distinct tokens
    with pytest.raises(DataError, match="draft_vocab_size=0"):
        select_draft_vocab(counts, 0)


def test_datamodule_d2t_counts_training_assistant_tokens(tokenizer_dir, tmp_path):
    sources = [DataSource(path=write_jsonl(tmp_path / "a.jsonl", chat_records(12)))]
    dm = make_datamodule(tokenizer_dir, tmp_path, sources, draft_vocab_size=8)
    dm.setup()
    assert dm.d2t.dtype == torch.long and len(dm.d2t) == 8
    counts = np.zeros(len(dm.tokenizer), dtype=np.int64)
    for ids, mask in zip(dm.train_dataset["input_ids"], dm.train_dataset["loss_mask"]):
        np.add.at(counts, np.asarray(ids)[np.asarray(mask)], 1)
    assert dm.d2t.tolist() == select_draft_vocab(counts, 8).tolist()
    assert dm.tokenizer.convert_tokens_to_ids(END_OF_TURN) in dm.d2t.tolist()  # every reply ends with it


# -- batches and prompts -------------------------------------------------------------------------------
def test_collate_pads_right():
    batch = ChatCollator(pad_token_id=0)(
        [{"input_ids": [4, 5, 6], "loss_mask": [False, True, True]}, {"input_ids": [7], "loss_mask": [True]}]
    )
    assert batch["input_ids"].tolist() == [[4, 5, 6], [7, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[False, True, True], [True, False, False]]
    assert (batch["input_ids"].dtype, batch["attention_mask"].dtype, batch["loss_mask"].dtype) == (
        torch.long,
        torch.long,
        torch.bool,
    )
    rounded = ChatCollator(pad_token_id=9, pad_to_multiple_of=4)(
        [{"input_ids": [1, 2, 3, 4, 5], "loss_mask": [True] * 5}]
    )
    assert rounded["input_ids"].tolist() == [[1, 2, 3, 4, 5, 9, 9, 9]]


def test_datamodule_batches_and_heldout_prompts(tokenizer_dir, tmp_path):
    sources = [DataSource(path=write_jsonl(tmp_path / "a.jsonl", chat_records(8)))]
    dm = make_datamodule(tokenizer_dir, tmp_path, sources)
    dm.prepare_data()
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == batch["loss_mask"].shape == batch["attention_mask"].shape
    assert batch["input_ids"].shape[0] == 3
    pad = dm.tokenizer.pad_token_id
    assert (batch["input_ids"][batch["attention_mask"] == 0] == pad).all()
    assert not batch["loss_mask"][batch["attention_mask"] == 0].any()
    assert len(list(dm.val_dataloader())) == 1

    prompts = dm.heldout_prompts(5)
    assert len(prompts) == 2  # only two validation conversations exist
    for ids in prompts:
        text = dm.tokenizer.decode(ids)
        assert text.startswith("<|im_start|>user\nquestion ") and text.endswith(GEN_PROMPT_NO_THINKING)
        assert "answer" not in text


def test_decoder_and_callback_render_prompts_as_training_renders_heldout_prompts(tokenizer_dir, tmp_path):
    """One renderer: a user turn rendered by `inference.prompts.render` (the decoder and the staircase callback's
    prompt files) gives the ids of the same turn held out by the data module."""
    import inference.prompts
    from spd_lightning.data import chat

    assert inference.prompts.render is chat.render_prompt and inference.prompts.load_tokenizer is chat.load_tokenizer
    records = chat_records(8)
    dm = make_datamodule(tokenizer_dir, tmp_path, [DataSource(path=write_jsonl(tmp_path / "a.jsonl", records))])
    dm.setup("fit")
    by_text = {r["conversations"][0]["value"]: r for r in records}
    for ids in dm.heldout_prompts(2):
        question = next(q for q in by_text if q + "<|im_end|>" in dm.tokenizer.decode(ids))
        assert inference.prompts.render(dm.tokenizer, question) == ids
    with pytest.raises(DataError, match="encodes to no token"):
        chat.render_prompt(type("NoTemplate", (), {"__call__": lambda self, t, **k: {"input_ids": []}})(), "")


def test_shared_pieces_import_neither_lightning_nor_datasets():
    code = (
        "import sys, inference.prompts, spd_lightning.data.chat, spd_lightning.training.metrics; "
        "print(sorted(m for m in ('lightning', 'pytorch_lightning', 'datasets') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
    ).stdout
    assert out.strip() == "[]"


def test_sources_parse_from_yaml_like_lightning_cli(tokenizer_dir, tmp_path):
    from jsonargparse import ArgumentParser

    path = write_jsonl(tmp_path / "a.jsonl", chat_records(6))
    parser = ArgumentParser()
    parser.add_class_arguments(ChatDataModule, "data")
    config = parser.parse_string(f"""
data:
  tokenizer: {tokenizer_dir}
  cache_dir: {tmp_path / "cache"}
  val_size: 0.25
  sources:
    - {{path: sharegpt, weight: 2.0, max_samples: 40}}
    - {{path: {path}, weight: 0.5}}
""")
    dm = parser.instantiate_classes(config).data
    assert dm.sources == [DataSource(path="sharegpt", weight=2.0, max_samples=40), DataSource(path=path, weight=0.5)]
    assert dm.val_size == 0.25 and isinstance(dm.val_size, float)
    dm.setup()
    assert dm.stats[0].records == 40 and dm.stats[1].kept == 6


# -- bad input: one line that names the value and the fix ----------------------------------------------
def one_line_error(call, match):
    with pytest.raises(DataError, match=match) as error:
        call()
    assert "\n" not in str(error.value)


def test_bad_input_raises_one_line_errors(tokenizer_dir, tmp_path):
    good = [DataSource(path=write_jsonl(tmp_path / "a.jsonl", chat_records(4)))]
    one_line_error(lambda: make_datamodule(tokenizer_dir, tmp_path, good, draft_vocab_size=0), "draft_vocab_size=0")
    one_line_error(lambda: make_datamodule(tokenizer_dir, tmp_path, good, val_size=-1), "val_size=-1")
    one_line_error(lambda: ChatDataModule(tokenizer=str(tmp_path / "no_such_tokenizer")), "does not exist")
    one_line_error(lambda: DataSource(path="x.jsonl", weight=0), "weight=0")

    missing = [DataSource(path=str(tmp_path / "missing.jsonl"))]
    one_line_error(make_datamodule(tokenizer_dir, tmp_path, missing).setup, "does not exist")
    wrong_schema = [DataSource(path=write_jsonl(tmp_path / "text.jsonl", [{"text": "hello"}]))]
    one_line_error(make_datamodule(tokenizer_dir, tmp_path, wrong_schema).setup, "needs `conversations`")
    bad_role = [
        DataSource(path=write_jsonl(tmp_path / "role.jsonl", [sharegpt_record(("human", "q"), ("robot", "a"))]))
    ]
    one_line_error(make_datamodule(tokenizer_dir, tmp_path, bad_role).setup, "unknown role 'robot'")
    one_line_error(make_datamodule(tokenizer_dir, tmp_path, good, val_size=10).setup, "only 4 usable samples")
    offline_hub = [DataSource(path="HuggingFaceH4/ultrachat_200k", split="train_sft")]  # HF_HUB_OFFLINE=1 here
    one_line_error(make_datamodule(tokenizer_dir, tmp_path, offline_hub).setup, "cannot load hub dataset")


def test_a_subset_of_a_source_without_subsets_is_one_line(tmp_path):
    """`subset` names a configuration of a hub or directory dataset; on the embedded ShareGPT or a local file it
    was accepted and ignored."""
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}]}) + "\n")
    for source in (DataSource("sharegpt", subset="x"), DataSource(str(path), subset="x")):
        with pytest.raises(DataError, match="has no subsets, got subset='x': drop `subset`"):
            load_source(source, str(tmp_path / "raw"))


def test_on_several_ranks_a_source_that_prepare_data_cannot_read_is_raised_by_setup(tokenizer_dir, tmp_path):
    """Lightning runs `prepare_data` on one process per node while the others wait in a barrier: the failure is kept
    there and raised by `setup`, where every rank reads the data and ends with the line (the whole 2-process run:
    `test_cli::test_a_bad_data_file_ends_every_ddp_rank_with_its_line`, slow). On one rank it is raised at once."""
    bad = tmp_path / "chats.jsonl"
    bad.write_text('{"conversations": [{"from": "human", "value": "hi"}]}\n{"conversations": [\n')
    for world_size in (1, 2):
        datamodule = make_datamodule(tokenizer_dir, tmp_path, [DataSource(path=str(bad))])
        datamodule.trainer = SimpleNamespace(world_size=world_size)
        if world_size == 1:
            one_line_error(datamodule.prepare_data, "as json")
        else:
            datamodule.prepare_data()  # the rank that prepares joins the others' barrier
            one_line_error(lambda dm=datamodule: dm.setup("fit"), f"cannot read '{bad}' as json")
