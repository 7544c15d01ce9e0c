"""`python -m inference.eval` (a tiny simulated benchmark) and `python -m inference.plan` (the cost model)."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from kit import make_tiny_model, save_random_drafter, target_dir

import inference.runtime.cache
from inference.cycle.simulator import Simulator
from inference.evaluation import costs
from inference.evaluation import plan as spd_plan
from inference.evaluation import run as spd_eval
from inference.processes import launch as launch_module
from inference.runtime.cache import StageCache
from inference.runtime.drafter import PDMDrafter
from inference.runtime.stages import Stage
from inference.sampling import Sampling
from inference.setup import decode_job, prepare
from spd_lightning.export import load_drafter
from spd_lightning.geometry import Geometry
from spd_lightning.target import Target

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    path, target = target_dir(tmp_path_factory, "qwen3_5", make_tiny_model)
    drafter = save_random_drafter(target, Geometry.build(target.num_layers, 2), str(root / "drafter"))
    sets = []
    for name, turns in (
        ("gsm8k_question", ["hello world", "the cat sat on the mat", "unused"]),
        ("humaneval_question", ["a cat", "world hello"]),
    ):
        p = root / f"{name}.jsonl"
        p.write_text("".join(json.dumps({"question_id": i, "turns": [t]}) + "\n" for i, t in enumerate(turns)))
        sets.append(str(p))
    bad = root / "bad.jsonl"
    bad.write_text('{"no_turns": 1}\n')
    return {"target": path, "drafter": drafter, "sets": sets, "bad": str(bad), "root": root}


@pytest.fixture(scope="module")
def evaluated(files):
    out = files["root"] / "out"
    rc = spd_eval.main(
        [
            "--ckpt",
            files["drafter"],
            "--prompts",
            *files["sets"],
            "--max-new-tokens",
            "8",
            "--limit",
            "2",
            "--temperatures",
            "0",
            "1",
            "--out",
            str(out),
            "--simulate",
            "--no-progress",
        ]
    )
    assert rc == 0
    return out


def test_eval_writes_json_markdown_and_plot(evaluated):
    report = json.loads((evaluated / "eval.json").read_text())
    assert report["n"] == 2 and report["mode"] == "spd"
    rows = report["results"]
    assert [(r["set"], r["temperature"]) for r in rows] == [
        (s, t) for t in (0.0, 1.0) for s in ("gsm8k", "humaneval", "overall")
    ]
    n = report["n"]
    for r in rows:
        assert r["prompts"] == (4 if r["set"] == "overall" else 2)
        for key in (
            "alpha",
            "r",
            "T_full_s",
            "T_draft_s",
            "S0",
            "S_spd",
            "S_post",
            "decode_tokens_per_s",
            "ar_decode_tokens_per_s",
            "wall_clock_speedup",
        ):
            assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert r["alpha"] == pytest.approx(r["N"] / r["K"]) and 0 < r["alpha"] <= 1
        assert r["S0"] == pytest.approx(n * r["alpha"])
        assert r["r_min"] <= r["r"] <= r["r_max"] and r["r_repeats"] == r["prompts"]  # the median per-prompt r
        assert r["S"] == r["S_spd"] and r["S_gpu"] == pytest.approx(n * r["alpha"])  # 2 x 0.035 < 1: masked
        assert r["ci"]["alpha"][0] <= r["alpha"] <= r["ci"]["alpha"][1] and len(r["accept_by_fill"]) == n
        assert r["S_post"] == pytest.approx(n * r["alpha"] / (1 + n * r["r"]))
        assert r["S_spd"] == pytest.approx(n * r["alpha"] * min(1.0, 1.0 / (n * r["r"])))
        assert r["wall_clock_speedup"] == pytest.approx(r["decode_tokens_per_s"] / r["ar_decode_tokens_per_s"])
    by = {(r["set"], r["temperature"]): r for r in rows}
    for t in (0.0, 1.0):  # the overall row pools the sets
        assert by[("overall", t)]["N"] == by[("gsm8k", t)]["N"] + by[("humaneval", t)]["N"]
        assert by[("overall", t)]["K"] == by[("gsm8k", t)]["K"] + by[("humaneval", t)]["K"]
    assert by[("gsm8k", 1.0)]["sampling"]["top_k"] == 50 and by[("gsm8k", 0.0)]["sampling"]["temperature"] == 0
    md = (evaluated / "eval.md").read_text()
    assert md.count("\n| ") == 1 + len(rows) and "| overall | 1 |" in md
    assert (evaluated / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(report["plan_inputs"]) >= {"T_full_s", "T_draft_s", "L_s", "overhead_s", "n", "alpha"}


def test_plan_reads_the_eval_report(evaluated, tmp_path, capsys):
    eval_json = str(evaluated / "eval.json")
    rc = spd_plan.main(
        [
            "--times",
            eval_json,
            "--alphas",
            eval_json,
            "--alpha",
            "1:2:1.0",
            "--plot",
            str(tmp_path / "p.png"),
            "--json",
            str(tmp_path / "p.json"),
        ]
    )
    assert rc == 0
    out = json.loads((tmp_path / "p.json").read_text())
    p = json.loads(evaluated.joinpath("eval.json").read_text())["plan_inputs"]
    row = next(r for r in out["rows"] if r["n"] == 2)
    stage_fixed = max(0.0, p["slowest_stage_s"] - p["T_full_s"] / p["n"])  # the measured stage beyond its share
    assert out["model"]["stage_fixed"] == pytest.approx(stage_fixed)
    assert row["stage"] == pytest.approx(p["T_full_s"] / 2 + stage_fixed) and row["draft"] == pytest.approx(
        p["T_draft_s"]
    )
    assert row["cycle"] == pytest.approx(max(row["stage"], row["draft"]) + p["overhead_s"])
    assert row["speedup"] == pytest.approx(p["alpha"] * p["T_full_s"] / row["cycle"])
    assert "recommended: n=" in capsys.readouterr().out and (tmp_path / "p.png").stat().st_size > 0


def test_plan_cost_model_by_hand():
    m = spd_plan.CostModel(t_full=8.0, t_draft_layer=1.0, overhead=0.5, num_layers=8)
    a = m.predict(4, 1, 0.75)  # stage 2, draft 1: stage-bound, cycle 2.5
    assert (a["stage"], a["draft"], a["cycle"], a["draft_bound"]) == (2.0, 1.0, 2.5, False)
    assert a["speedup"] == pytest.approx(0.75 * 8 / 2.5) and a["S0"] == 3.0
    b = m.predict(8, 3, 0.5)  # stage 1, draft 3: draft-bound, cycle 3.5
    assert (b["cycle"], b["draft_bound"]) == (3.5, True) and b["speedup"] == pytest.approx(0.5 * 8 / 3.5)
    rows, best = spd_plan.plan(m, {(4, 1): 0.75, (8, 3): 0.5, (2, 1): 0.9})  # 2.4, 1.14, 8*0.9/4.5 = 1.6
    assert (best["n"], best["L_s"]) == (4, 1) and [r["n"] for r in rows] == [4, 2, 8]
    # with no overhead the model reduces to the formulas of docs/DESIGN.md, "Speedup formulas" (r = draft / T_full)
    free = spd_plan.CostModel(t_full=8.0, t_draft_layer=1.0)
    post = spd_plan.CostModel(t_full=8.0, t_draft_layer=1.0, schedule="post_step")
    for n, L_s in ((4, 1), (8, 3), (2, 1)):
        assert free.predict(n, L_s, 0.6)["speedup"] == pytest.approx(costs.s_spd(n, 0.6, L_s / 8.0))
        assert post.predict(n, L_s, 0.6)["speedup"] == pytest.approx(costs.s_ppsd(n, 0.6, L_s / 8.0))


def test_plan_stage_fixed_cost_by_hand(tmp_path):
    # a stage pays 1.0 beyond its share: n = 8 stops paying off against n = 4 at equal alpha
    m = spd_plan.CostModel(t_full=8.0, t_draft_layer=0.5, stage_fixed=1.0)
    assert m.stage(4) == 3.0 and m.stage(8) == 2.0
    assert m.predict(8, 1, 0.5)["speedup"] == pytest.approx(0.5 * 8 / 2.0)
    # derived from a measured slowest stage: 2.5 at n = 4 with T_full = 8 -> 0.5 per stage
    times = tmp_path / "eval.json"
    times.write_text(
        json.dumps(
            {
                "plan_inputs": {
                    "T_full_s": 8.0,
                    "T_draft_s": 1.0,
                    "L_s": 1,
                    "overhead_s": 0.0,
                    "n": 4,
                    "alpha": 0.5,
                    "L": 8,
                    "slowest_stage_s": 2.5,
                }
            }
        )
    )
    argv = ["--times", str(times), "--alpha", "4:1:0.5", "--plot", ""]
    assert spd_plan.run(spd_plan.parse_args(argv))["model"]["stage_fixed"] == pytest.approx(0.5)
    model = spd_plan.run(spd_plan.parse_args([*argv, "--stage-fixed", "0"]))["model"]
    assert model["stage_fixed"] == 0.0  # the flag overrides the measurement


def test_plan_from_a_target_config(files, tmp_path, capsys):
    alphas = tmp_path / "alphas.json"
    alphas.write_text(json.dumps({"2,1": 0.9, "4,2": 0.6, "4,1": 0.5}))
    assert (
        spd_plan.main(
            [
                "--target",
                files["target"],
                "--alphas",
                str(alphas),
                "--overhead-layers",
                "0",
                "--plot",
                str(tmp_path / "p.png"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    # L=4 target layers: n=4 L_s=1 cycle = max(1, 1) = 1 -> 0.5*4; n=2 L_s=1 cycle 2 -> 0.9*2; n=4 L_s=2 -> 0.6*4/2
    assert "recommended: n=4 L_s=1 (predicted 2.00x" in out and "| 2 | 1 | 0.900 | 1.80 |" in out


@pytest.mark.parametrize(
    "case",
    [
        "no_alpha",
        "alpha_range",
        "alpha_syntax",
        "n_over_L",
        "no_shape",
        "missing_json",
        "seconds_without_t_full",
        "bad_alphas_json",
    ],
)
def test_plan_bad_input_is_one_line(files, tmp_path, capsys, case):
    garbage = tmp_path / "g.json"
    garbage.write_text('{"x": [1, 2]}')
    argv = {
        "no_alpha": ["--layers", "8"],
        "alpha_range": ["--layers", "8", "--alpha", "2:1:1.5"],
        "alpha_syntax": ["--layers", "8", "--alpha", "2-1-0.5"],
        "n_over_L": ["--layers", "2", "--alpha", "4:1:0.5"],
        "no_shape": ["--alpha", "2:1:0.5"],
        "missing_json": ["--layers", "8", "--alphas", str(tmp_path / "nope.json")],
        "seconds_without_t_full": ["--layers", "8", "--t-draft", "0.1", "--alpha", "2:1:0.5"],
        "bad_alphas_json": ["--layers", "8", "--alphas", str(garbage)],
    }[case]
    assert spd_plan.main([*argv, "--plot", ""]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


TIMES = {"T_full_s": 0.1, "T_draft_s": 0.01, "L_s": 3, "overhead_s": 0.0, "n": 2, "L": 4, "slowest_stage_s": 0.06}
EAGLE3 = {"k": 3, "alpha": 2.0, "tau": 2.0, "T_full_s": 0.1, "T_draft_step_s": 0.01, "T_verify_s": 0.1}


@pytest.mark.parametrize(
    "edit,message",
    [
        ({"L_s": 0}, "plan_inputs.L_s=0 must be an integer >= 1"),  # was ZeroDivisionError
        ({"L_s": "3"}, "plan_inputs.L_s='3' must be an integer >= 1"),  # the TypeErrors below
        ({"T_full_s": "0.1"}, "plan_inputs.T_full_s='0.1' must be a number > 0"),
        ({"T_draft_s": "0.01"}, "plan_inputs.T_draft_s='0.01' must be a number > 0"),
        ({"n": "2"}, "plan_inputs.n='2' must be an integer >= 1"),
        ({"overhead_s": "x"}, "plan_inputs.overhead_s='x' must be a number >= 0"),
        ({"L": "4"}, "plan_inputs.L='4' must be an integer >= 1"),
        ({"T_draft_s": math.nan}, "plan_inputs.T_draft_s=nan must be a number > 0"),  # was a silent 1.00x
        ({"plan_inputs_eagle3": [{**EAGLE3, "T_full_s": 0}]}, "plan_inputs_eagle3[0].T_full_s=0 must be a number > 0"),
        ({"plan_inputs_eagle3": [{**EAGLE3, "k": "3"}]}, "plan_inputs_eagle3[0].k='3' must be an integer >= 1"),
        ({"plan_inputs_eagle3": [{"alpha": 2.0}]}, "plan_inputs_eagle3[0] has no k"),
        ({"plan_inputs_eagle3": {"k": 3}}, "plan_inputs_eagle3 must be a list of rows"),
    ],
)
def test_plan_reads_a_hand_edited_eval_json_with_one_line(tmp_path, capsys, edit, message):
    """`--times eval.json` edited by hand: a zero, a string, a NaN is one line naming the value, not a
    ZeroDivisionError/TypeError (exit 1, a bug) nor a silent prediction."""
    edit = dict(edit)
    eagle3 = edit.pop("plan_inputs_eagle3", [EAGLE3])
    times = tmp_path / "eval.json"
    times.write_text(json.dumps({"plan_inputs": {**TIMES, **edit}, "plan_inputs_eagle3": eagle3}))
    assert spd_plan.main(["--times", str(times), "--alpha", "2:3:0.5", "--plot", ""]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    times.write_text(json.dumps({"plan_inputs": TIMES, "plan_inputs_eagle3": [EAGLE3]}))
    assert spd_plan.main(["--times", str(times), "--alpha", "2:3:0.5", "--plot", ""]) == 0  # as written by eval


@pytest.mark.parametrize("flag", [[], ["--t-full", "0.4"]])
def test_plan_divides_eagle3s_times_by_its_own_ar_baseline(tmp_path, flag):
    """Under `--compile` eval measures EAGLE-3 (eager) against an eager AR baseline and SPD against a compiled one:
    the plan divides EAGLE-3's times by its rows' own `T_full_s`, not SPD's (unless `--t-full` sets one for all)."""
    times = tmp_path / "eval.json"
    eagle3 = {**EAGLE3, "T_full_s": 0.2}  # the eager AR forward: slower than SPD's compiled 0.1
    times.write_text(json.dumps({"plan_inputs": TIMES, "plan_inputs_eagle3": [eagle3]}))
    result = spd_plan.run(spd_plan.parse_args(["--times", str(times), "--alpha", "2:3:0.5", "--plot", "", *flag]))
    t_full = float(flag[1]) if flag else 0.2
    expected = costs.s_eagle3(2.0, 3, 0.01 / t_full, 0.1 / t_full)
    assert result["eagle3"][0]["speedup"] == pytest.approx(expected)


