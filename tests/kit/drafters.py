"""Drafters for the tiny targets: random-init PDMs (in memory and saved), one that agrees with a nearly-bigram
target, and a PDM fed by random anchor states without any target (the layout tests)."""

import torch

from spd_lightning.export import DrafterSpec, save_drafter
from spd_lightning.geometry import Geometry
from spd_lightning.pdm import PDMConfig, PipelineDraftModule
from spd_lightning.target import Target

from .targets import make_tiny_model, target_dir

ANCHOR_HIDDEN, ANCHOR_VOCAB, ANCHOR_BATCH = 24, 50, 3  # the stand-in target's width, V_d, sequences per batch


def random_pdm(
    target: Target, geometry: Geometry, draft_vocab: int = 48, seed: int = 0, num_layers: int = 2
) -> PipelineDraftModule:
    """A random-init PDM over a random subset of the target vocabulary (so q is zero outside V_d)."""
    g = torch.Generator().manual_seed(seed)
    d2t = torch.randperm(target.vocab_size, generator=g)[:draft_vocab].sort().values
    torch.manual_seed(seed)
    cfg = PDMConfig(
        target.hidden_size,
        geometry.num_types,
        draft_vocab,
        hidden_size=32,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
    )
    return PipelineDraftModule(cfg, d2t).eval()


def save_random_drafter(target: Target, geometry: Geometry, directory: str, seed: int = 0) -> str:
    pdm = random_pdm(target, geometry, seed=seed)
    save_drafter(pdm, DrafterSpec(pdm.cfg, geometry, target.info), directory)
    return directory


def saved_random_drafter(tmp_path_factory) -> str:
    """The tiny Qwen3.5 and a random n = 2 drafter for it, both saved; returns the drafter's directory (its spec
    names the target's)."""
    _, target = target_dir(tmp_path_factory, "qwen3_5", make_tiny_model)
    directory = str(tmp_path_factory.mktemp("s") / "spd")
    return save_random_drafter(target, Geometry.build(target.num_layers, 2), directory)


def agreeing_pdm(target: Target, geometry: Geometry, context: float) -> PipelineDraftModule:
    """A PDM that reproduces `targets.nearly_bigram_target`: its type projections pass the embedding anchor
    through (plus a small term from the deeper anchors), its head is the target's LM head, its layers add a small
    context term."""
    torch.manual_seed(0)
    H = target.hidden_size
    cfg = PDMConfig(
        H,
        geometry.num_types,
        target.vocab_size,
        hidden_size=H,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
    )
    pdm = PipelineDraftModule(cfg).eval()
    with torch.no_grad():
        for proj in pdm.fusion.proj:  # g = RMSNorm(H^0) + a small term from the deeper anchors of its type
            proj.weight.mul_(context)[:, :H] = torch.eye(H)
        for layer in pdm.layers:
            layer.self_attn.o_proj.weight.mul_(context)
            layer.mlp.down_proj.weight.mul_(context)
        pdm.init_head_from_target(target.lm_head.weight)
    return pdm


def anchor_pdm(geometry: Geometry, num_layers: int, seed: int = 0) -> PipelineDraftModule:
    """A random-init PDM fed by random anchor states of width ANCHOR_HIDDEN (no d2t: the layouts need none)."""
    torch.manual_seed(seed)
    cfg = PDMConfig(
        target_hidden_size=ANCHOR_HIDDEN,
        num_types=geometry.num_types,
        draft_vocab_size=ANCHOR_VOCAB,
        hidden_size=32,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=48,
    )
    return PipelineDraftModule(cfg).eval()


def padded_anchor_states(geometry: Geometry, T: int, seed: int):
    """Random anchor states of ANCHOR_BATCH right-padded sequences (lengths T, 2T/3, T/5) with 1e4 garbage in the
    padding; returns the states, the lengths and the generator (for the fill draws)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([T, T - T // 3, max(2, T // 5)])
    states = torch.randn(ANCHOR_BATCH, T, geometry.num_types, ANCHOR_HIDDEN, generator=gen)
    for b, length in enumerate(lengths.tolist()):
        states[b, length:] = 1e4  # garbage in the padding must not reach any real token
    return states, lengths, gen
