"""The tiny target's model: a Qwen3.5 (Gated DeltaNet + full attention) or dense Qwen3 config and its fresh weights,
and what a config of it may be."""

from __future__ import annotations

import torch

from .tokenizer import ENDOFTEXT, IM_END, TinyTargetError

ARCHS = ("qwen3_5", "qwen3")


def tiny_model_config(
    arch: str, vocab_size: int, hidden_size: int, num_layers: int, eos_token_id: int, pad_token_id: int
):
    """A Qwen3.5 (hybrid: 3 Gated DeltaNet layers per full-attention layer) or dense Qwen3 config."""
    from transformers import Qwen3_5TextConfig, Qwen3Config

    if arch not in ARCHS:
        raise TinyTargetError(f"arch={arch!r}: use one of {ARCHS}")
    if hidden_size < 16 or hidden_size % 8:
        raise TinyTargetError(f"hidden_size={hidden_size}: use a multiple of 8, at least 16")
    head_dim = 32 if hidden_size >= 128 else 8
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=(hidden_size * 12 // 5) // 8 * 8,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
    )
    if arch == "qwen3":
        return Qwen3Config(**common)
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]
    if "full_attention" not in layer_types:
        layer_types[-1] = "full_attention"  # a hybrid target must exercise both cache kinds
    return Qwen3_5TextConfig(
        **common,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=layer_types,
    )


def tiny_model(tokenizer, arch: str, hidden_size: int, num_layers: int, seed: int):
    """A freshly initialized (from `seed`) causal LM for `tokenizer`, ending generation at `<|im_end|>`."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    eos_id, pad_id = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        tiny_model_config(arch, len(tokenizer), hidden_size, num_layers, eos_id, pad_id)
    )
    model.config.eos_token_id, model.config.pad_token_id = eos_id, pad_id
    model.generation_config = GenerationConfig(eos_token_id=[eos_id, pad_id], pad_token_id=pad_id, do_sample=False)
    return model
