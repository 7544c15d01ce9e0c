"""Compiled flex under every variant a real `fit` meets stays within the recompile limit `fit` sets.

Past dynamo's limit torch would silently run eager flex with the whole score matrix (~13 GB per call at
S = 10,240); `fit` raises the limit to what a run needs and makes hitting it an error (`set_recompile_limit`).
Variants: grad off (validation, `torch.no_grad`) and inference mode (`validate`), the rows of every copy and the
loss copy's rows alone (the pruned last layer), a full batch and a short last one, one 128-block and several.
On CPU, flex has no backward and inductor's CPU flex template does not compile `T x S` queries (the loss copy's
rows) nor a batch of 1 (torch 2.13: C++ compile errors), so those variants are the GPU check's
(scripts/gpu_check.py); this test runs the others (slow: about a minute of CPU compiles).
"""

import itertools

import pytest
import torch
from torch._dynamo.utils import counters

from spd_lightning.geometry import Geometry
from spd_lightning.training.attention import dense_attend, dense_mask, make_attend
from spd_lightning.training.layouts import build_layout
from spd_lightning.training.module import FLEX_RECOMPILE_LIMIT


def run_variant(layout, mode, rows_of, batch: int, length: int, gen) -> None:
    lengths = torch.full((batch,), length)
    lengths[-1] = length - 5
    rep = layout.replicate(lengths, length, layout.draw_fill(batch, length, gen))
    rows = rep.length if rows_of == "loss_copy" else rep.seq_len
    q = torch.randn(batch, 2, rows, 16, generator=gen)
    k, v = (torch.randn(batch, 2, rep.seq_len, 16, generator=gen) for _ in range(2))
    with mode():
        out = make_attend("flex_compiled", rep.mask_mod, rep.plan_fn, batch, rep.seq_len, rep.device, rep.step_rows())(
            0, q, k, v
        )
    expected = dense_attend(dense_mask(rep.mask_mod, batch, rep.seq_len, rep.device)[:, :, :rows])(0, q, k, v)
    torch.testing.assert_close(out, expected, atol=3e-5, rtol=3e-5)


@pytest.mark.slow
def test_every_variant_of_a_run_fits_under_the_limit(limited_dynamo):
    assert torch._dynamo.config.recompile_limit == FLEX_RECOMPILE_LIMIT
    assert torch._dynamo.config.fail_on_recompile_limit_hit  # hitting the limit raises instead of going eager
    gen = torch.Generator().manual_seed(0)
    layout = build_layout("depth", Geometry.build(8, 2))  # CPU inductor cannot compile larger masks
    variants = itertools.product((torch.no_grad, torch.inference_mode), ("every_copy",), (2,), (128, 256))
    for mode, rows_of, batch, length in variants:  # the grad mode, rows, batch and length of a real run
        run_variant(layout, mode, rows_of, batch, length, gen)
    graphs = counters["stats"]["unique_graphs"]
    assert 0 < graphs <= FLEX_RECOMPILE_LIMIT, dict(counters["stats"])
    assert counters["frames"]["ok"] == counters["frames"]["total"]
