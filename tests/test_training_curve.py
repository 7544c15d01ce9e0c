"""`scripts/training_curve.py`: the legs of one drafter become one log whose steps keep counting, and its plot."""

import csv
import json

import pytest
from kit import load_script

curve = load_script("training_curve")


def log(path, rows):
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return str(path)


def val(step, agree):
    return {"step": str(step), "val/loss": "2.0", "val/agree": str(agree)}


def test_a_resumed_leg_keeps_its_steps_and_a_warm_started_one_continues_the_count(tmp_path, capsys):
    first = log(tmp_path / "a.csv", [val(49, 0.1), val(99, 0.2)])
    resumed = log(tmp_path / "b.csv", [val(149, 0.3), {"step": "200", "staircase/alpha": "0.15"}])
    warm = log(tmp_path / "c.csv", [val(49, 0.4), {"step": "99", "train/agree": "0.5"}])  # init_from: from 0 again
    merged = tmp_path / "all.csv"
    assert curve.main([first, resumed, warm, str(tmp_path / "curve.png"), "--csv", str(merged)]) == 0
    rows = list(csv.DictReader(open(merged)))
    assert [int(r["step"]) for r in rows] == [49, 99, 149, 200, 249, 299]
    assert {"staircase/alpha", "train/agree", "val/agree"} <= set(rows[0])  # the union of the legs' columns
    assert (tmp_path / "curve.png").stat().st_size > 0
    table = capsys.readouterr().out
    assert "| 249 | 2.000 | 0.400 |" in table and "| 149 | 2.000 | 0.300 |" in table

    _, starts = curve.join_legs([curve.read_rows(p) for p in (first, resumed, warm)])
    assert starts == [200]  # only the warm-started leg is marked


def test_the_acceptance_of_every_fill_and_the_predicted_n_alpha_are_plotted_and_tabled(tmp_path, capsys):
    fills = {f"val/accept_fill{k}": str(0.3 + k / 100) for k in (1, 2, 10)}
    rows = [{**val(49, 0.2), **fills, "val/predicted_n_alpha": "1.7"}, {"step": "50", "staircase/speedup": "1.6"}]
    assert curve.fill_keys(rows) == ["val/accept_fill1", "val/accept_fill2", "val/accept_fill10"]  # numeric order
    assert curve.main([log(tmp_path / "a.csv", rows), str(tmp_path / "curve.png")]) == 0
    table = capsys.readouterr().out
    assert "| step | loss | agree | predicted_n_alpha | accept_fill1 | accept_fill2 | accept_fill10 |" in table
    assert "| 49 | 2.000 | 0.200 | 1.700 | 0.310 | 0.320 | 0.400 |" in table


def test_until_keeps_the_rows_up_to_the_drafters_step(tmp_path, capsys):
    """A drafter exported from a checkpoint before the run's end: its log and table stop at that step."""
    first = log(tmp_path / "a.csv", [val(49, 0.1), val(99, 0.2)])
    later = log(tmp_path / "b.csv", [val(149, 0.3), val(199, 0.4)])
    merged = tmp_path / "all.csv"
    assert curve.main([first, later, str(tmp_path / "curve.png"), "--csv", str(merged), "--until", "149"]) == 0
    assert [int(r["step"]) for r in csv.DictReader(open(merged))] == [49, 99, 149]
    table = capsys.readouterr().out
    assert "| 149 | 2.000 | 0.300 |" in table and "| 199 |" not in table


def test_walked_held_out_points_join_the_plot_in_step_order(tmp_path, capsys):
    rows = [{**val(49, 0.2), "val/accept_fill1": "0.3", "val/predicted_n_alpha": "1.7"}]
    walked = []
    for step, value in ((200, 1.9), (100, 1.8)):  # given out of order
        path = tmp_path / f"walked{step}.json"
        path.write_text(
            json.dumps({"decode": {"walked": {"n_alpha": value}, "walked_interval": [value - 0.1, value + 0.1]}})
        )
        walked.append(f"{step}={path}")
    assert curve.main([log(tmp_path / "a.csv", rows), str(tmp_path / "curve.png"), "--walked", *walked]) == 0
    out = capsys.readouterr().out
    assert out.index("step 100: held-out n*alpha 1.800 [1.70, 1.90]") < out.index("step 200: held-out n*alpha 1.900")
    with pytest.raises(SystemExit, match="STEP=JSON"):
        curve.main([log(tmp_path / "a.csv", rows), str(tmp_path / "curve.png"), "--walked", "last.json"])
