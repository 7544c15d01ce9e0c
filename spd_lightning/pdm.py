"""The Pipeline Draft Module (docs/DESIGN.md, "The PDM"): a pure `nn.Module`, shared by training and inference.

    anchor states H^{b_0..b_{tau-1}}  --RMSNorm each, concat, Linear_tau-->  g   (fusion, one per type)
    g at true positions  --L_s Qwen3-style layers-->  final RMSNorm  -->  head over V_d draft tokens

Attention is the only part whose *mask* differs between the training layouts and the decoder, so each
attention layer computes q, k, v (q/k RMSNorm, RoPE at the true positions) and hands them to an
`attend(layer, q, k, v)` callable, keys and values unexpanded (GQA: `num_kv_heads` heads, query head `h` reads
key head `h // (num_heads // num_kv_heads)`, SDPA's and flex's `enable_gqa`), so no cache stores copies.
The default is plain causal attention, which is exactly the explicit staircase view; layouts and the
decoder's KV cache pass their own. The math stays here, once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .errors import ConfigError

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class PDMConfig:
    target_hidden_size: int
    num_types: int
    draft_vocab_size: int
    hidden_size: int
    num_layers: int = 1
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    # The head is the target's own LM head restricted to V_d, frozen: the drafter file does not store it and the
    # loader takes it from the target (EAGLE-1 reads the target's head the same way), so V_d can cover the
    # vocabulary the data uses without growing the file (docs/DESIGN.md, "The PDM").
    head_from_target: bool = False

    def __post_init__(self):
        for f in (
            "target_hidden_size",
            "num_types",
            "draft_vocab_size",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
        ):
            if getattr(self, f) < 1:
                raise ConfigError(f"PDM {f}={getattr(self, f)} must be a positive integer")
        if self.num_layers < 1:
            raise ConfigError(f"PDM num_layers={self.num_layers}: the drafter needs at least one layer (L_s >= 1)")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"PDM num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> PDMConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def block_shape(
    target_config,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
) -> dict:
    """A drafter block's attention and MLP shape (the PDM's and EAGLE-3's): each value given, else the target's
    (`target_config`, a transformers text config). The one place these defaults are read: `fit`, `estimate` and
    EAGLE-3 build the same drafter from the same settings."""
    cfg = target_config
    heads = num_heads or cfg.num_attention_heads
    return dict(
        num_heads=heads,
        num_kv_heads=num_kv_heads or getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=head_dim or getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        intermediate_size=intermediate_size or cfg.intermediate_size,
        rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-6),
    )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self.normalize(x)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """`x / rms(x)` in `x`'s dtype (computed in float32), before the learned scale."""
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half convention) of `x[B, h, S, hd]` at integer `positions[B, S]`."""
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    angles = positions.to(torch.float32)[:, None, :, None] * inv_freq  # [B, 1, S, hd/2]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


def causal_attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention over the sequence as given: the explicit staircase view."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[-2] > 1, enable_gqa=True)


class Attention(nn.Module):
    def __init__(self, cfg: PDMConfig):
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(d, cfg.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, layer: int, attend: Attend, outputs: int | None = None
    ) -> torch.Tensor:
        """Attention output of the first `outputs` rows (all rows when None); every row is a key and value."""
        B, S, _ = x.shape
        R = S if outputs is None else outputs
        c = self.cfg
        q = self.q_norm(self.q_proj(x[:, :R]).view(B, R, c.num_heads, c.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, S, c.num_kv_heads, c.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, S, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q, k = rope(q, positions[:, :R], c.rope_theta), rope(k, positions, c.rope_theta)
        # Under autocast the fp32 q/k-norm weights promote q and k to fp32 while v stays bf16: one dtype for
        # every backend (flex rejects mixed dtypes on older torch, or silently runs fp32 kernels).
        q, k = q.to(v.dtype), k.to(v.dtype)
        out = attend(layer, q, k, v)  # k, v unexpanded [B, kv_heads, S, hd]; out [B, heads, R, hd]
        return self.o_proj(out.transpose(1, 2).reshape(B, R, c.num_heads * c.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: PDMConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Qwen3 decoder layer; parameter names match Hugging Face's so target layers can seed it."""

    def __init__(self, cfg: PDMConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, layer: int, attend: Attend, outputs: int | None = None):
        """The layer's output for the first `outputs` rows (all when None); every row feeds attention's keys."""
        h = self.self_attn(self.input_layernorm(x), positions, layer, attend, outputs)
        x = x[:, : h.shape[1]] + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Fusion(nn.Module):
    """`g = Linear_tau([RMSNorm(H^{b_0}); ...; RMSNorm(H^{b_{tau-1}})])`, one projection per type."""

    def __init__(self, cfg: PDMConfig):
        super().__init__()
        self.norms = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(cfg.num_types))
        self.proj = nn.ModuleList(
            nn.Linear(tau * cfg.target_hidden_size, cfg.hidden_size, bias=False) for tau in range(1, cfg.num_types + 1)
        )
        self._groups: dict[tuple[tuple[int, ...], torch.device], list[tuple[int, torch.Tensor]]] = {}

    def forward(self, states: torch.Tensor, types: int | tuple[int, ...]) -> torch.Tensor:
        """`states[..., m, H]` holds a token's anchor states in anchor order (entries past its type are
        ignored); `types` is one type for all tokens, or one type per position (`states[..., T, m, H]`) as a
        host tuple: the types are the schedule's, known without reading the device."""
        if isinstance(types, int):
            return self._one(states, types)
        out = states.new_zeros(*states.shape[:-2], self.proj[0].out_features)
        for tau, at in self.groups(types, states.device):
            out[..., at, :] = self._one(states[..., at, :, :], tau)
        return out

    def by_type(self, states: torch.Tensor, types: torch.Tensor, present: Sequence[int]) -> torch.Tensor:
        """The same fusion with the type of each token as a device tensor (`types`, the shape of `states[..., m,
        H]` less its last two dims): every type in `present` is projected over every token and each token keeps
        its own type's. A fixed number of ops for any number of tokens and any mix of types (the decoder's
        batched draft); a token whose type is not in `present` gets the first one's."""
        H = states.shape[-1]
        normed = torch.cat([self.norms[j](states[..., j, :]) for j in range(max(present))], dim=-1)
        out = None
        for tau in present:
            y = self.proj[tau - 1](normed[..., : tau * H])
            out = y if out is None else torch.where((types == tau)[..., None], y, out)
        return out

    def groups(self, types: tuple[int, ...], device: torch.device) -> list[tuple[int, torch.Tensor]]:
        """`(type, positions of that type)` per type present, the positions a device tensor built once per
        type tuple (the decoder meets a few, one per fill and depth pattern): indexing with a Python list would
        copy it to the device on every call, a blocking copy from pageable memory on a GPU."""
        key = (types, device)
        if key not in self._groups:
            self._groups[key] = [
                (tau, torch.tensor([i for i, t in enumerate(types) if t == tau], device=device))
                for tau in sorted(set(types))
            ]
        return self._groups[key]

    def _one(self, states: torch.Tensor, tau: int) -> torch.Tensor:
        proj = self.proj[tau - 1]
        if torch.is_grad_enabled() and proj.weight.requires_grad:
            # Training: the norms' scales folded into the projection's columns, `x_hat @ (W diag(w))^T`, the same
            # map as `[w_0 x_hat_0; ...] @ W^T`. The activations `x_hat` (of frozen target states) then carry no
            # gradient, so backward computes the weights' gradients only and skips the `[tokens, tau*H]` input
            # gradient: a third of the fusion's backward, the largest matmul of a training step (docs/DESIGN.md,
            # "The training step's cost"). Decoding keeps the plain form, which costs no fold per call.
            unit = torch.cat([self.norms[j].normalize(states[..., j, :]) for j in range(tau)], dim=-1)
            scale = torch.cat([self.norms[j].weight for j in range(tau)])
            return F.linear(unit, proj.weight * scale)
        normed = [self.norms[j](states[..., j, :]) for j in range(tau)]
        return proj(torch.cat(normed, dim=-1))


