"""`python -m inference.decode`: the happy paths (simulator, processes, AR, a Lightning .ckpt) and bad input."""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from kit import check_batched_timing, make_tiny_model, random_pdm, save_target, target_dir

from inference import cli
from inference.cycle.profiler import Profiler
from inference.cycle.result import COMPUTE, TIMING_FIELDS, WALL
from inference.decode import main
from inference.evaluation.repetition import repeated_kgrams, repeated_share
from inference.processes.job import DecodeJob
from inference.processes.launch import launch
from inference.prompts import PromptError
from inference.sampling import Sampling
from spd_lightning.export import CKPT_KEY, DrafterLoadError, DrafterSpec, load_drafter, read_drafter_spec, save_drafter
from spd_lightning.geometry import MODES, Geometry, GeometryError

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
    return {
        "target": path,
        "drafter": drafter,
        "ckpt": str(ckpt),
        "prompts": str(prompts),
        "long": str(long_prompt),
        "other": other,
        "corrupt": str(corrupt),
        "truncated": str(truncated),
        "root": root,
    }


@pytest.mark.hf_internals
def test_simulated_decode_writes_the_report(files, capsys):
    out = files["root"] / "report.json"
    rc = main(
        [
            "--ckpt",
            files["drafter"],
            "--prompts",
            files["prompts"],
            "--max-new-tokens",
            "12",
            "--simulate",
            "--check-lossless",
            "--profile",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "lossless=yes" in printed
    report = json.loads(out.read_text())
    assert report["mode"] == "spd" and report["n"] == 2 and report["totals"]["lossless"] is True
    first = report["prompts"][0]
    for key in (
        "tokens",
        "text",
        "N",
        "K",
        "alpha",
        "theoretical_speedup",
        "accepted_by_fill",
        "rejected_by_fill",
        "accepted_by_depth",
        "rejected_by_depth",
        "timing",
        "lossless",
        "prompt_len",
    ):
        assert key in first, key
    assert first["N"] == len(first["tokens"]) == 12 and first["alpha"] == pytest.approx(12 / first["K"])
    assert first["theoretical_speedup"] == pytest.approx(2 * first["alpha"])
    assert set(first["timing"]["per_cycle"]) == {"slots", "stage_compute_s", "draft_s", "verify_s", "comm_s", "wall_s"}
    assert first["timing"]["per_cycle"]["slots"] == [1] * first["K"] and first["timing"]["cycles"] == [
        1,
        first["K"] + 1,
    ]
    assert report["totals"]["alpha"] == pytest.approx(report["totals"]["N"] / report["totals"]["K"])
    low, high = report["totals"]["theoretical_speedup_interval"]  # over the prompts, printed beside n*alpha
    assert low <= report["totals"]["theoretical_speedup"] <= high and f"[{low:.2f}, {high:.2f}]" in printed


def test_multi_process_decode_from_a_lightning_checkpoint(files, capsys):
    out = files["root"] / "dist.json"
    rc = main(
        [
            "--ckpt",
            files["ckpt"],
            "--prompt",
            "hello world",
            "--max-new-tokens",
            "10",
            "--check-lossless",
            "--json",
            str(out),
            "--timeout",
            "60",
        ]
    )
    assert rc == 0
    captured = capsys.readouterr()
    assert "prompt 1: N=10" in captured.err and "lossless=yes" in captured.out
    assert json.loads(out.read_text())["simulate"] is False


def test_ar_mode_needs_no_drafter(files, capsys):
    assert (
        main(
            [
                "--ckpt",
                "none",
                "--target",
                files["target"],
                "--mode",
                "ar",
                "--prompt",
                "hello",
                "--max-new-tokens",
                "5",
            ]
        )
        == 0
    )
    assert "mode=ar" in capsys.readouterr().out


def test_sampling_options_run(files, capsys):
    assert (
        main(
            [
                "--ckpt",
                files["drafter"],
                "--prompt",
                "hello",
                "--max-new-tokens",
                "6",
                "--simulate",
                "--temperature",
                "0.8",
                "--top-k",
                "20",
                "--top-p",
                "0.9",
                "--seed",
                "3",
                "--mode",
                "post_step",
            ]
        )
        == 0
    )
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
    "spd without a drafter": (
        ["--prompt", "hi", "--ckpt", "none", "--target", "{target}", "--mode", "spd"],
        "needs a drafter",
    ),
    "ppsd on an spd drafter": (["--prompt", "hi", "--mode", "ppsd"], "features"),
    "missing prompts file": (["--prompts", "{root}/none.jsonl"], "does not exist"),
    "no prompt at all": ([], "exactly one"),
    "lossless check while sampling": (["--prompt", "hi", "--temperature", "1", "--check-lossless"], "greedy"),
    "cuda without a GPU": (["--prompt", "hi", "--device", "cuda"], "CUDA"),
    "unwritable report": (
        ["--prompt", "hi", "--max-new-tokens", "2", "--json", "{root}/none/report.json"],
        "cannot write",
    ),
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


@pytest.mark.slow  # fast: scripts/bad_inputs.py's "corrupt checkpoint" case (tests/test_bad_inputs.py), in-process
def test_the_process_exits_non_zero_with_one_line(files):
    proc = subprocess.run(
        [sys.executable, "-m", "inference.decode", "--ckpt", files["corrupt"], "--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().startswith("error:") and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "where",
    ["--simulate", pytest.param("processes", marks=pytest.mark.slow)],  # processes: 20 s, spawns 3 ranks
)
def test_a_reader_that_went_away_ends_the_decode_quietly(files, tmp_path, monkeypatch, capsys, where):
    """`inference.decode --stream ... | head -1`: a closed stdout is no bug (Python's BrokenPipeError, not SIGPIPE):
    exit 141 as a program SIGPIPE ended, no error line, and the decode still ends and writes its --json (the
    launcher's report thread that prints the stream keeps every later result)."""
    out = tmp_path / "out.json"
    argv = ["--ckpt", files["drafter"], "--prompts", files["prompts"], "--max-new-tokens", "6", "--stream"]
    argv += ["--json", str(out), "--timeout", "60"] + (["--simulate"] if where == "--simulate" else [])
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first token
    with open(write, "w") as stdout:
        monkeypatch.setattr(sys, "stdout", stdout)
        monkeypatch.delenv("SPD_DEBUG", raising=False)
        assert main(argv) == 141
        monkeypatch.undo()
    err = capsys.readouterr().err
    assert "error" not in err and "Traceback" not in err, err
    assert len(json.loads(out.read_text())["prompts"]) == 2


@pytest.mark.parametrize(
    "device,message",
    [
        (
            "cuda:abc",
            "--device 'cuda:abc': use cuda or cuda:INDEX",
        ),  # was 'unexpected RuntimeError: Invalid device string'
        ("cudax", "--device 'cudax': use cuda or cuda:INDEX"),
        ("cuda:-1", "--device 'cuda:-1': use cuda or cuda:INDEX"),
        ("cuda:5", "--device cuda:5: this machine has 2 GPU(s), cuda:0 to cuda:1"),  # failed at the first tensor
    ],
)
def test_a_device_this_machine_lacks_is_one_line(files, monkeypatch, capsys, device, message):
    """On a machine with 2 GPUs (faked: this one may have none), before anything loads."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("SPD_DEBUG", raising=False)
    for mode in (
        ["--ckpt", files["drafter"], "--simulate"],
        ["--ckpt", "none", "--target", files["target"], "--mode", "ar"],
    ):
        assert main([*mode, "--prompt", "hi", "--device", device]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_too_few_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    job = DecodeJob("unused", Geometry.build(8, 4), [[1]], 4, [], 10, 8, Sampling(), device="cuda")
    with pytest.raises(cli.UsageError, match="need 5 GPUs, 2 are visible"):
        launch(job)


def test_the_decoder_deploys_without_training_code():
    """docs/DESIGN.md, "Architecture rules": importing every decoder module pulls in neither Lightning nor the LightningModule."""
    code = (
        "import sys, pkgutil, importlib, inference\n"
        "for m in pkgutil.walk_packages(inference.__path__, 'inference.'): importlib.import_module(m.name)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning') or m == 'spd_lightning.training.module']\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_decode_prints_each_text_and_its_repetition(files, capsys):
    """stdout: per prompt a header, the generated text, its counters; then the totals, with repeated 4-grams."""
    out = files["root"] / "texts.json"
    assert (
        main(
            [
                "--ckpt",
                files["drafter"],
                "--prompts",
                files["prompts"],
                "--max-new-tokens",
                "12",
                "--simulate",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    report = json.loads(out.read_text())
    for i, (entry, prompt) in enumerate(zip(report["prompts"], ["hello world", "the cat sat on the mat"])):
        at = lines.index(f"### prompt {i + 1}: {prompt}")
        assert "\n".join(lines[at + 1 :]).startswith(entry["text"] + "\n(N=12 K=")
        assert entry["repeated_4gram_share"] == repeated_share([entry["tokens"]])
    share = repeated_share([p["tokens"] for p in report["prompts"]])
    assert report["totals"]["repeated_4gram_share"] == share
    assert lines[-1].startswith("mode=spd n=2 prompts=2 N=24") and f"repeated_4grams={share:.2f}" in lines[-1]
    assert report["prompts"][0]["timing"] == {}  # no --profile: the decoder timed nothing


def test_simulated_batched_decode_profiles_each_prompt(files):
    """`--simulate --max-batch 2 --profile`: each prompt's timing holds the batch's cycles it took part in, the
    tokens are those of the decode without timing."""
    out, plain = files["root"] / "batched_profile.json", files["root"] / "batched.json"
    argv = ["--ckpt", files["drafter"], "--prompts", files["prompts"], "--max-new-tokens", "10", "--simulate"]
    assert main([*argv, "--max-batch", "2", "--profile", "--json", str(out)]) == 0
    assert main([*argv, "--max-batch", "2", "--json", str(plain)]) == 0
    report = json.loads(out.read_text())
    check_batched_timing(report["prompts"], n=2, max_batch=2)
    assert [p["tokens"] for p in report["prompts"]] == [p["tokens"] for p in json.loads(plain.read_text())["prompts"]]


def test_a_max_batch_above_the_prompts_gets_a_slot_per_prompt(files, monkeypatch):
    """Each slot's caches are sized for a whole decode: `--max-batch 100000000` on two prompts allocated them all
    (the process was killed for memory). Slots beyond the prompts hold nothing, so the decoder runs one per prompt."""
    import inference.backends as backends

    built, simulator = [], backends.Simulator
    monkeypatch.setattr(backends, "Simulator", lambda *a, **kw: built.append(kw["max_batch"]) or simulator(*a, **kw))
    out = files["root"] / "max_batch.json"
    argv = ["--ckpt", files["drafter"], "--prompts", files["prompts"], "--max-new-tokens", "2", "--simulate"]
    assert main([*argv, "--max-batch", "64", "--json", str(out)]) == 0
    assert built == [2] and json.loads(out.read_text())["max_batch"] == 2


def test_timing_off_is_a_no_op_even_on_a_gpu_device():
    """Off, the profiler hands out one shared no-op span and never touches the device (no CUDA event, no sync)."""
    clock = Profiler(False, torch.device("cuda"))
    clock.start(3, 10)
    assert clock.span(0, COMPUTE, device_work=True) is clock.span([0, 1], WALL) and clock.rows.size == 0
    on = Profiler(True, torch.device("cpu"))
    on.start(2, 4)
    on.cycle = 3
    with on.span([0, 1], WALL):
        sum(range(1000))
    assert (
        on.rows.shape == (2, 5, TIMING_FIELDS)
        and (on.rows[:, 3, WALL] > 0).all()
        and on.rows.sum() == on.rows[:, 3, WALL].sum()
    )


def test_repeated_share_pools_the_outputs():
    assert repeated_kgrams([1, 2, 3, 4, 1, 2, 3, 4, 1, 2]) == (3, 7)  # 1234 2341 3412 4123, then 3 repeats
    assert repeated_share([[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [1, 2, 3, 4, 5, 6]]) == 3 / 10
    assert repeated_share([[1, 2]]) is None


def test_the_error_policy(monkeypatch, capsys):
    """A UserError is bad input (exit 2, one line); anything else a bug (exit 1, one line); --debug/SPD_DEBUG raise;
    an error without a message still gets its line (its type)."""

    def parse(_argv):
        return argparse.Namespace(debug=False)

    def bad_input(_):
        raise PromptError("the prompt is empty")

    def bug(_):
        raise KeyError("oops")

    def silent_bug(_):
        raise RuntimeError()

    def finish(_args, _result):
        return 0

    monkeypatch.delenv("SPD_DEBUG", raising=False)
    assert cli.main([], parse, bad_input, finish) == 2
    assert capsys.readouterr().err == "error: the prompt is empty\n"
    assert cli.main([], parse, bug, finish) == 1
    assert capsys.readouterr().err == (
        "error: unexpected KeyError: 'oops' (a bug: rerun with --debug for the traceback and report it)\n"
    )
    assert cli.main([], parse, silent_bug, finish) == 1
    assert "error: unexpected RuntimeError: RuntimeError (a bug" in capsys.readouterr().err
    monkeypatch.setenv("SPD_DEBUG", "1")
    with pytest.raises(KeyError):
        cli.main([], parse, bug, finish)


def test_an_interrupt_is_one_line_not_a_bug(monkeypatch, capsys):
    """ctrl-C in this process (the simulator, AR, eval) and a signal while the launcher's agent runs the ranks
    (the agent raises its SignalException, having stopped them): exit 128 + the signal and one line, neither a
    traceback nor 'a bug'."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def parse(_argv):
        return argparse.Namespace(debug=False)

    def ctrl_c(_):
        raise KeyboardInterrupt

    def agent_sigterm(_):
        raise SignalException("Process 1 got signal: 15", signal.SIGTERM)

    monkeypatch.delenv("SPD_DEBUG", raising=False)
    try:
        assert cli.main([], parse, ctrl_c, lambda *_: 0) == 130
    except KeyboardInterrupt:
        pytest.fail("ctrl-C escaped main: Python printed its traceback")
    assert capsys.readouterr().err == (
        "error: interrupted by SIGINT: stopped, with every rank it had started, before writing its results\n"
    )
    assert cli.main([], parse, agent_sigterm, lambda *_: 0) == 143
    assert capsys.readouterr().err.startswith("error: interrupted by SIGTERM: stopped")


@pytest.mark.parametrize("mode,schedule,features", [(m, *MODES[m]) for m in MODES])
def test_the_mode_table_is_the_geometrys(mode, schedule, features):
    geometry = Geometry.build(8, 4, schedule=schedule, features=features)
    assert geometry.mode == mode and geometry.with_mode(mode) == geometry
    trained = Geometry.build(8, 4, features=features)
    assert (trained.with_mode(mode).schedule, trained.with_mode(mode).features) == (schedule, features)
    other = "ppsd" if features == "spd" else "spd"
    with pytest.raises(GeometryError, match=f"--mode {other} reads"):
        trained.with_mode(other)


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors"])
def test_a_drafter_directory_names_its_missing_file(files, tmp_path, missing):
    """One reader: the stage ranks' `read_drafter_spec` and the PDM rank's `load_drafter` say the same."""
    broken = tmp_path / "drafter"
    shutil.copytree(files["drafter"], broken)
    os.remove(broken / missing)
    messages = set()
    for read in (read_drafter_spec, load_drafter):
        with pytest.raises(DrafterLoadError, match=f"it has no {missing}") as info:
            read(str(broken))
        messages.add(str(info.value))
    assert len(messages) == 1


def test_options_a_mode_cannot_use_are_warned_about(files, caplog):
    """`--profile` and `--check-lossless` with `--mode ar`, and `--pdm-placement shared` in one process: accepted,
    and nothing was said that they did nothing."""
    argv = ["--ckpt", "none", "--target", files["target"], "--mode", "ar", "--prompt", "hi", "--max-new-tokens", "2"]
    assert main([*argv, "--profile", "--check-lossless", "--pdm-placement", "shared"]) == 0
    assert "--profile times the pipeline's cycles; --mode ar has none: ignored" in caplog.text
    assert "--check-lossless compares a drafter's output with AR decoding, which --mode ar is: ignored" in caplog.text
    assert "--pdm-placement shared places the PDM's rank process" in caplog.text
    caplog.clear()
    argv = ["--ckpt", files["drafter"], "--prompt", "hi", "--max-new-tokens", "2", "--simulate", "--check-lossless"]
    assert main([*argv, "--profile", "--pdm-placement", "shared"]) == 0
    assert "--profile" not in caplog.text and "--check-lossless" not in caplog.text  # the simulator uses both
    assert "--pdm-placement shared places the PDM's rank process" in caplog.text
