"""Loading the frozen target: straight onto its rank's device (no full CPU copy first), and which Gated DeltaNet
implementation it runs.

What a CPU can show: the loading call asks transformers to place every tensor on the rank's device
(`device_map`), never `.to()`s a loaded model, and a load onto the `meta` device leaves no parameter or buffer
on the CPU. That the CUDA load itself streams tensor by tensor is transformers' behaviour, not shown here.
"""

import json
import os
import sys

import pytest
import torch
from kit import make_tiny_model

from spd_lightning import target as target_module
from spd_lightning.target import Target, linear_attention_path, load_hf_causal_lm
from spd_lightning.training.deltanet_fallback import fallback_warning


@pytest.fixture(scope="module")
def saved_qwen35(tmp_path_factory):
    model = make_tiny_model("qwen3_5")
    path = tmp_path_factory.mktemp("qwen35") / "target"
    model.save_pretrained(path)
    return str(path), model


@pytest.fixture
def no_module_moves(monkeypatch):
    """Fails the test if anything calls `nn.Module.to` (a load that lands on the CPU and then moves would)."""

    def refuse(module, *args, **kwargs):
        raise AssertionError(f"{type(module).__name__}.to{args} called: the target was moved after loading")

    monkeypatch.setattr(torch.nn.Module, "to", refuse)


def test_the_load_call_places_the_weights_on_the_rank_device(saved_qwen35, monkeypatch, no_module_moves):
    """A GPU rank's load: what transformers is asked for (this machine has no CUDA to load onto)."""
    from transformers import AutoModelForCausalLM

    calls = []

    class Loaded(torch.nn.Module):
        pass

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **kw: calls.append(kw) or Loaded())
    load_hf_causal_lm(saved_qwen35[0], "bfloat16", torch.device("cuda", 3))
    assert len(calls) == 1 and calls[0]["device_map"] == {"": "cuda:3"} and calls[0]["dtype"] is torch.bfloat16


def test_a_meta_load_creates_no_cpu_tensor(saved_qwen35, no_module_moves):
    target = Target.load(saved_qwen35[0], "float32", "meta")
    devices = {t.device.type for t in [*target.model.parameters(), *target.model.buffers()]}
    assert devices == {"meta"}


def test_a_cpu_load_has_the_saved_weights(saved_qwen35, no_module_moves):
    target = Target.load(saved_qwen35[0], "float32", "cpu")
    saved = saved_qwen35[1].state_dict()
    loaded = target.model.state_dict()
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert not any(p.requires_grad for p in target.model.parameters()) and not target.model.training


def test_gated_deltanet_path_reports_the_fallback_on_this_cpu_machine(saved_qwen35):
    assert "torch fallback" in linear_attention_path(saved_qwen35[1])
    assert "flash-linear-attention, causal-conv1d" in linear_attention_path(saved_qwen35[1])
    assert linear_attention_path(make_tiny_model("qwen3")) is None  # no linear-attention layers


def test_gated_deltanet_path_reports_the_kernels_transformers_bound(saved_qwen35, monkeypatch):
    """transformers binds a kernel at import and records it in its wrapper's closure; mimic a bound one."""
    model = saved_qwen35[1]
    modeling = sys.modules[type(model.model.layers[0].linear_attn).__module__]

    def wrapper_of(is_new_implementation):
        def wrapped(*args, **kwargs):
            return is_new_implementation

        return wrapped

    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", wrapper_of(True))
    path = linear_attention_path(model)  # the recurrence fast, the short convolution in torch: not the slow fallback
    assert (
        path.startswith("fast recurrence (flash-linear-attention), torch short convolution") and "causal-conv1d" in path
    )
    assert fallback_warning(path, torch.device("cuda"), "t") is None  # no "SLOW" line at fit's start
    monkeypatch.setattr(modeling, "causal_conv1d_fn", wrapper_of(True))
    assert linear_attention_path(model) == "fast kernels (flash-linear-attention, causal-conv1d)"
    assert set(target_module.DELTANET_KERNELS) <= set(vars(modeling))  # the names transformers 5 uses


CUSTOM_TOKENIZER = """
from transformers import PreTrainedTokenizerFast


class CustomTokenizer(PreTrainedTokenizerFast):
    pass
"""


def test_trust_remote_code_reaches_the_targets_tokenizer(tmp_path):
    """A target whose tokenizer is its repository's own class: `--trust-remote-code` (decode, serve, eval) and
    `model.trust_remote_code` (fit, linked to the data module) let it load; the flag reached only the model, so the
    tokenizer was transformers' built-in stand-in (or, without one, an error or a question on a terminal)."""
    from kit import REPO, save_target

    from inference import decode as spd_decode
    from inference.setup import prepare
    from spd_lightning.data.chat import load_tokenizer
    from spd_lightning.prepare import data_module

    path = save_target(make_tiny_model("qwen3"), str(tmp_path / "target"))
    (tmp_path / "target" / "custom_tokenizer.py").write_text(CUSTOM_TOKENIZER)
    config_file = tmp_path / "target" / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config |= {
        "tokenizer_class": "CustomTokenizer",
        "auto_map": {"AutoTokenizer": [None, "custom_tokenizer.CustomTokenizer"]},
    }
    config_file.write_text(json.dumps(config))
    assert type(load_tokenizer(path)).__name__ != "CustomTokenizer"  # a built-in class stands in, silently
    assert type(load_tokenizer(path, trust_remote_code=True)).__name__ == "CustomTokenizer"
    args = spd_decode.parse_args(["--ckpt", "none", "--target", path, "--mode", "ar", "--prompt", "hi"])
    args.trust_remote_code = True
    assert type(prepare(args).tokenizer).__name__ == "CustomTokenizer"
    fit = ["--config", os.path.join(REPO, "configs", "tiny.yaml"), "--model.target", path]
    data = data_module([*fit, "--model.trust_remote_code", "true", "--data.cache_dir", str(tmp_path / "cache")])
    assert type(data.tokenizer).__name__ == "CustomTokenizer"
