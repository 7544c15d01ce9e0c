"""Stages and their caches: same math as the HF model, exact rollback, per-rank loading of own weights only."""

import json

import pytest
import torch
from kit import assert_same_state, hf_logits, make_tiny_model, save_target, slot_state

from inference.runtime.stages import Stage, load_pieces
from spd_lightning.geometry import Geometry
from spd_lightning.target import Target, TargetError

# tiny models run fastest single-threaded
pytestmark = pytest.mark.hf_internals


def run_through(stages, ids, start):
    """The stages in sequence on slot 0: the prefill at `start` 0, else one token; the last stage's logits."""
    x = torch.tensor([ids]) if start == 0 else torch.tensor([[ids[0]]])
    for stage in stages:
        if start == 0:
            x, _, logits = stage.prefill(0, x, 64)
        else:
            out = stage.step(x, {0: start})
            x, logits = out.hidden, None if out.logits is None else out.logits[0]
    return logits


@pytest.mark.parametrize("n", [1, 2, 3])
def test_stages_in_sequence_are_the_hf_model(tiny_target, n):
    geometry = Geometry.build(tiny_target.num_layers, n)
    stages = [Stage.from_target(tiny_target, geometry, s) for s in range(1, n + 1)]
    ids = [5, 17, 3, 44, 9, 81, 2]
    reference = hf_logits(tiny_target, ids)
    assert torch.allclose(run_through(stages, ids[:4], 0), reference[3], atol=1e-5)
    for i in range(4, len(ids)):  # then one token at a time through the caches
        assert torch.allclose(run_through(stages, ids[i : i + 1], i), reference[i], atol=1e-5)


def test_anchor_states_are_hf_hidden_states(tiny_qwen35):
    geometry = Geometry.build(4, 2, anchors=[0, 1, 2, 3, 4])
    stages = [Stage.from_target(tiny_qwen35, geometry, s) for s in (1, 2)]
    ids = torch.tensor([[5, 17, 3, 44]])
    hidden = tiny_qwen35.model(ids, output_hidden_states=True).hidden_states
    hidden1, anchors1, _ = stages[0].prefill(0, ids, 8)
    _, anchors2, _ = stages[1].prefill(0, hidden1, 8)
    assert stages[0].anchor_layers == (1, 2) and stages[1].anchor_layers == (3, 4)  # anchor 0: the PDM embeds itself
    got = torch.cat([anchors1, anchors2], dim=1)
    want = torch.stack([hidden[b][0] for b in (1, 2, 3, 4)], dim=1)
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_rollback_is_bit_exact(arch):
    """Run a, b, c, then d1..d4 (to be rejected; n = 4 is the most a rejection discards on stage 1: the n - 1
    younger in-flight tokens plus the draft it ran optimistically): rolling back equals a run that never
    saw them, and decoding on after the rollback equals decoding on that run."""
    target = Target(make_tiny_model(arch), arch)
    geometry = Geometry.build(4, 4)  # one layer per stage; window n+1 = 5 snapshots
    stage_a = [Stage.from_target(target, geometry, s) for s in range(1, 5)]
    stage_b = [Stage.from_target(target, geometry, s) for s in range(1, 5)]
    prompt, kept, discarded, after = [3, 9, 27], [81, 5], [11, 12, 13, 14], [40, 41]
    for stages in (stage_a, stage_b):
        run_through(stages, prompt, 0)
        for i, t in enumerate(kept):
            run_through(stages, [t], len(prompt) + i)
    clean = [slot_state(s.cache, 0) for s in stage_b]
    keep = len(prompt) + len(kept)
    for i, t in enumerate(discarded):
        run_through(stage_a, [t], keep + i)
    for s in stage_a:
        s.cache.rollback(0, keep)
    for restored, fresh in zip([slot_state(s.cache, 0) for s in stage_a], clean):
        assert_same_state(restored, fresh)
    if arch == "qwen3_5":
        assert any(s.cache.linear_layers for s in stage_a)
    for i, t in enumerate(after):
        assert torch.equal(run_through(stage_a, [t], keep + i), run_through(stage_b, [t], keep + i))