@pytest.mark.parametrize("case", ["missing_prompts", "bad_jsonl", "max_new_tokens", "missing_ckpt", "limit"])
def test_eval_bad_input_is_one_line(files, tmp_path, capsys, case):
    base = [
        "--ckpt",
        files["drafter"],
        "--prompts",
        files["sets"][0],
        "--out",
        str(tmp_path / "o"),
        "--simulate",
        "--max-new-tokens",
        "4",
        "--no-progress",
    ]
    argv = {
        "missing_prompts": [*base, "--prompts", str(tmp_path / "nope.jsonl")],
        "bad_jsonl": [*base, "--prompts", files["bad"]],
        "max_new_tokens": [*base, "--max-new-tokens", "0"],
        "missing_ckpt": [*base, "--ckpt", str(tmp_path / "no_drafter")],
        "limit": [*base, "--limit", "0"],
    }[case]
    assert spd_eval.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "o" / "eval.json").exists()


def test_prompt_sets_can_be_datasets(tmp_path):
    """Anything that is not a file goes through `datasets.load_dataset`: a local dataset directory here, a hub
    name (`openai/gsm8k:main@test`) on a machine that reaches the hub."""
    from inference.prompts import PromptError, looks_like_hub_name, read_prompts

    questions = tmp_path / "qa"
    questions.mkdir()
    (questions / "test.jsonl").write_text(
        "".join(json.dumps({"question": q, "answer": "4"}) + "\n" for q in ("2+2?", "3+1?"))
    )
    (questions / "train.jsonl").write_text(json.dumps({"question": "not this split", "answer": "0"}) + "\n")
    assert read_prompts(None, str(questions)) == ["2+2?", "3+1?"]
    assert read_prompts(None, f"{questions}@train") == ["not this split"]
    turns = tmp_path / "mt"
    turns.mkdir()
    (turns / "test.jsonl").write_text(json.dumps({"turns": ["first", "second"]}) + "\n")
    assert read_prompts(None, str(turns)) == ["first"]
    assert looks_like_hub_name("openai/gsm8k:main@test") and not looks_like_hub_name("runs/none.jsonl")
    with pytest.raises(PromptError, match="does not exist"):
        read_prompts(None, str(tmp_path / "none.jsonl"))
    with pytest.raises(PromptError, match="cannot load the dataset .* local jsonl"):
        read_prompts(None, "nobody-here/no-such-set")  # offline in tests: the hub is not reached
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "test.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(PromptError, match="no prompt column"):
        read_prompts(None, str(tmp_path / "bad"))


