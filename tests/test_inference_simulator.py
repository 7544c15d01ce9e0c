"""The one-process simulator: lossless greedy decoding, closed forms, the PDM's cached staircase, EOS, and
optimistic execution under exact accept/reject patterns."""

import json

import pytest
import torch
from kit import random_pdm

from inference.cycle.ar import ar_decode
from inference.cycle.result import DecodeResult
from inference.cycle.schedule import PipelineSchedule, Verdict
from inference.cycle.simulator import Simulator, simulate_decode
from inference.runtime.drafter import PDMDrafter
from inference.runtime.replay import ReplayDrafter
from inference.sampling import Sampling
from spd_lightning.geometry import Geometry
from spd_lightning.pdm import PDMConfig, PipelineDraftModule

PROMPTS = [[3, 14, 15, 92, 65, 35], [7, 7, 8]]


@pytest.mark.parametrize("n", [2, 4])
def test_greedy_spd_is_token_identical_to_ar(tiny_target, n):
    geometry = Geometry.build(tiny_target.num_layers, n)
    simulator = Simulator(tiny_target, random_pdm(tiny_target, geometry), geometry)
    for prompt in PROMPTS:
        reference = ar_decode(tiny_target, prompt, 24)
        result = simulator.decode(prompt, 24)
        assert result.tokens == reference.tokens
        assert result.N == 24 and n <= result.K <= n * (result.N - 1)
        assert sum(result.counters["accepted_by_fill"]) + sum(result.counters["rejected_by_fill"]) == result.N - 1


def test_llama_target_is_lossless():
    from kit import make_tiny_model

    from spd_lightning.target import Target

    target = Target(make_tiny_model("llama"), "tiny-llama")
    geometry = Geometry.build(target.num_layers, 3)
    result = simulate_decode(target, random_pdm(target, geometry), geometry, PROMPTS[0], 16)
    assert result.tokens == ar_decode(target, PROMPTS[0], 16).tokens


@pytest.mark.parametrize("schedule,features", [("post_step", "spd"), ("post_step", "first_stage")])
def test_post_step_and_ppsd_are_lossless(tiny_qwen35, schedule, features):
    geometry = Geometry.build(tiny_qwen35.num_layers, 3, schedule=schedule, features=features)
    result = simulate_decode(tiny_qwen35, random_pdm(tiny_qwen35, geometry, num_layers=1), geometry, PROMPTS[0], 20)
    assert result.tokens == ar_decode(tiny_qwen35, PROMPTS[0], 20).tokens
    assert result.mode == ("ppsd" if features == "first_stage" else "post_step")


@pytest.mark.parametrize("n", [2, 3, 4])
def test_closed_forms_with_a_real_target(tiny_qwen35, n):
    geometry = Geometry.build(tiny_qwen35.num_layers, n)
    references = [ar_decode(tiny_qwen35, p, 16).tokens for p in PROMPTS]
    for policy, expected_K in (("oracle", lambda N: N + n - 2), ("adversary", lambda N: n * (N - 1))):
        simulator = Simulator(tiny_qwen35, ReplayDrafter(references, policy, tiny_qwen35.vocab_size), geometry)
        for prompt, reference in zip(PROMPTS, references):
            result = simulator.decode(prompt, 16)
            assert result.tokens == reference
            assert result.K == expected_K(result.N)


def test_pdm_cache_computes_the_explicit_staircase(tiny_qwen35):
    """Drafting with the cached verified prefix gives exactly the PDM forward over the explicit view."""
    n = 3
    geometry = Geometry.build(tiny_qwen35.num_layers, n)
    pdm = random_pdm(tiny_qwen35, geometry, num_layers=2)
    drafter = PDMDrafter(pdm, geometry, tiny_qwen35.embed_tokens, torch.float32, 1)
    g = torch.Generator().manual_seed(0)
    T, H, m = 14, tiny_qwen35.hidden_size, geometry.num_types
    tokens = torch.randint(0, tiny_qwen35.vocab_size, (T,), generator=g)
    states = torch.randn(T, m, H, generator=g)
    with torch.no_grad():
        states[:, 0] = tiny_qwen35.embed_tokens(tokens)
    prompt_len = 4
    drafter.start(0, tokens[:prompt_len][None], T + 1, Sampling(1.0), seed=0)
    for s in range(1, n + 1):
        drafter.store_anchors(
            0, s, 0, states[:, [i for i, b in enumerate(geometry.anchors) if b > 0 and geometry.stage_of_layer(b) == s]]
        )
    for t, fill in zip(range(prompt_len, T - 1), [1, 2, 3, 3, 1, 2, 3, 2, 3]):
        for p in range(prompt_len, t + 1):
            drafter.set_token(0, p, int(tokens[p]))
        view = geometry.view(t, fill)
        q = drafter.draft({0: view[-fill:]}).q[0]
        explicit = torch.stack([states[p] * (torch.arange(m) < geometry.type_of(d))[:, None] for d, p in view])[None]
        types = tuple(geometry.type_of(d) for d, _ in view)
        with torch.no_grad():
            logits = pdm(explicit, types, torch.arange(t + 1)[None])[0, -1]
        assert torch.allclose(q, torch.softmax(logits, -1), atol=1e-5), (t, fill)


def test_eos_ends_the_output_like_ar(tiny_qwen3):
    geometry = Geometry.build(tiny_qwen3.num_layers, 2)
    free = ar_decode(tiny_qwen3, PROMPTS[0], 20).tokens
    eos = free[5]
    cut = free.index(eos)
    for eos_id in (eos, [eos, 10_000]):
        result = simulate_decode(
            tiny_qwen3, random_pdm(tiny_qwen3, geometry), geometry, PROMPTS[0], 20, eos_token_id=eos_id
        )
        assert result.tokens == free[: cut + 1] == ar_decode(tiny_qwen3, PROMPTS[0], 20, eos_token_id=eos_id).tokens
        assert result.stop_reason == "eos"


