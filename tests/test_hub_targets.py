"""Targets by hub id: resolved through the Hugging Face cache, offline when cached, one line when not."""

import pytest
from kit import make_tiny_model, random_pdm, save_target

from inference.decode import main
from inference.runtime.stages import meta_target, resolve_target
from spd_lightning.export import DrafterSpec, save_drafter
from spd_lightning.geometry import Geometry
from spd_lightning.target import Target, TargetError

pytestmark = pytest.mark.timeout(120)
REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A Hugging Face cache (the hub's own layout) holding `tiny-org/tiny-qwen` and a drafter trained on it."""
    root = tmp_path_factory.mktemp("hub")
    cache = root / "hub_cache"
    repo = cache / "models--tiny-org--tiny-qwen"
    snapshot = repo / "snapshots" / REVISION
    model = make_tiny_model("qwen3_5")
    save_target(model, str(snapshot))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    target = Target(model, "tiny-org/tiny-qwen")
    geometry = Geometry.build(target.num_layers, 2)
    pdm = random_pdm(target, geometry)
    drafter = save_drafter(pdm, DrafterSpec(pdm.cfg, geometry, target.info), str(root / "drafter"))
    return {"cache": str(cache), "snapshot": str(snapshot), "drafter": drafter}


@pytest.fixture
def cached(hub, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", hub["cache"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return hub


def test_a_cached_hub_id_resolves_to_its_snapshot_offline(cached):
    assert resolve_target("tiny-org/tiny-qwen") == cached["snapshot"]
    assert resolve_target(f"tiny-org/tiny-qwen@{REVISION}") == cached["snapshot"]
    assert meta_target("tiny-org/tiny-qwen").name_or_path == cached["snapshot"]
    assert resolve_target(cached["snapshot"]) == cached["snapshot"]  # a directory is itself


def test_decode_with_the_hub_id_the_drafter_recorded(cached, capsys):
    rc = main(
        [
            "--ckpt",
            cached["drafter"],
            "--prompt",
            "hello world",
            "--max-new-tokens",
            "6",
            "--simulate",
            "--check-lossless",
        ]
    )
    assert rc == 0
    assert "lossless=yes" in capsys.readouterr().out
    rc = main(
        [
            "--ckpt",
            cached["drafter"],
            "--target",
            "tiny-org/tiny-qwen",
            "--prompt",
            "hi",
            "--max-new-tokens",
            "4",
            "--simulate",
        ]
    )
    assert rc == 0


def test_an_uncached_hub_id_offline_is_one_line_naming_it(cached, capsys):
    with pytest.raises(TargetError, match="'tiny-org/absent'.*not in the Hugging Face cache"):
        resolve_target("tiny-org/absent")
    rc = main(["--ckpt", cached["drafter"], "--target", "tiny-org/absent", "--prompt", "hi", "--simulate"])
    err = capsys.readouterr().err
    assert rc == 2 and "tiny-org/absent" in err and len(err.strip().splitlines()) == 1


def test_neither_a_directory_nor_a_hub_id(tmp_path):
    with pytest.raises(TargetError, match="not a local directory nor a hub id"):
        resolve_target(str(tmp_path / "missing"))
