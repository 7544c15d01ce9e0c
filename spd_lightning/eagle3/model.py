"""The EAGLE-3 drafter (docs/DESIGN.md, "The EAGLE-3 baseline"): a pure `nn.Module`, shared by training and inference.

    target states H^{l_low}, H^{l_mid}, H^{l_high} of token x_i  --RMSNorm each, concat, fc-->  h_i      [H]
    cat(RMSNorm(embed(x_{i+1})), RMSNorm(h_i))  --ONE Qwen3-style layer (q/k/v from 2H)-->  o_i          [H]
    o_i  --final RMSNorm, head over V_d-->  draft logits of x_{i+2}

Row `i` reads the features of `x_i` and the embedding of the NEXT token `x_{i+1}` and drafts `x_{i+2}`.
The layer's residual stream is `h` (not the concatenation), so its output `o_i` has the width of `h` and is
fed back as the next step's `h` in training-time test (spd_lightning/eagle3/ttt.py) and in chain drafting.

Feature indices are Hugging Face `hidden_states[l]` indices (docs/DESIGN.md, "Terms": 0 = embedding output, `l < L` = the
residual entering layer `l`, `L` = final-norm output). EAGLE's default `(2, L//2, L-3)` is "the states
entering layers 2, L//2 and L-3", i.e. exactly `hidden_states[2], hidden_states[L//2], hidden_states[L-3]`
(SpecForge's `[1, L//2-1, L-4]` are layer OUTPUTS: the same three tensors).

The token embedding is the target's own table, frozen and NOT part of this module: callers pass the
embedded tokens, so the drafter never stores a copy of a (V x H) table. Attention, MLP, RMSNorm and RoPE
are the PDM's (spd_lightning/pdm.py); only the attention input width differs (2H), see `FusedInputAttention`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

import torch
from torch import nn

from ..errors import UserError
from ..pdm import MLP, Attend, Attention, PDMConfig, RMSNorm, causal_attend, draft_to_target, init_linear

NUM_FEATURES = 3


class Eagle3ConfigError(UserError):
    """An impossible EAGLE-3 drafter shape or feature-layer choice; the message names the value and the fix."""


def eagle_feature_layers(num_layers: int) -> list[int]:
    """EAGLE's low / middle / high capture `hidden_states[2, L//2, L-3]`, for targets with `L >= 7` (where these
    are strictly increasing). Shallower targets (the tiny test targets) use `[1, L//2, L-1]`."""
    L = num_layers
    if L >= 7:
        return [2, L // 2, L - 3]
    if L >= 4:
        return [1, L // 2, L - 1]
    raise Eagle3ConfigError(
        f"the EAGLE-3 default feature layers need a target with L >= 4 layers, this one has "
        f"L={L}: pass three hidden-state indices in 0..{L} explicitly (feature_layers)"
    )


def check_feature_layers(layers: Sequence[int], num_layers: int) -> list[int]:
    layers = [int(b) for b in layers]
    if len(layers) != NUM_FEATURES:
        raise Eagle3ConfigError(
            f"feature_layers={layers}: EAGLE-3 fuses exactly {NUM_FEATURES} target states (low, middle, high)"
        )
    if any(not 0 <= b <= num_layers for b in layers):
        raise Eagle3ConfigError(
            f"feature_layers={layers} are out of range: hidden-state indices go from 0 to L={num_layers}"
        )
    return layers


@dataclass
class Eagle3Config:
    hidden_size: int  # the target's width H: features, embeddings and the layer's residual stream
    draft_vocab_size: int
    feature_layers: tuple[int, ...]  # HF hidden_states indices (low, middle, high)
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0

    def __post_init__(self):
        self.feature_layers = tuple(int(b) for b in self.feature_layers)
        if len(self.feature_layers) != NUM_FEATURES:
            raise Eagle3ConfigError(
                f"feature_layers={list(self.feature_layers)}: EAGLE-3 fuses exactly 3 target states"
            )
        self.block_config()  # shape errors (heads, sizes) now, with the PDM's messages

    def block_config(self, width: int | None = None) -> PDMConfig:
        """The PDM config whose attention / MLP pieces this drafter reuses, at input `width` (default H)."""
        return PDMConfig(
            target_hidden_size=self.hidden_size,
            num_types=1,
            draft_vocab_size=self.draft_vocab_size,
            hidden_size=width or self.hidden_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["feature_layers"] = list(self.feature_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Eagle3Config:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class FusedInputAttention(Attention):
    """The PDM's attention (q/k RMSNorm, RoPE at true positions, GQA) reading the `2H` concatenation: q/k/v
    project from `2H`, and `o_proj` maps back to the residual width `H`."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__(cfg.block_config(width=2 * cfg.hidden_size))
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)


class Eagle3Layer(nn.Module):
    """The single EAGLE-3 decoder layer. Names follow SpecForge's `midlayer` (input_layernorm normalizes the
    token embedding, hidden_norm the fed-in state)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = FusedInputAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.block_config())

    def forward(
        self, hidden: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        hidden = hidden + self.self_attn(x, positions, 0, attend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: Eagle3Config, d2t: torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.feature_norms = nn.ModuleList(RMSNorm(H, cfg.rms_norm_eps) for _ in range(NUM_FEATURES))
        self.fc = nn.Linear(NUM_FEATURES * H, H, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", draft_to_target(d2t, cfg.draft_vocab_size), persistent=True)
        self.apply(init_linear)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """`features[..., 3, H]` (low, middle, high target states of a token) -> `h[..., H]`."""
        normed = [norm(features[..., j, :]) for j, norm in enumerate(self.feature_norms)]
        return self.fc(torch.cat(normed, dim=-1))

    def step(
        self, hidden: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, attend: Attend = causal_attend
    ) -> torch.Tensor:
        """One pass of the layer over rows `[B, S]`: `hidden` is `fc(features)` (TTT step 0) or the previous
        step's output, `embeds` the embedded next tokens; returns the layer output `o` (pre-norm)."""
        return self.midlayer(hidden, embeds, positions, attend)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft logits over `V_d` from layer outputs."""
        return self.lm_head(self.norm(out))

    def forward(
        self, features: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, attend: Attend = causal_attend
    ) -> torch.Tensor:
        """Teacher-forced step 0 (plain causal attention by default): draft logits at every row."""
        return self.logits(self.step(self.fuse(features), embeds, positions, attend))

    @torch.no_grad()
    def init_head_from_target(self, target_lm_head: torch.Tensor) -> None:
        """Seed the head with the target LM-head rows of the draft vocabulary."""
        if target_lm_head.shape[1] != self.cfg.hidden_size:
            raise Eagle3ConfigError(
                f"cannot seed the draft head: target LM head width {target_lm_head.shape[1]} != "
                f"drafter hidden_size {self.cfg.hidden_size}"
            )
        self.lm_head.weight.copy_(target_lm_head[self.d2t.to(target_lm_head.device)].to(self.lm_head.weight))
