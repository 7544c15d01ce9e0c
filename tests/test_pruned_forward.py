"""The pruned training forward (the last layer run for the loss copy's rows only) computes exactly what the full one
computes for the loss copy.

The training step reads only the loss copy (copy 0, the first `T` rows of the replicated sequence) unless the
auxiliary loss is on, so `PipelineDraftModule.body(outputs=T)` runs the last layer's queries, attention output,
MLP and final norm for those rows alone; the other copies still supply that layer's keys and values.

Tolerance: none. In fp32 on one thread the pruned hidden states, logits and training loss are bit-for-bit those
of the full forward (every row's matmuls and softmax see the same operands in the same order); the gradients,
whose weight reductions now run over fewer (all-zero-gradient) rows, agree to 1e-6 relative.
"""

import itertools

import pytest
import torch
from kit import anchor_pdm, attached_module, loss_batch, loss_target, padded_anchor_states

from spd_lightning.geometry import Geometry
from spd_lightning.training.distill import distill
from spd_lightning.training.layouts import FillDistribution, build_layout, depth_copies, replication

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
T = 40
GRID = list(itertools.product(["depth", "type"], [1, 3], [2, 4, 8]))


def forwards(layout_name: str, n: int, num_layers: int, backend: str):
    """Full and pruned hidden states of the loss copy, and the replication, on a right-padded batch."""
    geometry = Geometry.build(16, n)
    pdm = anchor_pdm(geometry, num_layers)
    layout = build_layout(layout_name, geometry, FillDistribution(full_prob=0.3))
    states, lengths, gen = padded_anchor_states(geometry, T, seed=n + num_layers)
    rep = layout.replicate(lengths, T, layout.draw_fill(len(lengths), T, gen))
    with torch.no_grad():
        g, positions = rep.features(pdm.fuse, states), rep.positions()
        full = pdm.body(g, positions, rep.attend(backend))
        pruned = pdm.body(g, positions, rep.attend(backend), outputs=T)
    return pdm, rep, full, pruned


@pytest.mark.parametrize("layout_name,num_layers,n", GRID)
@pytest.mark.parametrize("backend", ["dense", "two_part"])
def test_pruned_forward_is_the_loss_copy_of_the_full_one(layout_name, num_layers, n, backend):
    pdm, rep, full, pruned = forwards(layout_name, n, num_layers, backend)
    assert pruned.shape == (full.shape[0], T, full.shape[-1]) and rep.loss_copy == 0
    assert torch.equal(pruned, full[:, rep.copy_slice(rep.loss_copy)])
    with torch.no_grad():
        assert torch.equal(pdm.lm_head(pruned), pdm.lm_head(full[:, :T]))


@pytest.mark.parametrize("layout_name,num_layers", [("depth", 3), ("type", 1)])
def test_pruned_forward_on_flex(layout_name, num_layers):
    """FlexAttention's block mask for the loss copy's queries alone (`T x S`) gives the same rows."""
    _, rep, full, pruned = forwards(layout_name, 4, num_layers, "flex")
    assert torch.equal(pruned, full[:, rep.copy_slice(rep.loss_copy)])


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> str:
    return loss_target(str(tmp_path_factory.mktemp("pruned_target")), num_layers=8)


def full_loss(module, batch):
    """The training loss read from the full (every copy) forward with the same fill draws."""
    fwd = module._forward(batch, module._fill_generator(0, 0), every_copy=True, full_vocab=False)
    main = distill(fwd, fwd.rep.loss_copy, module.hparams.teacher_temperature)
    return main.mean(main.kl)


@pytest.mark.parametrize("layout_name,num_layers,n", GRID)
def test_training_loss_and_gradients_equal_the_full_forward(target_dir, layout_name, num_layers, n):
    module = attached_module(target_dir, layout=layout_name, n=n, num_layers=num_layers)
    batch = loss_batch()  # three right-padded sequences
    module.pdm.zero_grad()
    pruned = module.training_step(batch, 0)
    pruned.backward()
    pruned_grads = [p.grad.clone() for p in module.pdm.parameters() if p.grad is not None]
    module.pdm.zero_grad()
    full = full_loss(module, batch)
    full.backward()
    assert torch.equal(pruned, full), (pruned.item(), full.item())
    full_grads = [p.grad for p in module.pdm.parameters() if p.grad is not None]
    assert len(pruned_grads) == len(full_grads) > 0
    for got, want in zip(pruned_grads, full_grads):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)


class QueryRows:
    """Records the number of query rows of every attention call the training layouts serve."""

    def __init__(self, monkeypatch):
        self.calls, real = [], replication.make_attend

        def wrapped(*args):
            attend = real(*args)

            def recording(layer, q, k, v):
                self.calls.append((layer, q.shape[-2], k.shape[-2]))
                return attend(layer, q, k, v)

            return recording

        monkeypatch.setattr(replication, "make_attend", wrapped)


@pytest.mark.parametrize("aux_loss_weight", [0.0, 0.5])
def test_last_layer_queries_only_the_loss_copy_unless_the_aux_loss_reads_the_others(
    target_dir, monkeypatch, aux_loss_weight
):
    rows = QueryRows(monkeypatch)
    module = attached_module(target_dir, layout="depth", n=4, num_layers=3, aux_loss_weight=aux_loss_weight)
    batch = loss_batch()
    T_batch, S = batch["input_ids"].shape[1], 5 * batch["input_ids"].shape[1]
    module.training_step(batch, 0)
    last = T_batch if aux_loss_weight == 0 else S  # the aux loss reads copies 1..n: every row is computed
    assert rows.calls == [(0, S, S), (1, S, S), (2, last, S)]


def test_plan_grids_are_reused_across_batches():
    """The shape-only part of the two-part plan is built once per shape; each batch cuts it by its own fill."""
    layout = build_layout("depth", Geometry.build(8, 4))
    gen = torch.Generator().manual_seed(0)
    depth_copies._depth_grid.cache_clear()
    for lengths in ([12, 7], [12, 3]):
        rep = layout.replicate(torch.tensor(lengths), 12, layout.draw_fill(2, 12, gen))
        predicate = torch.stack(
            [rep.mask_mod(torch.tensor(b), 0, torch.arange(12)[:, None], torch.arange(60)) for b in range(2)]
        )
        assert torch.equal(rep.plan(12).dense(rep.seq_len), predicate)
    info = depth_copies._depth_grid.cache_info()
    assert (info.misses, info.hits) == (1, 1) and info.maxsize is not None
