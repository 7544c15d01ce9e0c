"""Tests that bite on the batched state: every slot's logits are a plain forward's, and a slot's caches after a
rollback or a reuse are exactly a fresh cache's (attention keys/values and the Gated DeltaNet conv and recurrent
states of the tiny hybrid Qwen3.5 target), at B = 1 and B = 3.

Comparing only tokens hides a wrong state on the tiny random target: a neighbour's linear-attention state moves a
logit by less than the gap between its top two. So the logits of every row are held to a plain Hugging Face
forward of the same sequence, and the states to a fresh cache's, bit for bit."""

import pytest
import torch
from kit import assert_same_state, random_pdm, slot_state

from inference.cycle.ar import ar_decode
from inference.cycle.simulator import Simulator
from inference.cycle.slots import Request
from inference.runtime.stages import Stage
from inference.sampling import Sampling
from spd_lightning.geometry import Geometry

CAPACITY = 64
LOGIT_TOLERANCE = 1e-4  # the clean code differs from a plain forward by 6e-7 here (float32, 2-core CPU, 2026-12-02)


class Pipe:
    """The target's stages over `B` slots, run in sequence on one token per slot."""

    def __init__(self, target, geometry: Geometry, B: int):
        self.B = B
        self.stages = [Stage.from_target(target, geometry, s, B) for s in range(1, geometry.n + 1)]

    def prefill(self, slot: int, ids: list[int]) -> None:
        x = torch.tensor([ids])
        for stage in self.stages:
            x, _, _ = stage.prefill(slot, x, CAPACITY)

    def step(self, tokens: dict[int, int]) -> None:
        """One token per slot in `tokens` (slot -> token id), each at its slot's next position."""
        ids = torch.zeros(self.B, 1, dtype=torch.long)
        for b, token in tokens.items():
            ids[b, 0] = token
        x = ids
        for stage in self.stages:
            positions = {b: stage.cache.lengths[b] for b in tokens}
            x = stage.step(x, positions).hidden

    def rollback(self, slot: int, keep: int) -> None:
        for stage in self.stages:
            stage.cache.rollback(slot, keep)

    def state(self, slot: int) -> list[torch.Tensor]:
        """Slot `slot`'s caches over every stage."""
        return [tensor for stage in self.stages for tensor in slot_state(stage.cache, slot)]


NEIGHBOUR = ([5, 6, 7, 8], [40, 41, 42, 43, 44, 45])  # slot 0's prompt and tokens, beside the slot under test
PROMPT, TOKENS = [3, 14, 15, 92], [65, 35, 89, 79, 32]


def neighbours(B: int, step: int) -> dict[int, int]:
    """What the other slots run in `step`: slot 0 its own sequence (B > 1)."""
    return {0: NEIGHBOUR[1][step]} if B > 1 else {}


@pytest.mark.parametrize("B", [1, 3])
def test_a_rolled_back_slot_holds_exactly_a_fresh_caches_state(tiny_qwen35, B):
    """A slot runs 5 tokens beside a neighbour, rolls the last 2 back: its caches are exactly those of a slot that
    ran only the first 3 (the same steps beside the same neighbour), and the next token leaves both alike."""
    geometry = Geometry.build(tiny_qwen35.num_layers, 2)
    slot = B - 1
    rolled, fresh = Pipe(tiny_qwen35, geometry, B), Pipe(tiny_qwen35, geometry, B)
    for pipe in (rolled, fresh):
        if B > 1:
            pipe.prefill(0, NEIGHBOUR[0])
        pipe.prefill(slot, PROMPT)
    for i, token in enumerate(TOKENS):
        rolled.step({**neighbours(B, i), slot: token})
        if i < 3:
            fresh.step({**neighbours(B, i), slot: token})
    rolled.rollback(slot, len(PROMPT) + 3)
    assert_same_state(rolled.state(slot), fresh.state(slot))
    rolled.step({slot: 7})
    fresh.step({slot: 7})
    assert_same_state(rolled.state(slot), fresh.state(slot))


@pytest.mark.parametrize("B", [1, 3])
def test_a_reused_slot_starts_from_exactly_a_fresh_caches_state(tiny_qwen35, B):
    """A slot that decoded one request and then takes another holds exactly what a fresh slot holds after the
    second request's prefill and tokens: nothing of the first request is left."""
    geometry = Geometry.build(tiny_qwen35.num_layers, 2)
    slot = B - 1
    reused, fresh = Pipe(tiny_qwen35, geometry, B), Pipe(tiny_qwen35, geometry, B)
    reused.prefill(slot, [9, 9, 9, 9, 9, 9, 9])
    for token in TOKENS:
        reused.step({slot: token})
    for pipe in (reused, fresh):
        pipe.prefill(slot, PROMPT)
    assert_same_state(reused.state(slot), fresh.state(slot))
    for pipe in (reused, fresh):
        pipe.step({slot: TOKENS[0]})
        pipe.step({slot: TOKENS[1]})
    assert_same_state(reused.state(slot), fresh.state(slot))


class LastStageLogits:
    """Records every row the last stage runs: (the slot's prompt, the position, its logits)."""

    def __init__(self, simulator: Simulator):
        self.rows: list[tuple[tuple[int, ...], int, torch.Tensor]] = []
        stage, step = simulator.stages[simulator.n], simulator.stages[simulator.n].step

        def recording(inputs, tokens):
            out = step(inputs, tokens)
            for b, position in tokens.items():
                prompt = tuple(simulator.slots[b].request.prompt_ids)
                self.rows.append((prompt, position, out.logits[b].clone()))
            return out

        stage.step = recording


def test_every_batched_row_has_a_plain_forwards_logits(tiny_qwen35):
    """B = 3, four requests (one joins a freed slot), greedy and sampled, a drafter that is often wrong (rejections
    roll slots back): every logit row the last stage produced equals a plain Hugging Face forward of that slot's
    sequence up to that position."""
    geometry = Geometry.build(tiny_qwen35.num_layers, 3)
    simulator = Simulator(tiny_qwen35, random_pdm(tiny_qwen35, geometry, num_layers=1), geometry, max_batch=3)
    recorder = LastStageLogits(simulator)
    prompts = [[3, 14, 15, 92, 65], [7, 7, 8], [5], [11, 12, 13, 14, 15, 16]]
    samplings = [Sampling(), Sampling(1.0, top_k=20), Sampling(), Sampling(0.8)]
    requests = [Request(p, 14, sampling=s, seed=i) for i, (p, s) in enumerate(zip(prompts, samplings))]
    results = simulator.run(requests)
    assert sum(sum(r.counters["rejected_by_fill"]) for r in results) > 0  # slots were rolled back
    assert results[0].tokens == ar_decode(tiny_qwen35, prompts[0], 14).tokens
    sequences = {tuple(p): list(p) + r.tokens for p, r in zip(prompts, results)}
    worst = 0.0
    with torch.no_grad():
        plain = {p: tiny_qwen35.model(torch.tensor([s])).logits[0] for p, s in sequences.items()}
    for prompt, position, logits in recorder.rows:
        worst = max(worst, float((logits - plain[prompt][position]).abs().max()))
    assert len(recorder.rows) > 40 and worst < LOGIT_TOLERANCE, worst
