"""The embedded tiny target: tokenizer + chat template, a short pretraining run, an ordinary HF directory."""

import json

import pytest
import torch

from spd_lightning.tiny_target import (
    DEFAULT_STEPS,
    REPORT_FILE,
    TinyTargetError,
    build_tiny_target,
    main,
    resolve_budget,
    tiny_model_config,
)

TINY_BUILD = dict(
    minutes=2.0,
    max_steps=2,
    hidden_size=32,
    num_layers=4,
    vocab_size=512,
    seq_len=64,
    batch_size=2,
    max_conversations=120,
    tokenizer_conversations=100,
    heldout_conversations=8,
    heldout_blocks=2,
)


@pytest.fixture(scope="module")
def built_qwen35(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_qwen35")
    report = build_tiny_target(str(out), arch="qwen3_5", seed=0, **TINY_BUILD)
    return str(out), report


def test_build_report(built_qwen35):
    out, report = built_qwen35
    with open(f"{out}/{REPORT_FILE}") as f:
        assert json.load(f) == report
    assert report["steps"] == 2 and report["tokens_seen"] == 2 * 2 * 64
    assert report["model_class"] == "Qwen3_5ForCausalLM" and report["params"] > 0
    assert 0 < report["heldout_loss"] < 10 and "--max-steps 2 --hidden-size 32" in report["rebuild_command"]


def test_tokenizer_and_template_round_trip(built_qwen35):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built_qwen35[0])
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    for token in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"):
        assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1, token
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Ünïcode, 数字 42 and  spaces?"},
        {"role": "assistant", "content": "Yes: 数字 works.\n\n- fine"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, enable_thinking=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nÜnïcode, 数字 42 and  spaces?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nYes: 数字 works.\n\n- fine<|im_end|>\n"
    )
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    prompt = tokenizer.apply_chat_template(
        messages[:2], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    thinking = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert thinking.endswith("<|im_start|>assistant\n")
    # the think markers are ordinary added tokens, as in Qwen3: skipping special tokens keeps them
    ids = tokenizer("<think>x</think><|im_end|>", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>x</think>"


@pytest.mark.hf_internals
def test_loads_through_auto_classes_and_generates(built_qwen35):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spd_lightning.target import Target

    out, _ = built_qwen35
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert set(model.config.layer_types) == {"linear_attention", "full_attention"}
    assert model.config.eos_token_id == tokenizer.eos_token_id and model.config.pad_token_id == tokenizer.pad_token_id
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}],
        add_generation_prompt=True,
        enable_thinking=False,
        return_tensors="pt",
        return_dict=True,
    )
    generated = model.generate(**prompt, max_new_tokens=6, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]
    target = Target.load(out)
    assert target.num_layers == 4 and target.vocab_size == len(tokenizer)


def test_same_seed_steps_and_threads_give_the_same_target(tmp_path):
    session = torch.get_num_threads()
    torch.set_num_threads(2)  # not the build's count (conftest runs the session on one thread)
    try:
        first = build_tiny_target(str(tmp_path / "a"), arch="qwen3", seed=3, num_threads=1, **TINY_BUILD)
        again = build_tiny_target(str(tmp_path / "b"), arch="qwen3", seed=3, num_threads=1, **TINY_BUILD)
        assert torch.get_num_threads() == 2  # the build leaves the process's setting as it found it
    finally:
        torch.set_num_threads(session)
    assert first["heldout_loss"] == again["heldout_loss"] and first["model_class"] == "Qwen3ForCausalLM"
    from safetensors.torch import load_file

    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with open(tmp_path / "a" / "tokenizer.json") as fa, open(tmp_path / "b" / "tokenizer.json") as fb:
        assert fa.read() == fb.read()


def test_the_budget_is_a_step_count_unless_minutes_are_asked_for():
    assert resolve_budget(None, None) == (None, DEFAULT_STEPS)  # the demo's target: the same on every machine
    assert resolve_budget(18.0, None) == (18.0, None)  # the benchmark target: a wall-clock schedule
    assert resolve_budget(2.0, 5) == (2.0, 5)  # steps, with a cap
    with pytest.raises(TinyTargetError, match="budget must be positive"):
        resolve_budget(None, 0)


def test_bad_settings_fail_with_one_line(capsys):
    with pytest.raises(TinyTargetError, match="arch='llama'"):
        tiny_model_config("llama", 512, 32, 2, eos_token_id=2, pad_token_id=0)
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", "unused", "--minutes", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: minutes=0") and "\n" not in err
