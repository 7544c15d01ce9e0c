"""Target loading and anchor states (docs/DESIGN.md, "Terms", "Real parts, offline")."""

import pytest
import torch
from kit import make_tiny_model

from spd_lightning.target import Target, TargetError


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "llama"])
@pytest.mark.hf_internals
def test_anchor_states_equal_output_hidden_states(arch):
    model = make_tiny_model(arch)
    target = Target(model)
    ids = torch.randint(1, 90, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # right padding
    layers = [0, 1, 3, 4]
    states, logits = target.anchor_states(ids, mask, layers)
    ref = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert states.shape == (2, 12, 4, 32)
    for j, b in enumerate(layers):
        torch.testing.assert_close(states[:, :, j], ref.hidden_states[b], rtol=0, atol=0)
    torch.testing.assert_close(logits, ref.logits, rtol=0, atol=0)


def test_target_is_frozen_and_described(tiny_target):
    assert not any(p.requires_grad for p in tiny_target.parameters())
    assert not tiny_target.model.training
    info = tiny_target.info
    assert (info.num_layers, info.hidden_size, info.vocab_size) == (4, 32, 97)


def test_out_of_range_layer_is_one_line(tiny_qwen3):
    with pytest.raises(TargetError, match=r"\[7\] are out of range 0..L=4"):
        tiny_qwen3.anchor_states(torch.ones(1, 3, dtype=torch.long), None, [0, 7])


def test_local_round_trip_and_missing_path(tmp_path):
    model = make_tiny_model("qwen3_5")
    model.save_pretrained(tmp_path / "t")
    target = Target.load(str(tmp_path / "t"))
    ids = torch.randint(1, 90, (1, 6))
    torch.testing.assert_close(target.anchor_states(ids, None, [4])[1], model(input_ids=ids).logits)
    with pytest.raises(TargetError, match="does not exist"):
        Target.load(str(tmp_path / "nowhere" / "x"))


@pytest.mark.hf_internals
def test_conditional_generation_checkpoint_loads_text_model(tmp_path):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = make_tiny_model("qwen3_5").config.to_dict()
    cfg = Qwen3_5Config(
        text_config=text,
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32),
    )
    Qwen3_5ForConditionalGeneration(cfg).save_pretrained(tmp_path / "vl")
    target = Target.load(str(tmp_path / "vl"))
    assert target.num_layers == 4 and target.hidden_size == 32
    states, logits = target.anchor_states(torch.randint(1, 90, (1, 5)), None, [0, 4])
    assert states.shape == (1, 5, 2, 32) and logits.shape[-1] == 97


def test_an_unreadable_checkpoint_is_one_line(tmp_path):
    """A target file cut short (a full disk, an interrupted download or copy), a shard its index names that is
    missing, an index that is not JSON, no weights at all: a TargetError naming the file, as the pipeline's ranks
    say (inference/runtime/stages.py), not safetensors' or transformers' own error ('a bug', exit 1) on the paths
    that load the whole target (--simulate, --mode ar, eval, fit, prepare)."""
    model = make_tiny_model("qwen3")
    model.save_pretrained(tmp_path / "cut")
    weights = tmp_path / "cut" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(TargetError, match=r"cut/model.safetensors' cannot be read \(SafetensorError.*truncated"):
        Target.load(str(tmp_path / "cut"))
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    (tmp_path / "sharded" / "model-00002-of-00012.safetensors").unlink()
    with pytest.raises(TargetError, match=r"model-00002-of-00012.safetensors' cannot be read \(FileNotFoundError"):
        Target.load(str(tmp_path / "sharded"))
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(TargetError, match=r"index.json' cannot be read \(JSONDecodeError"):
        Target.load(str(tmp_path / "sharded"))
    model.save_pretrained(tmp_path / "bare")
    (tmp_path / "bare" / "model.safetensors").unlink()
    with pytest.raises(
        TargetError,
        match=r"cannot read the weights of target .*bare. \(OSError: .*download, copy or convert the target again",
    ):
        Target.load(str(tmp_path / "bare"))
