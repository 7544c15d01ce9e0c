"""Tiny random-init targets: the causal LMs of every supported family, a chat tokenizer of exactly their vocabulary,
and the same saved as an ordinary HF checkpoint directory."""

import torch

from spd_lightning.target import Target

TINY_VOCAB = 97

CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}"
)


# The head of Qwen3's chat template: its scan for the last real user query, and its refusal when every user
# turn is a tool response (prepend it to a template to refuse such conversations as a real Qwen3 target does)
QWEN3_NO_USER_QUERY = (
    "{%- set ns = namespace(multi_step_tool=true) %}{%- for m in messages[::-1] %}"
    "{%- if ns.multi_step_tool and m.role == 'user' and not (m.content.startswith('<tool_response>') "
    "and m.content.endswith('</tool_response>')) %}{%- set ns.multi_step_tool = false %}{%- endif %}{%- endfor %}"
    "{%- if ns.multi_step_tool %}{{- raise_exception('No user query found in messages.') }}{%- endif %}"
)


def make_tiny_model(arch: str, num_layers: int = 4, vocab_size: int = TINY_VOCAB, hidden_size: int = 32, seed: int = 0):
    """A random-init tiny causal LM of a supported family (qwen3_5 is hybrid linear + full attention)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3_5ForCausalLM,
        Qwen3_5TextConfig,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        eos_token_id=vocab_size - 1,
        pad_token_id=0,
    )
    if arch == "qwen3_5":
        cfg = Qwen3_5TextConfig(
            **common,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            full_attention_interval=2,
        )
        model = Qwen3_5ForCausalLM(cfg)
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        raise ValueError(arch)
    # Random init gives near-uniform logits; a larger output scale makes greedy decoding non-trivial.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model.eval()


def make_tokenizer(vocab_size: int):
    """A WordLevel tokenizer with exactly `vocab_size` ids, a Qwen-style chat template, EOS = the last id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<|im_start|>", "<think>", "</think>"]
    words = ["user", "assistant", "system", "hello", "world", "the", "a", "cat", "sat", "on", "mat"]
    words += [f"w{i}" for i in range(vocab_size - len(specials) - len(words) - 1)]
    vocab = {t: i for i, t in enumerate(specials + words + ["<|im_end|>"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", "<think>", "</think>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_target(model, directory: str) -> str:
    """An ordinary HF checkpoint directory (weights + config + tokenizer), like a real target."""
    model.save_pretrained(directory)
    make_tokenizer(model.config.vocab_size).save_pretrained(directory)
    return directory


def target_dir(tmp_path_factory, arch: str, make_model) -> tuple[str, Target]:
    """`make_model(arch)` saved to a fresh temporary directory; returns the directory and the in-memory target."""
    directory = str(tmp_path_factory.mktemp(f"target_{arch}"))
    model = make_model(arch)
    save_target(model, directory)
    return directory, Target(model, directory)


def hf_logits(target: Target, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return target.model(torch.tensor([ids])).logits[0]


def nearly_bigram_target(arch: str, context: float) -> Target:
    """A tiny target made nearly a bigram model: its attention and MLP outputs scaled by `context`, so the next
    token depends mostly, not only, on the current one (`drafters.agreeing_pdm` then agrees with it most of the
    time)."""
    model = make_tiny_model(arch, num_layers=4, seed=1)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.split(".")[-1] in ("o_proj", "out_proj", "down_proj"):
                module.weight.mul_(context)
    return Target(model, f"nearly-bigram-{arch}")
