"""Chain speculative decoding with the EAGLE-3 drafter: lossless greedy (== AR) for Qwen3 and Qwen3.5 with a
drafter that is often accepted, one that never is and an oracle (closed form), exact rollback of the verify
forward, TTT == inference drafting, the sampled output distribution, and the speedup formula."""

import functools
import math
import time

import numpy as np
import pytest
import torch
from kit import assert_same_state, make_tiny_model, slot_state

from inference.chain import decoder as chain_decoder
from inference.chain.decoder import ChainResult, chain_decode
from inference.chain.drafter import Draft, Eagle3Runtime
from inference.chain.target import ChainTarget
from inference.cycle.ar import ar_decode
from inference.sampling import Sampling
from spd_lightning.eagle3.model import Eagle3Config, Eagle3Drafter, eagle_feature_layers
from spd_lightning.eagle3.ttt import ttt_outputs, ttt_step_losses, ttt_total
from spd_lightning.target import Target

PROMPTS = [[3, 14, 15, 92, 65, 35], [7, 7, 8], [50, 2, 33, 71]]
NEW = 40


def drafter_for(target: Target, d2t: torch.Tensor, layers, seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    cfg = Eagle3Config(
        target.hidden_size, len(d2t), layers, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64
    )
    return Eagle3Drafter(cfg, d2t)


def right_padded(seqs):
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, : len(s)], mask[b, : len(s)] = torch.tensor(s), 1
    return ids, mask


def train_on_references(target: Target, sequences, layers, steps: int = 100) -> Eagle3Drafter:
    """A drafter trained with TTT on the target's own greedy continuations: often accepted on them."""
    ids, mask = right_padded(sequences)
    features, logits = target.anchor_states(ids, mask, layers)
    drafter = drafter_for(target, torch.arange(target.vocab_size), layers)
    drafter.init_head_from_target(target.lm_head.weight)
    optimizer = torch.optim.Adam(drafter.parameters(), lr=1e-2)
    for _ in range(steps):
        outs = ttt_outputs(drafter, features, ids, target.embed_tokens, 3, dense=True)
        loss = ttt_total(ttt_step_losses(drafter, outs, logits, mask), 0.8)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval()


@functools.cache  # built once per family, whatever order pytest runs the tests in
def build_family(arch: str):
    target = Target(make_tiny_model(arch), f"tiny-{arch}")
    references = [ar_decode(target, p, NEW).tokens for p in PROMPTS]
    layers = eagle_feature_layers(target.num_layers)
    trained = train_on_references(target, [p + r for p, r in zip(PROMPTS, references)], layers)
    return target, references, layers, trained


@pytest.fixture(params=["qwen3", "qwen3_5"])
def family(request):
    return build_family(request.param)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_chain_with_a_trained_drafter_is_ar(family, k):
    target, references, layers, trained = family
    chain_target, runtime = (
        ChainTarget(target, layers, k + 1),
        Eagle3Runtime(trained, target.embed_tokens, Sampling()),
    )
    results = [chain_decode(chain_target, runtime, p, NEW, k) for p in PROMPTS]
    for result, reference in zip(results, references):
        assert result.tokens == reference
        assert sum(result.accept_lengths) == result.N - 1 and max(result.accept_lengths) <= k + 1
    assert sum(r.N - 1 for r in results) / sum(r.K for r in results) > 1 + 0.3 * k  # drafts are often accepted


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.hf_internals
def test_greedy_chain_with_a_never_accepted_drafter_is_ar(family, k):
    target, references, layers, _ = family
    unused = next(t for t in range(target.vocab_size) if all(t not in r for r in references))
    drafter = drafter_for(target, torch.tensor([unused]), layers)  # proposes only a token AR never emits
    chain_target, runtime = (
        ChainTarget(target, layers, k + 1),
        Eagle3Runtime(drafter, target.embed_tokens, Sampling()),
    )
    for prompt, reference in zip(PROMPTS, references):
        result = chain_decode(chain_target, runtime, prompt, NEW, k)
        assert result.tokens == reference
        assert result.K == result.N - 1 and set(result.accept_lengths) == {1}


