"""Plot a `fit` run's validation curve (and the training agreement) from its CSV logs, for a drafter's TRAINING.md.

    python scripts/training_curve.py runs/smollm2/fit/version_0/metrics.csv drafters/smollm2-135m/validation.png

Several logs are the legs of one drafter, in order: a resumed leg continues the step count itself; a warm-started
leg (`--model.init_from`) counts from 0 again, so its steps continue from the previous leg's last one, and a dotted
line marks where it began. `--csv` writes the legs as one log; `--until STEP` keeps the rows up to STEP (a drafter
exported from a checkpoint before the run's end). Where validation logged them, a second row of panels
shows the teacher-forced acceptance at every fill level (`val/accept_fill{k}`: what greedy decoding accepts of a
draft made with k tokens in flight) and the `n*alpha` the refill model predicts from them beside the staircase
evaluation's measured one; `--walked STEP=JSON ...` adds held-out `n*alpha` at those steps with their intervals
(`scripts/replay_prediction.py --decode` outputs: what a T = 0 decode of the checkpoint gives, exactly). Prints the
validation rows (step, val/loss, val/agree and, when logged, the predicted `n*alpha` and the acceptance per fill) as
a markdown table on stdout, and the walked points after it.
"""

from __future__ import annotations

import argparse
import csv
import json
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


def fill_keys(rows: list[dict[str, str]]) -> list[str]:
    """`val/accept_fill1 .. fill{n}` in fill order, those any row logged."""
    keys = {key for row in rows for key, value in row.items() if key.startswith("val/accept_fill") and value}
    return sorted(keys, key=lambda key: int(key.removeprefix("val/accept_fill")))


def read_walked(pairs: list[str]) -> list[tuple[int, float, list[float]]]:
    """`STEP=JSON` pairs: (step, walked `n*alpha`, its interval) of each replay_prediction `--decode` output."""
    points = []
    for pair in pairs:
        step, _, path = pair.partition("=")
        if not step.isdigit() or not path:
            raise SystemExit(f"--walked {pair!r}: give STEP=JSON, e.g. 16500=runs/smollm2_8m/walked_step16500.json")
        with open(path) as f:
            walked = json.load(f)["decode"]
        points.append((int(step), walked["walked"]["n_alpha"], walked["walked_interval"]))
    return sorted(points)


def plot_fills(
    rows: list[dict[str, str]], fills: list[str], fill_axis, speed_axis, walked: list[tuple[int, float, list[float]]]
) -> None:
    """Acceptance per fill level, and predicted against measured `n*alpha`."""
    for key in fills:
        fill_axis.plot(*series(rows, key), label=f"fill {key.removeprefix('val/accept_fill')}")
    fill_axis.set_title("val/accept_fill{k}: teacher-forced acceptance")
    fill_axis.legend(fontsize=7, ncol=2)
    for key, style in (("val/predicted_n_alpha", "-"), ("staircase/speedup", "o")):
        steps, values = series(rows, key)
        if steps:
            speed_axis.plot(steps, values, style, label=key)
    if walked:
        steps, values, intervals = zip(*walked)
        errors = [[v - lo for v, (lo, _) in zip(values, intervals)], [hi - v for v, (_, hi) in zip(values, intervals)]]
        speed_axis.errorbar(steps, values, yerr=errors, fmt="s", capsize=3, label="held-out decode (walked), 95 % CI")
    speed_axis.set_title("n*alpha: predicted and measured")
    speed_axis.legend(fontsize=7)
    for axis in (fill_axis, speed_axis):
        axis.set_xlabel("optimizer step")


def print_table(rows: list[dict[str, str]], fills: list[str]) -> None:
    extra = (["val/predicted_n_alpha"] if any(r.get("val/predicted_n_alpha") for r in rows) else []) + fills
    names = ["val/loss", "val/agree", *extra]
    print("| step | " + " | ".join(n.removeprefix("val/") for n in names) + " |")
    print("|---:|" + "---:|" * len(names))
    for row in rows:
        if row.get("val/loss"):
            cells = [f"{float(row[n]):.3f}" if row.get(n) else "" for n in names]
            print(f"| {row['step']} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", nargs="+", help="metrics.csv of a CSVLogger run; several: the legs, in order")
    parser.add_argument("out", help="the PNG to write")
    parser.add_argument("--csv", help="also write the legs as one CSV log here")
    parser.add_argument("--until", type=int, help="only the rows up to this step (the drafter's checkpoint)")
    parser.add_argument("--walked", nargs="+", default=[], metavar="STEP=JSON", help="held-out n*alpha of checkpoints")
    args = parser.parse_args(argv)
    walked = read_walked(args.walked)
    rows, starts = join_legs([read_rows(path) for path in args.metrics])
    if args.until is not None:
        rows = [r for r in rows if int(r["step"]) <= args.until]
        starts = [s for s in starts if s <= args.until]
    if args.csv:
        write_rows(rows, args.csv)
    plt = pyplot()
    fills = fill_keys(rows)
    fig, axes = plt.subplots(2 if fills else 1, 2, figsize=(10, 7 if fills else 3.5), squeeze=False)
    (left, right) = axes[0]
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
    if fills:
        plot_fills(rows, fills, *axes[1], walked)
    fig.tight_layout()
    save(fig, args.out)
    print_table(rows, fills)
    for step, value, (lo, hi) in walked:
        print(f"step {step}: held-out n*alpha {value:.3f} [{lo:.2f}, {hi:.2f}] (walked)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
