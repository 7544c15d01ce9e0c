"""Draw the decoder's per-cycle critical path, both PDM placements (docs/DESIGN.md, "The critical path").

    .venv/bin/python scripts/critical_path_figure.py --out docs/critical_path.png

A schematic, not a measurement: two steady-state cycles of a full pipeline (n = 3, pre-step drafting) with
unit-length stage forwards, a draft of 0.8 and a judgement of 0.15. Each bar is what a rank (or, with
`--pdm-placement shared`, one CUDA stream of process 0) does; each arrow is a message a later bar waits for.
What it shows: no stage forward waits for a verdict or for the draft the verifier judges later; the PDM
drafts from the anchor states the other stages send as their step starts (the previous step's) and checks
the verdict afterwards; in the shared placement stage 1's forward is launched first and waits for no other
process, while the receives of those anchor states and the draft run beside it on the second stream.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from inference.evaluation.tables import pyplot, save  # noqa: E402

FORWARD, DRAFT, JUDGE = 1.0, 0.8, 0.15
COLORS = {"forward": "#4c72b0", "draft": "#dd8452", "judge": "#55a868", "anchors": "#8c8c8c"}


def bars(shared: bool) -> tuple[list[str], list[tuple[int, float, float, str, str]], list[tuple]]:
    """Rows, bars `(row, start, length, kind, label)` and arrows `(row_from, t_from, row_to, t_to, label)`."""
    if shared:
        rows = ["process 0, main stream\n(stage 1)", "process 0, side stream\n(PDM)", "stage 2", "stage 3\n(verifier)"]
        s1, pdm, s2, s3 = 0, 1, 2, 3
    else:
        rows = ["stage 1", "stage 2", "stage 3\n(verifier)", "PDM rank"]
        s1, s2, s3, pdm = 0, 1, 2, 3
    items, arrows = [], []
    for j in range(2):
        t = j * (FORWARD + 0.25)
        items.append((s1, t, FORWARD, "forward", f"draft {j}"))
        items.append((s2, t, FORWARD, "forward", f"token {j - 1}"))
        items.append((s3, t, FORWARD, "forward", f"token {j - 2}"))
        items.append((s3, t + FORWARD + 0.02, JUDGE, "judge", "judge"))
        start = t + (0.05 if shared else 0.1)  # shared: launched right after stage 1's forward, on its own stream
        items.append((pdm, start, DRAFT, "draft", f"draft {j + 1}"))
        arrows.append((pdm, start + DRAFT, s1, t + FORWARD + 0.25, "draft"))  # stage 1's next input
        arrows.append((pdm, start + DRAFT, s3, t + FORWARD + 0.02, "draft"))  # taken after the verifier's forward
        arrows.append((s3, t + FORWARD + 0.02 + JUDGE, pdm, start + FORWARD + 0.25 + DRAFT, "verdict"))
        for s in (s2, s3):  # the previous step's anchor states, sent as the stage's step starts
            arrows.append((s, t, pdm, start, "anchors"))
    return rows, items, arrows


def draw(out: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(10, 7.2))
    for ax, shared in zip(axes, (False, True)):
        rows, items, arrows = bars(shared)
        for row, start, length, kind, label in items:
            ax.barh(row, length, left=start, color=COLORS[kind], edgecolor="black", height=0.55)
            ax.text(start + length / 2, row, label, ha="center", va="center", fontsize=7, color="white")
        for r0, t0, r1, t1, label in arrows:
            if max(t0, t1) < 2.8:
                color = {"verdict": COLORS["judge"], "anchors": COLORS["anchors"]}.get(label, COLORS["draft"])
                ax.annotate("", xy=(t1, r1), xytext=(t0, r0), arrowprops=dict(arrowstyle="->", lw=1.0, color=color))
        ax.set_yticks(range(len(rows)), rows, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(-0.1, 2.8)
        ax.set_xlabel("time (one stage forward = 1)")
        name = "shared (--pdm-placement shared: the PDM on stage 1's GPU)" if shared else "separate (n + 1 GPUs)"
        ax.set_title(f"PDM placement {name}", fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in ("forward", "draft", "judge", "anchors")]
    labels = [
        "stage forward",
        "PDM draft (arrows: the draft, to stage 1 and to the verifier)",
        "judgement (arrow: the verdict, read by the PDM after its next draft)",
        "arrows: the previous step's anchor states, to the PDM (shared: received on its stream, after stage 1's launch)",
    ]
    axes[1].legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.25), fontsize=8)
    fig.suptitle("Per-cycle critical path (schematic, n = 3, pre-step)")
    save(fig, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/critical_path.png")
    draw(p.parse_args(argv).out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
