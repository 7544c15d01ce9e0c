"""The real architectures of the shipped configs' targets, kept as data (the hub is unreachable here).

Each `<name>.json` holds the Hugging Face `config.json` fields of one checkpoint (for Qwen3.5, the text model
of the conditional-generation checkpoint), with `hub_id` and a `source` note on where the numbers come from.
`arch_config(name, hidden_size=32)` builds that architecture with only the width reduced: layer count, the
hybrid layer pattern, head counts and head dims, vocabulary and rope settings stay real. The CPU rehearsal of
every shipped config and the GPU check build their random-init targets from these.

Imports only transformers (no Lightning, no datasets): the GPU check runs where those are missing.
"""

from __future__ import annotations

import json
import os

import torch

ARCHS_DIR = os.path.dirname(os.path.abspath(__file__))


def arch_names() -> list[str]:
    return sorted(name[: -len(".json")] for name in os.listdir(ARCHS_DIR) if name.endswith(".json"))


def load_arch(name: str) -> dict:
    """`{"hub_id", "source", "config"}` of architecture `name` (e.g. `qwen3.5-9b`)."""
    path = os.path.join(ARCHS_DIR, f"{name}.json")
    if not os.path.isfile(path):
        raise ValueError(f"unknown architecture {name!r}: choose one of {arch_names()}")
    with open(path) as f:
        return json.load(f)


def arch_for_hub_id(hub_id: str) -> str | None:
    """The stored architecture of the checkpoint `hub_id` (e.g. `Qwen/Qwen3.5-9B`), or None."""
    return next((name for name in arch_names() if load_arch(name)["hub_id"] == hub_id), None)


def arch_config(name: str, hidden_size: int | None = None, intermediate_size: int | None = None, **overrides):
    """The transformers config of `name`; `hidden_size` (and the MLP width, 2x by default) reduced if given."""
    from transformers import AutoConfig

    fields = dict(load_arch(name)["config"])
    if hidden_size is not None:
        fields["hidden_size"] = hidden_size
        fields["intermediate_size"] = intermediate_size or 2 * hidden_size
    fields.update(overrides)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def random_target(name: str, hidden_size: int | None = None, seed: int = 0, logit_scale: float = 1.0, **overrides):
    """A random-init causal LM of architecture `name` (reduced width when `hidden_size` is given), in eval mode.
    `logit_scale` > 1 sharpens the random LM head so greedy decoding is not a near-uniform coin toss."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(arch_config(name, hidden_size, **overrides))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(logit_scale)
    return model.eval()
