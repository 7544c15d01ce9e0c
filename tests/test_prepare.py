"""`python -m spd_lightning prepare --config CFG`: builds the cache `fit` reads, from the same config and parser;
a second run does nothing and says so; concurrent runs on one cache build it once."""

import json
import os
import sys
import warnings

import pytest
import yaml
from kit import REPO

from spd_lightning import cli, prepare
from spd_lightning.data import tokenized


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from spd_lightning.tiny_target import sharegpt_conversations, train_chat_tokenizer

    texts = (m["content"] for c in sharegpt_conversations(200) for m in c)
    path = tmp_path_factory.mktemp("tokenizer")
    train_chat_tokenizer(texts, vocab_size=512, show_progress=False).save_pretrained(path)
    return str(path)


def chats(count):
    return [
        {
            "messages": [
                {"role": "user", "content": f"question {i} about pears"},
                {"role": "assistant", "content": f"answer {i}: pears are green."},
            ]
        }
        for i in range(count)
    ]


def prepare_args(tokenizer_dir, tmp_path, records=200):
    data = tmp_path / "chats.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps(r) + "\n" for r in chats(records)))
    return [
        "--config",
        os.path.join(REPO, "configs", "qwen35_9b.yaml"),
        "--model.target",
        tokenizer_dir,
        "--data.sources",
        f"[{{path: {data}}}]",
        "--data.val_size",
        "4",
        "--data.cache_dir",
        str(tmp_path / "cache"),
    ]


def test_prepare_builds_the_cache_fit_reads_and_a_second_run_does_nothing(tokenizer_dir, tmp_path, capsys, monkeypatch):
    args = prepare_args(tokenizer_dir, tmp_path)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        assert prepare.main(args) == 0
    # the main hands LightningCLI its own arguments: Lightning's warning about that is not the user's concern
    assert not [w for w in shown if "args parameter" in str(w.message)]
    out = capsys.readouterr().out
    assert "prepared 196 training and 4 validation samples" in out

    def no_build(*_args, **_kwargs):
        raise AssertionError("the cache was built again")

    monkeypatch.setattr(tokenized, "_build", no_build)
    monkeypatch.setattr("spd_lightning.data.vocab.count_assistant_tokens", no_build)
    assert prepare.main(args) == 0
    assert "already prepared, nothing to do" in capsys.readouterr().out

    # what `fit` builds from the same command line finds everything cached
    fit_data = prepare.data_module(args)
    assert fit_data.missing_caches() == []
    fit_data.setup("fit")
    assert len(fit_data.train_dataset) == 196


def test_prepare_parses_the_data_section_exactly_as_fit_does(tokenizer_dir, tmp_path, capsys):
    args = prepare_args(tokenizer_dir, tmp_path) + ["--data.num_proc", "3", "--data.max_length", "512"]
    with pytest.raises(SystemExit):
        cli.main(["fit", *args, "--print_config"])
    fit_data = yaml.safe_load(capsys.readouterr().out)["data"]
    fit_data.pop("tokenizer", None)  # linked to model.target, so not printed
    data = prepare.data_module(args)
    assert (data.num_proc, data.max_length, data.batch_size, data.draft_vocab_size) == (3, 512, 2, 32000)
    assert fit_data["num_proc"] == 3 and fit_data["max_length"] == 512 and fit_data["batch_size"] == 2
    assert data.tokenizer_name == tokenizer_dir and data.cache_dir == fit_data["cache_dir"]


def test_bad_config_value_is_one_line_exit_2(tokenizer_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["prepare", *prepare_args(tokenizer_dir, tmp_path), "--data.draft_vocab_size", "0"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "draft_vocab_size=0" in err


def _prepare_logging_builds(log, args, out):
    """One concurrent run (a forked process: it starts with everything imported, so both runs overlap)."""
    build = tokenized._build

    def logged(*a, **kw):
        with open(log, "a") as f:
            f.write("build\n")
        return build(*a, **kw)

    tokenized._build = logged
    with open(out, "w") as sys.stdout:
        code = prepare.main(args)
    os._exit(code)


@pytest.mark.timeout(120)
def test_two_concurrent_runs_build_once_and_both_succeed(tokenizer_dir, tmp_path):
    import multiprocessing

    args = prepare_args(tokenizer_dir, tmp_path, records=2000)
    log = tmp_path / "builds.log"
    context = multiprocessing.get_context("fork")
    jobs = [context.Process(target=_prepare_logging_builds, args=(log, args, tmp_path / f"out{i}")) for i in range(2)]
    for job in jobs:
        job.start()
    for job in jobs:
        job.join(timeout=100)
    assert [job.exitcode for job in jobs] == [0, 0]
    assert log.read_text() == "build\n"  # one tokenized, the other waited on the lock and read its cache
    finals = [(tmp_path / f"out{i}").read_text().strip().splitlines()[-1] for i in range(2)]
    assert all("1,996 training and 4 validation samples" in f or "already prepared" in f for f in finals), finals
    assert not list((tmp_path / "cache").rglob("*.partial*"))  # no staging left behind


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--limit", "100"], "--limit set(s) how --regenerate runs"),
        (["--temperature", "0.7", "--max-new-tokens", "64"], "--temperature, --max-new-tokens set(s) how --regenerate"),
        (["--states-batch-size", "8"], "--states-batch-size set(s) how --states runs"),
    ],
)
def test_an_option_of_regenerate_or_states_without_it_is_one_line(tokenizer_dir, tmp_path, capsys, extra, message):
    """`prepare --limit 100` tokenized everything: the options of `--regenerate` and `--states` were ignored
    without them, silently."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["prepare", *prepare_args(tokenizer_dir, tmp_path), *extra])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and message in err, err
