"""The PDM's draft is batched tensor work: the ops it dispatches per step do not grow with the slots it drafts
for, each row warps under its own settings exactly as `warp` does alone, and its counter-based draws are uniform
and follow each row's distribution."""

from __future__ import annotations

import math

import pytest
import torch
from kit import make_tiny_model, random_pdm
from torch.utils._python_dispatch import TorchDispatchMode

from inference.runtime.drafter import PDMDrafter
from inference.sampling import Sampling, counter_uniforms, draw_rows, seed_keys, warp, warp_rows
from spd_lightning.geometry import Geometry
from spd_lightning.target import Target


class OpCounter(TorchDispatchMode):
    """The aten ops dispatched inside the context that compute (views only relabel memory: no kernel, and torch
    shapes a size-1 batch with a few more of them)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not func.is_view
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def drafting_setup():
    torch.manual_seed(0)
    target = Target(make_tiny_model("qwen3_5"), "tiny-qwen3_5")
    geometry = Geometry.build(target.num_layers, 3)
    return target, geometry, random_pdm(target, geometry, num_layers=2)


def ops_of_a_steady_draft(setup, slots: int, sampling: Sampling) -> int:
    """Every slot holds the same 6-token prompt with its anchors and drafts at fill 2; the ops of the second
    step on the PDM rank: storing every stage's anchor message, then the draft (the first draft commits the
    prompts)."""
    target, geometry, pdm = setup
    drafter = PDMDrafter(pdm, geometry, target.embed_tokens, torch.float32, slots)
    P, m, H = 6, geometry.num_types, target.hidden_size
    states = torch.randn(P + geometry.n + 2, m, H, generator=torch.Generator().manual_seed(1))
    for b in range(slots):
        drafter.start(b, torch.arange(P)[None] + 3, 32, sampling, seed=b)
        for s in range(1, geometry.n + 1):
            drafter.store_anchors(b, s, 0, states[:, 1 : 1 + len(drafter._stage_anchors[s])])
    views = {b: geometry.view(P, 2)[-2:] for b in range(slots)}
    drafter.draft(views)
    views = {b: geometry.view(P + 1, 2)[-2:] for b in range(slots)}
    messages = {s: torch.randn(slots, len(drafter._stage_anchors[s]), H) for s in range(1, geometry.n + 1)}
    for b in range(slots):
        drafter.set_token(b, P, 5)  # a correction enters in every slot
    with OpCounter() as counter:
        for s, message in messages.items():  # a step's anchor messages, a row per slot
            drafter.store_step_anchors(s, {b: P for b in range(slots)}, message)
        drafter.draft(views)
    return counter.ops


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(0.8, top_k=7, top_p=0.9)], ids=["greedy", "sampled"])
def test_the_ops_of_a_draft_do_not_grow_with_the_slots(drafting_setup, sampling):
    """The anchor stores, fusion, segment gather, body, head, warp, draw, the seed's and the drafted token's
    embeddings: the same number of dispatched ops at B = 1, 2, 4 and 8 (a per-slot loop adds ops per slot)."""
    counts = {B: ops_of_a_steady_draft(drafting_setup, B, sampling) for B in (1, 2, 4, 8)}
    assert len(set(counts.values())) == 1, counts


SETTINGS = [
    Sampling(),
    Sampling(0.7, top_k=5),
    Sampling(1.3, top_p=0.6),
    Sampling(1.0),
    Sampling(2.0, top_k=60, top_p=0.9),
    Sampling(1e-5, top_k=3, top_p=0.5),  # greedy by its temperature
    Sampling(1.0, top_p=1e-5),  # greedy by its top_p
    Sampling(1e30, top_k=1),
]


def test_warp_rows_warps_each_row_as_warp_does_alone():
    logits = torch.randn(len(SETTINGS), 50, generator=torch.Generator().manual_seed(2)) * 3
    logits[3, :10] = float("-inf")
    logits[4, 7] = float("nan")
    rows = warp_rows(
        logits,
        torch.tensor([s.temperature for s in SETTINGS]),
        torch.tensor([s.top_k for s in SETTINGS]),
        torch.tensor([s.top_p for s in SETTINGS]),
    )
    for i, sampling in enumerate(SETTINGS):
        assert torch.equal(rows[i], warp(logits[i : i + 1], sampling)[0]), sampling


def chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Upper tail of Pearson's statistic (Wilson-Hilferty normal approximation)."""
    k = counts.numel() - 1
    stat = float(((counts - expected) ** 2 / expected).sum())
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_counter_uniforms_are_uniform_and_differ_across_seeds():
    counters = torch.arange(100_000)
    keys = [torch.full_like(counters, k) for k in seed_keys(7)]
    u = counter_uniforms(*keys, counters)
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert chi_square_p(torch.histc(u, 200, 0, 1), torch.full((200,), 500.0)) > 1e-3
    lagged = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]
    assert abs(float(lagged)) < 0.02
    other = counter_uniforms(*[torch.full_like(counters, k) for k in seed_keys(8)], counters)
    assert abs(float(torch.corrcoef(torch.stack([u, other]))[0, 1])) < 0.02
    assert torch.equal(u, counter_uniforms(*keys, counters))  # a function of (seed, counter) alone


def test_draws_follow_each_rows_distribution_and_never_a_zero():
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0], [0.1, 0.2, 0.3, 0.4, 0.0]])
    counters = torch.arange(60_000)
    keys = [torch.full_like(counters, k) for k in seed_keys(3)]
    u = counter_uniforms(*keys, counters)
    for row in probs:
        drawn = draw_rows(row.expand(len(u), -1), u)
        assert bool((row[drawn] > 0).all())
        counts = torch.bincount(drawn, minlength=5).double()[row > 0]
        if len(counts) > 1:
            assert chi_square_p(counts, row[row > 0].double() * len(u)) > 1e-3
    top = torch.tensor([1.0 - 2**-53])  # rounds to the total: falls back to the last positive index
    assert int(draw_rows(probs[:1], top)) == 3


def test_every_tensor_the_compiled_draft_reads_keeps_its_address_through_growth(drafting_setup):
    """A CUDA graph copies each input not marked static into a buffer of its own before every replay: the anchor
    store (`states`, the largest tensor the draft reads) and the cached lengths would be copied every step. Marked
    when made, and again when a longer request regrows them."""
    from torch._dynamo.utils import get_static_address_type

    target, geometry, pdm = drafting_setup
    drafter = PDMDrafter(pdm, geometry, target.embed_tokens, torch.float32, 2)

    def unmarked() -> list[str]:
        cache = drafter.cache
        read = dict(states=drafter.states, keys=cache.keys, values=cache.values, offsets=cache.offsets)
        read |= dict(rows=cache.rows, positions=cache.positions, columns=drafter._columns, row_ids=drafter._row_ids)
        return [name for name, tensor in read.items() if get_static_address_type(tensor) is None]

    assert unmarked() == []
    held = drafter.capacity
    drafter.start(0, torch.tensor([3, 4]), 4 * held)
    assert drafter.capacity > held and unmarked() == []