def test_a_rank_loads_only_its_own_stage(tmp_path):
    model = make_tiny_model("qwen3_5")
    save_target(model, str(tmp_path))
    target = Target(model, str(tmp_path))
    geometry = Geometry.build(4, 2)
    loaded = Stage.load(str(tmp_path), geometry, 2)
    in_memory = Stage.from_target(target, geometry, 2)
    assert loaded.embed_tokens is None and loaded.lm_head is not None
    for (name, a), (_, b) in zip(loaded.state_dict().items(), in_memory.state_dict().items()):
        assert torch.equal(a, b), name
    pieces = load_pieces(str(tmp_path), range(0, 2), embed=True, head=False)
    assert set(pieces.layers) == {0, 1} and pieces.lm_head is None
    assert torch.equal(pieces.embed_tokens.weight, model.get_input_embeddings().weight)
    ids = torch.tensor([[4, 8, 15, 16]])
    first = Stage.load(str(tmp_path), geometry, 1)
    hidden = first.prefill(0, ids, 8)[0]
    assert torch.allclose(loaded.prefill(0, hidden, 8)[2], hf_logits(target, ids[0].tolist())[-1], atol=1e-5)


def test_incomplete_checkpoint_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    save_target(make_tiny_model("qwen3"), str(tmp_path))
    weights = load_file(str(tmp_path / "model.safetensors"))
    save_file(
        {k: v for k, v in weights.items() if ".layers.3." not in k},
        str(tmp_path / "model.safetensors"),
        metadata={"format": "pt"},
    )
    Stage.load(str(tmp_path), Geometry.build(4, 2), 1)  # stage 1 never reads layer 3
    with pytest.raises(TargetError, match="layers.3"):
        Stage.load(str(tmp_path), Geometry.build(4, 2), 2)


def test_a_truncated_checkpoint_is_one_line(tmp_path):
    """A target file cut short (a full disk, an interrupted download) or a shard its index names that is missing:
    a TargetError naming the file (a rank's input error: exit 2), not safetensors' own error (exit 1, 'a bug')."""
    save_target(make_tiny_model("qwen3"), str(tmp_path / "cut"))
    weights = tmp_path / "cut" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(TargetError, match=r"model.safetensors' cannot be read \(SafetensorError.*truncated"):
        Stage.load(str(tmp_path / "cut"), Geometry.build(4, 2), 1)
    save_target(make_tiny_model("qwen3"), str(tmp_path / "sharded"))
    (tmp_path / "sharded" / "model.safetensors").unlink()
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(TargetError, match=r"model-00001-of-00002.safetensors' cannot be read"):
        load_pieces(str(tmp_path / "sharded"), range(0), embed=True, head=False)


def test_a_checkpoint_without_safetensors_is_one_line(tmp_path):
    """A target saved in another weight format (pytorch_model.bin): the ranks say they read safetensors only."""
    save_target(make_tiny_model("qwen3"), str(tmp_path))
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(TargetError, match=r"has no model.safetensors \(or index\): .* safetensors checkpoints only"):
        Stage.load(str(tmp_path), Geometry.build(4, 2), 1)


def test_tied_heads_and_prefixed_checkpoints_load(tmp_path):
    """A tied LM head is read from the embedding; `model.language_model.*` keys (Qwen3.5 conditional-generation
    checkpoints) map onto the text model."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tied = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=50,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=True,
        )
    ).eval()
    tied.save_pretrained(tmp_path / "tied")
    assert not any(k.startswith("lm_head") for k in load_file(str(tmp_path / "tied" / "model.safetensors")))
    last = Stage.load(str(tmp_path / "tied"), Geometry.build(2, 2), 2)
    assert torch.equal(last.lm_head.weight, tied.get_input_embeddings().weight)

    model = make_tiny_model("qwen3_5")
    save_target(model, str(tmp_path / "prefixed"))
    file = str(tmp_path / "prefixed" / "model.safetensors")
    weights = load_file(file)
    save_file(
        {k.replace("model.", "model.language_model.", 1): v for k, v in weights.items()},
        file,
        metadata={"format": "pt"},
    )
    stage = Stage.load(str(tmp_path / "prefixed"), Geometry.build(4, 2), 1)
    assert torch.equal(stage.layers[1].mlp.up_proj.weight, model.model.layers[1].mlp.up_proj.weight)
