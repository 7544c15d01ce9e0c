"""Smoke tests of the benchmark scripts on a micro target: each runs end to end and writes what the docs quote.

The benchmarks themselves never run here (docs/BENCHMARKS.md has their commands); these prove the
commands work: `scripts/bench_paper.py` trains, evaluates and tabulates a real run, `scripts/bench_train_step.py`
times a real training step, `scripts/sharegpt_heldout.py` writes prompts no training run reads. Each script's
`main` runs in the test's process (the runs it launches are still their own processes); the whole-script run of
`bench_paper.py`, every step through a fresh interpreter and the planner checked against a real pipeline, is slow.
"""

import json
import os
import shlex
import subprocess
import sys

import pytest
from kit import REPO, load_script

pytestmark = pytest.mark.timeout(480)


def _script(name: str, *args: str, cwd: str = REPO) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", name), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=220,
    )


@pytest.fixture
def in_repo(monkeypatch):
    """What `_script` gives a child: the repository as the working directory and on the path (one thread: conftest)."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("PYTHONPATH", REPO)


def bench_paper(capsys, *argv: str) -> tuple[int, str, str]:
    """`scripts/bench_paper.py ARGV` in this process: its exit code, stdout and stderr."""
    code = load_script("bench_paper").main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def tiny_fit_extra(micro_target, tmp_path) -> str:
    return shlex.join(
        [
            "--model.target",
            micro_target,
            "--data.sources",
            "[{path: sharegpt, max_samples: 100}]",
            "--data.max_length",
            "1024",
            "--data.draft_vocab_size",
            "256",
            "--data.batch_size",
            "2",
            "--data.val_size",
            "4",
            "--data.cache_dir",
            str(tmp_path / "cache"),
            "--trainer.max_steps",
            "2",
            "--trainer.val_check_interval",
            "2",
            "--trainer.log_every_n_steps",
            "1",
            "--trainer.enable_progress_bar",
            "false",
        ]
    )


def two_prompts(tmp_path):
    prompts = tmp_path / "set_question.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in ("hello world", "the cat sat")))
    return prompts


def trained_run(root) -> dict:
    """spd_n2_L3's train.json, checked: the 2 steps ran and the command names the run's geometry."""
    trained = json.loads((root / "spd_n2_L3" / "train.json").read_text())
    assert trained["exit"] == 0 and trained["steps"] == 2 and 0 <= trained["val/agree"] <= 1
    assert "--model.n 2 --model.num_layers 3" in trained["command"]
    return trained


def evaluated_run(root) -> dict:
    report = json.loads((root / "spd_n2_L3" / "eval" / "eval.json").read_text())
    assert (report["n"], report["L_s"], report["mode"]) == (2, 3, "spd")
    return report


def tables_files(tmp_path):
    """A markdown file whose marked region `table` replaces, and the plot's path."""
    out, png = tmp_path / "tables.md", tmp_path / "tables.png"
    out.write_text("# Numbers\n\n<!-- paper-tables:begin -->\nold\n<!-- paper-tables:end -->\n\nkept\n")
    return out, png


def check_tables(out, png, report: dict, trained: dict) -> dict:
    """The run's row (its greedy alpha), the missing run and the command are in the region, nothing else changed;
    returns the greedy overall result."""
    text = out.read_text()
    greedy = next(r for r in report["results"] if r["set"] == "overall" and r["temperature"] == 0)
    assert "| spd_n2_L3 | spd | 2 | 3 | depth | n_scaled | 2 |" in text and f"| {greedy['alpha']:.3f} |" in text
    assert "Not run: spd_n4_L1" in text and trained["command"] in text
    assert text.startswith("# Numbers\n") and text.endswith("\n\nkept\n") and "old" not in text  # only the region
    assert png.read_bytes()[:4] == b"\x89PNG"
    return greedy


def test_bench_paper_trains_evaluates_and_tabulates_a_run(micro_target, tmp_path, in_repo, capsys):
    """One run through train, eval, table and alphas (the slow whole-script test also trains a second run and
    checks the planner against the real pipeline)."""
    prompts, root = two_prompts(tmp_path), tmp_path / "bench"
    common = ["--root", str(root), "--config", os.path.join(REPO, "configs", "bench_tiny.yaml")]
    extra = tiny_fit_extra(micro_target, tmp_path)
    code, out, err = bench_paper(capsys, "train", "spd_n2_L3", *common, "--extra", extra)
    assert code == 0, out[-2000:] + err[-2000:]
    assert "python -m spd_lightning fit --config" in out  # the command is printed before it runs
    trained = trained_run(root)

    code, out, err = bench_paper(
        capsys, "eval", "spd_n2_L3", *common, "--sets", str(prompts), "--limit", "2", "--max-new-tokens", "6"
    )
    assert code == 0, out[-2000:] + err[-2000:]
    report = evaluated_run(root)

    out, png = tables_files(tmp_path)
    code, _, err = bench_paper(capsys, "table", "--root", str(root), "--out", str(out), "--png", str(png))
    assert code == 0, err[-2000:]
    greedy = check_tables(out, png, report, trained)

    code, _, _ = bench_paper(capsys, "alphas", "--root", str(root), "--out", str(tmp_path / "alphas.json"))
    assert code == 0 and json.loads((tmp_path / "alphas.json").read_text()) == {"2,3": greedy["alpha"]}


