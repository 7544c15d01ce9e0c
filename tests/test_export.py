"""Export round trip: the exported directory, the checkpoint and the in-memory PDM give the same logits."""

import json
import os

import pytest
import torch
from kit import SyntheticChat, make_module, make_trainer
from safetensors import safe_open

from spd_lightning import cli
from spd_lightning.export import WEIGHTS_FILE, load_drafter


def test_export_round_trip(tiny_target_dir, tmp_path):
    module = make_module(tiny_target_dir, num_layers=2)
    trainer = make_trainer(tmp_path, max_steps=2, enable_checkpointing=True)
    trainer.fit(module, datamodule=SyntheticChat(num_samples=8))
    ckpt = trainer.checkpoint_callback.last_model_path or trainer.checkpoint_callback.best_model_path
    out = cli.export(["--ckpt", ckpt, "--out", str(tmp_path / "drafter")])

    from_ckpt, ckpt_spec = load_drafter(ckpt)
    from_dir, dir_spec = load_drafter(out)
    assert ckpt_spec.to_dict() == dir_spec.to_dict() == module.drafter_spec().to_dict()
    dir_spec.check_target(module.target.info)
    assert torch.equal(from_dir.d2t, module.pdm.d2t)

    geometry = module.geometry
    gen = torch.Generator().manual_seed(0)
    states = torch.randn(2, 7, geometry.num_types, module.target.hidden_size, generator=gen)
    types = tuple([geometry.type_of(geometry.n)] * 5 + [geometry.type_of(1), geometry.type_of(0)])
    positions = torch.arange(7).expand(2, -1)
    with torch.no_grad():
        want = module.pdm.eval()(states, types, positions)
        torch.testing.assert_close(from_ckpt(states, types, positions), want, rtol=0, atol=0)
        torch.testing.assert_close(from_dir(states, types, positions), want, rtol=0, atol=0)

    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert config["geometry"]["n"] == 2 and config["geometry"]["split"] == [0, 2, 4]
    assert config["pdm"]["num_layers"] == 2 and config["pdm"]["draft_vocab_size"] == 64
    assert config["target"]["name_or_path"] == tiny_target_dir and config["target"]["num_layers"] == 4

    # Float weights (the trained head included) stored in bfloat16 (`--dtype`): half the bytes, cast back on load.
    half = cli.export(["--ckpt", ckpt, "--out", str(tmp_path / "half"), "--dtype", "bfloat16"])
    with safe_open(os.path.join(half, WEIGHTS_FILE), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    assert stored["lm_head.weight"].dtype == torch.bfloat16 and stored["d2t"].dtype == torch.int64
    assert all(v.dtype == torch.bfloat16 for k, v in stored.items() if k != "d2t")
    floats = sum(v.numel() for v in module.pdm.state_dict().values() if v.is_floating_point())
    saved = os.path.getsize(os.path.join(out, WEIGHTS_FILE)) - os.path.getsize(os.path.join(half, WEIGHTS_FILE))
    assert abs(saved - 2 * floats) < 64  # the safetensors header differs by a few bytes
    from_half, _ = load_drafter(half)
    for name, tensor in module.pdm.state_dict().items():
        loaded = from_half.state_dict()[name]
        assert loaded.dtype == tensor.dtype, name
        want = tensor.to(torch.bfloat16).to(tensor.dtype) if tensor.is_floating_point() else tensor
        torch.testing.assert_close(loaded, want, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("under", ["", "drafter"], ids=["a_file", "under_a_file"])
def test_an_out_path_that_cannot_be_a_directory_is_one_line(drafter_dir, tmp_path, capsys, under):
    """`export --out` naming a file, or a path under one: one `error:` line and exit 2 (it was an unexpected
    FileExistsError / NotADirectoryError, exit 1 'a bug')."""
    taken = tmp_path / "taken"
    taken.write_text("")
    out = str(taken / under if under else taken)
    code = cli.run_main(lambda: cli.export_main(["--ckpt", drafter_dir, "--out", out]), False)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: cannot write the drafter to {out!r}: ") and err.count("\n") == 1