def test_sampling_is_reproducible_per_seed(tiny_qwen35):
    geometry = Geometry.build(tiny_qwen35.num_layers, 2)
    simulator = Simulator(tiny_qwen35, random_pdm(tiny_qwen35, geometry), geometry, Sampling(1.0, top_k=20, top_p=0.9))
    runs = [simulator.decode(PROMPTS[1], 16, seed=s).tokens for s in (0, 0, 1)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_timing_breakdown_has_one_row_per_cycle(tiny_qwen3):
    geometry = Geometry.build(tiny_qwen3.num_layers, 2)
    result = simulate_decode(tiny_qwen3, random_pdm(tiny_qwen3, geometry), geometry, PROMPTS[0], 8, profile=True)
    per_cycle = result.timing["per_cycle"]
    assert len(per_cycle["wall_s"]) == len(per_cycle["draft_s"]) == len(per_cycle["stage_compute_s"]) == result.K
    assert all(len(row) == 2 for row in per_cycle["stage_compute_s"])
    assert result.timing["totals"]["draft_s"] > 0
    restored = DecodeResult.from_dict(json.loads(json.dumps(result.to_dict())))  # what the JSON report carries
    assert (restored.tokens, restored.K, restored.counters, restored.alpha) == (
        result.tokens,
        result.K,
        result.counters,
        result.alpha,
    )


def test_mismatched_pdm_is_refused(tiny_qwen3):
    geometry = Geometry.build(tiny_qwen3.num_layers, 2)
    wrong = PipelineDraftModule(PDMConfig(tiny_qwen3.hidden_size, geometry.num_types + 1, 16, 32, head_dim=8))
    with pytest.raises(ValueError, match="aggregation types"):
        Simulator(tiny_qwen3, wrong, geometry)


def logical_run(geometry, max_new_tokens, prompt_len, reference, pattern, eos=frozenset()):
    """K and counters of the logical schedule when the draft at each position is right as `pattern` says."""
    schedule = PipelineSchedule(geometry, max_new_tokens, eos)
    plan = schedule.begin(Verdict.FIRST, reference[0], prompt_len=prompt_len)
    while plan is not None:
        if plan.judged_position < 0:
            plan = schedule.begin(Verdict.NONE, -1)
            continue
        index = plan.judged_position - prompt_len
        right = pattern[index % len(pattern)] == "R"
        plan = schedule.begin(Verdict.ACCEPT if right else Verdict.REJECT, reference[index])
    return schedule.K, schedule.counters.to_dict()


@pytest.mark.parametrize("n,kind", [(2, "pre_step"), (3, "pre_step"), (4, "pre_step"), (3, "post_step")])
@pytest.mark.hf_internals
def test_optimistic_steps_roll_back_exactly(tiny_qwen35, n, kind):
    """Rejections right after a refill (WW), after accepts (RRW), at the last verdict: AR's tokens and the
    logical schedule's K and counters, both when the stages skip the wasted optimistic steps and when they
    run them, as distributed stage ranks do when the verdict arrives late (the hybrid target restores its
    linear-attention states from the snapshot ring)."""
    geometry = Geometry.build(tiny_qwen35.num_layers, n, schedule=kind)
    references = [ar_decode(tiny_qwen35, p, 20).tokens for p in PROMPTS]
    seen = torch.zeros(2, n, dtype=torch.long)  # accepted / rejected by fill, over every run
    for pattern in ("RWW", "RRW", "WRRRW"):
        expected = [logical_run(geometry, 20, len(p), r, pattern) for p, r in zip(PROMPTS, references)]
        for _, counters in expected:
            seen += torch.tensor([counters["accepted_by_fill"], counters["rejected_by_fill"]])
        for replay in (False, True):
            drafter = ReplayDrafter(references, pattern, tiny_qwen35.vocab_size)
            simulator = Simulator(tiny_qwen35, drafter, geometry, replay_wasted_work=replay)
            for prompt, reference, (K, counters) in zip(PROMPTS, references, expected):
                result = simulator.decode(prompt, 20)
                assert result.tokens == reference and (result.K, result.counters) == (K, counters), (pattern, replay)
    assert seen[1, 0] > 0 and seen[1, n - 1] > 0 and seen[0].sum() > 0  # rejects right after refills and at fill n


@pytest.mark.parametrize("right_at_eos", [True, False])
def test_an_eos_verdict_ends_an_optimistic_step(tiny_qwen3, right_at_eos):
    """EOS accepted while the next step already runs, or EOS as the correction: the output ends there."""
    n, pattern = 3, "RRW"
    geometry = Geometry.build(tiny_qwen3.num_layers, n)
    reference = ar_decode(tiny_qwen3, PROMPTS[0], 30).tokens
    i = next(
        i
        for i in range(n + 1, len(reference))
        if reference[i] not in reference[:i] and (pattern[i % len(pattern)] == "R") == right_at_eos
    )
    eos = reference[i]
    for replay in (False, True):
        drafter = ReplayDrafter([reference], pattern, tiny_qwen3.vocab_size)
        result = Simulator(tiny_qwen3, drafter, geometry, replay_wasted_work=replay).decode(
            PROMPTS[0], 30, eos_token_id=eos
        )
        assert result.tokens == reference[: i + 1] == ar_decode(tiny_qwen3, PROMPTS[0], 30, eos_token_id=eos).tokens
        assert (result.K, result.counters) == logical_run(
            geometry, 30, len(PROMPTS[0]), reference, pattern, frozenset({eos})
        )
