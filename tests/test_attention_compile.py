"""Compiled FlexAttention serves every (batch, length) of a run from a bounded number of graphs.

With `dynamic=False`, each new replicated length recompiles; past dynamo's recompile limit (8) torch silently
runs the unfused flex path that builds the whole `S x S` score matrix (43 GB per layer call at T=2048, n=8).
"""

import pytest
import torch
from torch._dynamo.utils import counters

from spd_lightning.geometry import Geometry
from spd_lightning.training import block_sparsity, layouts
from spd_lightning.training.attention import dense_attend, dense_mask, make_attend
from spd_lightning.training.layouts import build_layout

# 4 distinct lengths with S >= 2 blocks: static shapes would compile 4 graphs per function, dynamic ones 1. (More
# lengths than dynamo's recompile limit of 8 add no check: past it the unfused path still gives the right numbers.)
LENGTHS = [48, 80, 144, 192]


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def test_compiled_flex_does_not_recompile_per_length(fresh_dynamo):
    layout = build_layout("depth", Geometry.build(8, 2, "uniform", "n_scaled", "pre_step", "spd"))
    gen = torch.Generator().manual_seed(0)
    heads, hd = 2, 16
    for T in LENGTHS:
        B = 2
        lengths = torch.randint(T // 2, T + 1, (B,), generator=gen)
        rep = layout.replicate(lengths, T, layout.draw_fill(B, T, gen))
        q, k, v = (torch.randn(B, heads, rep.seq_len, hd, generator=gen) for _ in range(3))
        out = make_attend("flex_compiled", rep.mask_mod, rep.plan_fn, B, rep.seq_len, rep.device)(0, q, k, v)
        expected = dense_attend(dense_mask(rep.mask_mod, B, rep.seq_len, rep.device))(0, q, k, v)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    # One graph each for create_block_mask and flex_attention; with static shapes it is one per length, up to
    # the limit. (A size that is 1 at first, e.g. one KV block, is re-specialized once: hence T >= 48 here.)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert counters["frames"]["ok"] == counters["frames"]["total"]


@pytest.mark.parametrize("layout_name", ["depth", "type"])
def test_compiled_flex_with_the_block_structure_of_the_shape_equals_dense(fresh_dynamo, layout_name):
    """At a block-aligned length the flex path takes its block mask from the shape's cached structure
    (spd_lightning/training/block_sparsity.py): compiled flex on it equals the dense mask, padding and fills included."""
    block_sparsity._SKELETONS.clear()
    layout = build_layout(layout_name, Geometry.build(8, 2))
    gen = torch.Generator().manual_seed(1)
    T, heads, hd = 128, 2, 16
    for lengths in ([T, 77], [40, T]):
        lengths = torch.tensor(lengths)
        rep = layout.replicate(lengths, T, layout.draw_fill(2, T, gen))
        q, k, v = (torch.randn(2, heads, rep.seq_len, hd, generator=gen) for _ in range(3))
        out = rep.attend("flex_compiled")(0, q, k, v)
        expected = dense_attend(dense_mask(rep.mask_mod, 2, rep.seq_len, rep.device))(0, q, k, v)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    assert len(block_sparsity._SKELETONS) == 1  # one shape, built once, used by both steps


@pytest.mark.parametrize("layout_name", ["depth", "type"])
def test_a_training_step_after_validation_under_inference_mode_backpropagates(aot_eager_flex, layout_name):
    """Lightning validates under inference mode on NCCL (the sanity check comes before the first step): a tensor
    cached there and closed over by a later training step's mask_mod would be an inference tensor, which flex's
    backward cannot save ("Inference tensors cannot be saved for backward")."""
    layouts.index_table.cache_clear()
    block_sparsity._SKELETONS.clear()
    layout = build_layout(layout_name, Geometry.build(32, 8))
    gen = torch.Generator().manual_seed(2)
    T, lengths = 128, torch.tensor([128, 100])
    with torch.inference_mode():  # the validation step fills the caches: the index tables, the shape's blocks
        rep = layout.replicate(lengths, T, layout.validation_fill(2, T))
        rep.attend("flex_compiled")(0, *(torch.randn(2, 2, rep.seq_len, 16, generator=gen) for _ in range(3)))
    rep = layout.replicate(lengths, T, layout.draw_fill(2, T, gen))
    q, k, v = (torch.randn(2, 2, rep.seq_len, 16, generator=gen, requires_grad=True) for _ in range(3))
    rep.attend("flex_compiled")(0, q, k, v).sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))
