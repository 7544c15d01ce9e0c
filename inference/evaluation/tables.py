"""The few helpers every report of this project uses: numbers in cells, markdown tables, matplotlib bars.

`inference.eval`, `inference.plan` and `scripts/bench_paper.py` write their tables and plots with these,
so a missing number reads `-` everywhere and every plot is drawn off-screen the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def fmt(x, digits: int = 3) -> str:
    """A table cell: `-` for a missing or non-finite number, floats with `digits` decimals."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def fmt_ci(x, interval: Sequence[float] | None, digits: int = 2) -> str:
    """A value with its 95 % interval, `1.23 [1.10, 1.35]`; the value alone when it has none."""
    if interval is None or x is None:
        return fmt(x, digits)
    return f"{fmt(x, digits)} [{fmt(interval[0], digits)}, {fmt(interval[1], digits)}]"


def fmt_spread(row: dict) -> str:
    """A row's median draft cost `r` with its min-max spread and repeats, `0.287 (0.25-0.31, 15x)`."""
    if row.get("r") is None or row.get("r_repeats") is None:
        return fmt(row.get("r"))
    return f"{fmt(row['r'])} ({fmt(row['r_min'])}-{fmt(row['r_max'])}, {row['r_repeats']}x)"


def markdown_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """The lines of a markdown table: the header, its rule, one line per row."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]


def pyplot():
    """matplotlib's pyplot on the off-screen backend (imported only when a plot is drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def grouped_bars(ax, series: Sequence[tuple[str, Sequence[float | None]]]) -> list[float]:
    """One group of bars per x position, one bar per (label, values) series, side by side (the group 0.8 wide);
    returns the x positions of the groups. A missing value draws as 0."""
    x = list(range(len(series[0][1])))
    bar = 0.8 / len(series)
    for j, (label, values) in enumerate(series):
        ax.bar([i + (j - (len(series) - 1) / 2) * bar for i in x], [v or 0.0 for v in values], bar, label=label)
    return x


def save(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    fig.clear()
    pyplot().close(fig)


def rates(values: list[float | None] | None) -> str:
    """Acceptance per fill, depth or draft position, compact (`-`: none judged there or not recorded)."""
    return " ".join("-" if v is None else f"{v:.2f}" for v in values) if values else "-"