def draft_to_target(d2t: torch.Tensor | None, draft_vocab_size: int) -> torch.Tensor:
    """The `d2t` buffer of a drafter head (draft id -> target id; the identity when not given), checked."""
    d2t = torch.arange(draft_vocab_size) if d2t is None else d2t.to(torch.long)
    if d2t.shape != (draft_vocab_size,):
        raise ConfigError(f"d2t has shape {tuple(d2t.shape)} but draft_vocab_size={draft_vocab_size}")
    return d2t


def init_linear(m: nn.Module) -> None:
    """Drafter init: every linear layer ~ N(0, 1/fan_in) (heads and layers seeded from the target overwrite it)."""
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=1.0 / math.sqrt(m.in_features))


class PipelineDraftModule(nn.Module):
    def __init__(self, cfg: PDMConfig, d2t: torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        self.fusion = Fusion(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(not cfg.head_from_target)
        self.register_buffer("d2t", draft_to_target(d2t, cfg.draft_vocab_size), persistent=True)
        self.apply(init_linear)

    def stored_state_dict(self) -> dict[str, torch.Tensor]:
        """What a drafter file holds: every weight, less the head when it is the target's own (`head_from_target`)."""
        state = self.state_dict()
        if self.cfg.head_from_target:
            del state["lm_head.weight"]
        return state

    def fuse(self, states: torch.Tensor, types: int | tuple[int, ...]) -> torch.Tensor:
        return self.fusion(states, types)

    def body(
        self,
        g: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend = causal_attend,
        checkpointing: bool = False,
        outputs: int | None = None,
    ) -> torch.Tensor:
        """Run the `L_s` layers over features `g[B, S, d]` at `positions[B, S]`; returns normed hidden.

        `outputs`: only the first `outputs` rows are read (None: all). The last layer then computes queries,
        attention output, MLP and final norm for those rows alone, while every row still supplies keys and
        values; `attend` receives their queries (`q.shape[-2] == outputs`) and the result is `[B, outputs, d]`.
        Earlier layers run every row: later rows are keys of the last one. (Training's loss copy is the first
        `T` rows of the replicated sequence: spd_lightning/training/layouts/.)

        With `checkpointing` (and grad enabled) each layer keeps only its input and recomputes its inside in
        the backward pass (non-reentrant `torch.utils.checkpoint`): the activations of `n+1` replicated
        copies drop from every tensor of every layer to one `[B, S, d]` tensor per layer."""
        x = g
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            rows = outputs if i == last else None
            if checkpointing and torch.is_grad_enabled():
                x = checkpoint(layer, x, positions, i, attend, rows, use_reentrant=False)
            else:
                x = layer(x, positions, i, attend, rows)
        return self.norm(x)

    def forward(
        self,
        states: torch.Tensor,
        types: int | tuple[int, ...],
        positions: torch.Tensor,
        attend: Attend = causal_attend,
    ) -> torch.Tensor:
        """Draft logits over `V_d` at every position (the decoder reads the last one)."""
        return self.lm_head(self.body(self.fuse(states, types), positions, attend))

    @torch.no_grad()
    def init_head_from_target(self, target_lm_head: torch.Tensor) -> None:
        """Seed the head with the target LM-head rows of the draft vocabulary (needs d == target width)."""
        self.init_head_from_rows(target_lm_head[self.d2t.to(target_lm_head.device)])

    @torch.no_grad()
    def init_head_from_rows(self, rows: torch.Tensor) -> None:
        """Seed the head with the target LM-head rows of the draft vocabulary already selected, `[V_d, H]` (what a
        state cache stores)."""
        if rows.shape != self.lm_head.weight.shape:
            raise ValueError(
                f"cannot seed the draft head: target LM-head rows {tuple(rows.shape)} != PDM head "
                f"{tuple(self.lm_head.weight.shape)}; set hidden_size to the target width or disable init_head"
            )
        self.lm_head.weight.copy_(rows.to(self.lm_head.weight))

    @torch.no_grad()
    def init_layer_from_target(self, index: int, target_layer: nn.Module) -> list[str]:
        """Seed PDM layer `index` from a target decoder layer where names and shapes agree.

        Norms are copied by their effective scale (the norm applied to a vector of ones), so targets
        whose RMSNorm stores `weight - 1` (Qwen3.5) seed correctly too. Returns the copied names."""
        own = dict(self.layers[index].named_modules())
        copied = []
        for name, module in target_layer.named_modules():
            mine = own.get(name)
            if isinstance(mine, RMSNorm) and getattr(module, "weight", None) is not None:
                if module.weight.shape == mine.weight.shape:
                    probe = torch.ones(1, mine.weight.numel(), dtype=module.weight.dtype, device=module.weight.device)
                    eps = getattr(module, "eps", getattr(module, "variance_epsilon", 0.0))
                    scale = module(probe)[0].float() * math.sqrt(1.0 + eps)
                    mine.weight.copy_(scale.to(mine.weight))
                    copied.append(name + ".weight")
            elif (
                isinstance(mine, nn.Linear)
                and isinstance(module, nn.Linear)
                and module.weight.shape == mine.weight.shape
            ):
                mine.weight.copy_(module.weight.to(mine.weight))
                copied.append(name + ".weight")
        return copied
