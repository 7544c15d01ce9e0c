"""Lossless decoding with a drafter that is accepted most of the time (docs/DESIGN.md, "The decode schedule", "Lossless").

A random PDM is almost never accepted, so the pipeline rarely runs at deep fill levels with the live
`PDMDrafter`. Here the target is made nearly a bigram model (its attention and MLP outputs are scaled
down, so the next token depends mostly, not only, on the current one) and the PDM is built to reproduce
that bigram: its type projections pass the embedding anchor through (plus a small term from the deeper
anchors, so the depth at which each token is read matters), its head is the target's LM head, and its
own layers add a small context-dependent term. It agrees with the target's argmax most of the
time, and rejections still happen, so every fill level 1..n is reached and the refill path runs too.

Every draft of the live `PDMDrafter` is instrumented by wrapping its public methods (production
behaviour unchanged): the view the pipeline passed must be the staircase `Geometry.view(t, a)` and the
logits it computed must equal a plain PDM forward over that explicit view, built from the target states
of a full HF forward of the tokens in flight at that moment.
"""

from unittest import mock

import pytest
import torch
from kit import agreeing_pdm, nearly_bigram_target

from inference.cycle.ar import ar_decode
from inference.cycle.simulator import Simulator
from inference.runtime.drafter import PDMDrafter
from inference.sampling import Sampling, warp
from spd_lightning.geometry import Geometry
from spd_lightning.target import Target

PROMPTS = [[3, 14, 15, 92, 65, 35], [7, 7, 8], [40, 2]]
TOKENS = 40


class DraftSpy:
    """Records, for every `PDMDrafter.draft`, the view, the tokens the drafter holds at that moment and the
    logits it computed; the real methods run unchanged."""

    def __init__(self):
        self.tokens: list[int] = []
        self.drafts: list[tuple[list, list[int], torch.Tensor, torch.Tensor | None]] = []
        self.real = {name: getattr(PDMDrafter, name) for name in ("start", "set_token", "draft")}

    def start(self, drafter, slot, prompt_ids, capacity, sampling, seed):
        self.tokens = prompt_ids.flatten().tolist() + [-1] * capacity
        return self.real["start"](drafter, slot, prompt_ids, capacity, sampling, seed)

    def set_token(self, drafter, slot, position, token):
        self.tokens[position] = int(token)
        return self.real["set_token"](drafter, slot, position, token)

    def draft(self, drafter, views, rows=None):
        captured = []
        hook = drafter.pdm.lm_head.register_forward_hook(lambda m, i, out: captured.append(out.detach().clone()))
        try:
            drafts = self.real["draft"](drafter, views, rows)
        finally:
            hook.remove()
        ((slot, view),) = views.items()  # one slot: batch 1
        token, q = drafts.tokens[slot], None if drafts.q is None else drafts.q[slot].clone()
        t = view[-1][1]
        self.drafts.append((list(view), self.tokens[: t + 1], captured[-1][slot], q))
        self.tokens[t + 1] = int(token)
        return drafts

    def patches(self):
        return [
            mock.patch.object(PDMDrafter, name, autospec=True, side_effect=getattr(self, name))
            for name in ("start", "set_token", "draft")
        ]


def explicit_logits(target: Target, pdm, geometry: Geometry, tokens: list[int], view_full) -> torch.Tensor:
    with torch.no_grad():
        hidden = target.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        states = torch.stack([hidden[b][0] for b in geometry.anchors], dim=1)  # [t + 1, m, H]
        types = tuple(geometry.type_of(d) for d, _ in view_full)
        g = states[[i for _, i in view_full]][None]
        return pdm(g, types, torch.tensor([[i for _, i in view_full]]))[0, -1]


def decode_with_spy(target, pdm, geometry, sampling, prompts, seed=0):
    spy = DraftSpy()
    patches = spy.patches()
    for p in patches:
        p.start()
    try:
        simulator = Simulator(target, pdm, geometry, sampling)
        results = [simulator.decode(prompt, TOKENS, seed=seed + i) for i, prompt in enumerate(prompts)]
    finally:
        for p in patches:
            p.stop()
    return results, spy


def check_drafts_read_the_staircase(spy, target, pdm, geometry, sampling) -> set[int]:
    fills = set()
    for view, tokens, logits, q in spy.drafts:
        t, fill = view[-1][1], len(view)
        full = geometry.view(t, fill)
        assert view == full[-fill:], (t, fill)  # the in-flight part of the staircase, at its depths
        want = explicit_logits(target, pdm, geometry, tokens, full)
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4, msg=lambda m: f"t={t} fill={fill}: {m}")  # noqa: B023
        if q is not None:
            torch.testing.assert_close(q, warp(want, sampling), atol=1e-5, rtol=1e-4)
        fills.add(fill)
    return fills


CASES = [("qwen3", 4, "pre_step"), ("qwen3_5", 3, "pre_step"), ("qwen3", 4, "post_step")]


@pytest.mark.parametrize("arch,n,schedule", CASES)
def test_greedy_with_an_accepted_drafter(arch, n, schedule):
    context = 0.1
    target = nearly_bigram_target(arch, context)
    geometry = Geometry.build(target.num_layers, n, schedule=schedule)
    pdm = agreeing_pdm(target, geometry, context)
    results, spy = decode_with_spy(target, pdm, geometry, Sampling(), PROMPTS)
    accepted = torch.tensor([r.counters["accepted_by_fill"] for r in results]).sum(0)
    rejected = torch.tensor([r.counters["rejected_by_fill"] for r in results]).sum(0)
    for prompt, result in zip(PROMPTS, results):
        assert result.tokens == ar_decode(target, prompt, TOKENS).tokens
    assert (accepted > 0).all(), accepted.tolist()  # every fill level 1..n produced accepted drafts
    assert rejected.sum() > 0 and accepted.sum() >= 0.7 * (accepted.sum() + rejected.sum()), (accepted, rejected)
    assert check_drafts_read_the_staircase(spy, target, pdm, geometry, Sampling()) == set(range(1, n + 1))


@pytest.mark.parametrize("arch,n", [("qwen3", 4), ("qwen3_5", 2)])
def test_sampling_with_an_accepted_drafter(arch, n):
    """Sampled decoding: the drafts' q is the warped explicit view, every fill is reached and accepted, and
    every generated token lies in the support of the warped target given its prefix."""
    context = 0.1
    sampling = Sampling(0.7, top_k=12, top_p=0.95)
    target = nearly_bigram_target(arch, context)
    geometry = Geometry.build(target.num_layers, n)
    pdm = agreeing_pdm(target, geometry, context)
    results, spy = decode_with_spy(target, pdm, geometry, sampling, PROMPTS[:2], seed=3)
    accepted = torch.tensor([r.counters["accepted_by_fill"] for r in results]).sum(0)
    rejected = torch.tensor([r.counters["rejected_by_fill"] for r in results]).sum(0)
    assert (accepted > 0).all() and rejected.sum() > 0, (accepted, rejected)
    assert check_drafts_read_the_staircase(spy, target, pdm, geometry, sampling) == set(range(1, n + 1))
    for prompt, result in zip(PROMPTS, results):
        with torch.no_grad():
            logits = target.model(torch.tensor([prompt + result.tokens])).logits[0, len(prompt) - 1 : -1]
        allowed = warp(logits, sampling)
        assert (allowed[torch.arange(result.N), torch.tensor(result.tokens)] > 0).all()