def test_a_prompts_file_is_read_as_utf8_and_its_turns_as_a_list(tmp_path):
    """UTF-8 whatever the locale, a leading byte-order mark (Windows editors) included; another encoding, or a
    'turns' that is one string (whose first "turn" would be its first letter), is one line naming the line."""
    from inference.prompts import PromptError, read_prompts

    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(("\ufeff" + json.dumps({"turns": ["caf\u00e9 \u2615"]}) + "\n").encode("utf-8"))
    assert read_prompts(None, str(bom)) == ["caf\u00e9 \u2615"]
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"turns": ["hi"]}\n{"turns": ["caf\xe9"]}\n')
    with pytest.raises(PromptError, match=r"latin1.jsonl:2: not UTF-8 text .*save the file as UTF-8"):
        read_prompts(None, str(latin1))
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"turns": "Explain RoPE."}) + "\n")
    with pytest.raises(PromptError, match=r"text.jsonl:1: 'turns' is a str, expected a list"):
        read_prompts(None, str(text))


def test_drafters_of_one_method_are_told_apart_by_their_run():
    assert spd_eval.drafter_name("runs/deep/type_n4_L3/checkpoints/last.ckpt") == "type_n4_L3"
    assert spd_eval.drafter_name("drafters/spd_n4/") == "spd_n4" == spd_eval.drafter_name("spd_n4")


