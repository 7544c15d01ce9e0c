"""Plot a `fit` run's validation curve (and the training agreement) from its CSV log, for a drafter's TRAINING.md.

    python scripts/training_curve.py runs/smollm2/fit/version_0/metrics.csv drafters/smollm2-135m/validation.png

Prints the validation rows (step, val/loss, val/agree) as a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from inference.evaluation.tables import pyplot, save


def read_rows(path: str) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


def series(rows: list[dict[str, str]], key: str) -> tuple[list[int], list[float]]:
    points = [(int(r["step"]), float(r[key])) for r in rows if r.get(key)]
    return [s for s, _ in points], [v for _, v in points]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", help="metrics.csv of a CSVLogger run")
    parser.add_argument("out", help="the PNG to write")
    args = parser.parse_args(argv)
    rows = read_rows(args.metrics)
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    for key, axis in (("val/loss", left), ("val/agree", right)):
        steps, values = series(rows, key)
        axis.plot(steps, values, marker="o", label=key)
        axis.set_xlabel("optimizer step")
        axis.set_title(key)
    steps, values = series(rows, "train/agree")
    right.plot(steps, values, alpha=0.4, label="train/agree")
    right.legend()
    save(fig, args.out)
    print("| step | val/loss | val/agree |\n|---:|---:|---:|")
    for row in rows:
        if row.get("val/loss"):
            print(f"| {row['step']} | {float(row['val/loss']):.3f} | {float(row['val/agree']):.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
