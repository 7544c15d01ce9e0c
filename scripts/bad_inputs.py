"""Run every CLI on a table of bad inputs and report what the user sees.

Each case calls the CLI's `main(argv)` in this process against a tiny target and a tiny random drafter built in
a temp dir, captures stdout/stderr and the exit code, and records: the exit code, the `error:` line(s), whether a
traceback appeared. The contract every case should meet: non-zero exit, exactly one `error:` line, no traceback.

    python scripts/bad_inputs.py                          # print the table
    python scripts/bad_inputs.py --out docs/BAD_INPUTS.md # write it as markdown

tests/test_bad_inputs.py imports CASES, build_files and run_case from here.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import shutil
import sys
import tempfile
import traceback
from dataclasses import dataclass, field

from spd_lightning.errors import first_line
from spd_lightning.testing import fit_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

for _k, _v in {
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
}.items():
    os.environ.setdefault(_k, _v)

TINY = dict(
    max_steps=1,
    hidden_size=32,
    vocab_size=512,
    seq_len=64,
    batch_size=2,
    max_conversations=200,
    tokenizer_conversations=200,
    heldout_conversations=4,
    heldout_blocks=2,
)


@dataclass(frozen=True)
class Case:
    name: str  # what is wrong
    cli: str  # decode | eval | plan | fit | export | tiny_target
    argv: tuple  # '{key}' placeholders are filled from build_files()
    expect: str  # a fragment the error line must contain
    xfail: str = ""  # non-empty: a known bug (the reason)


@dataclass
class Result:
    case: Case
    argv: list
    exit: object
    stderr: str
    error_lines: list = field(default_factory=list)
    traceback: bool = False
    uncaught: str = ""  # an exception that escaped main()

    @property
    def message(self) -> str:
        if self.error_lines:
            return self.error_lines[0]
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        return self.uncaught or (lines[-1] if lines else "")

    @property
    def clean(self) -> bool:
        return (
            self.exit not in (0, None)
            and len(self.error_lines) == 1
            and not self.traceback
            and not self.uncaught
            and self.case.expect in self.error_lines[0]
        )


PROG = {
    "decode": "python -m inference.decode",
    "eval": "python -m inference.eval",
    "plan": "python -m inference.plan",
    "fit": "python -m spd_lightning fit",
    "export": "python -m spd_lightning export",
    "tiny_target": "python -m spd_lightning.tiny_target",
}

DEC = ("--ckpt", "{drafter}", "--simulate")
FIT = ("@fit",)  # replaced by the shrunk configs/tiny.yaml arguments (spd_lightning.testing.fit_args)

CASES = [
    # inference.decode
    Case("empty prompt", "decode", DEC + ("--prompt", "   "), "empty"),
    Case("no prompt at all", "decode", DEC, "exactly one"),
    Case("missing prompts file", "decode", DEC + ("--prompts", "{root}/none.jsonl"), "does not exist"),
    Case("prompts file with the wrong schema", "decode", DEC + ("--prompts", "{wrong_schema}"), "turns"),
    Case("prompts file that is not JSON", "decode", DEC + ("--prompts", "{not_json}"), "turns"),
    Case("empty prompts file", "decode", DEC + ("--prompts", "{empty_prompts}"), "holds no prompt"),
    Case("prompts file not in UTF-8 (Latin-1)", "decode", DEC + ("--prompts", "{latin1}"), "save the file as UTF-8"),
    Case("prompts file whose 'turns' is a string", "decode", DEC + ("--prompts", "{turns_text}"), "expected a list"),
    Case("prompt with a byte that is not UTF-8", "decode", DEC + ("--prompt", "{not_utf8}"), "not Unicode text"),
    Case("prompts file with a lone surrogate", "decode", DEC + ("--prompts", "{lone_surrogate}"), "not Unicode text"),
    Case("temperature -1", "decode", DEC + ("--prompt", "hi", "--temperature", "-1"), "temperature"),
    Case("top-p 0", "decode", DEC + ("--prompt", "hi", "--top-p", "0"), "top_p"),
    Case("top-p 1.5", "decode", DEC + ("--prompt", "hi", "--top-p", "1.5"), "top_p"),
    Case("top-k -1", "decode", DEC + ("--prompt", "hi", "--top-k", "-1"), "top_k"),
    Case("max-new-tokens 0", "decode", DEC + ("--prompt", "hi", "--max-new-tokens", "0"), "max-new-tokens"),
    Case(
        "max-new-tokens above the target's context",
        "decode",
        DEC + ("--prompt", "hi", "--max-new-tokens", "1000000000"),
        "context of 4096",
    ),
    Case("max-new-tokens not an int", "decode", DEC + ("--prompt", "hi", "--max-new-tokens", "ten"), "invalid int"),
    Case(
        "corrupt checkpoint (random bytes .ckpt)",
        "decode",
        ("--ckpt", "{corrupt}", "--simulate", "--prompt", "hi"),
        "corrupt",
    ),
    Case(
        "missing checkpoint file",
        "decode",
        ("--ckpt", "{root}/nope.ckpt", "--simulate", "--prompt", "hi"),
        "does not exist",
    ),
    Case(
        "missing drafter dir",
        "decode",
        ("--ckpt", "{root}/no_drafter", "--simulate", "--prompt", "hi"),
        "does not exist",
    ),
    Case(
        "drafter dir without config.json",
        "decode",
        ("--ckpt", "{no_config}", "--simulate", "--prompt", "hi"),
        "config.json",
    ),
    Case("truncated drafter weights", "decode", ("--ckpt", "{truncated}", "--simulate", "--prompt", "hi"), "corrupt"),
    Case(
        "drafter of another target (different L)",
        "decode",
        DEC + ("--prompt", "hi", "--target", "{other_L}"),
        "mismatch",
    ),
    Case(
        "drafter of another target (different vocab)",
        "decode",
        DEC + ("--prompt", "hi", "--target", "{other_vocab}"),
        "mismatch",
    ),
    Case(
        "drafter with an older format_version",
        "decode",
        ("--ckpt", "{old_format}", "--simulate", "--prompt", "hi"),
        "re-export",
    ),
    Case("prompt longer than the target context", "decode", DEC + ("--prompts", "{long}"), "context"),
    Case(
        "missing --target directory",
        "decode",
        DEC + ("--prompt", "hi", "--target", "{root}/no_target"),
        "does not exist",
    ),
    Case(
        "--target whose model.safetensors is cut short",
        "decode",
        DEC + ("--prompt", "hi", "--target", "{truncated_target}"),
        "cannot be read",
    ),
    Case(
        "--mode ar, --target whose model.safetensors is cut short",
        "decode",
        ("--mode", "ar", "--prompt", "hi", "--target", "{truncated_target}"),
        "cannot be read",
    ),
    Case(
        "missing --target .gguf file",
        "decode",
        DEC + ("--prompt", "hi", "--target", "{root}/none.gguf"),
        "pass an existing .gguf file",
    ),
    Case(
        "spd mode without a drafter",
        "decode",
        ("--ckpt", "none", "--target", "{target}", "--mode", "spd", "--prompt", "hi"),
        "needs a drafter",
    ),
    Case("unknown dtype", "decode", DEC + ("--prompt", "hi", "--dtype", "float13"), "float13"),
    Case("timeout NaN", "decode", ("--ckpt", "{drafter}", "--prompt", "hi", "--timeout", "nan"), "--timeout=nan"),
    Case("timeout infinite", "decode", ("--ckpt", "{drafter}", "--prompt", "hi", "--timeout", "inf"), "--timeout=inf"),
    Case(
        "lossless check while sampling",
        "decode",
        DEC + ("--prompt", "hi", "--temperature", "1", "--check-lossless"),
        "greedy",
    ),
    # inference.eval
    Case(
        "eval: missing prompts file",
        "eval",
        ("--ckpt", "{drafter}", "--simulate", "--prompts", "{root}/none.jsonl", "--out", "{root}/eval_out"),
        "does not exist",
    ),
    Case(
        "eval: negative temperature",
        "eval",
        (
            "--ckpt",
            "{drafter}",
            "--simulate",
            "--prompts",
            "{prompts}",
            "--temperatures",
            "-1",
            "--out",
            "{root}/eval_out",
        ),
        "temperature",
    ),
    # inference.plan
    Case("plan: alpha spec without ALPHA", "plan", ("--layers", "4", "--alpha", "2:1", "--plot", ""), "N:L_S:ALPHA"),
    Case("plan: alpha spec not numbers", "plan", ("--layers", "4", "--alpha", "a:b:c", "--plot", ""), "N:L_S:ALPHA"),
    Case("plan: alpha above 1", "plan", ("--layers", "4", "--alpha", "2:1:1.5", "--plot", ""), "alpha=1.5"),
    Case("plan: n above L", "plan", ("--layers", "4", "--alpha", "8:1:0.5", "--plot", ""), "exceed"),
    Case(
        "plan: missing alphas file",
        "plan",
        ("--layers", "4", "--alphas", "{root}/none.json", "--plot", ""),
        "does not exist",
    ),
    Case("plan: no alpha", "plan", ("--layers", "4", "--plot", ""), "no alpha"),
    Case(
        "plan: plot in a format matplotlib cannot write",
        "plan",
        ("--layers", "4", "--alpha", "2:1:0.5", "--plot", "{root}/plan.txt"),
        "cannot write .txt",
    ),
    # spd_lightning fit
    Case("fit: n > L", "fit", FIT + ("--model.n", "5"), "n=5"),
    Case("fit: n 0", "fit", FIT + ("--model.n", "0"), "n=0"),
    Case("fit: anchor out of range", "fit", FIT + ("--model.anchors", "[0, 2, 9]"), "out of range"),
    Case("fit: anchors unsorted", "fit", FIT + ("--model.anchors", "[0, 3, 2]"), "strictly increasing"),
    Case("fit: anchors not starting at 0", "fit", FIT + ("--model.anchors", "[1, 2]"), "must start with 0"),
    Case("fit: unknown layout", "fit", FIT + ("--model.layout", "diagonal"), "model.layout: Expected"),
    Case("fit: n not an int", "fit", FIT + ("--model.n", "two"), "model.n: Expected"),
    Case(
        "fit: split with an empty stage",
        "fit",
        FIT + ("--model.n", "3", "--model.split", "[0, 3, 3, 4]"),
        "stage split",
    ),
    Case("fit: missing target path", "fit", FIT + ("--model.target", "{root}/no_target"), "does not exist"),
    Case(
        "fit: target whose model.safetensors is cut short",
        "fit",
        FIT + ("--model.target", "{truncated_target}"),
        "cannot be read",
    ),
    Case("fit: max_length below any sample", "fit", FIT + ("--data.max_length", "8"), "max_length"),
    Case("fit: negative lr", "fit", FIT + ("--model.lr=-1e-3",), "lr="),
    # spd_lightning export
    Case(
        "export: missing ckpt", "export", ("--ckpt", "{root}/nope.ckpt", "--out", "{root}/exported"), "does not exist"
    ),
    Case("export: corrupt ckpt", "export", ("--ckpt", "{corrupt}", "--out", "{root}/exported"), "corrupt"),
    # spd_lightning.tiny_target
    Case("tiny_target: zero budget", "tiny_target", ("--out", "{root}/tt", "--minutes", "0"), "budget"),
]


def build_files(root: str) -> dict:
    """A tiny target (4 layers, 512 ids), two mismatching targets, a random drafter and the broken inputs."""
    import torch

    from spd_lightning.export import DrafterSpec, save_drafter
    from spd_lightning.geometry import Geometry
    from spd_lightning.pdm import PDMConfig, PipelineDraftModule
    from spd_lightning.target import Target
    from spd_lightning.tiny_target import build_tiny_target

    torch.set_num_threads(1)
    files = {"root": root}
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        files["target"] = os.path.join(root, "target")
        build_tiny_target(files["target"], num_layers=4, **TINY)
        files["other_L"] = os.path.join(root, "target_L6")
        build_tiny_target(files["other_L"], num_layers=6, **TINY)
        files["other_vocab"] = os.path.join(root, "target_V384")
        build_tiny_target(files["other_vocab"], num_layers=4, **{**TINY, "vocab_size": 384})
    target = Target.load(files["target"])
    geometry = Geometry.build(target.num_layers, 2)
    g = torch.Generator().manual_seed(0)
    d2t = torch.randperm(target.vocab_size, generator=g)[:48].sort().values
    torch.manual_seed(0)
    cfg = PDMConfig(
        target.hidden_size,
        geometry.num_types,
        48,
        hidden_size=32,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
    )
    pdm = PipelineDraftModule(cfg, d2t).eval()
    spec = DrafterSpec(pdm.cfg, geometry, target.info)
    files["drafter"] = save_drafter(pdm, spec, os.path.join(root, "drafter"))

    files["old_format"] = os.path.join(root, "drafter_old")
    shutil.copytree(files["drafter"], files["old_format"])
    config = os.path.join(files["old_format"], "config.json")
    with open(config) as f:
        d = json.load(f)
    d["format_version"] = 0
    with open(config, "w") as f:
        json.dump(d, f)
    files["no_config"] = os.path.join(root, "drafter_no_config")
    shutil.copytree(files["drafter"], files["no_config"])
    os.remove(os.path.join(files["no_config"], "config.json"))
    files["truncated"] = os.path.join(root, "drafter_truncated")
    shutil.copytree(files["drafter"], files["truncated"])
    weights = os.path.join(files["truncated"], "model.safetensors")
    with open(weights, "rb") as f:
        data = f.read()
    with open(weights, "wb") as f:
        f.write(data[: len(data) // 2])
    files["truncated_target"] = os.path.join(root, "target_truncated")
    shutil.copytree(files["target"], files["truncated_target"])
    weights = os.path.join(files["truncated_target"], "model.safetensors")
    with open(weights, "rb") as f:
        data = f.read()
    with open(weights, "wb") as f:
        f.write(data[: len(data) // 2])
    files["corrupt"] = os.path.join(root, "corrupt.ckpt")
    with open(files["corrupt"], "wb") as f:
        f.write(os.urandom(4096))

    def write(name, text):
        files[name] = os.path.join(root, f"{name}.jsonl")
        with open(files[name], "w") as f:
            f.write(text)

    write("prompts", '{"turns": ["hello world"]}\n')
    write("wrong_schema", '{"text": "hello world"}\n')
    write("not_json", "hello world\n")
    write("empty_prompts", "\n\n")
    files["latin1"] = os.path.join(root, "latin1.jsonl")
    with open(files["latin1"], "wb") as f:
        f.write('{"turns": ["caf\u00e9"]}\n'.encode("latin-1"))
    write("turns_text", '{"turns": "hello world"}\n')
    files["not_utf8"] = "caf\udce9"  # `--prompt caf$'\xe9'` in a Latin-1 terminal: Python's surrogateescape
    write("lone_surrogate", '{"turns": ["caf\\ud800"]}\n')  # valid JSON, not text
    write("long", json.dumps({"turns": [" ".join(f"word{i} and more" for i in range(3000))]}) + "\n")
    return files


def cli_main(cli: str):
    if cli == "decode":
        from inference.decode import main
    elif cli == "eval":
        from inference.evaluation.run import main
    elif cli == "plan":
        from inference.evaluation.plan import main
    elif cli in ("fit", "export"):
        from spd_lightning.cli import main as spd_main

        return lambda argv: spd_main([cli, *argv])
    elif cli == "tiny_target":
        from spd_lightning.tiny_target import main
    else:
        raise ValueError(cli)
    return main


def expand(case: Case, files: dict) -> list[str]:
    argv = []
    for a in case.argv:
        if a == "@fit":
            argv += fit_args(files["target"], os.path.join(files["root"], "fit_" + str(abs(hash(case.name)))))
        else:
            argv.append(a.format(**files))
    return argv


def run_case(case: Case, files: dict) -> Result:
    argv = expand(case, files)
    out, err = io.StringIO(), io.StringIO()
    code, uncaught = None, ""
    os.environ.pop("SPD_DEBUG", None)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli_main(case.cli)(argv)
            code = 0 if code is None or isinstance(code, dict) else code
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException as e:  # noqa: BLE001 - an exception escaping main() is a finding
            traceback.print_exc()
            uncaught = f"uncaught {type(e).__name__}: {first_line(e)}"
            code = 1
    stderr = err.getvalue()
    errors = [line.strip() for line in stderr.splitlines() if "error:" in line and not line.startswith((" ", "\t"))]
    return Result(case, argv, code, stderr, errors, "Traceback" in stderr, uncaught)


def short_command(case: Case) -> str:
    args = []
    for a in case.argv:
        if a == "@fit":
            args.append("<tiny fit args>")
        else:
            args.append(a.replace("{", "<").replace("}", ">") if a.strip() else repr(a))
    return f"{PROG[case.cli]} {' '.join(args)}"


def markdown(results: list[Result], command: str) -> str:
    lines = [
        "# Bad inputs",
        "",
        f"Generated by `{command}` on {datetime.date.today().isoformat()}.",
        "",
        "Every CLI run in-process on a tiny target (4 layers, 512 ids) and a random 2-stage drafter. "
        "The contract: non-zero exit, exactly one `error:` line on stderr, no traceback "
        "(`--debug` shows it). `<name>` stands for a file the script builds in a temp dir.",
        "",
        "| case | command | exit | message | one line, no traceback |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        note = (
            "yes"
            if r.clean
            else "**NO**: "
            + ", ".join(
                filter(
                    None,
                    [
                        "exit 0" if r.exit in (0, None) else "",
                        f"{len(r.error_lines)} error lines" if len(r.error_lines) != 1 else "",
                        "traceback" if r.traceback else "",
                        r.uncaught and "uncaught exception",
                        "" if r.case.expect in r.message else f"expected {r.case.expect!r}",
                    ],
                )
            )
        )
        if r.case.xfail:
            note += f" (known bug: {r.case.xfail})"
        if "usage:" in r.stderr:
            note += " (argparse usage printed above the error line)"
        msg = r.message.replace("|", "\\|").replace("<", "&lt;")
        lines.append(f"| {r.case.name} | `{short_command(r.case)}` | {r.exit} | {msg} | {note} |")
    bad = [r for r in results if not r.clean]
    lines += ["", f"{len(results) - len(bad)} of {len(results)} cases meet the contract."]
    if bad:
        lines += ["", "Cases that do not:", ""]
        for r in bad:
            rest = [
                line.strip()
                for line in r.stderr.splitlines()
                if line.startswith((" ", "\t")) and line.strip() and not line.strip().startswith("[")
            ]
            lines.append(f"- {r.case.name}: `{r.message}`" + (f" followed by `{rest[-1]}`" if rest else ""))
    return "\n".join(lines) + "\n"


def scrub(text: str, files: dict) -> str:
    return text.replace(files["root"], "<tmp>")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the markdown table here (default: print it)")
    p.add_argument("--only", help="run only the cases whose name contains this")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bad_inputs_") as root:
        files = build_files(root)
        results = []
        for case in CASES:
            if args.only and args.only not in case.name:
                continue
            r = run_case(case, files)
            r.error_lines = [scrub(e, files) for e in r.error_lines]
            r.stderr = scrub(r.stderr, files)
            results.append(r)
            print(f"[{'ok' if r.clean else 'BAD'}] {case.name}: exit={r.exit} {r.message[:160]}", file=sys.stderr)
        command = "python scripts/bad_inputs.py" + (f" --out {args.out}" if args.out else "")
        text = markdown(results, command)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0 if all(r.clean for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
