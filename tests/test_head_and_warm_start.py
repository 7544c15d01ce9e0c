"""The draft head's rows are those of the drafted tokens (through `d2t`, never by position), and a warm start copies a
tensor whole or not at all (a shape that differs copies nothing of it, and the log line says so)."""

import logging
from types import SimpleNamespace

import pytest
import torch
from kit import TINY_VOCAB, attach_stub_trainer, random_pdm

from spd_lightning.export import DrafterSpec, load_drafter, save_drafter, seed_from_drafter
from spd_lightning.geometry import Geometry
from spd_lightning.pdm import PDMConfig, PipelineDraftModule
from spd_lightning.training.module import SPDModule

V_D = 40


def scattered_d2t(seed: int = 4) -> torch.Tensor:
    """A sorted draft vocabulary far from `0..V_d-1`, so rows taken by position differ from rows taken by token."""
    d2t = torch.randperm(TINY_VOCAB, generator=torch.Generator().manual_seed(seed))[:V_D].sort().values
    assert not torch.equal(d2t, torch.arange(V_D))
    return d2t


def built_module(target_dir: str, seed: int = 0, **overrides) -> SPDModule:
    """An SPDModule after `setup` and `configure_model` (a stand-in trainer), its PDM drawn from `seed`."""
    args = dict(target=target_dir, target_dtype="float32", n=2, num_layers=1, intermediate_size=48, seed=0)
    module = SPDModule(**{**args, **overrides})
    attach_stub_trainer(module, SimpleNamespace(d2t=scattered_d2t()))
    module.setup("fit")
    torch.manual_seed(seed)
    module.configure_model()
    return module


@pytest.mark.parametrize("head_from_target", [False, True])
def test_the_head_and_the_teacher_are_the_rows_of_the_drafted_tokens(tiny_target_dir, head_from_target):
    module = built_module(tiny_target_dir, head_from_target=head_from_target)
    full = module.target.lm_head.weight.detach()
    rows = full[module.pdm.d2t]
    assert not torch.equal(rows, full[:V_D])  # the test can tell the two apart
    torch.testing.assert_close(module.pdm.lm_head.weight.detach(), rows, rtol=0, atol=0)
    torch.testing.assert_close(module._vd_head().weight, rows, rtol=0, atol=0)  # the teacher's head


def test_the_loader_takes_the_rows_of_the_drafted_tokens(tiny_target, tmp_path):
    geometry = Geometry.build(tiny_target.num_layers, 2)
    source = random_pdm(tiny_target, geometry, draft_vocab=V_D, seed=3, num_layers=1)
    cfg = PDMConfig(**{**source.cfg.to_dict(), "head_from_target": True})
    pdm = PipelineDraftModule(cfg, scattered_d2t())
    out = save_drafter(pdm, DrafterSpec(cfg, geometry, tiny_target.info), str(tmp_path / "drafter"))
    full = tiny_target.lm_head.weight.detach()
    loaded, _ = load_drafter(out, target_head=full)
    torch.testing.assert_close(loaded.lm_head.weight, full[scattered_d2t()], rtol=0, atol=0)


def test_a_tensor_whose_shape_differs_is_not_copied_at_all(tiny_target, tmp_path):
    geometry = Geometry.build(tiny_target.num_layers, 2)
    source = random_pdm(tiny_target, geometry, draft_vocab=V_D, seed=1, num_layers=1)  # intermediate_size 64
    path = save_drafter(source, DrafterSpec(source.cfg, geometry, tiny_target.info), str(tmp_path / "source"))
    narrower = PDMConfig(**{**source.cfg.to_dict(), "intermediate_size": 48})
    torch.manual_seed(7)
    pdm = PipelineDraftModule(narrower, source.d2t)
    before = {k: v.clone() for k, v in pdm.state_dict().items()}
    copied, skipped = seed_from_drafter(pdm, path)
    mlp = {f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    assert mlp <= set(skipped) and not mlp & set(copied)
    for name in mlp:  # untouched, not a slice of the source's
        torch.testing.assert_close(pdm.state_dict()[name], before[name], rtol=0, atol=0)
    for name in copied:
        torch.testing.assert_close(pdm.state_dict()[name], source.state_dict()[name], rtol=0, atol=0)
    assert "layers.0.self_attn.q_proj.weight" in copied  # what agrees is copied


def test_init_from_names_what_it_kept_and_copies_nothing_of_it(tiny_target_dir, tmp_path, caplog):
    wider = built_module(tiny_target_dir, seed=1, intermediate_size=64)
    path = save_drafter(wider.pdm, wider.drafter_spec(), str(tmp_path / "wider"))
    plain = built_module(tiny_target_dir, seed=2)
    with caplog.at_level(logging.INFO):
        warm = built_module(tiny_target_dir, seed=2, init_from=path)
    [line] = [r.getMessage() for r in caplog.records if "warm-started" in r.getMessage()]
    for p in ("gate", "up", "down"):
        name = f"layers.0.mlp.{p}_proj.weight"
        assert name in line.split("kept")[1]
        torch.testing.assert_close(warm.pdm.state_dict()[name], plain.pdm.state_dict()[name], rtol=0, atol=0)
    q = "layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(warm.pdm.state_dict()[q], wider.pdm.state_dict()[q], rtol=0, atol=0)
