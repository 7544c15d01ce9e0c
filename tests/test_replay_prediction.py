"""`scripts/replay_prediction.py` end to end on a micro target: a drafter fitted for a few steps, exported and
decoded at T = 0; the script walks its teacher-forced drafts over the decode's answers (their counts must be the
decoder's) and over the fit's validation split. The exactness itself is proven in tests/test_decode_prediction.py."""

import json

from kit import fit_args, load_script

from inference.decode import main as decode_main
from spd_lightning import cli


def test_the_script_walks_a_decode_and_a_validation_split(micro_target, tmp_path):
    cli.run_cli(["fit", *fit_args(micro_target, tmp_path, "--trainer.max_steps", "3")])
    last = str(tmp_path / "ckpt" / "last.ckpt")
    drafter = cli.export(["--ckpt", last, "--out", str(tmp_path / "drafter")])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in ("hello there", "tell me a story")))
    decoded = str(tmp_path / "decode.json")
    argv = ["--ckpt", drafter, "--prompts", str(prompts), "--max-new-tokens", "12", "--simulate", "--json", decoded]
    assert decode_main(argv) == 0

    script = load_script("replay_prediction")
    out = tmp_path / "walked.json"
    script.main(["--ckpt", last, "--drafter", drafter, "--decode", decoded, "--out", str(out)])
    walked = json.loads(out.read_text())["decode"]
    assert walked["counts_equal"] and walked["n_alpha_equal"] and walked["answers"] == 2
    judged = sum(walked["walked"]["accepted_by_fill"]) + sum(walked["walked"]["rejected_by_fill"])
    assert judged == walked["drafted_tokens"] == sum(len(p["tokens"]) - 1 for p in json.load(open(decoded))["prompts"])

    script.main(
        ["--ckpt", last, "--drafter", drafter, "--target", micro_target, "--out", str(out), "--val-batches", "2"]
        + ["--fit-args", *fit_args(micro_target, tmp_path)]
    )
    split = json.loads(out.read_text())
    assert set(split) == {"all", "first", "first63", "rotated"}
    assert split["all"]["answers"] == 4 and split["all"]["drafted_tokens"] >= split["first63"]["drafted_tokens"] > 0
