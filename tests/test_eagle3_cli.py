"""EAGLE-3 through the command lines: `fit --model Eagle3Module` -> `export` -> `inference.decode --mode eagle3`
greedy == AR; `inference.eval --eagle3` rows beside SPD's; `inference.plan` predicts EAGLE-3; a drafter of the
wrong kind for the mode is one line."""

import json
import os

import pytest
import torch
from kit import REPO, eagle3_fit_args, load_script, make_tiny_model, save_random_drafter, target_dir

from inference import decode as spd_decode
from inference.evaluation import plan as spd_plan
from inference.evaluation import run as spd_eval
from inference.runtime.stages import Stage
from inference.sampling import Sampling
from inference.setup import prepare
from spd_lightning import cli
from spd_lightning.eagle3.export import Eagle3Spec, save_eagle3
from spd_lightning.eagle3.model import Eagle3Config, Eagle3Drafter, eagle_feature_layers
from spd_lightning.geometry import Geometry

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def exported(micro_target, tmp_path_factory):
    """An EAGLE-3 drafter trained 2 steps by `fit --model Eagle3Module` and exported by `export`."""
    root = tmp_path_factory.mktemp("eagle3_fit")
    trained = cli.run_cli(["fit", *eagle3_fit_args(micro_target, root)])
    assert type(trained.model).__name__ == "Eagle3Module" and trained.trainer.global_step == 2
    return cli.export(["--ckpt", str(root / "ckpt" / "last.ckpt"), "--out", str(root / "drafter")])


def test_fit_export_decode_is_ar(exported, micro_target, tmp_path):
    assert json.loads(open(os.path.join(exported, "config.json")).read())["kind"] == "eagle3"
    common = ["--prompt", "Tell me about cats.", "--max-new-tokens", "12", "--json"]
    rc = spd_decode.main(["--ckpt", exported, "--k", "3", *common, str(tmp_path / "e3.json"), "--check-lossless"])
    report = json.loads((tmp_path / "e3.json").read_text())
    assert rc == 0 and report["mode"] == "eagle3" and report["k"] == 3 and report["totals"]["lossless"]
    rc = spd_decode.main(
        ["--ckpt", "none", "--target", micro_target, "--mode", "ar", *common, str(tmp_path / "ar.json")]
    )
    ar = json.loads((tmp_path / "ar.json").read_text())
    assert rc == 0 and report["prompts"][0]["tokens"] == ar["prompts"][0]["tokens"]
    assert report["prompts"][0]["K"] >= 1 and report["prompts"][0]["tau"] >= 1


def test_the_drafter_module_comes_from_the_config_or_the_command_line(tmp_path, capsys):
    config = os.path.join(REPO, "configs", "tiny_eagle3.yaml")
    with pytest.raises(SystemExit):
        cli.main(["fit", "--config", config, "--print_config"])
    out = capsys.readouterr().out
    assert "class_path: spd_lightning.eagle3.module.Eagle3Module" in out and "ttt_steps: 7" in out
    assert "num_layers" not in out.split("model:")[1].split("data:")[0]
    with pytest.raises(SystemExit):
        cli.main(["fit", "--config", config, "--model", "SPDModule", "--model.ttt_steps", "3", "--print_config"])
    assert "ttt_steps" in capsys.readouterr().err  # the PDM has no such option: the flag switched the module


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--model", "Medusa"], "Medusa"),
        (["--trainer.callbacks", "[{class_path: callbacks.StaircaseEvaluation}]"], "does not apply"),
    ],
)
def test_bad_drafter_settings_are_one_line(micro_target, tmp_path, capsys, extra, expected):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", *eagle3_fit_args(micro_target, tmp_path), *extra])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert exit_info.value.code == 2 and len(lines) == 1 and expected in lines[0], err


