"""scripts/bench_decode_gpu.py in its smoke mode (tiny shapes, CPU, eager): every section, numbers that
add up, and the planner fed from them."""

import json

import pytest
import torch
from kit import load_script

from inference.runtime.stages import Stage
from spd_lightning.geometry import Geometry


def test_tiny_cpu_smoke_run_writes_consistent_json_and_markdown(tmp_path, capsys):
    """Its `main` in this process; test_gpu_check.py runs the whole script as the GPU check does, in a child."""
    out, md, rows_path = tmp_path / "decode.json", tmp_path / "decode.md", tmp_path / "rows.jsonl"
    argv = ["--tiny", "--device", "cpu", "--no-compile", "--json", str(out), "--md", str(md), "--alpha", "4:2:0.5"]
    assert load_script("bench_decode_gpu").main([*argv, "--rows", str(rows_path)]) == 0
    report = json.loads(out.read_text())["models"]["tiny"]
    stages = {r["stage"]: r for r in report["stages"]}
    assert set(stages) == {"first", "last"} and all(r["ms"] > 0 and not r["captured"] for r in report["stages"])
    assert sorted(r["L_s"] for r in report["drafts"]) == [1, 2, 3, 4]
    [sim] = report["simulator"]
    assert sim["n"] == 4 and sim["K"] >= 1
    assert sim["non_stage_ms"] == pytest.approx(sim["wall_ms"] - sim["stages_ms"])
    assert sim["overhead_ms"] == pytest.approx(sim["non_stage_ms"] - sim["draft_ms"])
    [row] = report["plan"]
    t_full = 4 * stages["first"]["ms"] + stages["last"]["ms"] - stages["first"]["ms"]
    assert (row["n"], row["L_s"], row["alpha"]) == (4, 2, 0.5) and row["t_full_ms"] == pytest.approx(t_full)
    assert row["overhead"] == pytest.approx(max(sim["overhead_ms"], 0.0))
    assert row["speedup"] == pytest.approx(0.5 * t_full / row["cycle"])
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]  # appended as measured
    # the draft line first (every n's plan needs it), then n's stages, its simulator and its cycle row
    assert [r["kind"] for r in rows] == ["decode_draft"] * 4 + ["decode_stage"] * 2 + [
        "decode_simulator",
        "decode_cycle",
    ]
    assert [{k: v for k, v in r.items() if k not in ("kind", "model")} for r in rows[:6]] == [
        *report["drafts"],
        *report["stages"],
    ]
    cycle = rows[-1]
    assert (cycle["n"], cycle["L_s"], cycle["cycle_ms"], cycle["stage_ms"]) == (4, 2, row["cycle"], row["stage"])
    assert cycle["cuda_graphs"] is False and set(cycle["cuda_graphs_skip"]) == {
        "stage first n=4",
        "stage last n=4",
        *(f"draft L_s={k}" for k in (1, 2, 3, 4)),
    }
    text = md.read_text()
    for section in ("stage forward", "PDM draft", "simulator per cycle", "planner"):
        assert f"tiny: {section}" in text
    assert text.strip() in capsys.readouterr().out


def test_weight_bytes_leave_out_the_embedding_table_but_not_the_lm_head():
    """A decode step reads one row of the embedding (stage 1) but the whole LM head (the last stage): the bound
    `weights_ms` counts the bytes a step reads."""
    bench = load_script("bench_decode_gpu")
    target = bench.make_target(bench.SHAPES["tiny"], 2, torch.device("cpu"), torch.float32)
    first, last = (Stage.from_target(target, Geometry.build(2, 2), s) for s in (1, 2))
    size = lambda *modules: sum(4 * p.numel() for m in modules for p in m.parameters())  # noqa: E731 - float32
    assert bench.weight_bytes(first) == size(first.layers)
    assert bench.weight_bytes(last) == size(last.layers, last.norm, last.lm_head)
