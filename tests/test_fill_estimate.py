"""`fill_probs: auto` (spd_lightning/training/fill_estimate.py): the running acceptance converges to the drafter's,
the fill weights follow the refill chain, both layouts validate every fill, and a fit logs and checkpoints it."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from kit import SyntheticChat, make_module, make_trainer
from lightning.pytorch.strategies import DDPStrategy
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from spd_lightning.fill_chain import judged_fill_shares
from spd_lightning.geometry import Geometry
from spd_lightning.training.fill_estimate import FLOOR, REFRESH_STEPS, AcceptanceEstimate
from spd_lightning.training.layouts import FillDistribution, build_layout
from spd_lightning.training.module import FILL_ESTIMATE_KEY


@pytest.mark.parametrize("layout_name", ["depth", "type"])
def test_the_running_estimate_converges_to_the_acceptance_per_fill(layout_name):
    """Outputs accepted at a fixed rate per fill, fills drawn from the estimate's own weights (as in training)."""
    n, truth = 4, torch.tensor([0.3, 0.5, 0.7, 0.9])
    layout, est = build_layout(layout_name, Geometry.build(8, n)), AcceptanceEstimate(n)
    gen = torch.Generator().manual_seed(0)
    for step in range(1, 40 * REFRESH_STEPS + 1):
        layout.fill_dist = FillDistribution(probs=est.weights)
        fill = layout.replicate(torch.full((4,), 64), 64, layout.draw_fill(4, 64, gen)).fill[0]  # the loss copy's
        accepted = torch.rand(fill.shape, generator=gen) < truth[fill - 1]
        est.update(accepted, torch.ones_like(accepted), fill)
        if step % REFRESH_STEPS == 0:
            logged = est.refresh()
    assert est.acceptance() == pytest.approx(truth.tolist(), abs=0.08)
    chain = judged_fill_shares(truth.tolist(), n)
    assert est.weights == pytest.approx([(1 - FLOOR) * s + FLOOR / n for s in chain], abs=0.04)
    assert logged["train/fill_weight1"] == est.weights[0]


def test_an_untrained_drafter_trains_at_fill_1():
    est = AcceptanceEstimate(8)
    assert est.weights[0] == pytest.approx(1 - FLOOR + FLOOR / 8)
    assert sum(est.weights) == pytest.approx(1.0)


@pytest.mark.parametrize("layout_name", ["depth", "type"])
@pytest.mark.parametrize("n", [2, 3, 8])
def test_validation_fills_cover_every_level_equally(layout_name, n):
    layout = build_layout(layout_name, Geometry.build(8, n))
    fill = layout.validation_fill(n, 16)
    counts = torch.bincount(fill.reshape(-1), minlength=n + 1)[1:]
    assert counts.min() > 0 and counts.max() - counts.min() <= counts.min() // 2 + 1


def test_auto_is_the_default_and_a_fit_logs_it(tiny_target_dir, tmp_path):
    module = make_module(tiny_target_dir, n=3)
    assert module.fill_estimate is not None
    trainer = make_trainer(tmp_path, max_steps=REFRESH_STEPS + 1, enable_checkpointing=True)
    trainer.fit(module, datamodule=SyntheticChat(repeat_one=True))
    m = trainer.callback_metrics
    weights = [float(m[f"train/fill_weight{k}"]) for k in (1, 2, 3)]
    assert weights == pytest.approx(list(module.fill_estimate.weights))
    assert module.layout.fill_dist.probs == module.fill_estimate.weights
    assert weights[0] < 1 - FLOOR  # the drafter learned one repeated sequence: fills above 1 are reached
    for k in (1, 2, 3):
        assert f"val/agree_fill{k}" in m and f"val/accept_fill{k}" in m
    assert 1.0 <= float(m["val/predicted_n_alpha"]) <= 3.0
    ckpt = torch.load(trainer.checkpoint_callback.best_model_path, weights_only=False)
    restored = make_module(tiny_target_dir, n=3)
    restored.on_load_checkpoint(ckpt)
    assert restored.layout.fill_dist.probs == module.fill_estimate.weights
    assert torch.equal(restored.fill_estimate.total, ckpt[FILL_ESTIMATE_KEY]["total"])


def test_a_restored_estimate_is_reduced_over_the_ranks_on_the_gpu(tiny_target_dir):
    """A resumed run's counts are on the host (as saved) until its first training step moves them, and a refresh may
    come first (a resume at a multiple of REFRESH_STEPS): its reduce must not hand NCCL a host tensor ("No backend
    type associated with device type cpu"). A fake process group that serves only cuda and a fake cuda device
    (FakeTensorMode) stand in for NCCL and the GPU."""
    module = make_module(tiny_target_dir, n=3)
    module.fill_estimate.load_state_dict(AcceptanceEstimate(3).state_dict())  # what on_load_checkpoint does
    module._trainer = SimpleNamespace(strategy=DDPStrategy(parallel_devices=[torch.device("cuda", 0)]))
    dist.init_process_group("cuda:fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            summed = [module._over_ranks(t, "sum") for t in (module.fill_estimate.correct, module.fill_estimate.total)]
    finally:
        dist.destroy_process_group()
    assert [t.device for t in summed] == [torch.device("cuda", 0)] * 2


def test_fixed_fills_stay_available(tiny_target_dir):
    fixed = make_module(tiny_target_dir, n=3, fill_probs=None, fill_full_prob=0.5)
    assert fixed.fill_estimate is None and fixed.layout.fill_dist.probabilities(3).tolist() == [0.25, 0.25, 0.5]
    with pytest.raises(ValueError, match="fill_probs='often'"):
        make_module(tiny_target_dir, fill_probs="often")
    for fill_probs in ("auto", [0.2, 0.3, 0.5]):  # fill_full_prob applies only to fill_probs: null (it was dropped)
        with pytest.raises(ValueError, match="fill_full_prob=0.9 applies with fill_probs: null"):
            make_module(tiny_target_dir, n=3, fill_probs=fill_probs, fill_full_prob=0.9)