class OracleDrafter:
    """Drafts the AR continuation itself (the i-th `start` replays the i-th reference): always accepted."""

    def __init__(self, prompt_lens, references):
        self.queue, self.prompt_len, self.reference, self.committed = list(zip(prompt_lens, references)), 0, [], 0

    def start(self, capacity: int) -> None:
        (self.prompt_len, self.reference), self.queue = self.queue[0], self.queue[1:]
        self.committed = 0

    def commit(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        self.committed += features.shape[0]

    def draft(self, k: int, generator) -> Draft:
        index = self.committed + 1 - self.prompt_len  # the newest committed row drafts reference[index]
        return Draft(self.reference[index : index + k], None, torch.zeros(k, 1))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_oracle_drafter_closed_form(family, k):
    target, references, layers, _ = family
    drafter = OracleDrafter([len(p) for p in PROMPTS], references)
    for prompt, reference in zip(PROMPTS, references):
        result = chain_decode(ChainTarget(target, layers, k + 1), drafter, prompt, NEW, k)
        assert result.tokens == reference
        assert result.K == math.ceil((result.N - 1) / (k + 1))
        assert result.accept_lengths[:-1] == [k + 1] * (result.K - 1)


def test_eos_stops_like_ar(family):
    target, references, layers, trained = family
    eos = references[0][NEW // 2]
    expected = ar_decode(target, PROMPTS[0], NEW, eos_token_id=eos)
    result = chain_decode(
        ChainTarget(target, layers, 4),
        Eagle3Runtime(trained, target.embed_tokens, Sampling()),
        PROMPTS[0],
        NEW,
        3,
        eos_token_id=eos,
    )
    assert result.tokens == expected.tokens and result.stop_reason == "eos" == expected.stop_reason


# -- the verify forward's rollback -------------------------------------------------------------------
PROMPT = torch.tensor([PROMPTS[0]])
BLOCK = torch.tensor([[5, 6, 7, 8, 9, 10]])


@pytest.mark.hf_internals
def test_full_rollback_restores_the_cache_bitwise(tiny_target):
    chain_target = ChainTarget(tiny_target, [1, 2, 3], BLOCK.shape[1])
    chain_target.forward(PROMPT, 0)
    before = slot_state(chain_target.cache, 0)
    chain_target.forward(BLOCK, PROMPT.shape[1])
    chain_target.rollback(PROMPT.shape[1])
    assert_same_state(slot_state(chain_target.cache, 0), before)


@pytest.mark.parametrize("accepted", [1, 3, 5])
@pytest.mark.hf_internals
def test_rejected_drafts_leave_no_trace(tiny_target, accepted):
    """Two verify forwards that share their first `accepted` tokens: after rollback, the caches and the
    next forward are bit-identical whatever the rejected tail was."""
    chain_target = ChainTarget(tiny_target, [1, 2, 3], BLOCK.shape[1])
    start, other = PROMPT.shape[1], BLOCK.clone()
    other[0, accepted:] = torch.arange(40, 40 + BLOCK.shape[1] - accepted)
    runs = []
    for block in (BLOCK, other):
        chain_target.reset()
        chain_target.forward(PROMPT, 0)
        chain_target.forward(block, start)
        chain_target.rollback(start + accepted)
        state = slot_state(chain_target.cache, 0)
        runs.append((state, *chain_target.forward(torch.tensor([[20, 21, 22]]), start + accepted)))
    assert_same_state(runs[0][0], runs[1][0])
    assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][2], runs[1][2])
    # ... and the kept cache is AR's (one token at a time), up to float round-off of the batched forward.
    chain_target.reset()
    chain_target.forward(PROMPT, 0)
    for j in range(accepted):
        chain_target.forward(BLOCK[:, j : j + 1], start + j)
    for got, want in zip(runs[0][0], slot_state(chain_target.cache, 0)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# -- training-time test == inference drafting ----------------------------------------------------------
def test_ttt_steps_are_what_chain_drafting_computes(family):
    """Row p's TTT step j, fed the drafts as ground truth, equals the runtime's j-th chain step."""
    target, references, layers, trained = family
    sequence, p, k = PROMPTS[0] + references[0], 10, 3
    ids, mask = right_padded([sequence])
    features, _ = target.anchor_states(ids, mask, layers)
    runtime = Eagle3Runtime(trained, target.embed_tokens, Sampling())
    runtime.start(64)
    runtime.commit(features[0, : p + 1], ids[0, 1 : p + 2])  # rows 0..p
    draft = runtime.draft(k)
    forced = torch.tensor([sequence[: p + 2] + draft.tokens + [0] * 4])
    with torch.no_grad():
        outs = ttt_outputs(trained, features[:, : forced.shape[1]], forced, target.embed_tokens, k)
        for j in range(k):
            torch.testing.assert_close(trained.logits(outs[j][0, p]), draft.logits[j], atol=1e-4, rtol=1e-4)


# -- sampling ---------------------------------------------------------------------------------------
def test_sampled_chain_follows_the_target_distribution():
    from kit import exact_distributions, merged_chisquare

    V, SPROMPT, SAMPLING = 8, [1, 2, 3], Sampling(0.9, top_k=6, top_p=0.95)  # a vocabulary small enough to enumerate

    model = make_tiny_model("qwen3", num_layers=2, vocab_size=V)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.3)  # a spread-out target distribution
    target = Target(model, "tiny-v8")
    layers = [0, 1, 2]
    drafter = drafter_for(target, torch.tensor([0, 2, 3, 5, 6]), layers)
    with torch.no_grad():
        drafter.lm_head.weight.mul_(3.0)  # a draft distribution that clearly differs from the target's
    chain_target, runtime = (
        ChainTarget(target, layers, 3),
        Eagle3Runtime(drafter, target.embed_tokens, SAMPLING),
    )
    runs = 800
    results = [
        chain_decode(chain_target, runtime, SPROMPT, 4, 2, SAMPLING, seed=s, d2t=drafter.d2t) for s in range(runs)
    ]
    taus = [r.accept_lengths[0] for r in results]
    assert min(taus) == 1 and max(taus) == 3 and taus.count(2) > 0  # reject first, reject second, accept both
    outputs = np.array([r.tokens[:3] for r in results])
    joint01, marginal2 = exact_distributions(target, SPROMPT, SAMPLING)
    observed01 = np.bincount(outputs[:, 0] * V + outputs[:, 1], minlength=V * V)
    observed2 = np.bincount(outputs[:, 2], minlength=V)
    assert merged_chisquare(observed01, joint01.flatten().numpy() * runs) > 1e-3
    assert merged_chisquare(observed2, marginal2.numpy() * runs) > 1e-3