def test_acceptance_per_depth_and_per_draft_position():
    """The benchmark tables' per-depth (SPD, PPSD) and per-position (EAGLE-3) acceptance, pooled by hand."""
    from inference.cycle.result import DecodeResult
    from inference.evaluation.totals import acceptance_by, acceptance_by_position

    def result(accepted, rejected):
        counters = {"accepted_by_depth": accepted, "rejected_by_depth": rejected}
        return DecodeResult(mode="spd", n=3, prompt_len=1, tokens=[1], K=1, stop_reason="eos", counters=counters)

    pooled = acceptance_by([result([1, 0, 2], [1, 0, 0]), result([2, 0, 0], [0, 0, 2])], "depth")
    assert pooled == [3 / 4, None, 2 / 4]
    # forwards accepting 0, 1, 3 and 0 of k = 3 drafts: position 1 reached 4 times (2 accepted), position 2 twice
    # (1 accepted), position 3 once (accepted)
    assert acceptance_by_position([1, 2, 4, 1], 3) == [0.5, 0.5, 1.0]
    assert acceptance_by_position([1, 1], 2) == [0.0, None]


def test_eval_reports_acceptance_per_depth(evaluated):
    report = json.loads((evaluated / "eval.json").read_text())
    for row in report["results"]:
        rates = row["accept_by_depth"]
        assert len(rates) >= report["n"] and any(r is not None for r in rates)
        assert all(r is None or 0 <= r <= 1 for r in rates)