# -- eval and plan on a saved tiny target: a random PDM and a random EAGLE-3 drafter -----------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_eagle3")
    path, target = target_dir(tmp_path_factory, "qwen3_5", make_tiny_model)
    pdm = save_random_drafter(target, Geometry.build(target.num_layers, 2), str(root / "pdm"))
    ppsd_geometry = Geometry.build(target.num_layers, 2, schedule="post_step", features="first_stage")
    ppsd = save_random_drafter(target, ppsd_geometry, str(root / "ppsd"), seed=1)
    torch.manual_seed(0)
    layers = eagle_feature_layers(target.num_layers)
    cfg = Eagle3Config(target.hidden_size, 48, layers, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64)
    drafter = Eagle3Drafter(cfg, torch.randperm(target.vocab_size)[:48].sort().values)
    drafter.init_head_from_target(target.lm_head.weight)
    eagle3 = save_eagle3(drafter, Eagle3Spec(cfg, target.info), str(root / "eagle3"))
    prompts = root / "set_question.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in ("hello world", "the cat sat")))
    return {"target": path, "pdm": pdm, "ppsd": ppsd, "eagle3": eagle3, "prompts": str(prompts), "root": root}


@pytest.mark.parametrize("drafter, mode, expected", [("eagle3", "spd", "is an EAGLE-3"), ("pdm", "eagle3", "is a PDM")])
def test_a_drafter_of_the_wrong_kind_is_one_line(files, capsys, drafter, mode, expected):
    assert spd_decode.main(["--ckpt", files[drafter], "--mode", mode, "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err and "--mode" in err and "Traceback" not in err


@pytest.mark.parametrize("cli_name", ["decode", "eval"])
def test_a_k_above_the_context_is_one_line(files, tmp_path, capsys, cli_name):
    """The chain's caches are sized for k drafts: a k beyond the target's context (512) would be an allocation
    failure (exit 1, 'a bug'), not a line that says which value to lower."""
    if cli_name == "decode":
        rc = spd_decode.main(["--ckpt", files["eagle3"], "--prompt", "hi", "--k", "1000000000"])
    else:
        argv = ["--ckpt", files["pdm"], "--eagle3", files["eagle3"], "--k", "3", "1000000000", "--simulate"]
        rc = spd_eval.main([*argv, "--prompts", files["prompts"], "--max-new-tokens", "4", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--k=1000000000" in err and "context of 512" in err, err


def test_an_eagle3_drafter_to_compare_is_one_line(files, tmp_path, capsys):
    argv = ["--ckpt", files["pdm"], "--compare", files["eagle3"], "--prompts", files["prompts"], "--simulate"]
    assert spd_eval.main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pass it as --eagle3" in err and "Traceback" not in err


def test_an_eagle3_ckpt_with_pdm_drafters_to_compare_is_one_line(files, tmp_path, capsys):
    """An EAGLE-3 drafter as --ckpt with PDM drafters in --compare: decoded in full, then an IndexError (exit 1, no
    report) where the plan inputs looked for --ckpt's PDM rows; one line before any decode instead."""
    argv = ["--ckpt", files["eagle3"], "--compare", files["pdm"], "--prompts", files["prompts"], "--simulate"]
    assert spd_eval.main([*argv, "--max-new-tokens", "4", "--out", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the EAGLE-3 one as --eagle3" in err and not os.listdir(tmp_path)


def test_under_compile_eagle3_is_measured_against_an_eager_ar_baseline(files, monkeypatch):
    """Chain decoding has no compiled path: under `--compile` EAGLE-3's r, verify ratio and wall-clock speedup divide
    by an eager AR decode of the same prompts, the PDM drafter's by the compiled one its stages match."""
    argv = ["--ckpt", files["pdm"], "--eagle3", files["eagle3"], "--k", "2", "--prompts", files["prompts"]]
    args = spd_eval.parse_args([*argv, "--simulate", "--compile", "--max-new-tokens", "1"])
    decoders = spd_eval.Decoders(args, [prepare(args)], files["eagle3"])
    ran = []  # whether the stage of each AR decode ran compiled (one token: a prefill, nothing is compiled here)
    prefill = Stage.prefill
    monkeypatch.setattr(Stage, "prefill", lambda stage, *a: ran.append(stage.compiled) or prefill(stage, *a))
    decoded = decoders.ar(Sampling(), [[3, 14, 15]])
    assert sorted(ran) == [False, True]  # an eager AR decode of the prompt beside the compiled one
    divided_by = {}  # each method's rows: the AR decodes they divide by
    for method in decoders.methods:
        monkeypatch.setattr(method, "row", lambda results, ar, m=method: divided_by.update({m.results: ar}) or {})
    spd_eval._add_rows(
        {"results": [], "eagle3_results": []}, decoders.methods, {}, {**decoded, **dict.fromkeys(decoders.methods)}
    )
    eager = next(name for name, stages in decoders.baselines.items() if not stages[0].compiled)
    assert divided_by["eagle3_results"] is decoded[eager] and divided_by["results"] is not decoded[eager]


@pytest.fixture(scope="module")
def evaluated(files):
    out = files["root"] / "out"
    argv = ["--ckpt", files["pdm"], "--compare", files["ppsd"], "--eagle3", files["eagle3"], "--k", "1", "3"]
    argv += ["--prompts", files["prompts"], "--max-new-tokens", "8", "--temperatures", "0", "--out", str(out)]
    argv += ["--simulate", "--no-progress"]
    assert spd_eval.main(argv) == 0
    return out


def test_eval_reports_spd_ppsd_and_eagle3_in_one_report(evaluated, files):
    report = json.loads((evaluated / "eval.json").read_text())
    spd = {r["set"]: r for r in report["results"] if r["mode"] == "spd"}
    ppsd = {r["set"]: r for r in report["results"] if r["mode"] == "ppsd"}
    assert set(spd) == set(ppsd) == {"set", "overall"} and len(report["results"]) == 4
    for name, r in ppsd.items():  # the compared drafter: its own mode, decoded against the same AR
        assert r["drafter"] == files["ppsd"] and r["method"] == "ppsd n=2 L_s=2" and r["n"] == 2
        assert r["ar_decode_tokens_per_s"] == spd[name]["ar_decode_tokens_per_s"]
        assert r["S_ppsd"] == pytest.approx(r["S0"] / (1 + 2 * r["r"])) and r["alpha"] == r["N"] / r["K"]
    assert report["plan_inputs"]["alpha"] == spd["overall"]["alpha"]  # the plan reads --ckpt's rows
    rows = {(r["set"], r["k"]): r for r in report["eagle3_results"]}
    assert set(rows) == {(s, k) for s in ("set", "overall") for k in (1, 3)}
    for (name, k), r in rows.items():
        assert r["method"] == "eagle3" and r["alpha"] == pytest.approx(r["N"] / r["K"]) and r["S0"] == r["alpha"]
        assert r["S_eagle3"] == pytest.approx(r["tau"] / (1 + k * r["r"] + r["verify_ratio"] - 1))
        assert r["wall_clock_speedup"] == pytest.approx(r["decode_tokens_per_s"] / r["ar_decode_tokens_per_s"])
        assert r["ar_decode_tokens_per_s"] == spd[name]["ar_decode_tokens_per_s"]  # one AR baseline for all
        positions = r["accept_by_position"]  # tau = 1 + the sum over positions of reaching and passing each
        reach, expected_tau = 1.0, 1.0
        for rate in positions:
            reach *= rate or 0.0
            expected_tau += reach
        assert len(positions) == k and expected_tau == pytest.approx(r["tau"])
    assert [p["k"] for p in report["plan_inputs_eagle3"]] == [1, 3] and "plan_inputs" in report
    md = (evaluated / "eval.md").read_text()
    assert "| eagle3 k=3 | overall | 0 |" in md and "| spd n=2 L_s=2 | overall | 0 |" in md
    assert "| ppsd n=2 L_s=2 | overall | 0 |" in md


def test_plan_predicts_eagle3_beside_spd(evaluated, tmp_path, capsys):
    eval_json = str(evaluated / "eval.json")
    argv = ["--times", eval_json, "--alphas", eval_json, "--plot", "", "--json", str(tmp_path / "p.json")]
    assert spd_plan.main(argv) == 0
    out = capsys.readouterr().out
    plan = json.loads((tmp_path / "p.json").read_text())
    inputs = {p["k"]: p for p in json.loads(open(eval_json).read())["plan_inputs_eagle3"]}
    for row in plan["eagle3"]:
        p = inputs[row["k"]]
        cost = row["k"] * p["T_draft_step_s"] + p["T_verify_s"]
        assert row["speedup"] == pytest.approx(p["alpha"] * plan["model"]["t_full"] / cost)
    assert "EAGLE-3 on 1 GPU" in out and "n=2 (SPD on 2 GPUs" in out and "recommended: n=2" in out


def test_serve_greedy_is_decode(exported, tmp_path):
    """`inference.serve --mode eagle3 --simulate`: the in-process chain backend answers what decode prints."""
    from fastapi.testclient import TestClient

    from inference.serving import server as serve

    prompt = "Tell me about dogs."
    common = ["--ckpt", exported, "--mode", "eagle3", "--k", "2", "--max-new-tokens", "10"]
    assert spd_decode.main([*common, "--prompt", prompt, "--json", str(tmp_path / "d.json")]) == 0
    decoded = json.loads((tmp_path / "d.json").read_text())["prompts"][0]["text"]
    app, engine = serve.build(serve.parse_args([*common, "--simulate", "--threads", "1"]))
    try:
        with TestClient(app) as client:
            body = {"model": "drafter", "messages": [{"role": "user", "content": prompt}], "temperature": 0}
            body["max_tokens"] = 10
            reply = client.post("/v1/chat/completions", json=body)
            streamed = client.post("/v1/chat/completions", json={**body, "stream": True})
    finally:
        engine.close()
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == decoded
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == decoded and decoded


def test_a_pdm_config_becomes_an_eagle3_config(tmp_path, capsys):
    """What `scripts/bench_paper.py train eagle3_k7` trains: the benchmark config's data, trainer and optimizer
    settings with the EAGLE-3 module, the staircase callback (PDM only) dropped."""
    import yaml

    bench_paper = load_script("bench_paper")
    config_path = os.path.join(REPO, "configs", "bench_tiny.yaml")
    args = bench_paper.parse_args(["commands", "eagle3_k7", "--root", str(tmp_path), "--config", config_path])
    train, evaluate = bench_paper.train_command("eagle3_k7", args), bench_paper.eval_command("eagle3_k7", args)
    with pytest.raises(SystemExit):
        cli.main(["fit", "--config", config_path, "--print_config"])
    pdm = yaml.safe_load(capsys.readouterr().out)
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*train[3:], "--print_config"])
    eagle3 = yaml.safe_load(capsys.readouterr().out)
    assert exit_info.value.code == 0 and eagle3["model"]["class_path"].endswith("Eagle3Module")
    for key in ("target", "target_dtype", "lr", "warmup_steps"):
        assert eagle3["model"]["init_args"][key] == pdm["model"]["init_args"][key]
    assert eagle3["model"]["init_args"]["ttt_steps"] == 7 and eagle3["trainer"]["callbacks"] == []
    assert eagle3["data"] == pdm["data"] and eagle3["trainer"]["max_steps"] == pdm["trainer"]["max_steps"]
    assert evaluate[evaluate.index("--k") + 1 : evaluate.index("--k") + 6] == ["1", "2", "3", "5", "7"]


def test_serve_runs_eagle3_in_its_own_process_without_simulate(files):
    """EAGLE-3 is a one-GPU method: the server decodes it in process, never on pipeline ranks."""
    from inference.backends import ChainBackend
    from inference.serving import server as serve

    args = serve.parse_args(["--ckpt", files["eagle3"], "--mode", "eagle3", "--k", "2", "--port", "1"])
    backend = serve.make_backend(serve.prepared(args), args)  # the server's own setup (it fills --max-batch)
    assert isinstance(backend, ChainBackend)


def test_eval_and_plan_of_an_eagle3_drafter_alone(files, tmp_path, capsys):
    """What `bench_paper.py eval eagle3_k7` runs: an EAGLE-3 drafter as --ckpt, no SPD rows, and a plan without alphas."""
    out = tmp_path / "out"
    argv = ["--ckpt", files["eagle3"], "--k", "2", "--prompts", files["prompts"], "--max-new-tokens", "6"]
    assert spd_eval.main([*argv, "--temperatures", "0", "--out", str(out), "--no-progress"]) == 0
    report = json.loads((out / "eval.json").read_text())
    assert report["mode"] == "eagle3" and report["results"] == [] and "plan_inputs" not in report
    assert [r["k"] for r in report["eagle3_results"]] == [2, 2] and report["plan_inputs_eagle3"][0]["k"] == 2
    capsys.readouterr()
    assert spd_plan.main(["--times", str(out / "eval.json"), "--plot", ""]) == 0
    printed = capsys.readouterr().out
    assert "EAGLE-3 on 1 GPU" in printed and "SPD plan" not in printed
