"""A PDM whose head is the target's own LM head (`head_from_target`): the head stays the target's rows through
training, the drafter file does not store it, and every loader (in process, the PDM rank) takes it from the
target, so the decoded drafts are those of the trained module; a warm start copies only what means the same."""

import json
import os

import pytest
import torch
from kit import SyntheticChat, make_module, make_trainer, random_pdm
from safetensors import safe_open

from inference import decode
from inference.processes.job import DecodeJob
from inference.processes.roles import load_role
from inference.sampling import Sampling
from inference.serving import server as serve
from spd_lightning.errors import ConfigError
from spd_lightning.export import DrafterLoadError, DrafterSpec, load_drafter, save_drafter, seed_from_drafter
from spd_lightning.geometry import Geometry
from spd_lightning.pdm import PDMConfig, PipelineDraftModule


@pytest.fixture(scope="module")
def trained(micro_target, tmp_path_factory):
    """Three steps of training with the target's head, the checkpoint exported."""
    root = tmp_path_factory.mktemp("head_from_target")
    module = make_module(micro_target, num_layers=1, head_from_target=True)
    trainer = make_trainer(root, max_steps=3)
    trainer.fit(module, datamodule=SyntheticChat(num_samples=12))
    out = str(root / "drafter")
    save_drafter(module.pdm, module.drafter_spec(), out)
    return module, out


def test_head_stays_the_targets_rows_and_is_not_stored(trained):
    module, out = trained
    rows = module.target.lm_head.weight.detach()[module.pdm.d2t]
    assert not module.pdm.lm_head.weight.requires_grad
    torch.testing.assert_close(module.pdm.lm_head.weight.detach(), rows, rtol=0, atol=0)
    assert any(p.requires_grad for p in module.pdm.layers.parameters())  # the rest did train
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys() and "d2t" in f.keys()
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["pdm"]["head_from_target"] is True


def test_loaders_take_the_head_from_the_target(trained, micro_target, tmp_path):
    module, out = trained
    with pytest.raises(DrafterLoadError, match="target_head=") as failure:
        load_drafter(out)
    assert "\n" not in str(failure.value)
    loaded, _ = load_drafter(out, target_head=module.target.lm_head.weight)
    geometry = module.geometry
    states = torch.randn(
        1, 5, geometry.num_types, module.target.hidden_size, generator=torch.Generator().manual_seed(0)
    )
    types, positions = tuple([geometry.type_of(geometry.n)] * 5), torch.arange(5)[None]
    with torch.no_grad():
        want = module.pdm.eval()(states, types, positions)
        torch.testing.assert_close(loaded(states, types, positions), want, rtol=0, atol=0)

    fields = dict(prompts=[], max_new_tokens=1, eos_token_ids=[], vocab_size=1, hidden_size=1, sampling=Sampling())
    job = DecodeJob(target_path=micro_target, drafter_path=out, geometry=geometry, **fields)
    pdm_rank = load_role(job, geometry.n, torch.device("cpu")).pdm  # what the PDM's process loads
    torch.testing.assert_close(pdm_rank.lm_head.weight, module.pdm.lm_head.weight, rtol=0, atol=0)

    report = tmp_path / "decode.json"  # the in-process decoder (`--simulate`), checked against AR
    args = ["--ckpt", out, "--target", micro_target, "--prompt", "Tell me about cats.", "--max-new-tokens", "12"]
    assert decode.main([*args, "--simulate", "--check-lossless", "--json", str(report)]) == 0
    assert json.loads(report.read_text())["totals"]["lossless"]

    serve_args = serve.parse_args(["--ckpt", out, "--target", micro_target, "--simulate"])  # `serve --simulate`
    backend = serve.make_backend(serve.prepared(serve_args), serve_args)
    try:
        torch.testing.assert_close(backend.runner.drafter.pdm.lm_head.weight, pdm_rank.lm_head.weight, rtol=0, atol=0)
    finally:
        backend.close()


def test_a_head_from_target_needs_init_head(tiny_target_dir):
    with pytest.raises(ConfigError, match="needs init_head: true"):
        make_module(tiny_target_dir, head_from_target=True, init_head=False)


def test_warm_start_copies_what_means_the_same(tiny_target, tmp_path):
    geometry = Geometry.build(tiny_target.num_layers, 2, "uniform", "n_scaled", "pre_step", "spd")
    source = random_pdm(tiny_target, geometry, draft_vocab=48, seed=1, num_layers=1)
    path = save_drafter(source, DrafterSpec(source.cfg, geometry, tiny_target.info), str(tmp_path / "source"))

    same = random_pdm(tiny_target, geometry, draft_vocab=48, seed=1, num_layers=1)
    torch.nn.init.zeros_(same.lm_head.weight)
    copied, skipped = seed_from_drafter(same, path)
    assert "lm_head.weight" in copied and skipped == ["d2t"]
    for name, tensor in same.state_dict().items():
        torch.testing.assert_close(tensor, source.state_dict()[name], rtol=0, atol=0)

    # Grown data re-counts the vocabulary: 30 tokens both hold (in another order), 10 only the new one holds.
    fresh = torch.tensor(sorted(set(range(tiny_target.vocab_size)) - set(source.d2t.tolist())))[:10]
    d2t = torch.cat([source.d2t[10:40].flip(0), fresh])
    other_vocab = PipelineDraftModule(PDMConfig(**{**source.cfg.to_dict(), "draft_vocab_size": 40}), d2t)
    head = other_vocab.lm_head.weight.clone()
    copied, skipped = seed_from_drafter(other_vocab, path)
    assert skipped == ["d2t"] and {"lm_head.weight[30/40 rows]", "layers.0.mlp.up_proj.weight"} <= set(copied)
    source_rows = {int(t): row for t, row in zip(source.d2t, source.lm_head.weight)}
    for j, token in enumerate(d2t.tolist()):  # a row is a token: matched by target id, else left as initialised
        expected = source_rows[token] if token in source_rows else head[j]
        torch.testing.assert_close(other_vocab.lm_head.weight[j], expected, rtol=0, atol=0)

    disjoint = PipelineDraftModule(PDMConfig(**{**source.cfg.to_dict(), "draft_vocab_size": 10}), fresh)
    head = disjoint.lm_head.weight.clone()
    copied, skipped = seed_from_drafter(disjoint, path)
    assert set(skipped) == {"d2t", "lm_head.weight"}  # no token in common: nothing of the head is copied
    torch.testing.assert_close(disjoint.lm_head.weight, head, rtol=0, atol=0)