CUSTOM_MODELING = """
from transformers import Qwen3Config, Qwen3ForCausalLM


class CustomQwen3Config(Qwen3Config):
    model_type = "spd_custom_qwen3"


class CustomQwen3ForCausalLM(Qwen3ForCausalLM):
    config_class = CustomQwen3Config
"""


def test_eval_trusts_the_targets_own_code_when_told(tmp_path_factory, tmp_path, capsys):
    """A target whose config names its own modeling code (`auto_map`) loads under `--trust-remote-code` everywhere
    eval loads it (the decoder and the AR baseline), and nowhere without it."""
    path, target = target_dir(tmp_path_factory, "qwen3", make_tiny_model)
    (Path(path) / "custom_qwen3.py").write_text(CUSTOM_MODELING)
    config_file = Path(path) / "config.json"
    config = json.loads(config_file.read_text())
    config["model_type"] = "spd_custom_qwen3"
    config["auto_map"] = {
        "AutoConfig": "custom_qwen3.CustomQwen3Config",
        "AutoModelForCausalLM": "custom_qwen3.CustomQwen3ForCausalLM",
    }
    config_file.write_text(json.dumps(config))
    drafter = save_random_drafter(target, Geometry.build(target.num_layers, 2), str(tmp_path / "drafter"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": 0, "turns": ["hello world"]}) + "\n")
    argv = ["--ckpt", drafter, "--prompts", str(prompts), "--max-new-tokens", "4", "--temperatures", "0"]
    argv += ["--out", str(tmp_path / "out"), "--simulate", "--no-progress"]
    capsys.readouterr()  # the target's save progress
    assert spd_eval.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--trust-remote-code" in err, err  # says how to allow it
    assert spd_eval.main([*argv, "--trust-remote-code"]) == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert [(r["set"], r["N"] > 0) for r in report["results"]] == [("p", True), ("overall", True)]


def test_compile_compiles_the_ar_baseline_too(files, monkeypatch):
    """`--compile` compiles the AR baseline's step as it does SPD's: T_full, which every speedup divides by, is
    then not the eager launch-bound time beside SPD's captured graphs. Chain decoding (EAGLE-3) has no compiled
    path, and the report says so."""
    argv = ["--ckpt", files["drafter"], "--prompts", files["sets"][0], "--simulate", "--compile"]
    args = spd_eval.parse_args([*argv, "--max-new-tokens", "1"])
    setup = prepare(args)
    decoders = spd_eval.Decoders(args, [setup], None)
    ran = []  # the stages whose prefill ran the AR decode: one token, so no step (nothing is compiled here)
    prefill = Stage.prefill
    monkeypatch.setattr(Stage, "prefill", lambda stage, *a: ran.append(stage.compiled) or prefill(stage, *a))
    decoders.ar(Sampling(), [[3, 14, 15]])
    assert ran == [True]
    compiled = {"pdm": True, "ar": True, "eagle3": False, "eagle3_ar": False}
    assert spd_eval._report_head(args, setup, None)["compiled"] == compiled


@pytest.fixture
def growth(monkeypatch):
    """Every capacity bucket a stage cache or the PDM's cache grows to (under `--compile` a new bucket is a new graph
    per stage and fill level), tagged with `growth.phase` at the time; buckets of 4 positions, so a few tokens more
    cross one."""
    monkeypatch.setattr(inference.runtime.cache, "CAPACITY_STEP", 4)
    growth = SimpleNamespace(phase="warm-up", grew=[])

    def recorded(reserve):
        def recording(self, positions):
            held = self.capacity
            reserve(self, positions)
            if self.capacity != held:
                growth.grew.append((growth.phase, type(self).__name__, self.capacity))

        return recording

    monkeypatch.setattr(StageCache, "reserve", recorded(StageCache.reserve))
    monkeypatch.setattr(PDMDrafter, "_reserve", recorded(PDMDrafter._reserve))
    return growth


def test_warm_up_reserves_the_buckets_of_every_measured_decode(files, tmp_path, growth, monkeypatch):
    """The warm-up (simulator, AR) reaches every capacity bucket the measured decodes need: no graph is compiled
    and captured inside a measured prompt's times under `--compile`."""
    sets = []
    for name, turns in (("short", ["hi"]), ("long", ["the cat sat on the mat and then " * 6])):
        sets.append(tmp_path / f"{name}.jsonl")
        sets[-1].write_text(json.dumps({"question_id": 0, "turns": turns}) + "\n")
    warm_up = spd_eval.Decoders.warm_up

    def warm_up_then_measure(decoders, *args):
        warm_up(decoders, *args)
        growth.phase = "measured"

    monkeypatch.setattr(spd_eval.Decoders, "warm_up", warm_up_then_measure)
    argv = ["--ckpt", files["drafter"], "--prompts", *map(str, sets), "--max-new-tokens", "12", "--temperatures", "0"]
    assert spd_eval.main([*argv, "--out", str(tmp_path / "out"), "--simulate", "--no-progress"]) == 0
    assert {kind for phase, kind, _ in growth.grew} == {"StageCache", "PDMDrafter"}
    assert [grew for grew in growth.grew if grew[0] == "measured"] == []


def test_distributed_ranks_warm_up_before_the_measured_prompts(files, growth, monkeypatch):
    """Fresh ranks per launch: with `DecodeJob.warm_up` each rank decodes the longest request first, unreported.
    The ranks' runner is the simulator here (the same runner over a local transport: no process group)."""
    args = spd_eval.parse_args(["--ckpt", files["drafter"], "--prompts", files["sets"][0], "--max-new-tokens", "12"])
    setup = prepare(args)
    target = Target.load(setup.target_path, setup.dtype, "cpu")
    runner = Simulator(target, load_drafter(setup.ckpt, "cpu", target.lm_head.weight)[0], setup.geometry)
    growth.grew.clear()  # the drafter's first bucket, at construction
    run, runs = runner.run, []

    def counted(requests, on_result=None):  # growth.phase: which workload of the rank's it is
        growth.phase = len(runs)
        runs.append([len(r.prompt_ids) for r in requests])
        return run(requests, on_result)

    monkeypatch.setattr(runner, "run", counted)
    monkeypatch.setattr(launch_module, "build_runner", lambda job, rank, device: runner)
    prompts = [[3, 14], list(range(3, 33))]  # capacities 17 and 45: buckets 32 and 64
    job = decode_job(setup, args, prompts, Sampling(), profile=False, warm_up=True)
    reported = []

    def report(index, result):
        reported.append(index)

    launch_module.decode_prompts(job, runner.verifier_rank, torch.device("cpu"), None, report, None)
    assert runs == [[30], [2, 30]] and reported == [0, 1]  # the longest first, alone and unreported
    assert {phase for phase, _, _ in growth.grew} == {0} and (0, "StageCache", 64) in growth.grew
    launched = []  # eval's distributed decodes ask for it
    monkeypatch.setattr(spd_eval, "launch", lambda job, on_result: launched.append(job) or [])
    spd_eval.PdmDecoder(args, setup, target).decode(Sampling(), prompts, lambda done: None)
    assert launched[0].warm_up


def test_plan_options_it_cannot_use_are_refused_or_warned_about(tmp_path, capsys, caplog):
    """`--draft-fixed` is seconds (it was added to target layers in the config-only model); `--batch-alpha` needs a
    batch plan; `--plot` plots the SPD plan, which an EAGLE-3-only plan has not (it wrote nothing, silently)."""
    config_only = ["--layers", "32", "--alpha", "8:3:0.42", "--plot", ""]
    assert spd_plan.main([*config_only, "--draft-fixed", "0.0005"]) == 2
    assert "--draft-fixed/--overhead/--stage-fixed are seconds" in capsys.readouterr().err
    assert spd_plan.main([*config_only, "--batch-alpha", "2"]) == 2
    assert "--batch-alpha sets the batch plan's tokens per cycle: it needs --batch-times" in capsys.readouterr().err
    times, out = tmp_path / "eval.json", tmp_path / "p.png"
    times.write_text(json.dumps({"plan_inputs_eagle3": [EAGLE3]}))
    assert spd_plan.main(["--times", str(times), "--plot", str(out)]) == 0
    assert not out.exists() and f"--plot {out} not written: it plots the SPD plan" in caplog.text
