"""A training step makes no host/device sync once its shape has been seen (spd_lightning/host_syncs.py).

Counted: the project's own code (the module, the layouts, the block mask, the PDM), forward and backward. The
frozen target's forward runs transformers' mask preparation, which reads device values (3 scalar reads per
forward): that lives outside this repository and is left out by call site.
"""

import os

import pytest
import torch
from kit import attached_module, loss_batch

from spd_lightning.geometry import Geometry
from spd_lightning.host_syncs import HostSyncCounter
from spd_lightning.training import block_sparsity
from spd_lightning.training.layouts import build_layout

PROJECT = os.path.dirname(os.path.abspath(block_sparsity.__file__))


def project_syncs(counter: HostSyncCounter) -> list:
    return [r for r in counter.records if r.site.startswith(PROJECT)]


@pytest.mark.parametrize(
    "overrides",
    [
        dict(layout="depth"),
        dict(layout="type", aux_loss_weight=0.5),
        dict(layout="depth", attention_backend="two_part", activation_checkpointing=True),
    ],
)
def test_no_sync_in_a_training_step_after_the_first_of_its_shape(loss_target_dir, overrides):
    module, batch = attached_module(loss_target_dir, **overrides), loss_batch()
    counters = []
    for _ in range(3):
        with HostSyncCounter(device="cpu") as syncs:
            module.training_step(batch, 0).backward()
        counters.append(syncs)
    later = [r for c in counters[1:] for r in project_syncs(c)]
    assert not later, "\n".join(str(r) for r in later)


@pytest.mark.parametrize("layout_name", ["depth", "type"])
def test_the_flex_block_mask_of_a_known_shape_makes_no_sync(layout_name):
    """The flex path's per-step work (replication, block mask from the shape's skeleton); flex itself runs
    compiled on a GPU, which a dispatch mode cannot watch."""
    layout = build_layout(layout_name, Geometry.build(8, 4))
    gen = torch.Generator().manual_seed(0)
    for step, lengths in enumerate(([128, 100], [90, 128])):
        fill, lengths = layout.draw_fill(2, 128, gen), torch.tensor(lengths)
        with HostSyncCounter(device="cpu") as syncs:
            rep = layout.replicate(lengths, 128, fill)
            skel = block_sparsity.skeleton(rep.shape, rep.seq_len, rep.seq_len, rep.device)
            block_sparsity.step_block_mask(skel, rep.step_rows(), rep.mask_mod)
        if step:
            assert syncs.total == 0, syncs.summary()
