"""The frozen target: load any HF causal LM and read its anchor states (docs/DESIGN.md, "Terms", "Real parts, offline").

`Target` wraps a Hugging Face causal LM (Qwen3, Qwen3.5 and its conditional-generation checkpoint,
Llama, ...) and exposes the pieces the rest of the project needs without caring about the family:
the embedding, the decoder layers, the final norm, the LM head and the rotary embedding. Anchor
states are captured with forward hooks at the requested hidden-state indices only, so a 32-layer
target never holds 33 copies of its residual stream.

Loading goes straight onto the rank's device (transformers' `device_map`, which reads each checkpoint tensor onto
that device): the 8 ranks of a node never hold 8 CPU copies of an 18 GB target. Hybrid targets (Qwen3.5's
Gated DeltaNet layers) run transformers' fast kernels when `flash-linear-attention` and `causal-conv1d` are
installed (`pip install .[gpu]`), its slow torch fallback otherwise (`Target.linear_attention_path` says which).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from .errors import TargetError, first_line
from .target_source import resolve_target

log = logging.getLogger(__name__)

# Gated DeltaNet functions of transformers 5's modeling_qwen3_5 -> (package with the fast kernel, its pip name)
DELTANET_KERNELS = {
    "torch_chunk_gated_delta_rule": ("fla", "flash-linear-attention"),
    "causal_conv1d_fn": ("causal_conv1d", "causal-conv1d"),
}


DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise TargetError(f"unknown dtype {dtype!r}: use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def looks_local(name: str) -> bool:
    """A hub id is `name` or `org/name`; anything else (./x, /x, ~/x, a/b/c) can only be a local path."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1


def local_target(name_or_path: str) -> str:
    """The target's checkpoint directory (`resolve_target`: a directory, a GGUF converted once, a hub id), with
    the one-line error for a local path that does not exist."""
    path = os.path.expanduser(name_or_path)
    if looks_local(name_or_path) and not os.path.exists(path) and not path.endswith(".gguf"):  # GGUF: its own error
        raise TargetError(
            f"target path {name_or_path!r} does not exist: build the tiny target with "
            f"`python -m spd_lightning.tiny_target --out {name_or_path}` or pass a hub name or a .gguf file"
        )
    return resolve_target(path)


def load_hf_config(name_or_path: str, trust_remote_code: bool = False):
    """The target's HF config alone (cheap: no weights), with the same one-line errors as the model."""
    from transformers import AutoConfig

    path = local_target(name_or_path)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except OSError as e:
        raise TargetError(
            f"cannot load target {name_or_path!r}: no such local directory and the hub could not "
            f"provide it ({first_line(e)[:120]}); pass an existing directory, or build the tiny "
            f"target with `python -m spd_lightning.tiny_target --out DIR`"
        ) from e
    except ValueError as e:
        raise TargetError(
            f"cannot load target {name_or_path!r}: {first_line(e)} "
            f"(if you trust that repository: --trust-remote-code for inference, --model.trust_remote_code true for fit)"
        ) from e
    return config


def load_hf_causal_lm(
    name_or_path: str,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
) -> nn.Module:
    """`AutoModelForCausalLM` with the checks a user needs: a missing local path or a hub name that cannot
    be reached fails with one line; remote code runs only when the caller passes `trust_remote_code`.
    The weights are created on `device` directly (no full copy in CPU memory first). Hub kernels stay off, the
    default before transformers 5.25: 5.25 turns them on, fetching layer code from the hub at load time and failing
    on the meta device, while the decoders drive the layers the tests check (docs/DESIGN.md, "Supported versions")."""
    from transformers import AutoModelForCausalLM

    config = load_hf_config(name_or_path, trust_remote_code)
    path = local_target(name_or_path)  # resolved twice, cheaply: a GGUF is converted once, a hub id read from the cache
    check_checkpoint_files(path)
    device = torch.device(device)
    with reading_weights(path):
        if importlib.util.find_spec("accelerate") is None:  # transformers needs it for `device_map`
            if device.type != "cpu":
                log.warning(
                    f"loading the target through CPU memory before moving it to {device}: install `accelerate` "
                    f"(a dependency of this package) to load it straight onto the device"
                )
            model = AutoModelForCausalLM.from_pretrained(
                path, config=config, dtype=resolve_dtype(dtype), trust_remote_code=trust_remote_code, use_kernels=False
            )
            return model.to(device)
        return AutoModelForCausalLM.from_pretrained(
            path,
            config=config,
            dtype=resolve_dtype(dtype),
            device_map={"": str(device)},
            trust_remote_code=trust_remote_code,
            use_kernels=False,
        )


