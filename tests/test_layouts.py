"""The defining equivalence of the training layouts (docs/DESIGN.md, "The structural mask") and the agreement of the attention backends.

For random drafting times `t` and fill levels `a`, the loss-copy logits at position `t` of ONE replicated
forward must equal a separate plain PDM forward over the explicit staircase view `geometry.view(t, a)`
(features of each (depth, position) pair, causal attention, true positions). Random anchor states stand in
for a target: the property is about the mask and the feature placement, not about the target.
"""

import math

import pytest
import torch
from kit import ANCHOR_HIDDEN, ANCHOR_VOCAB, anchor_pdm

from spd_lightning.geometry import Geometry
from spd_lightning.pdm import PDMConfig, PipelineDraftModule
from spd_lightning.training.attention import dense_mask
from spd_lightning.training.layouts import DepthLayout, FillDistribution, TypeLayout, build_layout

TOL = 1e-5


def staircase_logits(pdm, geometry: Geometry, states: torch.Tensor, t: int, fill: int) -> torch.Tensor:
    """The inference computation: the view of drafting time `t`, run as a plain causal sequence."""
    view = geometry.view(t, fill)
    g = torch.stack([pdm.fuse(states[i], geometry.type_of(depth)) for depth, i in view])[None]
    positions = torch.tensor([[i for _, i in view]])
    return pdm.lm_head(pdm.body(g, positions))[0, -1]


def replicated_logits(pdm, layout, states, lengths, fill, backend="dense"):
    rep = layout.replicate(lengths, states.shape[1], fill)
    hidden = pdm.body(rep.features(pdm.fuse, states), rep.positions(), rep.attend(backend))
    return pdm.lm_head(hidden[:, rep.copy_slice(rep.loss_copy)]), rep


def fill_at(layout, fill: torch.Tensor, b: int, t: int) -> int:
    return int(fill[b, t]) if isinstance(layout, DepthLayout) else int(fill[b])


GEOMETRIES = {
    "pre_step": dict(),
    "post_step": dict(schedule="post_step"),
    "first_stage": dict(features="first_stage"),
    "quarters": dict(anchors="quarters"),
}


