"""Every CLI on the bad-input table of scripts/bad_inputs.py: one `error:` line, no traceback, non-zero exit.
Plus safe loading: no unguarded `torch.load`, no remote code from a target's `auto_map` without trust."""

import ast
import json
import os
import sys

import pytest
from kit import REPO

sys.path.insert(0, os.path.join(REPO, "scripts"))

import bad_inputs  # noqa: E402

from spd_lightning.target import Target, TargetError  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """One tiny target (plus two mismatching ones), one random drafter and the broken inputs for every case."""
    return bad_inputs.build_files(str(tmp_path_factory.mktemp("bad_inputs")))


def _param(case):
    marks = [pytest.mark.xfail(reason=case.xfail, strict=True)] if case.xfail else []
    return pytest.param(case, id=case.name, marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in bad_inputs.CASES])
def test_bad_input_gives_one_error_line(files, case):
    r = bad_inputs.run_case(case, files)
    assert r.exit not in (0, None), r.stderr
    assert not r.uncaught, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert len(r.error_lines) == 1, r.stderr
    assert case.expect in r.error_lines[0], r.stderr


def test_case_names_are_unique():
    names = [c.name for c in bad_inputs.CASES]
    assert len(names) == len(set(names))


def _torch_load_calls(path):
    tree = ast.parse(open(path).read(), filename=path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if (
                isinstance(f, ast.Attribute)
                and f.attr == "load"
                and isinstance(f.value, ast.Name)
                and f.value.id == "torch"
            ):
                yield node
            if isinstance(f, ast.Name) and f.id == "load":  # `from torch import load`
                src = open(path).read()
                if "from torch import" in src and " load" in src.split("from torch import", 1)[1].splitlines()[0]:
                    yield node


def test_every_torch_load_uses_weights_only():
    unsafe, seen = [], 0
    for package in ("spd_lightning", "inference", "callbacks"):
        for dirpath, _, names in os.walk(os.path.join(REPO, package)):
            for name in names:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                for call in _torch_load_calls(path):
                    seen += 1
                    ok = any(
                        k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                        for k in call.keywords
                    )
                    if not ok:
                        unsafe.append(f"{os.path.relpath(path, REPO)}:{call.lineno}")
    assert seen >= 1  # the scan finds the loaders it guards
    assert not unsafe, f"torch.load without weights_only=True: {unsafe}"


def test_auto_map_code_is_not_run_without_trust_remote_code(tmp_path):
    target = tmp_path / "evil_target"
    target.mkdir()
    marker = tmp_path / "EXECUTED"
    code = f"open({str(marker)!r}, 'w').write('remote code ran')\n"
    code += (
        "from transformers import PretrainedConfig, PreTrainedModel\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evil_spd'\n"
        "class EvilModel(PreTrainedModel):\n    config_class = EvilConfig\n"
    )
    (target / "evil.py").write_text(code)
    (target / "config.json").write_text(
        json.dumps(
            {
                "model_type": "evil_spd",
                "architectures": ["EvilModel"],
                "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"},
            }
        )
    )
    with pytest.raises(TargetError) as info:
        Target.load(str(target))
    message = str(info.value)
    assert "\n" not in message.strip() and "trust_remote_code" in message, message
    assert not marker.exists(), "the target's custom code ran without trust_remote_code"
