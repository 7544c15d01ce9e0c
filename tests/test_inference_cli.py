"""`python -m inference.decode`: the happy paths (simulator, processes, AR, a Lightning .ckpt) and bad input."""
import json
import subprocess
import sys

import pytest
import torch

from conftest import make_tiny_model
from spd_lightning.export import CKPT_KEY, DrafterSpec, save_drafter
from spd_lightning.geometry import Geometry
from inference.decode import main
from inference.launch import DecodeJob, TooFewDevices, launch
from test_inference_support import one_thread, random_pdm, save_target, target_dir  # noqa: F401 - autouse fixture

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    path, target = target_dir(tmp_path_factory, "qwen3_5", make_tiny_model)
    geometry = Geometry.build(target.num_layers, 2)
    pdm = random_pdm(target, geometry)
    spec = DrafterSpec(pdm.cfg, geometry, target.info)
    drafter = save_drafter(pdm, spec, str(root / "drafter"))
    ckpt = root / "last.ckpt"  # what the Lightning module writes: the drafter description + pdm.* weights
    torch.save({CKPT_KEY: spec.to_dict(), "state_dict": {f"pdm.{k}": v for k, v in pdm.state_dict().items()}}, ckpt)
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"turns": ["hello world"]}\n\n{"turns": ["the cat sat on the mat", "ignored"]}\n')
    long_prompt = root / "long.jsonl"
    long_prompt.write_text(json.dumps({"turns": [" ".join(["cat"] * 600)]}) + "\n")
    other = str(root / "other_target")  # 6 layers: a drafter trained on the 4-layer target does not fit it
    save_target(make_tiny_model("qwen3_5", num_layers=6), other)
    corrupt = root / "corrupt.ckpt"
    corrupt.write_bytes(b"not a checkpoint at all")
    truncated = root / "truncated"
    save_drafter(pdm, spec, str(truncated))
    weights = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    return {"target": path, "drafter": drafter, "ckpt": str(ckpt), "prompts": str(prompts), "long": str(long_prompt),
            "other": other, "corrupt": str(corrupt), "truncated": str(truncated), "root": root}


def test_simulated_decode_writes_the_report(files, capsys):
    out = files["root"] / "report.json"
    rc = main(["--ckpt", files["drafter"], "--prompts", files["prompts"], "--max-new-tokens", "12", "--simulate",
               "--check-lossless", "--profile", "--json", str(out)])
    assert rc == 0
    assert "lossless=yes" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["mode"] == "spd" and report["n"] == 2 and report["totals"]["lossless"] is True
    first = report["prompts"][0]
    for key in ("tokens", "text", "N", "K", "alpha", "theoretical_speedup", "accepted_by_fill", "rejected_by_fill",
                "accepted_by_depth", "rejected_by_depth", "timing", "lossless", "prompt_len"):
        assert key in first, key
    assert first["N"] == len(first["tokens"]) == 12 and first["alpha"] == pytest.approx(12 / first["K"])
    assert first["theoretical_speedup"] == pytest.approx(2 * first["alpha"])
    assert set(first["timing"]["per_cycle"]) == {"stage_compute_s", "draft_s", "verify_s", "comm_s", "wall_s"}
    assert report["totals"]["alpha"] == pytest.approx(report["totals"]["N"] / report["totals"]["K"])


def test_multi_process_decode_from_a_lightning_checkpoint(files, capsys):
    out = files["root"] / "dist.json"
    rc = main(["--ckpt", files["ckpt"], "--prompt", "hello world", "--max-new-tokens", "10", "--check-lossless",
               "--json", str(out), "--timeout", "60"])
    assert rc == 0
    captured = capsys.readouterr()
    assert "prompt 1: N=10" in captured.err and "lossless=yes" in captured.out
    assert json.loads(out.read_text())["simulate"] is False


def test_ar_mode_needs_no_drafter(files, capsys):
    assert main(["--ckpt", "none", "--target", files["target"], "--mode", "ar", "--prompt", "hello",
                 "--max-new-tokens", "5"]) == 0
    assert "mode=ar" in capsys.readouterr().out


def test_sampling_options_run(files, capsys):
    assert main(["--ckpt", files["drafter"], "--prompt", "hello", "--max-new-tokens", "6", "--simulate",
                 "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "3", "--mode", "post_step"]) == 0
    assert "mode=post_step" in capsys.readouterr().out


BAD = {
    "empty prompt": (["--prompt", "   "], "empty"),
    "prompt longer than the context": (["--prompts", "{long}"], "context is 512"),
    "drafter/target mismatch": (["--prompt", "hi", "--target", "{other}"], "drafter/target mismatch"),
    "corrupt checkpoint": (["--prompt", "hi", "--ckpt", "{corrupt}"], "corrupt"),
    "truncated drafter weights": (["--prompt", "hi", "--ckpt", "{truncated}"], "corrupt"),
    "missing checkpoint": (["--prompt", "hi", "--ckpt", "{root}/nope.ckpt"], "does not exist"),
    "negative temperature": (["--prompt", "hi", "--temperature", "-0.5"], "temperature"),
    "top-p zero": (["--prompt", "hi", "--top-p", "0"], "top_p"),
    "top-p above one": (["--prompt", "hi", "--top-p", "1.5"], "top_p"),
    "negative top-k": (["--prompt", "hi", "--top-k", "-1"], "top_k"),
    "zero new tokens": (["--prompt", "hi", "--max-new-tokens", "0"], "max-new-tokens"),
    "spd without a drafter": (["--prompt", "hi", "--ckpt", "none", "--target", "{target}", "--mode", "spd"], "needs a drafter"),
    "ppsd on an spd drafter": (["--prompt", "hi", "--mode", "ppsd"], "features"),
    "missing prompts file": (["--prompts", "{root}/none.jsonl"], "does not exist"),
    "no prompt at all": ([], "exactly one"),
    "lossless check while sampling": (["--prompt", "hi", "--temperature", "1", "--check-lossless"], "greedy"),
    "cuda without a GPU": (["--prompt", "hi", "--device", "cuda"], "CUDA"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_without_traceback(files, capsys, case):
    args, message = BAD[case]
    argv = ["--ckpt", files["drafter"], "--simulate"] + [a.format(**files) for a in args]
    if case == "cuda without a GPU" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(argv) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_debug_shows_the_traceback(files):
    with pytest.raises(Exception, match="temperature"):
        main(["--ckpt", files["drafter"], "--prompt", "hi", "--temperature", "-1", "--debug"])


def test_the_process_exits_non_zero_with_one_line(files):
    proc = subprocess.run([sys.executable, "-m", "inference.decode", "--ckpt", files["corrupt"], "--prompt", "hi"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip().startswith("error:") and "Traceback" not in proc.stderr


def test_too_few_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    job = DecodeJob("unused", Geometry.build(8, 4).to_dict(), [[1]], 4, [], 10, 8, {}, device="cuda")
    with pytest.raises(TooFewDevices, match="need 5 GPUs, 2 are visible"):
        launch(job)


def test_the_decoder_deploys_without_training_code():
    """SPEC 10: importing every decoder module pulls in neither Lightning nor the LightningModule."""
    code = ("import sys, pkgutil, importlib, inference\n"
            "for m in pkgutil.iter_modules(inference.__path__): importlib.import_module('inference.' + m.name)\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning') or m == 'spd_lightning.module']\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
