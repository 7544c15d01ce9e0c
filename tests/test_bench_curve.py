"""The training-budget curve of `scripts/bench_paper.py` (scripts/paper_bench/curve*.py, budget.py): checkpoints at
loss-token budgets that survive a resume, the report (table, plot, the paper's-ratio verdicts) from stored rows,
and, slow, the whole chain on the micro target: state cache, fits, evaluations, report, and reruns that redo
nothing."""

import json
import os
import shlex
import sys

import pytest
import torch
from kit import REPO, load_script, make_tiny_model, target_dir

from inference.cycle.result import DecodeResult
from inference.evaluation.rows import eagle3_row, pdm_row

pytestmark = pytest.mark.timeout(600)

sys.path.insert(0, os.path.join(REPO, "scripts"))
from paper_bench.budget import BudgetCheckpoints, read_reached  # noqa: E402


def _fit(budgets, dirpath, root, ckpt_path=None, max_steps=100) -> int:
    """A one-weight LightningModule whose batches carry 6 loss tokens each; returns the steps it ran."""
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, batch_idx):
            return (self.w - batch["x"].mean()) ** 2

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = [{"x": torch.ones(2), "loss_mask": torch.tensor([True, True, True, False])}] * 200
    loader = torch.utils.data.DataLoader(data, batch_size=2)  # 2 samples x 3 loss tokens
    trainer = pl.Trainer(
        max_steps=max_steps,
        callbacks=[BudgetCheckpoints(budgets, str(dirpath))],
        default_root_dir=str(root),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(), loader, ckpt_path=ckpt_path)
    return trainer.global_step


def test_budget_checkpoints_save_at_each_budget_stop_after_the_last_and_resume_counting(tmp_path):
    budgets = tmp_path / "budgets"
    assert _fit([10], budgets, tmp_path) == 2  # 6, 12 >= 10: saved at step 2, then stopped
    assert read_reached(str(budgets)) == {10: {"step": 2, "loss_tokens": 12}}
    # resumed from the budget's checkpoint with one more budget: the count goes on from 12 (18, 24, 30 >= 25)
    assert _fit([10, 25], budgets, tmp_path, ckpt_path=str(budgets / "budget_10.ckpt")) == 5
    assert read_reached(str(budgets)) == {10: {"step": 2, "loss_tokens": 12}, 25: {"step": 5, "loss_tokens": 30}}
    assert sorted(os.listdir(budgets)) == ["budget_10.ckpt", "budget_25.ckpt", "budgets.json"]
    with pytest.raises(ValueError, match="budgets="):
        BudgetCheckpoints([], str(budgets))


def _pdm(mode: str, n: int, tokens: int, K: int) -> list[DecodeResult]:
    """Four prompts of `tokens` tokens in K or K + 1 cycles, 0.01 s of draft per cycle (AR: 0.1 s per token, so
    r = 0.1 on every prompt)."""
    return [
        DecodeResult(
            mode=mode,
            n=n,
            prompt_len=3,
            tokens=[1] * tokens,
            K=K + i % 2,
            stop_reason="length",
            decode_s=1.0,
            timing={"totals": {"draft_s": 0.01 * (K + i % 2), "wall_s": 1.0}},
        )
        for i in range(4)
    ]


def _eagle3(k: int) -> list[DecodeResult]:
    timing = {"totals": {"draft_s": 0.01 * k * 4, "verify_s": 0.4, "draft_steps": 4 * k}}
    counters = {"accept_lengths": [2, 1, 2, 1]}
    one = DecodeResult(
        mode="eagle3", n=1, prompt_len=3, tokens=[1] * 7, K=4, stop_reason="length", timing=timing, counters=counters
    )
    return [DecodeResult(**{**one.__dict__, "decode_s": 0.8}) for _ in range(4)]