@pytest.mark.parametrize("num_layers", [1, 3])
@pytest.mark.parametrize("variant", list(GEOMETRIES))
def test_depth_layout_equals_explicit_staircase(num_layers, variant):
    geometry = Geometry.build(num_layers=8, n=4, **GEOMETRIES[variant])
    pdm, layout = anchor_pdm(geometry, num_layers), DepthLayout(geometry)
    gen = torch.Generator().manual_seed(1)
    B, T = 2, 13
    states = torch.randn(B, T, geometry.num_types, ANCHOR_HIDDEN, generator=gen)
    fill = layout.draw_fill(B, T, gen)
    fill[0, :5] = torch.tensor([1, 2, 3, 4, 4])  # every fill level at the start, where views are short
    with torch.no_grad():
        logits, _ = replicated_logits(pdm, layout, states, torch.full((B,), T), fill)
        for b in range(B):
            for t in range(T):
                want = staircase_logits(pdm, geometry, states[b], t, fill_at(layout, fill, b, t))
                torch.testing.assert_close(logits[b, t], want, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("variant", list(GEOMETRIES))
def test_type_layout_equals_explicit_staircase_for_one_layer(variant):
    geometry = Geometry.build(num_layers=8, n=4, **GEOMETRIES[variant])
    pdm, layout = anchor_pdm(geometry, 1), TypeLayout(geometry)
    gen = torch.Generator().manual_seed(2)
    T = 11
    states = torch.randn(1, T, geometry.num_types, ANCHOR_HIDDEN, generator=gen)
    with torch.no_grad():
        for a in range(1, geometry.n + 1):  # fill is one level per step in this layout
            fill = torch.tensor([a])
            logits, _ = replicated_logits(pdm, layout, states, torch.tensor([T]), fill)
            for t in range(T):
                torch.testing.assert_close(
                    logits[0, t], staircase_logits(pdm, geometry, states[0], t, a), atol=TOL, rtol=TOL
                )


def test_type_layout_is_only_approximate_for_deeper_pdms():
    """Guards the test above against vacuity: with L_s = 3 the type layout's keys carry their
    representative depth's view, so some drafting times differ from inference."""
    geometry = Geometry.build(num_layers=8, n=4)
    pdm, layout = anchor_pdm(geometry, 3), TypeLayout(geometry)
    states = torch.randn(1, 9, geometry.num_types, ANCHOR_HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, _ = replicated_logits(pdm, layout, states, torch.tensor([9]), torch.tensor([4]))
        gaps = [(logits[0, t] - staircase_logits(pdm, geometry, states[0], t, 4)).abs().max() for t in range(9)]
    assert max(gaps) > 1e-3


@pytest.mark.parametrize("layout_name", ["depth", "type"])
def test_padded_batch_equals_sequences_one_by_one(layout_name):
    geometry = Geometry.build(num_layers=8, n=4)
    pdm, layout = anchor_pdm(geometry, 2), build_layout(layout_name, geometry)
    gen = torch.Generator().manual_seed(4)
    lengths, T = torch.tensor([12, 7, 3]), 12
    states = torch.randn(3, T, geometry.num_types, ANCHOR_HIDDEN, generator=gen)
    states[1, 7:] = 1e4  # garbage in the padding must not leak into real tokens
    fill = layout.draw_fill(3, T, gen)
    with torch.no_grad():
        batched, _ = replicated_logits(pdm, layout, states, lengths, fill)
        assert torch.isfinite(batched).all()
        for b, n_b in enumerate(lengths.tolist()):
            alone_fill = fill[b : b + 1, : n_b + geometry.n] if layout_name == "depth" else fill[b : b + 1]
            alone, _ = replicated_logits(pdm, layout, states[b : b + 1, :n_b], lengths[b : b + 1], alone_fill)
            torch.testing.assert_close(batched[b, :n_b], alone[0], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("layout_name", ["depth", "type"])
@pytest.mark.parametrize("variant", ["pre_step", "post_step", "first_stage"])
def test_two_part_plan_is_the_predicate(layout_name, variant):
    """The two-part factorization describes exactly the mask the predicate defines."""
    geometry = Geometry.build(num_layers=8, n=4, **GEOMETRIES[variant])
    layout = build_layout(layout_name, geometry, FillDistribution(full_prob=0.3))
    gen = torch.Generator().manual_seed(5)
    lengths, T = torch.tensor([10, 6]), 10
    rep = layout.replicate(lengths, T, layout.draw_fill(2, T, gen))
    predicate = dense_mask(rep.mask_mod, 2, rep.seq_len, torch.device("cpu"))
    assert torch.equal(rep.plan().dense(rep.seq_len), predicate)
    assert torch.equal(rep.plan(T).dense(rep.seq_len), predicate[:, :T])  # the loss copy's rows alone (pruned layer)
    assert predicate.any(-1).all()  # every row attends to something, so no softmax row is empty


@pytest.mark.parametrize("layout_name", ["depth", "type"])
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_attention_backends_agree(layout_name):
    geometry = Geometry.build(num_layers=8, n=3)
    pdm, layout = anchor_pdm(geometry, 2), build_layout(layout_name, geometry)
    gen = torch.Generator().manual_seed(6)
    lengths, T = torch.tensor([9, 5]), 9
    states = torch.randn(2, T, geometry.num_types, ANCHOR_HIDDEN, generator=gen)
    fill = layout.draw_fill(2, T, gen)
    with torch.no_grad():
        dense, rep = replicated_logits(pdm, layout, states, lengths, fill, "dense")
        two_part, _ = replicated_logits(pdm, layout, states, lengths, fill, "two_part")
        flex, _ = replicated_logits(pdm, layout, states, lengths, fill, "flex")  # eager FlexAttention on CPU
    real = torch.arange(T)[None] < lengths[:, None]
    torch.testing.assert_close(two_part[real], dense[real], atol=TOL, rtol=TOL)
    torch.testing.assert_close(flex[real], dense[real], atol=TOL, rtol=TOL)


def test_two_part_gradients_match_dense():
    geometry = Geometry.build(num_layers=8, n=4)
    layout = DepthLayout(geometry)
    gen = torch.Generator().manual_seed(7)
    states = torch.randn(1, 8, geometry.num_types, ANCHOR_HIDDEN, generator=gen)
    fill = layout.draw_fill(1, 8, gen)
    grads = []
    for backend in ("dense", "two_part"):
        pdm = anchor_pdm(geometry, 2)
        logits, _ = replicated_logits(pdm, layout, states, torch.tensor([8]), fill, backend)
        logits.square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in pdm.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)


def test_fill_distribution():
    p = FillDistribution().probabilities(5)
    assert p[-1] == 0.5 and torch.allclose(p[:-1], torch.full((4,), 0.125, dtype=torch.float64))
    assert FillDistribution(probs=[1, 0, 0]).sample(3, (50,)).eq(1).all()
    draws = FillDistribution().sample(4, (4000,), torch.Generator().manual_seed(0))
    assert draws.min() == 1 and draws.max() == 4 and abs(draws.eq(4).float().mean() - 0.5) < 0.05
    with pytest.raises(ValueError, match="fill_probs"):
        FillDistribution(probs=[1, 1]).probabilities(3)


@pytest.mark.parametrize("probs", [[math.nan, 1.0], [math.inf, 1.0], [1e308, 1e308]], ids=["nan", "inf", "overflow"])
def test_fill_weights_that_are_no_distribution_are_refused_when_set(probs):
    """`fill_probs` with a NaN or an infinite weight (or a sum that overflows) passed the check made when the module
    is built and failed at the first training step in `torch.multinomial` (a RuntimeError, exit 1)."""
    with pytest.raises(ValueError, match=r"fill_probs=.* must be 2 non-negative finite weights"):
        FillDistribution(probs=probs).probabilities(2)


def test_fusion_by_position_types_equals_fusing_each_position_alone():
    """The decoder fuses a view's positions by types it holds on the host: one projection per type present,
    the same numbers as fusing each position with its own type."""
    torch.manual_seed(0)
    cfg = PDMConfig(ANCHOR_HIDDEN, 3, ANCHOR_VOCAB, hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8)
    fusion = PipelineDraftModule(cfg).fusion
    states = torch.randn(1, 5, 3, ANCHOR_HIDDEN)
    types = (3, 1, 2, 1, 3)
    one_by_one = torch.stack([fusion(states[:, i], t) for i, t in enumerate(types)], dim=1)
    torch.testing.assert_close(fusion(states, types), one_by_one)


@pytest.mark.parametrize("tau", [1, 2, 3])
def test_training_fusion_folds_the_norm_scales_into_the_projection_exactly(tau):
    """Training fuses with the norms' scales folded into the projection (no input gradient to compute); its
    outputs and every weight's gradient equal the defining form `proj([w_0 x_hat_0; ...])` that decoding runs."""
    torch.manual_seed(0)
    cfg = PDMConfig(ANCHOR_HIDDEN, 3, ANCHOR_VOCAB, hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8)
    fusion = PipelineDraftModule(cfg).fusion
    with torch.no_grad():
        for norm in fusion.norms:  # scales away from 1, distinct per anchor: a fold that mixes them up shows
            norm.weight.uniform_(0.5, 1.5)
    states = torch.randn(2, 7, 3, ANCHOR_HIDDEN)
    upstream = torch.randn(2, 7, 16)
    params = [*fusion.norms.parameters(), *fusion.proj.parameters()]

    def grads(out: torch.Tensor) -> list[torch.Tensor]:
        return torch.autograd.grad((out * upstream).sum(), params, allow_unused=True)

    folded = fusion(states, tau)  # grad enabled, trainable weights: the folded form
    defining = fusion.proj[tau - 1](torch.cat([fusion.norms[j](states[..., j, :]) for j in range(tau)], dim=-1))
    torch.testing.assert_close(folded, defining)
    for got, want in zip(grads(folded), grads(defining)):
        assert (got is None) == (want is None)
        if got is not None:
            torch.testing.assert_close(got, want)
    with torch.no_grad():  # decoding's form
        torch.testing.assert_close(fusion(states, tau), defining.detach())
