"""Batched pipeline decoding (B sequences per step) in one process: every sequence of a batch decodes exactly as it
does alone.

The reference of each sequence is its batch-1 `Simulator` decode (and, greedy, AR): tokens, K and the acceptance
counters, which depend on every draft, so equal counters mean every slot's drafts were its batch-1 drafts too. A
random PDM is rejected almost always (the refill and rollback paths); the nearly-bigram target with its agreeing
PDM of test_lossless_accepted.py is accepted most of the time (every fill level). Sequences join at later
cycles and leave (finish, EOS, cancel) while others are in flight.
"""

import dataclasses

import pytest
import torch
from kit import agreeing_pdm, nearly_bigram_target, random_pdm

from inference.cycle.ar import ar_decode
from inference.cycle.simulator import Simulator
from inference.cycle.slots import Request
from inference.sampling import Sampling
from spd_lightning.geometry import Geometry

PROMPTS = [[3, 14, 15, 92, 65, 35], [7, 7, 8], [5], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [40, 41]]
SAMPLED = Sampling(0.7, top_k=12, top_p=0.95)


def alone(target, pdm, geometry, request: Request):
    """The request's batch-1 decode."""
    simulator = Simulator(target, pdm, geometry, request.sampling)
    eos = sorted(request.eos_token_ids) or None
    return simulator.decode(
        request.prompt_ids, request.max_new_tokens, eos, request.seed, request.on_tokens, request.stop
    )


def same(result, reference) -> bool:
    return (result.tokens, result.K, result.counters, result.stop_reason) == (
        reference.tokens,
        reference.K,
        reference.counters,
        reference.stop_reason,
    )


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.hf_internals
def test_greedy_batch_equals_batch_one(tiny_target, n):
    """Mixed prompt lengths and max_new_tokens, more requests than slots (each joins when one frees up), B = 1
    and 4, on a Qwen3 and a hybrid Qwen3.5 target: each sequence is its batch-1 decode and AR's output, also when
    the stages run every slot's wasted optimistic steps (as distributed ranks do) and roll them back per slot."""
    geometry = Geometry.build(tiny_target.num_layers, n)
    pdm = random_pdm(tiny_target, geometry)
    requests = [Request(p, 6 + 4 * i) for i, p in enumerate(PROMPTS)]
    references = [alone(tiny_target, pdm, geometry, r) for r in requests]
    for r, reference in zip(requests, references):
        assert reference.tokens == ar_decode(tiny_target, r.prompt_ids, r.max_new_tokens).tokens
    for B, replay in ((1, False), (4, False), (4, True)):
        results = Simulator(tiny_target, pdm, geometry, max_batch=B, replay_wasted_work=replay).run(requests)
        assert [same(x, ref) for x, ref in zip(results, references)] == [True] * len(requests), (B, replay)


@pytest.mark.parametrize("arch,n", [("qwen3", 4), ("qwen3_5", 3)])
def test_accepted_drafts_and_mixed_sampling(arch, n):
    """An often-accepted PDM (every fill level reached), greedy and sampled requests with their own settings and
    seeds side by side: each sequence is its batch-1 decode at B = 3 and 5, so a seeded request gets the same
    tokens at any batch size."""
    target = nearly_bigram_target(arch, 0.1)
    geometry = Geometry.build(target.num_layers, n)
    pdm = agreeing_pdm(target, geometry, 0.1)
    settings = [Sampling(), SAMPLED, Sampling(), Sampling(1.0), Sampling(0.5, top_p=0.8)]
    requests = [Request(p, 16 + 3 * i, sampling=s, seed=i + 7) for i, (p, s) in enumerate(zip(PROMPTS, settings))]
    references = [alone(target, pdm, geometry, r) for r in requests]
    accepted = torch.tensor([r.counters["accepted_by_fill"] for r in references]).sum(0)
    assert (accepted > 0).all(), accepted.tolist()
    for B in (3, 5):
        results = Simulator(target, pdm, geometry, max_batch=B).run(requests)
        assert [same(x, ref) for x, ref in zip(results, references)] == [True] * len(requests), B


def test_seeded_sampling_is_the_same_at_batch_one_and_three(tiny_qwen35):
    geometry = Geometry.build(tiny_qwen35.num_layers, 3)
    pdm = random_pdm(tiny_qwen35, geometry)
    requests = [Request(p, 12, sampling=SAMPLED, seed=s) for p, s in zip(PROMPTS[:3], (0, 1, 2**70))]
    one = Simulator(tiny_qwen35, pdm, geometry, max_batch=1).run(requests)
    three = Simulator(tiny_qwen35, pdm, geometry, max_batch=3).run(requests)
    assert [r.tokens for r in one] == [r.tokens for r in three]
    assert [r.tokens for r in one] == [alone(tiny_qwen35, pdm, geometry, r).tokens for r in requests]
    assert len({tuple(r.tokens) for r in one}) == 3


def cancel_after(count: int) -> tuple:
    """`on_tokens` and `stop` of a client that cancels once it has `count` tokens."""
    seen = []
    return seen.extend, lambda: len(seen) >= count


@pytest.mark.parametrize("arch,n", [("qwen3", 3), ("qwen3_5", 2)])
def test_joins_and_leaves_mid_flight(arch, n):
    """A long request runs while others join at later cycles and leave: one ends at its max_new_tokens, one at
    an EOS, one is cancelled by its client; a late one takes a freed slot. Every sequence (the cancelled one
    included: it stops at the same cycle as alone) is its batch-1 decode."""
    target = nearly_bigram_target(arch, 0.1)
    geometry = Geometry.build(target.num_layers, n)
    pdm = agreeing_pdm(target, geometry, 0.1)
    eos = ar_decode(target, PROMPTS[3], 30).tokens[9]
    on_tokens, stop = cancel_after(6)
    requests = [
        Request(PROMPTS[0], 40, sampling=SAMPLED, seed=3),
        Request(PROMPTS[1], 5),
        Request(PROMPTS[3], 30, eos_token_ids=frozenset({eos})),
        Request(PROMPTS[2], 30, sampling=Sampling(1.0), seed=11, on_tokens=on_tokens, stop=stop),
        Request(PROMPTS[4], 8),
    ]
    joins = {0: 0, 2: 1, 3: 2, 5: 3, 24: 4}  # cycle -> the request that joins before it
    batch = Simulator(target, pdm, geometry, max_batch=4)
    owners, results = {}, {}
    for cycle in range(200):
        if cycle in joins:
            owners[batch.join(requests[joins[cycle]])] = joins[cycle]
        for slot, result in batch.step():
            results[owners.pop(slot)] = result
        if not batch.busy and cycle > max(joins):
            break
    on_tokens, stop = cancel_after(6)  # a fresh client for the batch-1 run
    requests[3] = dataclasses.replace(requests[3], on_tokens=on_tokens, stop=stop)
    references = [alone(target, pdm, geometry, r) for r in requests]
    assert [same(results[i], ref) for i, ref in enumerate(references)] == [True] * len(requests)
    assert [r.stop_reason for r in references] == [
        "max_new_tokens",
        "max_new_tokens",
        "eos",
        "cancelled",
        "max_new_tokens",
    ]
