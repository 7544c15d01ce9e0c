"""scripts/decode_compare.py: the table docs/SMOLLM2.md keeps for drafters decoded on the same prompts."""

import json

import pytest
from kit import load_script

compare = load_script("decode_compare")


def report(path, counts):
    """A decode --json report of n = 2 whose prompt i verified N tokens in K cycles, with its fill counters."""
    prompts = [
        {"prompt": f"p{i}", "N": N, "K": K, "accepted_by_fill": acc, "rejected_by_fill": rej}
        for i, (N, K, acc, rej) in enumerate(counts)
    ]
    path.write_text(json.dumps({"n": 2, "prompts": prompts}))
    return f"{path.stem}={path}"


COUNTS = [(10, 12, [4, 5], [1, 0]), (10, 16, [2, 3], [3, 1]), (10, 14, [3, 4], [2, 0])]


def test_the_table_by_hand(tmp_path, capsys):
    better = [(10, 11, [5, 4], [0, 0])] + COUNTS[1:]
    compare.main([report(tmp_path / "a", COUNTS), report(tmp_path / "b", better)])
    out = capsys.readouterr().out
    # a: n*alpha = 2 * 30 / 42; p = 21 accepted of 28 judged; b gains 2 * (30/41 - 30/42) on the same prompts
    assert f"| a | {2 * 30 / 42:.2f} [" in out and f"{21 / 28:.3f} [" in out and "| 0.00 [0.00, 0.00] |" in out
    assert f"| b | {2 * 30 / 41:.2f} [" in out and f"| {2 * (30 / 41 - 30 / 42):.2f} [" in out
    # fill 1 of a: 9 accepted of 15 judged, fill 2: 12 of 13 (shares 15 / 28 and 13 / 28)
    assert "| share, a | 0.54 | 0.46 |" in out and "| acceptance, a | 0.60 | 0.92 |" in out


def test_reports_of_other_prompts_are_refused(tmp_path):
    other = report(tmp_path / "b", COUNTS[:2])
    with pytest.raises(SystemExit, match="other prompts"):
        compare.main([report(tmp_path / "a", COUNTS), other])
