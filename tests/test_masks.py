"""The structural masks as objects of their own (`DepthMask`, `TypeMask`), built directly, without a layout's
replication: what their rows attend to, and that the two-part plan is the predicate."""

import pytest
import torch

from spd_lightning.geometry import Geometry
from spd_lightning.training.layouts import DepthMask, TypeLayout, TypeMask, index_table

T = 6


def grid(mask, batch: int, rows: int) -> torch.Tensor:
    """The predicate on every (sample, query row, key) as `[B, R, S]` bool."""
    b = torch.arange(batch)[:, None, None]
    q, kv = torch.arange(rows)[None, :, None], torch.arange(mask_keys(mask))[None, None, :]
    return mask.attends(b, 0, q, kv).expand(batch, rows, -1)


def mask_keys(mask) -> int:
    return (mask.n + 1 if isinstance(mask, DepthMask) else len(mask.jq)) * mask.length


def depth_mask(n: int, lengths, seed: int) -> DepthMask:
    fill = torch.randint(1, n + 1, (len(lengths), T + n), generator=torch.Generator().manual_seed(seed))
    return DepthMask(n=n, length=T, lengths=torch.tensor(lengths), fill=fill)


def type_mask(n: int, lengths, seed: int) -> TypeMask:
    layout = TypeLayout(Geometry.build(8, n))
    fill = torch.randint(1, n + 1, (1,), generator=torch.Generator().manual_seed(seed)).expand(len(lengths))
    return TypeMask(
        n=n,
        length=T,
        lengths=torch.tensor(lengths),
        fill=fill.clone(),
        block_of_j=tuple(layout.block_of_j),
        jq=tuple(layout.jq),
        first_deep_j=layout.first_deep_j,
        block_table=index_table(tuple(layout.block_of_j), torch.device("cpu")),
        jq_table=index_table(tuple(layout.jq), torch.device("cpu")),
    )


@pytest.mark.parametrize("make", [depth_mask, type_mask])
@pytest.mark.parametrize("n", [2, 4])
def test_the_two_part_plan_is_the_predicate(make, n):
    mask = make(n, [T, 4], seed=n)
    S = mask_keys(mask)
    for rows in (T, S):  # the loss copy's rows alone, and every row
        torch.testing.assert_close(mask.plan(rows).dense(S), grid(mask, 2, rows))


@pytest.mark.parametrize("make", [depth_mask, type_mask])
def test_padding_rows_attend_to_themselves_only(make):
    mask = make(3, [T, 2], seed=1)
    S = mask_keys(mask)
    attends = grid(mask, 2, S)[1]  # sample 1: positions 2.. are padding in every copy
    for q in range(S):
        if q % T >= 2:
            assert attends[q].nonzero().flatten().tolist() == [q]


def test_the_verified_copy_of_depth_is_plain_causal_attention():
    n = 3
    mask = depth_mask(n, [T], seed=2)
    attends = grid(mask, 1, (n + 1) * T)[0]
    verified = attends[n * T :]  # copy n: x_0..x_{T-1} verified, read causally from copy n alone
    expected = torch.zeros(T, (n + 1) * T, dtype=torch.bool)
    expected[:, n * T :] = torch.ones(T, T, dtype=torch.bool).tril()
    assert torch.equal(verified, expected)


def test_the_loss_block_of_type_reads_the_staircase_then_the_deepest_block():
    """Loss block row t at fill a: key t - delta from the block of in-flight index delta for delta < a (the
    staircase), then from the deepest block (everything verified)."""
    mask = type_mask(4, [T], seed=0)
    a, t = int(mask.fill[0]), T - 1
    row = grid(mask, 1, T)[0, t]
    blocks = {(int(k) // T, int(k) % T) for k in row.nonzero().flatten()}
    staircase = {(mask.block_of_j[d], t - d) for d in range(a)}
    deepest = {(len(mask.jq) - 1, t - d) for d in range(a, t + 1)}
    assert blocks == staircase | deepest
