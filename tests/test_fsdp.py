"""FSDP for the drafters (`trainer.strategy: fsdp`): the PDM (or the EAGLE-3 drafter) is sharded, the frozen target
is never wrapped or trained.

Lightning allows its FSDP strategy only on GPUs, torch's FSDP refuses CPU modules unless told the CPU device
explicitly, and Lightning's full state dict offloads to the CPU, which on CPU frees what it copies;
`fsdp_probe.CPUFSDPStrategy` lifts exactly those so two real gloo processes run Lightning's and torch's FSDP code
here (docs/DESIGN.md, "FSDP"): per-layer units, the staircase evaluation, saving and resuming.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kit import REPO, eagle3_fit_args, fit_args

from spd_lightning import cli
from spd_lightning.export import CKPT_KEY


def test_fsdp_resolves_from_a_shipped_config(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(
            [
                "fit",
                "--config",
                os.path.join(REPO, "configs", "qwen35_9b.yaml"),
                "--trainer.strategy",
                "fsdp",
                "--print_config",
            ]
        )
    assert exit_info.value.code == 0 and "strategy: fsdp" in capsys.readouterr().out


def fsdp_fit(target: str, root, *extra: str, eagle3: bool = False) -> list[dict]:
    """A 2-process CPU FSDP `fit` (of the PDM with the staircase evaluation after every step, or of the EAGLE-3
    drafter) with a checkpoint every 2 steps; returns each rank's FSDPProbe report."""
    launched = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")  # from an earlier run
    env = {
        **{k: v for k, v in os.environ.items() if k not in launched},
        "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests")]),
    }
    staircase = (
        "{class_path: callbacks.StaircaseEvaluation, init_args: {every_n_steps: 1, num_prompts: 2, "
        f"max_new_tokens: 4, num_batches: 1, prompts: {os.path.join(REPO, 'docs', 'demo_prompts.jsonl')}}}}}"
    )
    probe = f"{{class_path: fsdp_probe.FSDPProbe, init_args: {{out: {root}}}}}"
    callbacks = f"[{probe}]" if eagle3 else f"[{probe}, {staircase}]"
    args = (eagle3_fit_args if eagle3 else fit_args)(
        target,
        root,
        "--trainer.devices",
        "2",
        "--trainer.accelerator",
        "cpu",
        "--trainer.strategy",
        "{class_path: fsdp_probe.CPUFSDPStrategy}",
        "--trainer.callbacks",
        callbacks,
        "--checkpoint.dirpath",
        str(root / "ckpt"),
        "--checkpoint.every_n_train_steps",
        "2",
        *extra,
    )
    cmd = [sys.executable, "-m", "spd_lightning", "fit", *args]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "gradient_clip_algorithm" not in result.stderr  # configs/tiny.yaml clips gradients, as every config does
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]


def fsdp_fit_and_save(micro_target, tmp_path):
    """Per-layer FSDP units, the staircase evaluation of a sharded PDM and a full checkpoint; returns its path."""
    reports = fsdp_fit(micro_target, tmp_path, "--trainer.max_steps", "2")
    for report in reports:
        assert report["strategy"] == "CPUFSDPStrategy" and report["root_is_fsdp"]
        assert report["fsdp_units"] == 2  # the root (fusion, norm, head) and the one PDM decoder layer
        assert report["staircase_alpha"] and report["global_step"] == 2
        assert not report["target_in_fsdp"] and not report["target_has_fsdp"] and report["target_full"]
        assert not report["target_requires_grad"] and report["sharding"] == ["FULL_SHARD over 2"]
    last = tmp_path / "ckpt" / "last.ckpt"
    saved = torch.load(last, map_location="cpu", weights_only=False)
    assert saved["global_step"] == 2 and CKPT_KEY in saved and saved["optimizer_states"]
    assert all(k.startswith("pdm.") and "_fsdp" not in k for k in saved["state_dict"])  # what `export` reads
    # AdamW decays the matrices, as without FSDP (whose flat shards are 1-D: by shape, nothing was decayed)
    matrices = {k.removeprefix("pdm.") for k, v in saved["state_dict"].items() if v.ndim >= 2}
    for report in reports:
        trainable = set(report["decayed"]) | set(report["undecayed"])
        assert report["decayed"] and set(report["decayed"]) == matrices & trainable
    return last


@pytest.mark.timeout(300)
def test_fsdp_two_cpu_processes_evaluate_and_save(micro_target, tmp_path):
    fsdp_fit_and_save(micro_target, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp_two_cpu_processes_evaluate_save_and_resume(micro_target, tmp_path):
    """The fast test's run, then a resume from its checkpoint (a third and fourth process: slow)."""
    last = fsdp_fit_and_save(micro_target, tmp_path)
    resumed = fsdp_fit(micro_target, tmp_path, "--trainer.max_steps", "4", "--ckpt_path", str(last))
    assert all(r["global_step"] == 3 and r["staircase_alpha"] for r in resumed)  # one epoch is 3 steps per rank


@pytest.mark.slow  # fast: the PDM's FSDP run above (the same strategy, optimizer groups, clipping) and test_eagle3_cli
@pytest.mark.timeout(300)
def test_fsdp_trains_and_saves_the_eagle3_drafter(micro_target, tmp_path):
    """`fit --model Eagle3Module --trainer.strategy fsdp` with the configs' gradient clipping (Lightning's own norm
    clipping refuses FSDP at the first step): two steps, the matrices decayed, a checkpoint `export` reads."""
    reports = fsdp_fit(micro_target, tmp_path, eagle3=True)
    for report in reports:
        assert report["root_is_fsdp"] and report["global_step"] == 2 and report["sharding"] == ["FULL_SHARD over 2"]
        assert not report["target_in_fsdp"] and not report["target_requires_grad"]
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    assert all(k.startswith("drafter.") and "_fsdp" not in k for k in saved["state_dict"])
    matrices = {k.removeprefix("drafter.") for k, v in saved["state_dict"].items() if v.ndim >= 2}
    for report in reports:
        trainable = set(report["decayed"]) | set(report["undecayed"])
        assert report["decayed"] and set(report["decayed"]) == matrices & trainable
    exported = cli.export(["--ckpt", str(tmp_path / "ckpt" / "last.ckpt"), "--out", str(tmp_path / "drafter")])
    assert json.loads((Path(exported) / "config.json").read_text())["kind"] == "eagle3"