def _store(root, name: str, budget: int, results: list[dict], eagle3: list[dict], protocol: str = "") -> None:
    where = {"set": "overall", "path": None, "temperature": 0.0}
    report = {"results": [{**where, **r} for r in results], "eagle3_results": [{**where, **r} for r in eagle3]}
    out = root / name / f"eval_{budget}{protocol}"
    out.mkdir(parents=True)
    (out / "eval.json").write_text(json.dumps(report))
    reached = root / name / "budgets" / "budgets.json"
    before = json.loads(reached.read_text()) if reached.exists() else {}
    reached.parent.mkdir(parents=True, exist_ok=True)
    reached.write_text(json.dumps({**before, str(budget): {"step": budget // 100, "loss_tokens": budget + 7}}))


def test_the_curve_report_from_stored_rows(tmp_path_factory, tmp_path, capsys):
    target, _ = target_dir(tmp_path_factory, "qwen3", make_tiny_model)
    root = tmp_path / "root"
    ar = [DecodeResult(mode="ar", n=1, prompt_len=3, tokens=[1] * 11, K=11, stop_reason="length", decode_s=1.0)] * 4
    for budget, spd_tokens in ((1000, 12), (2000, 16), (3000, 9), (4000, 8)):
        # SPD n=4: alpha = 4 x tokens / 82 cycles, r = 0.1 (masked: 4 r < 1); PPSD n=4: alpha 24/82, / (1 + 0.4)
        spd = pdm_row("spd", 4, 1, _pdm("spd", 4, spd_tokens, 20), ar)
        ppsd = pdm_row("ppsd", 4, 1, _pdm("ppsd", 4, 6, 20), ar)
        _store(root, "curve_spd_n4_L1", budget, [{**spd, "mode": "spd", "n": 4, "L_s": 1}], [])
        _store(root, "curve_ppsd_n4_L1", budget, [{**ppsd, "mode": "ppsd", "n": 4, "L_s": 1}], [])
        _store(root, "curve_eagle3", budget, [], [eagle3_row(k, _eagle3(k), ar) for k in (1, 2)])
    out, png = tmp_path / "doc.md", tmp_path / "curve.png"
    out.write_text("# Doc\n\n<!-- paper-tables-curve:begin -->\nold\n<!-- paper-tables-curve:end -->\nkept\n")
    argv = ["curve", "--suite", "tiny", "--root", str(root), "--out", str(out)]
    argv += ["--budgets", "1000", "2000", "3000", "4000"]
    argv += ["--png", str(png), "--extra", shlex.join(["--model.target", target])]
    assert load_script("bench_paper").main(argv) == 0, capsys.readouterr()
    text = out.read_text()
    assert text.startswith("# Doc\n") and text.endswith("kept\n") and "\nold\n" not in text
    assert "| SPD n=4 L_s=1 | 2,000 | 2,007 | 20 |" in text and "| EAGLE-3 k=2 | 1,000 | 1,007 | 10 |" in text
    # SPD's S over PPSD's: (12 or 16) / 6 x 1.4 -> 2.8 and 3.73, both above the paper's 2x
    spd_1000 = 4 * 48 / 82
    assert f"SPD n=4 L_s=1 {spd_1000:.2f} [" in text and "ratio 2.80, the paper's >= 2x holds" in text
    assert "Trend of SPD n=4 L_s=1 / PPSD over the budgets: 2.80 -> 3.73 -> 2.10 -> 1.87." in text
    # 9 / 6 x 1.4 = 2.10: SPD's interval (about 1.76 +- 3 %) overlaps 2 x PPSD's (about 1.67 +- 3 %)
    assert "ratio 2.10, the paper's >= 2x holds (SPD's interval overlaps 2 x PPSD's, so the 95 % intervals" in text
    # 8 / 6 x 1.4 = 1.87 < 2: SPD about 1.56 +- 3 %, clear of 2 x PPSD
    assert "ratio 1.87, the paper's >= 2x does not hold (SPD's interval and 2 x PPSD's do not overlap" in text
    assert "python -m spd_lightning prepare --config configs/bench_tiny.yaml" in text
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_another_protocol_reads_and_writes_folders_of_its_own(tmp_path_factory, tmp_path, capsys):
    """`--limit 2 --max-new-tokens 6 --temperatures 0`: the report reads only that protocol's rows (the curve's own,
    stored beside them, stay out) and lists evaluation commands that run it; --temperatures elsewhere is refused."""
    target, _ = target_dir(tmp_path_factory, "qwen3", make_tiny_model)
    root = tmp_path / "root"
    ar = [DecodeResult(mode="ar", n=1, prompt_len=3, tokens=[1] * 11, K=11, stop_reason="length", decode_s=1.0)] * 4
    for tokens, protocol in ((12, ""), (8, "_2x6_T0")):
        spd = pdm_row("spd", 4, 1, _pdm("spd", 4, tokens, 20), ar)
        _store(root, "curve_spd_n4_L1", 1000, [{**spd, "mode": "spd", "n": 4, "L_s": 1}], [], protocol)
    out = tmp_path / "doc.md"
    argv = ["curve", "--suite", "tiny", "--root", str(root), "--out", str(out), "--budgets", "1000", "--png", ""]
    argv += ["--limit", "2", "--max-new-tokens", "6", "--temperatures", "0"]
    bench_paper = load_script("bench_paper")
    assert bench_paper.main([*argv, "--extra", shlex.join(["--model.target", target])]) == 0, capsys.readouterr()
    text = out.read_text()
    (row,) = [line for line in text.splitlines() if line.startswith("| SPD n=4 L_s=1 |")]
    assert f"| {4 * 32 / 82:.2f} [" in row  # n*alpha of the protocol's 8-token prompts, not the curve's 12-token ones
    evaluation = f"--limit 2 --max-new-tokens 6 --temperatures 0 --no-progress --simulate --out {root}/"
    assert evaluation + "curve_spd_n4_L1/eval_1000_2x6_T0" in text
    assert bench_paper.main(["eval", "--temperatures", "0"]) == 2
    assert "--temperatures goes with curve-eval and curve, not eval" in capsys.readouterr().err


def _bench_paper(*argv: str) -> int:
    import subprocess

    env = dict(os.environ, PYTHONPATH=REPO)
    command = [sys.executable, os.path.join(REPO, "scripts", "bench_paper.py"), *argv]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_curve_on_the_micro_target_resumes_and_redoes_nothing(micro_target, tmp_path):
    prompts = tmp_path / "set_question.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in ("hello world", "the cat sat")))
    extra = ["--model.target", micro_target, "--data.sources", "[{path: sharegpt, max_samples: 100}]"]
    extra += ["--data.max_length", "1024", "--data.draft_vocab_size", "256", "--data.batch_size", "2"]
    extra += ["--data.val_size", "4", "--data.cache_dir", str(tmp_path / "cache"), "--trainer.val_check_interval", "2"]
    common = ["--suite", "tiny", "--root", str(tmp_path / "root"), "--budgets", "1500", "3000"]
    common += ["--extra", shlex.join(extra), "--jobs", "2"]
    names = ["curve_spd_n4_L1", "curve_eagle3"]
    _bench_paper("curve-states", *common)
    out = _bench_paper("curve-train", *names, *common, "--tokens-per-step", "1000")
    assert "--data.states" in out and "BudgetCheckpoints" in out
    for name in names:
        assert set(read_reached(str(tmp_path / "root" / name / "budgets"))) == {1500, 3000}
    evaluation = ["--sets", str(prompts), "--limit", "2", "--max-new-tokens", "6"]
    _bench_paper("curve-eval", *names, *common, *evaluation)
    again = _bench_paper("curve-train", *names, *common) + _bench_paper("curve-eval", *names, *common, *evaluation)
    assert "every budget saved already" in again and "python -m" not in again  # nothing ran twice
    doc = tmp_path / "doc.md"
    _bench_paper("curve", *common, *evaluation, "--out", str(doc), "--png", str(tmp_path / "curve.png"))
    text = doc.read_text()
    assert "| SPD n=4 L_s=1 | 3,000 |" in text and "| EAGLE-3 k=3 | 1,500 |" in text