def test_measured_costs_of_one_prompt():
    # k = 3, two forwards yielding 3 and 1 tokens; 6 draft steps of 0.1 s, forwards of 1 s. The speedup with the
    # draft cost charged needs T_full from an AR decode: evaluation's cost model (tests/test_costs.py) owns it.
    result = ChainResult(
        3, 5, [1] * 5, [3, 1], "max_new_tokens", draft_s=0.6, verify_s=2.0, draft_steps=6, decode_s=2.6
    )
    assert result.tau == 2.0 and result.draft_over_verify == pytest.approx(0.1)
    assert "S_eagle3" not in result.counters()
    reported = result.to_decode_result()  # what the decode and eval reports hold
    assert (
        reported.K == 2 and reported.counters["tau"] == 2.0 and reported.decode_tokens_per_s == pytest.approx(4 / 2.6)
    )


def test_decode_seconds_are_the_wall_clock_of_the_whole_loop(tiny_qwen3, monkeypatch):
    """decode_s is wall-clock like AR's: judging (and rollbacks) count too, not only the timed draft and verify."""
    target, k, pause = tiny_qwen3, 3, 0.02
    layers = eagle_feature_layers(target.num_layers)
    chain_target = ChainTarget(target, layers, k + 1)
    runtime = Eagle3Runtime(
        drafter_for(target, torch.arange(target.vocab_size), layers), target.embed_tokens, Sampling()
    )
    judge = chain_decoder.judge_chain

    def slow_judge(*args):
        time.sleep(pause)
        return judge(*args)

    monkeypatch.setattr(chain_decoder, "judge_chain", slow_judge)
    result = chain_decode(chain_target, runtime, PROMPTS[0], 8, k)
    assert result.K >= 1
    assert result.to_decode_result().decode_s >= result.draft_s + result.verify_s + result.K * pause


def test_timed_parts_wait_for_the_gpu(monkeypatch):
    """On a GPU a timed draft / verify / commit ends with a device sync (a launch returns before its kernels
    ran); on the CPU nothing is synchronised. The GPU is a monkeypatched `torch.cuda.synchronize`."""
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: events.append(("sync", device)))
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert chain_decoder._timed(cuda, lambda x: events.append(("ran", x)) or x, 5)[0] == 5
    chain_decoder._timed(cpu, lambda: None)
    assert events == [("ran", 5), ("sync", cuda)]


def test_chain_target_loads_from_a_checkpoint_directory(tmp_path):
    model = make_tiny_model("qwen3_5")
    model.save_pretrained(str(tmp_path))
    target = Target(model, "tiny-qwen3_5")
    layers = eagle_feature_layers(target.num_layers)
    chain_target = ChainTarget(Target.load(str(tmp_path)), layers, 4)
    drafter = drafter_for(target, torch.arange(target.vocab_size), layers)
    runtime = Eagle3Runtime(drafter, chain_target.embed_tokens, Sampling())
    for prompt in ([5], PROMPTS[1]):  # a one-token prompt too (AR decoding cannot start from one token yet)
        assert chain_decode(chain_target, runtime, prompt, 12, 3).tokens == greedy_without_cache(target, prompt, 12)


def greedy_without_cache(target: Target, prompt, new: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            ids.append(int(target.model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_decoder_from_exported_files_is_ar(family, tmp_path):
    from inference.chain.decoder import ChainDecoder
    from spd_lightning.eagle3.export import Eagle3Spec, save_eagle3
    from spd_lightning.export import DrafterLoadError

    target, references, layers, trained = family
    target.model.save_pretrained(str(tmp_path / "target"))
    save_eagle3(trained, Eagle3Spec(trained.cfg, target.info), str(tmp_path / "drafter"))
    decoder = ChainDecoder.on_target(Target.load(str(tmp_path / "target")), str(tmp_path / "drafter"), 3)
    result = decoder.decode(PROMPTS[0], NEW)
    assert result.tokens == references[0] and result.tau > 1.5
    make_tiny_model("qwen3", num_layers=2).save_pretrained(str(tmp_path / "other"))
    with pytest.raises(DrafterLoadError, match="mismatch"):
        ChainDecoder.on_target(Target.load(str(tmp_path / "other")), str(tmp_path / "drafter"), 3)
