"""The tiny target's tokenizer: a byte-level BPE with Qwen2's pre-tokenizer split, Qwen's chat special tokens and a
Qwen3-style chat template that honours `enable_thinking=False`."""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import UserError

ENDOFTEXT, IM_START, IM_END, THINK, END_THINK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"


class TinyTargetError(UserError):
    """Impossible tiny-target settings (vocabulary, architecture, budget); the one-line message names the value and
    the fix. Here, where the build starts; every step of it raises it."""


# Qwen2's pre-tokenizer split: contractions, letter runs (with one leading symbol), single digits,
# punctuation runs, newline runs, spaces.
QWEN_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen3's template without tool calls: replies after the last user query show their think block (empty
# when there is no reasoning), earlier replies do not; `enable_thinking=False` pre-fills an empty block.
QWEN3_CHAT_TEMPLATE = """\
{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1, found=false) %}
{%- for message in messages[::-1] %}
    {%- if not ns.found and message.role == 'user' %}
        {%- set ns.found = true %}{%- set ns.last_query_index = messages|length - 1 - loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning_content = message.reasoning_content if message.reasoning_content is string else '' %}
        {%- if not reasoning_content and '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""


# -- tokenizer -------------------------------------------------------------------------------------
def train_chat_tokenizer(texts: Iterable[str], vocab_size: int = 4096, show_progress: bool = True):
    """A byte-level BPE chat tokenizer with Qwen's special tokens and template, as a `PreTrainedTokenizerFast`."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    special = [ENDOFTEXT, IM_START, IM_END]
    thinking = [THINK, END_THINK]
    if vocab_size < 256 + len(special) + len(thinking):
        raise TinyTargetError(
            f"vocab_size={vocab_size}: a byte-level BPE needs at least 261 ids (256 bytes + 5 chat tokens)"
        )
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(thinking),
        min_frequency=2,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    backend.train_from_iterator(texts, trainer)
    # Like Qwen3, the think markers are single tokens but not special: decoding keeps them.
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in thinking])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        chat_template=QWEN3_CHAT_TEMPLATE,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