@contextmanager
def reading_weights(path: str) -> Iterator[None]:
    """transformers' OSError while loading (no weights file it knows: a download of the config alone; a file it
    cannot open) is the user's to fix: one line naming the target."""
    try:
        yield
    except OSError as e:
        raise TargetError(
            f"cannot read the weights of target {path!r} ({type(e).__name__}: {first_line(e)[:160]}): download, "
            "copy or convert the target again"
        ) from e


@contextmanager
def reading_checkpoint(file: str) -> Iterator[None]:
    """A checkpoint file that cannot be read (cut short by a full disk or an interrupted download or copy, a shard
    its index names that is not there, an index that is not JSON) is the user's to fix: one line naming it (the
    pipeline's ranks read their layers' tensors under it too, inference/runtime/stages.py)."""
    from safetensors import SafetensorError

    try:
        yield
    except (SafetensorError, OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise TargetError(
            f"target checkpoint file {file!r} cannot be read ({type(e).__name__}: {first_line(e)[:160]}): it is "
            "truncated or incomplete; download, copy or convert the target again"
        ) from e


def check_checkpoint_files(path: str) -> None:
    """Open the header of every safetensors file of the checkpoint in `path` (cheap: no tensor is read) so that
    one that cannot be read is named (`reading_checkpoint`), not reported by safetensors or transformers without
    its name (as 'a bug'). Other weight formats (pytorch_model.bin) are transformers' to check."""
    from safetensors import safe_open

    for name in sorted(set((safetensors_weight_map(path) or {}).values())):
        file = os.path.join(path, name)
        with reading_checkpoint(file), safe_open(file, framework="pt"):
            pass


def safetensors_weight_map(path: str) -> dict[str, str] | None:
    """Tensor name -> the file (in `path`) that holds it, from `model.safetensors.index.json` or the one
    `model.safetensors`; None when the checkpoint has neither (another weight format)."""
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with reading_checkpoint(index), open(index) as f:
            return dict(json.load(f)["weight_map"])  # checked here: a weight_map that is no mapping is named too
    file = os.path.join(path, "model.safetensors")
    if os.path.isfile(file):
        with reading_checkpoint(file), safe_open(file, framework="pt") as f:
            return dict.fromkeys(f.keys(), "model.safetensors")
    return None


def _closure(function) -> dict:
    code, closure = getattr(function, "__code__", None), getattr(function, "__closure__", None) or ()
    return dict(zip(code.co_freevars, closure)) if code is not None else {}


def _bound_fast_kernel(function, package: str) -> bool:
    """Whether transformers bound the package's kernel behind `function` (its hub-kernel wrapper records the
    choice it made at import in the closure variable `is_new_implementation`); else whether it is importable.
    Where the `kernels` package is installed, that wrapper is the `func` of the module `function` is then."""
    wrapper = _closure(type(function).forward) if isinstance(function, nn.Module) else {}
    if "func" in wrapper:
        function = wrapper["func"].cell_contents
    cells = _closure(function)
    if "is_new_implementation" in cells:
        return bool(cells["is_new_implementation"].cell_contents)
    return importlib.util.find_spec(package) is not None


def deltanet_kernels(modeling) -> dict[str, bool]:
    """Per package of DELTANET_KERNELS (by its pip name): whether transformers' modeling module `modeling` (a
    Qwen3.5 one) bound its kernel, or runs the torch fallback of it."""
    return {
        pip_name: _bound_fast_kernel(getattr(modeling, function, None), package)
        for function, (package, pip_name) in DELTANET_KERNELS.items()
    }


def linear_attention_path(model: nn.Module) -> str | None:
    """Which implementation the target's Gated DeltaNet layers run: the fast kernels, or transformers' torch
    fallback (naming what to install); None for targets without linear-attention layers. The recurrence is what
    the fallback makes slow: with flash-linear-attention bound and only causal-conv1d missing, the short convolution
    alone runs in torch (one small op per layer), and the label does not say "torch fallback"."""
    layer = next((m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")), None)
    if layer is None:
        return None
    bound = deltanet_kernels(sys.modules[type(layer).__module__])
    missing = [name for name, ok in bound.items() if not ok]
    if not missing:
        return "fast kernels (flash-linear-attention, causal-conv1d)"
    if bound["flash-linear-attention"]:
        return (
            "fast recurrence (flash-linear-attention), torch short convolution (no causal-conv1d: `pip install .[gpu]`)"
        )
    return f"torch fallback (slow on GPU; missing {', '.join(missing)}: `pip install .[gpu]`)"


@dataclass(frozen=True)
class TargetInfo:
    """What a drafter must agree on with its target (stored in exported drafters, checked on load)."""

    name_or_path: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    rope_theta: float
    max_position_embeddings: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_config(cls, config, name_or_path: str, vocab_size: int | None = None) -> TargetInfo:
        """From the (text) config alone; `vocab_size`: the head's rows when a loaded model knows them."""
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return cls(
            name_or_path,
            int(config.num_hidden_layers),
            int(config.hidden_size),
            int(vocab_size if vocab_size is not None else config.vocab_size),
            float(theta),
            int(getattr(config, "max_position_embeddings", 0) or 0),
        )


def restrict_to_draft_vocab(logits: torch.Tensor, d2t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher logits over `V_d` in their own dtype, `[..., V_d]`, and whether each position's
    full-vocabulary argmax lies outside `V_d`, `[...]`. The restriction comes BEFORE any upcast: no
    `[*, V]` fp32 tensor exists (9B target, B=2, T=2048: 4.07 GB at V=248,320 vs 0.52 GB at V_d=32,000)."""
    d2t = d2t.to(logits.device)
    in_vd = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device).index_fill_(0, d2t, True)
    return logits.index_select(-1, d2t), ~in_vd[logits.argmax(-1)]


class Target(nn.Module):
    """A frozen HF causal LM seen as `embed -> layers[0..L-1] -> norm -> lm_head`."""

    def __init__(self, model: nn.Module, name_or_path: str = ""):
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.name_or_path = name_or_path
        inner = getattr(model, "model", model)
        inner = getattr(inner, "language_model", inner)  # conditional-generation wrappers
        for attr in ("embed_tokens", "layers", "norm"):
            if not hasattr(inner, attr):
                raise TargetError(
                    f"target {type(model).__name__} has no `{attr}`: only decoder-only LMs laid out as "
                    f"embed_tokens / layers / norm (Qwen3, Qwen3.5, Llama, ...) are supported"
                )
        self.text_model = inner
        self.config = getattr(model.config, "text_config", None) or model.config

    @classmethod
    def load(
        cls,
        name_or_path: str,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        trust_remote_code: bool = False,
    ) -> Target:
        return cls(load_hf_causal_lm(name_or_path, dtype, device, trust_remote_code), name_or_path)

    # -- the pieces -----------------------------------------------------------------------------
    @property
    def embed_tokens(self) -> nn.Module:
        return self.text_model.embed_tokens

    @property
    def layers(self) -> nn.ModuleList:
        return self.text_model.layers

    @property
    def norm(self) -> nn.Module:
        return self.text_model.norm

    @property
    def rotary_emb(self) -> nn.Module:
        return self.text_model.rotary_emb

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def linear_attention_path(self) -> str | None:
        return linear_attention_path(self.model)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def info(self) -> TargetInfo:
        return TargetInfo.from_config(self.config, self.name_or_path, self.vocab_size)

    def check_layers(self, layers: Sequence[int]) -> list[int]:
        layers = [int(b) for b in layers]
        bad = [b for b in layers if not 0 <= b <= self.num_layers]
        if bad:
            raise TargetError(f"hidden-state indices {bad} are out of range 0..L={self.num_layers} for this target")
        return layers

    # -- one call: anchor states + logits -------------------------------------------------------
    @torch.no_grad()
    def anchor_states(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, layers: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states `H^l` at `layers` (HF `hidden_states` indices, 0 = embedding output, L = final
        norm output) as `[B, T, len(layers), H]`, and the final logits `[B, T, V]`, for a right-padded batch."""
        layers = self.check_layers(layers)
        captured: dict[int, torch.Tensor] = {}
        L = self.num_layers

        def keep(index):
            def hook(_module, _inputs, output):
                captured[index] = output[0] if isinstance(output, tuple) else output

            return hook

        sources = {0: self.embed_tokens, L: self.norm}
        handles = [(sources.get(b) or self.layers[b - 1]).register_forward_hook(keep(b)) for b in set(layers)]
        try:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        finally:
            for h in handles:
                h.remove()
        states = torch.stack([captured[b] for b in layers], dim=2)
        return states, out.logits


def rebuilt_layer(name_or_path: str, trust_remote_code: bool, index: int, state: dict[str, torch.Tensor]) -> nn.Module:
    """Decoder layer `index` of the target, from its state dict alone (the state cache stores it for
    `init_layers_from`): the model is built on the meta device from its config (no weights read, no memory), and
    that one layer takes the given tensors; a buffer the state dict lacks would stay on meta and fail loudly."""
    from transformers import AutoModelForCausalLM

    config = load_hf_config(name_or_path, trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    layer = Target(model, name_or_path).layers[index]
    layer.load_state_dict(state, strict=True, assign=True)
    return layer.eval().requires_grad_(False)