# Slow: test_bench_paper_trains_evaluates_and_tabulates_a_run runs the same steps through `main` in this process;
# the planner check (`plancheck`, n + 1 gloo processes per run) is this test's alone.
@pytest.mark.slow
def test_the_whole_bench_paper_script_trains_evaluates_tabulates_and_checks_the_planner(micro_target, tmp_path):
    prompts, root = two_prompts(tmp_path), tmp_path / "bench"
    extra = tiny_fit_extra(micro_target, tmp_path)
    common = ["--root", str(root), "--config", os.path.join(REPO, "configs", "bench_tiny.yaml")]
    done = _script("bench_paper.py", "train", "spd_n2_L3", "spd_n4_L1", *common, "--extra", extra)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "python -m spd_lightning fit --config" in done.stdout  # the command is printed before it runs
    trained = trained_run(root)

    done = _script(
        "bench_paper.py", "eval", "spd_n2_L3", *common, "--sets", str(prompts), "--limit", "2", "--max-new-tokens", "6"
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = evaluated_run(root)

    out, png = tables_files(tmp_path)
    done = _script("bench_paper.py", "table", "--root", str(root), "--out", str(out), "--png", str(png))
    assert done.returncode == 0, done.stderr[-2000:]
    greedy = check_tables(out, png, report, trained)

    done = _script("bench_paper.py", "alphas", "--root", str(root), "--out", str(tmp_path / "alphas.json"))
    assert done.returncode == 0 and json.loads((tmp_path / "alphas.json").read_text()) == {"2,3": greedy["alpha"]}

    # the planner, calibrated on one real multi-process run, predicts another (n and L_s both differ)
    done = _script(
        "bench_paper.py",
        "plancheck",
        "--root",
        str(root),
        "--calibration",
        "spd_n4_L1",
        "--checks",
        "spd_n2_L3",
        "--sets",
        str(prompts),
        "--limit",
        "1",
        "--max-new-tokens",
        "6",
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = {
        line.split(" | ")[0].strip("| "): line.split(" | ")
        for line in (root / "pipeline" / "plan_check.md").read_text().splitlines()
        if line.startswith("| spd_")
    }
    assert set(rows) == {"spd_n4_L1 (calibration)", "spd_n2_L3"}
    predicted, measured = float(rows["spd_n4_L1 (calibration)"][4]), float(rows["spd_n4_L1 (calibration)"][5])
    assert predicted >= measured * 0.99  # the calibration reproduces its own cycle (more only if overhead clips at 0)
    pipeline = json.loads((root / "pipeline" / "spd_n2_L3" / "eval.json").read_text())
    assert pipeline["simulate"] is False and [r["temperature"] for r in pipeline["results"]] == [0.0, 0.0]


def test_bench_paper_rejects_an_unknown_run(tmp_path, capsys):
    code, _, err = bench_paper(capsys, "train", "spd_n3_L9", "--root", str(tmp_path))
    assert code == 2 and err.startswith("error: unknown run 'spd_n3_L9'")
    assert len(err.splitlines()) == 1  # one line, no traceback


def test_the_deep_suite_names_its_runs_and_trains_equal_wall_clock_from_measured_times(tmp_path, capsys):
    code, out, _ = bench_paper(capsys, "commands", "spd_n8_L3", "--suite", "deep", "--root", str(tmp_path))
    fit = shlex.split(out.splitlines()[0])
    assert code == 0 and fit[fit.index("--config") + 1] == "configs/bench_deep.yaml"
    assert fit[fit.index("--model.n") + 1] == "8" and fit[fit.index("--model.num_layers") + 1] == "3"
    code, _, err = bench_paper(capsys, "commands", "type_n4_L3_wall", "--suite", "deep", "--root", str(tmp_path))
    assert code == 2 and err.startswith("error: train spd_n4_L3 first")
    # depth took 30 min for 200 steps, type 20 min for 200: type gets 30 min at 0.1 min per step = 300 steps
    for name, minutes in (("spd_n4_L3", 30.0), ("type_n4_L3", 20.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.json").write_text(json.dumps({"steps": 200, "minutes": minutes}))
    code, out, _ = bench_paper(capsys, "commands", "type_n4_L3_wall", "--suite", "deep", "--root", str(tmp_path))
    fit = shlex.split(out.splitlines()[0])
    assert fit[fit.index("--trainer.max_steps") + 1] == "300" and fit[fit.index("--model.layout") + 1] == "type"
    code, _, err = bench_paper(capsys, "train", "spd_n4_L1", "--suite", "deep", "--root", str(tmp_path))
    assert code == 2 and "in suite 'deep'" in err


def test_bench_train_step_times_a_real_step(micro_target, tmp_path, in_repo, capsys):
    out = tmp_path / "steps.json"
    load_script("bench_train_step").main(
        [
            "--target",
            micro_target,
            "--layouts",
            "depth",
            "type",
            "--seq-lens",
            "32",
            "--batch-size",
            "1",
            "--steps",
            "2",
            "--threads",
            "1",
            "--json",
            str(out),
            "--markdown",
        ]
    )
    rows = json.loads(out.read_text())
    assert [(r["layout"], r["T"]) for r in rows] == [("depth", 32), ("type", 32)]
    for r in rows:
        assert 0 < r["target_forward_s"] < r["step_s"] and r["tokens_per_s"] == pytest.approx(32 / r["step_s"])
        assert r["backend"] == "dense" and r["peak_rss_mb"] >= r["rss_before_step_mb"] > 0
    # depth: one copy per depth 0..n (n = 4); type: one copy per aggregation type some view uses (at most n + 1)
    assert rows[0]["replicated_len"] == 5 * 32 and rows[1]["replicated_len"] in (32, 64, 96, 128, 160)
    assert "| depth | 32 | 1 |" in capsys.readouterr().out


def _record(*user: str) -> dict:
    return {
        "conversations": [
            turn for text in user for turn in ({"from": "human", "value": text}, {"from": "gpt", "value": "ok"})
        ]
    }


def test_sharegpt_heldout_drops_prompts_equal_by_content_to_a_training_prompt():
    heldout = load_script("sharegpt_heldout")
    records = [_record("test"), _record("hi", "write a  poem"), _record(" test\n"), _record("write a poem")]
    records += [_record("tell me\ta joke"), _record("tell me a joke"), _record("hi there")]
    # record 2 repeats record 0 (whitespace), 3 record 1's second user turn, 5 the pick 4 (whitespace)
    assert heldout.heldout_prompts(records, 2, 2, 600) == [(4, "tell me\ta joke"), (6, "hi there")]
    with pytest.raises(SystemExit, match="only 2 usable prompts"):
        heldout.heldout_prompts(records, 2, 3, 600)


def test_sharegpt_heldout_after_15000_training_records(tmp_path):
    out = tmp_path / "heldout.jsonl"
    load_script("sharegpt_heldout").main(["--skip", "15000", "--count", "40", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["question_id"] for r in rows] == list(range(40)) and min(r["record"] for r in rows) >= 15000
    from spd_lightning.data.sharegpt import load_embedded_sharegpt

    heldout = load_script("sharegpt_heldout")
    training = load_embedded_sharegpt(max_samples=15000)
    keys = {heldout.content_key(m) for i, r in enumerate(training) for m in heldout.user_messages(r, i)}
    assert "test" in keys and 15010 not in [r["record"] for r in rows]  # record 15,010 is "test", as 2,669 is
    assert not keys & {heldout.content_key(r["turns"][0]) for r in rows}


def test_repetition_counts_repeated_4grams(micro_target, tmp_path, in_repo, capsys):
    from inference.evaluation.repetition import repeated_kgrams

    assert repeated_kgrams([1, 2, 3, 4, 1, 2, 3, 4, 1, 2]) == (3, 7)  # 1234 2341 3412 4123, then 3 repeats
    assert repeated_kgrams([1, 2, 3, 4, 5, 6]) == (0, 3) and repeated_kgrams([1, 2]) == (0, 0)
    prompts = tmp_path / "set.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in ("hello world", "the cat sat", "unused")))
    code, out, err = bench_paper(
        capsys,
        "repetition",
        "--root",
        str(tmp_path / "bench"),
        "--target",
        micro_target,
        "--sets",
        str(prompts),
        "--limit",
        "2",
        "--max-new-tokens",
        "8",
    )
    assert code == 0, out[-2000:] + err[-2000:]
    row = next(line for line in out.splitlines() if line.startswith("| set.jsonl"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "2" and 0 <= float(cells[3]) <= 1


def test_bench_cycle_profiles_the_real_pipeline(micro_target, tmp_path, in_repo, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["hello world"]}) + "\n")
    out = tmp_path / "profile.json"
    bench_cycle = load_script("bench_cycle")
    argv = ["--target", micro_target, "--prompts", str(prompts), "--n", "2", "--max-new-tokens", "6"]
    assert bench_cycle.main([*argv, "--label", "smoke", "--json", str(out)]) == 0
    capsys.readouterr()
    assert bench_cycle.main(["--table", str(out), "--png", str(tmp_path / "profile.png")]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "| smoke |" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert "2" in cells and (tmp_path / "profile.png").read_bytes()[:4] == b"\x89PNG"
