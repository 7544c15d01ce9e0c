"""GGUF targets (spd_lightning/gguf_target.py, target_source.py): a tiny Llama written with the `gguf` package's
writer is converted once into a safetensors directory whose model gives the GGUF-loaded model's logits, whose
tokenizer and chat template are the GGUF's, and which every target-taking loader reads; and a random Llama written
the way llama.cpp's converter writes it (Q/K permuted) converts back to the original model's weights and logits."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from spd_lightning import gguf_target
from spd_lightning.data.chat import load_tokenizer
from spd_lightning.target import Target, TargetError, load_hf_config
from spd_lightning.target_source import resolve_target

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 32, 2, 4, 2, 64
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes: the base vocabulary of a byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def _add_vocabulary(writer, merges: list[str]) -> int:
    """A byte-level BPE vocabulary with two special tokens and a chat template, as llama.cpp's converter writes
    one; returns the vocabulary size."""
    tokens = _byte_alphabet() + [m.replace(" ", "") for m in merges] + ["<|end|>", "<|start|>"]
    vocab = len(tokens)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (vocab - 2) + [3, 3])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab - 1)
    writer.add_eos_token_id(vocab - 2)
    writer.add_chat_template(TEMPLATE)
    return vocab


def _add_llama_hparams(writer, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, eps: float) -> None:
    writer.add_context_length(128)
    writer.add_block_count(layers)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(eps)


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_tiny_llama(path: str, seed: int = 0) -> None:
    """A 2-layer Llama with a byte-level BPE vocabulary, two special tokens and a chat template; the attention
    and MLP weights of layer 0 are stored Q8_0 so the conversion dequantizes as it does for a real file."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "llama")
    _add_llama_hparams(writer, HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, 1e-5)
    vocab = _add_vocabulary(writer, ["h e", "l l", "he ll"])

    def weight(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    writer.add_tensor("token_embd.weight", weight(vocab, HIDDEN))
    writer.add_tensor("output_norm.weight", 1 + weight(HIDDEN) * 0.1)
    writer.add_tensor("output.weight", weight(vocab, HIDDEN))
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        shapes = {
            "attn_q": (HIDDEN, HIDDEN),
            "attn_k": (KV_HEADS * head_dim, HIDDEN),
            "attn_v": (KV_HEADS * head_dim, HIDDEN),
            "attn_output": (HIDDEN, HIDDEN),
            "ffn_gate": (FFN, HIDDEN),
            "ffn_up": (FFN, HIDDEN),
            "ffn_down": (HIDDEN, FFN),
        }
        for name, shape in shapes.items():
            tensor = weight(*shape)
            if i == 0:  # quantized: the converted model must hold the dequantized values, not the raw blocks
                quantized = gguf.quants.quantize(tensor, gguf.GGMLQuantizationType.Q8_0)
                writer.add_tensor(f"blk.{i}.{name}.weight", quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            else:
                writer.add_tensor(f"blk.{i}.{name}.weight", tensor)
        writer.add_tensor(f"blk.{i}.attn_norm.weight", 1 + weight(HIDDEN) * 0.1)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", 1 + weight(HIDDEN) * 0.1)
    _finish(writer)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    path = str(root / "tiny-llama.gguf")
    write_tiny_llama(path)
    return path


@pytest.fixture
def target_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPD_TARGET_CACHE", str(tmp_path / "targets"))
    return str(tmp_path / "targets")


@pytest.mark.hf_internals
def test_converted_logits_equal_the_gguf_models(tiny_gguf, target_cache):
    directory = resolve_target(tiny_gguf)
    assert directory.startswith(target_cache)
    assert os.path.isfile(os.path.join(directory, "model.safetensors"))
    ids = torch.tensor([[5, 17, 200, 3, 99, 42, 7, 250]])
    with torch.no_grad():
        expected = gguf_target.load_gguf_model(tiny_gguf)(ids).logits
        converted = Target.load(tiny_gguf).model(ids).logits  # the path every command takes
    assert converted.shape == expected.shape
    torch.testing.assert_close(converted, expected, rtol=0, atol=0)
    assert load_hf_config(tiny_gguf).num_hidden_layers == LAYERS


# A Llama's per-layer HF parameters and the GGUF tensor names llama.cpp's converter gives them
LAYER_TENSORS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
MERGES = ["h e", "l l", "he ll"]


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py (`LlamaModel.permute`) does to a Llama's Q and K rows: within each
    head, HF's two rotary halves are interleaved into GGML's adjacent rotary pairs. K is permuted over the KV
    heads; a reader must undo exactly this, or attention scores change while every shape still fits."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def random_llama(tied: bool, seed: int = 0):
    """A small GQA Llama (4 heads over 2 KV heads) with every weight drawn at random, norms around 1."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256 + len(MERGES) + 2,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.2)
            if name.endswith("norm.weight"):
                p.add_(1)
    return model


def write_as_llama_cpp_does(model, path: str) -> None:
    """`model` as convert_hf_to_gguf.py writes a Llama at `--outtype f32`: its hyperparameters, GGUF tensor
    names, Q/K permuted, no `output.weight` when the embeddings are tied."""
    c = model.config
    writer = gguf.GGUFWriter(path, "llama")
    _add_llama_hparams(
        writer,
        c.hidden_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.intermediate_size,
        c.rms_norm_eps,
    )
    assert _add_vocabulary(writer, MERGES) == c.vocab_size
    state = {name: t.detach().numpy() for name, t in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    if not c.tie_word_embeddings:
        writer.add_tensor("output.weight", state["lm_head.weight"])
    for i in range(c.num_hidden_layers):
        for hf_name, gguf_name in LAYER_TENSORS.items():
            tensor = state[f"model.layers.{i}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                tensor = llama_cpp_permute(tensor, c.num_attention_heads)
            elif gguf_name == "attn_k":
                tensor = llama_cpp_permute(tensor, c.num_key_value_heads)
            writer.add_tensor(f"blk.{i}.{gguf_name}.weight", tensor)
    _finish(writer)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.hf_internals
def test_a_llama_cpp_gguf_converts_back_to_the_original_model(tmp_path, target_cache, tied):
    """Against the original, not the GGUF-loaded model: a fault in the reading code both share (the Q/K
    un-permutation above all) changes the weights and the logits here."""
    original = random_llama(tied)
    path = str(tmp_path / "llama.gguf")
    write_as_llama_cpp_does(original, path)
    converted = Target.load(path).model
    for key in ("num_attention_heads", "num_key_value_heads", "hidden_size", "intermediate_size", "vocab_size"):
        assert getattr(converted.config, key) == getattr(original.config, key), key
    assert converted.config.rms_norm_eps == pytest.approx(original.config.rms_norm_eps, rel=1e-6)  # GGUF: float32
    assert converted.config.tie_word_embeddings == tied
    want, got = original.state_dict(), converted.state_dict()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), f"{name} differs from the original model's"
    ids = torch.tensor([[5, 17, 200, 3, 99, 42, 7, 250, 258, 1]])
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, original(ids).logits)  # eps differs in its 8th digit


@pytest.mark.hf_internals
def test_tokenizer_and_chat_template_come_from_the_gguf(tiny_gguf, target_cache):
    tokenizer = load_tokenizer(tiny_gguf)
    assert tokenizer.encode("hello", add_special_tokens=False)[0] == 256 + 2  # the merge "he ll"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|user|>hi<|end|>"
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|start|>", "<|end|>")  # 5.17's reader: both BOS


def test_conversion_runs_once_and_a_directory_holding_the_gguf_is_a_target(tiny_gguf, target_cache, tmp_path):
    first = resolve_target(tiny_gguf)
    stamp = os.stat(os.path.join(first, "model.safetensors")).st_mtime_ns
    holder = tmp_path / "holder"
    holder.mkdir()
    os.symlink(tiny_gguf, holder / "model.gguf")
    assert resolve_target(str(holder)) == first  # the same file through a directory: the same cache entry
    assert os.stat(os.path.join(first, "model.safetensors")).st_mtime_ns == stamp
    assert not [p for p in os.listdir(target_cache) if ".tmp-" in p]  # no staging directory left behind


def test_concurrent_conversions_produce_one_complete_directory(tiny_gguf, target_cache):
    code = "import sys; from spd_lightning.target_source import resolve_target; print(resolve_target(sys.argv[1]))"
    env = {**os.environ, "SPD_TARGET_CACHE": target_cache}
    procs = [
        subprocess.Popen([sys.executable, "-c", code, tiny_gguf], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)  # two racing processes prove it; each one more costs a transformers import
    ]
    outputs = [p.communicate(timeout=240)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(outputs)) == 1
    assert sorted(os.listdir(target_cache)) == sorted(
        [os.path.basename(outputs[0]), os.path.basename(outputs[0]) + ".lock"]
    )


def test_missing_packages_name_the_extra(tiny_gguf, target_cache, monkeypatch):
    real = gguf_target.importlib.util.find_spec
    monkeypatch.setattr(gguf_target.importlib.util, "find_spec", lambda name: None if name == "gguf" else real(name))
    with pytest.raises(TargetError, match=r"spd-lightning\[gguf\]"):
        resolve_target(tiny_gguf)


def test_bad_gguf_targets_are_one_line_errors(tmp_path, target_cache):
    with pytest.raises(TargetError, match="does not exist"):
        resolve_target(str(tmp_path / "absent.gguf"))
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(TargetError, match="several GGUF files"):
        resolve_target(str(tmp_path))
    (tmp_path / "b.gguf").unlink()
    (tmp_path / "a.gguf").write_bytes(b"not a gguf")
    with pytest.raises(TargetError, match="cannot read GGUF target"):
        resolve_target(str(tmp_path))
