"""Static stage caches: a one-token prompt, storage written in place (no allocation per cycle, rollback or
prompt), and a regrow past the budget that keeps what the cache holds."""

import pytest
import torch
from kit import random_pdm

import inference.runtime.cache
from inference.cycle.ar import ar_decode, run_slot_zero
from inference.cycle.simulator import Simulator
from inference.runtime.stages import Stage
from spd_lightning.geometry import Geometry

# tiny models run fastest single-threaded
pytestmark = pytest.mark.hf_internals


def run_through(stages, ids, start, capacity=0):
    return run_slot_zero(stages, torch.tensor([ids]), start, capacity)


@pytest.mark.parametrize("arch_fixture", ["tiny_qwen3", "tiny_qwen35"])
def test_a_one_token_prompt_decodes(arch_fixture, request):
    target = request.getfixturevalue(arch_fixture)
    geometry = Geometry.build(target.num_layers, 2)
    reference = ar_decode(target, [7], 12, geometry=geometry)
    assert len(reference.tokens) == 12
    result = Simulator(target, random_pdm(target, geometry), geometry).decode([7], 12)
    assert result.tokens == reference.tokens


def storage(stages):
    """data_ptr of every tensor the stage caches hold, snapshot rings included."""
    ptrs = {}
    for s, stage in enumerate(stages):
        cache = stage.cache
        for i in cache.attention_layers:
            ptrs[s, i, "k"], ptrs[s, i, "v"] = cache.keys[i].data_ptr(), cache.values[i].data_ptr()
            ptrs[s, i, "len"] = cache.positions.device.data_ptr()
        for i in cache.linear_layers:
            ptrs[s, i, "conv"], ptrs[s, i, "rec"] = cache.conv[i].data_ptr(), cache.recurrent[i].data_ptr()
            ptrs[s, i, "ring"] = (cache.conv_ring[i].data_ptr(), cache.recurrent_ring[i].data_ptr())
    return ptrs


def test_decode_rollback_and_a_new_prompt_allocate_no_cache_storage(tiny_qwen35):
    geometry = Geometry.build(tiny_qwen35.num_layers, 2)
    stages = [Stage.from_target(tiny_qwen35, geometry, s) for s in (1, 2)]
    run_through(stages, [3, 9, 27], 0, capacity=64)
    run_through(stages, [5], 3)
    before = storage(stages)
    assert any(k[2] == "ring" for k in before) and any(k[2] == "k" for k in before)
    for position, token in enumerate([11, 12, 13], start=4):
        run_through(stages, [token], position)
    for stage in stages:
        stage.cache.rollback(0, 5)
    run_through(stages, [40], 5)
    assert storage(stages) == before
    run_through(stages, [1, 2], 0, capacity=32)  # a new prompt within the budget reuses everything
    run_through(stages, [4], 2)
    assert storage(stages) == before


@pytest.mark.parametrize("arch_fixture", ["tiny_qwen3", "tiny_qwen35"])
def test_a_forward_past_the_budget_regrows_and_keeps_the_cache(arch_fixture, request, monkeypatch):
    target = request.getfixturevalue(arch_fixture)
    geometry = Geometry.build(target.num_layers, 2)
    ids = [5, 17, 3, 44, 9, 81, 2, 60, 61, 62, 63]
    big = [Stage.from_target(target, geometry, s) for s in (1, 2)]
    run_through(big, ids[:3], 0)
    monkeypatch.setattr(inference.runtime.cache, "CAPACITY_STEP", 4)
    small = [Stage.from_target(target, geometry, s) for s in (1, 2)]
    run_through(small, ids[:3], 0, capacity=4)
    for i in range(3, len(ids)):
        assert torch.allclose(run_through(small, ids[i : i + 1], i), run_through(big, ids[i : i + 1], i), atol=1e-5)
    assert small[0].cache.capacity >= len(ids) and small[0].cache.capacity < big[0].cache.capacity


def test_the_pdm_cache_holds_kv_heads_unexpanded_in_power_of_two_buckets(tiny_qwen35):
    """The PDM's KV cache stores its `num_kv_heads` heads (attention groups the query heads at attention time,
    `enable_gqa`), the decode is unchanged (== AR), and its capacity is a power-of-two bucket that a longer
    prompt within the bucket reuses."""
    geometry = Geometry.build(tiny_qwen35.num_layers, 2)
    pdm = random_pdm(tiny_qwen35, geometry)
    assert pdm.cfg.num_kv_heads < pdm.cfg.num_heads
    simulator = Simulator(tiny_qwen35, pdm, geometry)
    result = simulator.decode([7, 8, 9], 12)
    assert result.tokens == ar_decode(tiny_qwen35, [7, 8, 9], 12, geometry=geometry).tokens
    cache = simulator.drafter.cache
    assert cache.keys.shape[2] == pdm.cfg.num_kv_heads and cache.values.shape == cache.keys.shape
    capacity = simulator.drafter.capacity
    assert capacity & (capacity - 1) == 0 and capacity >= 3 + 12
    keys = cache.keys.data_ptr()
    simulator.decode([5 + i % 40 for i in range(capacity // 2)], 12)
    assert simulator.drafter.cache.keys.data_ptr() == keys
