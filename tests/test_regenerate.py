"""`prepare --regenerate` (spd_lightning/data/regenerate.py): the target answers the first user turn of every
training chat in batches; the answers are the target's own greedy continuations, the file resumes after a cut,
and prepare then tokenizes it as the data source."""

import json
import os
import re

import pytest
import torch
from kit import QWEN3_NO_USER_QUERY, REPO, TINY_VOCAB, make_tokenizer

from spd_lightning import prepare
from spd_lightning.data.chat import load_tokenizer, render_chat
from spd_lightning.data.regenerate import Generation, complete_records, fitting_prompts, regenerate
from spd_lightning.target import load_hf_causal_lm

PROMPTS = [[{"role": "user", "content": f"tell me about pears number {i}" + " please" * (i % 3)}] for i in range(5)]


def greedy_answer(model, tokenizer, turn, max_new_tokens):
    """The target's greedy answer to one prompt, unbatched, token by token without a cache."""
    ids = tokenizer(render_chat(tokenizer, turn, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    out = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
            if token == tokenizer.eos_token_id:
                break
            out.append(token)
    return tokenizer.decode(out, skip_special_tokens=True).strip()


def test_batched_answers_are_the_targets_greedy_answers_and_a_cut_file_resumes(micro_target, tmp_path):
    model = load_hf_causal_lm(micro_target).eval()
    tokenizer = load_tokenizer(micro_target)
    gen = Generation(max_new_tokens=6, batch_size=2)
    out = str(tmp_path / "answers.jsonl")
    assert regenerate(model, tokenizer, PROMPTS[:3], out, gen) == (3, 3)
    with open(out, "a") as f:
        f.write('{"messages": [{"role": "user", "cont')  # a crash in the middle of a record
    assert regenerate(model, tokenizer, PROMPTS, out, gen) == (2, 5)
    records = [json.loads(line) for line in open(out)]
    assert [r["index"] for r in records] == list(range(5))
    for record, turn in zip(records, PROMPTS):
        assert record["messages"][:-1] == turn
        assert record["messages"][-1] == {"role": "assistant", "content": greedy_answer(model, tokenizer, turn, 6)}
    assert complete_records(out) == 5


def test_prepare_regenerate_writes_the_answers_and_prepares_them(micro_target, tmp_path, capsys):
    data = tmp_path / "chats.jsonl"
    chats = [{"messages": [*turn, {"role": "assistant", "content": "an answer"}]} for turn in PROMPTS]
    data.write_text("".join(json.dumps(c) + "\n" for c in chats))
    out = tmp_path / "regenerated.jsonl"
    args = [
        "--config",
        os.path.join(REPO, "configs", "tiny.yaml"),
        "--model.target",
        micro_target,
        "--data.sources",
        f"[{{path: {data}}}]",
        "--data.val_size",
        "1",
        "--data.draft_vocab_size",
        "64",
        "--data.cache_dir",
        str(tmp_path / "cache"),
        "--regenerate",
        str(out),
        "--max-new-tokens",
        "4",
        "--limit",
        "4",
    ]
    assert prepare.main(args) == 0
    printed = capsys.readouterr().out
    assert "regenerated 4 answers now, 4 in" in printed and "prepared 3 training and 1 validation" in printed
    assert complete_records(str(out)) == 4
    assert prepare.main(args) == 0  # resumed: nothing left to answer, nothing left to prepare
    assert "regenerated 0 answers now, 4 in" in capsys.readouterr().out


def test_on_a_gpu_node_the_target_answers_on_the_gpu_in_the_configs_dtype(micro_target, tmp_path, monkeypatch):
    """`prepare --config configs/qwen35_9b.yaml --regenerate` on a GPU node once loaded the target in float32 into
    host memory and generated on the CPU: it runs as the state cache runs it (the GPU, the config's target_dtype)."""
    loaded = []

    class Asked(Exception):
        pass

    def load(path, dtype="float32", device="cpu", trust_remote_code=False):
        loaded.append((dtype, device, trust_remote_code))
        raise Asked  # stands in for the GPU: what was asked of the loader is all this test reads

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("spd_lightning.target.load_hf_causal_lm", load)
    data = tmp_path / "chats.jsonl"
    data.write_text(
        "".join(json.dumps({"messages": [*t, {"role": "assistant", "content": "a"}]}) + "\n" for t in PROMPTS)
    )
    config = ["--config", os.path.join(REPO, "configs", "tiny.yaml"), "--model.target", micro_target]
    args = [*config, "--model.target_dtype", "bfloat16", "--data.sources", f"[{{path: {data}}}]"]
    args += ["--data.cache_dir", str(tmp_path / "cache"), "--regenerate", str(tmp_path / "out.jsonl")]
    with pytest.raises(Asked):
        prepare.main(args)
    assert loaded == [("bfloat16", "cuda", False)]


def test_bad_generation_settings_are_one_line_errors():
    with pytest.raises(ValueError, match="--temperature -1"):
        Generation(temperature=-1)
    with pytest.raises(ValueError, match="--gen-batch-size|--batch-size"):
        Generation(batch_size=0)


def test_prompts_the_chat_template_refuses_are_skipped():
    """Qwen3's template refuses a first turn that is a lone tool response; `prepare --regenerate` skips it as it
    skips a prompt over `--max-prompt-tokens` (it stopped on jinja2's TemplateError, exit 1 'a bug'), and a source
    left with no prompt it can render is no IndexError."""
    tokenizer = make_tokenizer(TINY_VOCAB)
    tokenizer.chat_template = QWEN3_NO_USER_QUERY + tokenizer.chat_template
    tool = [{"role": "user", "content": "<tool_response>42</tool_response>"}]
    assert fitting_prompts(tokenizer, [tool, *PROMPTS[:2], tool], Generation()) == PROMPTS[:2]
    assert fitting_prompts(tokenizer, [tool], Generation()) == []


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--regenerate", "{tmp}"], "cannot write --regenerate '{tmp}': Is a directory"),
        (["--regenerate", "{tmp}/taken/answers.jsonl"], "cannot write --regenerate '{tmp}/taken/answers.jsonl'"),
        (["--regenerate", "{tmp}/answers.jsonl", "--limit", "0"], "--limit 0: use a positive number of prompts"),
    ],
    ids=["a_directory", "under_a_file", "limit_0"],
)
def test_bad_regenerate_flags_are_one_line_before_the_target_loads(
    micro_target, tmp_path, monkeypatch, extra, expected
):
    """An output path that cannot be written was an unexpected IsADirectoryError / NotADirectoryError (exit 1) once
    the target had loaded and answered nothing; `--limit 0` answered one prompt."""
    from spd_lightning.data import regenerate as regenerate_module
    from spd_lightning.errors import UserError

    (tmp_path / "taken").write_text("")
    monkeypatch.setattr(regenerate_module, "regenerate", lambda *a: pytest.fail("the target answered"))
    args = ["--config", os.path.join(REPO, "configs", "tiny.yaml"), "--model.target", micro_target]
    args += ["--data.cache_dir", str(tmp_path / "cache"), *(a.format(tmp=tmp_path) for a in extra)]
    with pytest.raises(UserError, match=re.escape(expected.format(tmp=tmp_path))):
        prepare.main(args)


def test_a_limit_over_several_sources_says_it_takes_them_in_order(tmp_path, caplog):
    """`--limit N` with a mixture: the first sources fill the limit whatever the weights (SmolTalk at 77 % of the
    weight got nothing behind 17.7k ShareGPT prompts), said in a warning; one source says nothing."""
    from spd_lightning.data import DataSource
    from spd_lightning.data.regenerate import first_turns

    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi there"}]}) + "\n")
    sources = [DataSource("sharegpt", weight=0.2, max_samples=5), DataSource(str(path), weight=0.8)]
    assert len(first_turns(sources, str(tmp_path / "raw"), limit=3)) == 3
    assert "--limit 3 takes the first prompts of the sources in order" in caplog.text
    caplog.clear()
    first_turns(sources[:1], str(tmp_path / "raw"), limit=3)
    assert "--limit" not in caplog.text
