"""Each run's validation curve beside the tables, so a drafter that trained less well than another is visible:
the held-out top-1 agreement of the loss copy (SPD, PPSD: `val/agree`; EAGLE-3: its first draft position,
`val/agree_step0`) at every validation of the run's CSV log."""

from __future__ import annotations

import csv
import glob
import os

from inference.evaluation.tables import pyplot, save

AGREEMENT_KEYS = ("val/agree", "val/agree_step0")


def validation_curve(run_dir: str) -> tuple[list[int], list[float]]:
    """(steps, agreement) from every CSV log version of the run, in step order; empty when it has none."""
    points = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "fit", "version_*", "metrics.csv"))):
        with open(path) as f:
            for row in csv.DictReader(f):
                key = next((k for k in AGREEMENT_KEYS if row.get(k)), None)
                if key is not None:
                    points[int(row["step"])] = float(row[key])
    steps = sorted(points)
    return steps, [points[s] for s in steps]


def plot_curves(root: str, names: list[str], path: str) -> list[str]:
    """One line per run that has a log; returns the runs drawn."""
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    drawn = []
    for name in names:
        steps, agree = validation_curve(os.path.join(root, name))
        if steps:
            ax.plot(steps, agree, marker=".", label=name)
            drawn.append(name)
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out top-1 agreement with the target")
    ax.set_title("validation curves (EAGLE-3: first draft position)")
    ax.legend(fontsize=8)
    save(fig, path)
    return drawn
