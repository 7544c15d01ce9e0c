"""Compare drafters decoded on the same prompts: `n*alpha` and the per-draft acceptance with 95 % bootstrap
intervals over prompts, the change against the first drafter as a paired interval (the same prompts resampled
together), and the share and acceptance of judged drafts per fill level (the decoder's own counters).

    python -m inference.decode --ckpt A --prompts P.jsonl --simulate --json a.json   # and b.json, c.json
    python scripts/decode_compare.py start=a.json fixed=b.json auto=c.json

Prints a markdown table (docs/SMOLLM2.md keeps such tables with their commands).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from inference.evaluation.intervals import bootstrap, pooled_ratio


def load(path: str) -> dict:
    with open(path) as f:
        report = json.load(f)
    prompts = report["prompts"]
    return {
        "n": report["n"],
        "prompts": [p["prompt"] for p in prompts],
        "N": [p["N"] for p in prompts],
        "K": [p["K"] for p in prompts],
        "accepted": [sum(p["accepted_by_fill"]) for p in prompts],
        "judged": [sum(p["accepted_by_fill"]) + sum(p["rejected_by_fill"]) for p in prompts],
        "accepted_by_fill": np.sum([p["accepted_by_fill"] for p in prompts], axis=0),
        "rejected_by_fill": np.sum([p["rejected_by_fill"] for p in prompts], axis=0),
    }


def fmt(value: float, interval: list[float] | None, digits: int = 3) -> str:
    low, high = interval if interval else (float("nan"), float("nan"))
    return f"{value:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def summary_rows(runs: dict[str, dict]) -> list[str]:
    base_name, base = next(iter(runs.items()))
    rows = [
        f"| drafter | n*alpha [95 % CI] | accepted per judged draft | n*alpha - {base_name}'s (paired) |",
        "|---|---|---|---|",
    ]
    for name, run in runs.items():
        n = run["n"]
        columns = {k: run[k] for k in ("N", "K", "accepted", "judged")}
        columns.update({"N0": base["N"], "K0": base["K"]})
        ci = bootstrap(
            columns,
            {
                "n_alpha": pooled_ratio("N", "K", n),
                "p": pooled_ratio("accepted", "judged"),
                "diff": lambda c, n=n: n * (c["N"].sum(1) / c["K"].sum(1) - c["N0"].sum(1) / c["K0"].sum(1)),
            },
        )
        n_alpha = n * sum(run["N"]) / sum(run["K"])
        p = sum(run["accepted"]) / sum(run["judged"])
        diff = n_alpha - base["n"] * sum(base["N"]) / sum(base["K"])
        rows.append(f"| {name} | {fmt(n_alpha, ci['n_alpha'], 2)} | {fmt(p, ci['p'])} | {fmt(diff, ci['diff'], 2)} |")
    return rows


def fill_rows(runs: dict[str, dict]) -> list[str]:
    n = next(iter(runs.values()))["n"]
    rows = ["| fill level | " + " | ".join(str(k) for k in range(1, n + 1)) + " |", "|---" * (n + 1) + "|"]
    for name, run in runs.items():
        accepted, rejected = run["accepted_by_fill"], run["rejected_by_fill"]
        judged = accepted + rejected
        share = judged / judged.sum()
        rate = np.divide(accepted, judged, out=np.full(n, np.nan), where=judged > 0)
        rows.append(f"| share, {name} | " + " | ".join(f"{s:.2f}" for s in share) + " |")
        rows.append(f"| acceptance, {name} | " + " | ".join(f"{r:.2f}" for r in rate) + " |")
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="NAME=REPORT.json", help="decode --json reports; the first is the base")
    args = p.parse_args(argv)
    if any("=" not in r for r in args.runs):
        sys.exit("error: give each report as NAME=PATH, e.g. fixed=fixed.json")
    runs = {name: load(path) for name, path in (r.split("=", 1) for r in args.runs)}
    first = next(iter(runs.values()))
    for name, run in runs.items():
        if run["prompts"] != first["prompts"] or run["n"] != first["n"]:
            sys.exit(f"error: {name} decoded other prompts or another n than the first report: compare like with like")
    print("\n".join(summary_rows(runs)) + "\n\n" + "\n".join(fill_rows(runs)))


if __name__ == "__main__":
    main()
