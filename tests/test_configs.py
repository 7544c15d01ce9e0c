"""The shipped target configs: their "Run:" line prepares the data on the CPUs before `fit` starts any rank."""

import os
import re

import pytest
from kit import REPO

TARGET_CONFIGS = ["qwen35_9b", "qwen35_4b", "qwen3_8b"]


@pytest.mark.parametrize("name", TARGET_CONFIGS)
def test_run_line_prepares_with_several_processes_then_fits(name):
    with open(os.path.join(REPO, "configs", f"{name}.yaml")) as f:
        [run] = [line for line in f if line.startswith("# Run:")]
    config = f"--config configs/{name}.yaml"
    commands = [c.strip() for c in run.removeprefix("# Run:").split("&&")]
    assert len(commands) == 2, run
    prepare, fit = commands
    assert prepare.startswith(f"python -m spd_lightning prepare {config}"), run
    assert int(re.search(r"--data\.num_proc (\d+)", prepare).group(1)) > 1, run
    assert fit == f"python -m spd_lightning fit {config}", run
