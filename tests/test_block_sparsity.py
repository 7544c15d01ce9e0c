"""A step's FlexAttention block mask from the block structure built once per shape equals, for attention, the
one `create_block_mask` builds from the step's predicate: it touches every block the exact mask touches,
and every block it claims full is full (the kernel applies the step's `mask_mod` in every other block); for
the `type` layout (one fill per sample) without padding it is the same block mask."""

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from spd_lightning.geometry import Geometry
from spd_lightning.training import block_sparsity
from spd_lightning.training.block_sparsity import skeleton, step_block_mask
from spd_lightning.training.layouts import build_layout

BLOCK = 8  # small blocks: many of them, at shapes the eager predicate evaluates quickly


def touched_and_full(mask: BlockMask) -> tuple[torch.Tensor, torch.Tensor]:
    """`[B, Q, K]` booleans: blocks the mask visits at all, and blocks it visits without the predicate."""
    full = BlockMask.from_kv_blocks(mask.full_kv_num_blocks, mask.full_kv_indices, BLOCK_SIZE=mask.BLOCK_SIZE)
    return mask.to_dense()[:, 0].bool(), full.to_dense()[:, 0].bool()


def replication(layout_name: str, n: int, T: int, lengths: list[int], seed: int):
    layout = build_layout(layout_name, Geometry.build(8, n))
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    return layout.replicate(lengths, T, layout.draw_fill(len(lengths), T, gen))


@pytest.mark.parametrize("layout_name", ["depth", "type"])
@pytest.mark.parametrize("n, T", [(2, 24), (4, 40), (8, 32)])
@pytest.mark.parametrize("rows", ["all", "loss copy"])
def test_the_cached_structure_covers_the_step_and_claims_only_full_blocks(layout_name, n, T, rows):
    kept_full = []
    for seed, lengths in enumerate(([T, T - 5, 3], [T, T], [7, 2, T - 1, 1])):
        rep = replication(layout_name, n, T, lengths, seed)
        R = rep.seq_len if rows == "all" else T
        exact = create_block_mask(rep.mask_mod, rep.batch, None, R, rep.seq_len, device="cpu", BLOCK_SIZE=BLOCK)
        step = rep.step_rows()
        cached = step_block_mask(skeleton(rep.shape, R, rep.seq_len, rep.device, BLOCK), step, rep.mask_mod)
        exact_touched, exact_full = touched_and_full(exact)
        ours_touched, ours_full = touched_and_full(cached)
        assert not (exact_touched & ~ours_touched).any(), "a block the step's mask needs is skipped"
        assert not (ours_full & ~exact_full).any(), "a block claimed full is not full"
        assert not (ours_touched & ours_full & ~exact_touched).any()  # claimed full implies needed
        assert not ours_touched.all()  # sparsity kept: some blocks skipped
        if layout_name == "type" and min(lengths) == T:  # one fill per sample, no padding: the same blocks
            assert torch.equal(ours_touched, exact_touched) and torch.equal(ours_full, exact_full)
        kept_full.append(bool(ours_full.any()))
    assert any(kept_full)  # and some blocks skip the predicate


def test_the_structure_is_built_once_per_shape_and_serves_every_fill_and_batch(monkeypatch):
    built = []
    monkeypatch.setattr(block_sparsity, "_build", lambda *a: built.append(a) or _real_build(*a))
    block_sparsity._SKELETONS.clear()
    for seed in range(3):
        rep = replication("depth", 4, 20, [20, 9 + seed], seed)
        skeleton(rep.shape, rep.seq_len, rep.seq_len, rep.device, BLOCK)
        skeleton(rep.shape, 20, rep.seq_len, rep.device, BLOCK)
    assert len(built) == 2  # one per row count (all rows, the loss copy), not per step


_real_build = block_sparsity._build
