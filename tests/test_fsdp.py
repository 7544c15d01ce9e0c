"""FSDP for the PDM (`trainer.strategy: fsdp`): the PDM is sharded, the frozen target is never wrapped or trained.

Lightning allows its FSDP strategy only on GPUs, and torch's FSDP refuses CPU modules unless told the CPU device
explicitly; `fsdp_probe.CPUFSDPStrategy` lifts exactly those two refusals so two real gloo processes run
Lightning's and torch's FSDP code here (docs/DESIGN.md, "FSDP"). Saving a checkpoint under FSDP on CPU kills
the run (rank 0 segfaults while the ranks gather the optimizer state), so this run saves none; that the target
never enters a checkpoint is structural (it is not a submodule) and tested in test_rehearsal.py.
"""

import json
import os
import subprocess
import sys

import pytest
from kit import fit_args

from spd_lightning import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended")


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


@pytest.mark.timeout(300)
def test_fsdp_two_cpu_processes_shard_the_pdm_and_leave_the_target_alone(micro_target, tmp_path):
    launched = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")  # from an earlier run
    env = {
        **{k: v for k, v in os.environ.items() if k not in launched},
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests")]),
    }
    probe = f"[{{class_path: fsdp_probe.FSDPProbe, init_args: {{out: {tmp_path}}}}}]"
    cmd = [
        sys.executable,
        "-m",
        "spd_lightning",
        "fit",
        *fit_args(
            micro_target,
            tmp_path,
            "--trainer.max_steps",
            "2",
            "--trainer.devices",
            "2",
            "--trainer.accelerator",
            "cpu",
            "--trainer.strategy",
            "{class_path: fsdp_probe.CPUFSDPStrategy}",
            "--trainer.callbacks",
            probe,
            "--checkpoint.save_last",
            "false",
            "--checkpoint.save_top_k",
            "0",
        ),
    ]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "gradient_clip_algorithm" not in result.stderr  # configs/tiny.yaml clips gradients, as every config does
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for report in ranks:
        assert report["strategy"] == "CPUFSDPStrategy" and report["root_is_fsdp"]
        assert not report["target_in_fsdp"] and not report["target_has_fsdp"] and report["target_full"]
        assert not report["target_requires_grad"] and report["sharding"] == ["FULL_SHARD over 2"]
