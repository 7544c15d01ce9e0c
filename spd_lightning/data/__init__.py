"""Chat data for training the drafter: formats, sources, rendering + loss mask, draft vocabulary, datamodule.

Names are imported on first use, so tools that need only the light parts (`tiny_target` reads ShareGPT
through `formats` and `sharegpt`) do not pay for importing Lightning.
"""

from importlib import import_module

_EXPORTS = {
    "chat": (
        "ChatRenderer",
        "RenderedChat",
        "assistant_char_spans",
        "load_tokenizer",
        "mark_assistant_tokens",
        "render_chat",
        "render_prompt",
    ),
    "collate": ("ChatCollator",),
    "datamodule": ("ChatDataModule",),
    "formats": ("DataError", "first_user_turn", "normalize_conversation"),
    "mixing": ("allocate", "plan_mixture"),
    "resumable": ("ResumableDataLoader", "ResumableSampler"),
    "sharegpt": ("iter_json_array_records", "load_embedded_sharegpt"),
    "sources": ("DataSource", "load_source"),
    "tokenized": ("SourceStats", "tokenize_source"),
    "vocab": ("count_assistant_tokens", "load_or_build_d2t", "select_draft_vocab"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_MODULE_OF[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
