"""Plot a `fit` run's validation curve (and the training agreement) from its CSV logs, for a drafter's TRAINING.md.

    python scripts/training_curve.py runs/smollm2/fit/version_0/metrics.csv drafters/smollm2-135m/validation.png

Several logs are the legs of one drafter, in order: a resumed leg continues the step count itself; a warm-started
leg (`--model.init_from`) counts from 0 again, so its steps continue from the previous leg's last one, and a dotted
line marks where it began. `--csv` writes the legs as one log. Prints the validation rows (step, val/loss,
val/agree) as a markdown table on stdout.
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


def join_legs(legs: list[list[dict[str, str]]]) -> tuple[list[dict[str, str]], list[int]]:
    """The legs' rows as one log (steps of a leg that restarts at 0 shifted past the previous leg), and the steps
    where such a warm-started leg began."""
    rows: list[dict[str, str]] = []
    starts = []
    for leg in legs:
        last = max((int(r["step"]) for r in rows), default=0)
        shift = last if rows and min(int(r["step"]) for r in leg) < last else 0
        if shift:
            starts.append(shift)
        rows += [{**r, "step": str(int(r["step"]) + shift)} for r in leg]
    return rows, starts


def write_rows(rows: list[dict[str, str]], path: str) -> None:
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def series(rows: list[dict[str, str]], key: str) -> tuple[list[int], list[float]]:
    points = [(int(r["step"]), float(r[key])) for r in rows if r.get(key)]
    return [s for s, _ in points], [v for _, v in points]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", nargs="+", help="metrics.csv of a CSVLogger run; several: the legs, in order")
    parser.add_argument("out", help="the PNG to write")
    parser.add_argument("--csv", help="also write the legs as one CSV log here")
    args = parser.parse_args(argv)
    rows, starts = join_legs([read_rows(path) for path in args.metrics])
    if args.csv:
        write_rows(rows, args.csv)
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    for key, axis in (("val/loss", left), ("val/agree", right)):
        steps, values = series(rows, key)
        axis.plot(steps, values, marker="o", label=key)
        for step in starts:
            axis.axvline(step, linestyle=":", color="grey")
        axis.set_xlabel("optimizer step (dotted: a warm-started leg begins)" if starts else "optimizer step")
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
