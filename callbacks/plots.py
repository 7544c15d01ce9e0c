"""The two pictures of the staircase dashboard, as PNG files (logged to W&B as images, kept on disk for any logger)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # headless: training nodes have no display
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402


def heatmap_png(rate: torch.Tensor, path: str, step: int) -> str:
    """`rate[depth 0..n, fill 1..n]` (NaN where a depth/fill pair never occurs) as an annotated heatmap."""
    depths, fills = rate.shape
    fig, ax = plt.subplots(figsize=(1.0 + 0.7 * fills, 1.0 + 0.5 * depths))
    im = ax.imshow(rate.numpy(), vmin=0.0, vmax=1.0, cmap="viridis", origin="lower", aspect="auto")
    for k in range(depths):
        for a in range(fills):
            v = rate[k, a].item()
            if v == v:  # not NaN
                ax.text(a, k, f"{v:.2f}", ha="center", va="center", fontsize=7, color="white" if v < 0.6 else "black")
    ax.set_xticks(range(fills), [str(a + 1) for a in range(fills)])
    ax.set_yticks(range(depths), [str(k) for k in range(depths)])
    ax.set_xlabel("fill level a")
    ax.set_ylabel("depth of the drafting copy")
    ax.set_title(f"teacher-forced top-1 agreement, step {step}", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.05)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def alpha_curve_png(history: list[tuple[int, float]], path: str) -> str:
    """Step acceptance alpha = N/K against the training step."""
    fig, ax = plt.subplots(figsize=(5, 3))
    if history:
        steps, alphas = zip(*history)
        ax.plot(steps, alphas, marker="o")
    ax.set_xlabel("global step")
    ax.set_ylabel("alpha = N / K")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.set_title("staircase acceptance", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
