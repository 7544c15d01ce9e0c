"""The planner per batch size for continuous batching (`python -m inference.plan --batch-times`): tokens/s in total
and per request at each B follow from the measured stage and draft step times, the weight-bound reading keeps
B = 1's cycle, bad input is one line; and `scripts/bench_batch.py --json` writes what the planner reads."""

import json
import os
import subprocess
import sys

import pytest
from kit import REPO

from inference.evaluation.plan import main

ROWS = [
    {"B": 1, "alpha": 0.5, "stage_s": [0.010, 0.012], "draft_s": 0.008, "overhead_s": 0.001},
    {"B": 4, "alpha": 0.5, "stage_s": [0.020, 0.018], "draft_s": 0.025, "overhead_s": 0.002},
]


def plan(tmp_path, report, *flags) -> tuple[int, dict]:
    path, out = tmp_path / "batch.json", tmp_path / "plan.json"
    path.write_text(json.dumps(report))
    rc = main(["--batch-times", str(path), "--plot", "", "--json", str(out), *flags])
    return rc, json.loads(out.read_text()) if rc == 0 else {}


def test_tokens_per_second_per_batch_size_follow_the_measured_cycle(tmp_path):
    rc, result = plan(tmp_path, {"rows": ROWS[::-1]})  # any order: the rows come back by B
    assert rc == 0
    one, four = result["batch"]
    assert one["cycle_s"] == pytest.approx(0.012 + 0.001)  # stage-bound: the slowest stage
    assert four["cycle_s"] == pytest.approx(0.025 + 0.002)  # draft-bound
    assert four["per_request_tok_s"] == pytest.approx(0.5 / 0.027)
    assert four["total_tok_s"] == pytest.approx(4 * 0.5 / 0.027)
    assert four["weight_bound_total_tok_s"] == pytest.approx(4 * one["total_tok_s"])
    assert four["weight_bound_per_request_tok_s"] == pytest.approx(one["per_request_tok_s"])
    assert "GPU weight-bound" in result["markdown"] and "Predictions" in result["markdown"]


def test_post_step_adds_the_draft_and_an_alpha_flag_overrides_the_measured_one(tmp_path):
    rc, result = plan(tmp_path, {"rows": ROWS}, "--schedule", "post_step", "--batch-alpha", "0.8")
    assert rc == 0
    assert result["batch"][0]["cycle_s"] == pytest.approx(0.012 + 0.008 + 0.001)
    assert result["batch"][1]["total_tok_s"] == pytest.approx(4 * 0.8 / (0.020 + 0.025 + 0.002))


@pytest.mark.parametrize(
    "report,message",
    [
        ({"rows": []}, "no rows"),
        ({"rows": [{"B": 0, "stage_s": [0.1], "draft_s": 0.1, "alpha": 0.5}]}, "B >= 1"),
        ({"rows": [{"B": 2, "stage_s": [None], "draft_s": 0.1, "alpha": 0.5}]}, "requests >= B"),
        ({"rows": [{"B": 2, "stage_s": [0.1], "draft_s": 0.1}]}, "--batch-alpha"),
        ({"rows": [{"B": 2, "stage_s": [0.1], "draft_s": 0.1, "alpha": 0.5, "overhead_s": "x"}]}, "overhead_s='x'"),
    ],
)
def test_bad_batch_times_are_one_line(tmp_path, capsys, report, message):
    rc, _ = plan(tmp_path, report)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and message in err and len(err.splitlines()) == 1


@pytest.mark.slow  # a subprocess that imports the test kit and decodes at two batch sizes
@pytest.mark.timeout(400)
def test_the_batch_bench_writes_what_the_planner_reads(tmp_path):
    out = tmp_path / "batch_times.json"
    args = ["--layers", "2", "--hidden", "32", "--requests", "2", "--max-new-tokens", "4", "--batch", "1", "2"]
    env = dict(os.environ, PYTHONPATH=REPO)
    script = os.path.join(REPO, "scripts", "bench_batch.py")
    done = subprocess.run([sys.executable, script, *args, "--json", str(out)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [r["B"] for r in report["rows"]] == [1, 2] and {"command", "machine", "date"} <= set(report)
    assert all(len(r["stage_s"]) == report["n"] == 2 and r["draft_s"] > 0 for r in report["rows"])
    rc, result = plan(tmp_path, report)
    assert rc == 0 and [r["B"] for r in result["batch"]] == [1, 2]
