"""A PNG heatmap of a selection: blocks x experts, each block's scores scaled to its maximum,
pruned experts crossed out. Drawn on matplotlib's Agg canvas (no pyplot, no GUI backend)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ggufcarve.fileio import save_figure
from ggufcarve.select.keep import Selection


def write_heatmap(selection: Selection, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    facts = selection.scores.model
    scores = selection.scores.scores()
    blocks = sorted(scores)
    n = facts.expert_count
    grid = np.zeros((len(blocks), n))
    for row, b in enumerate(blocks):
        top = float(np.max(np.abs(scores[b])))
        grid[row] = scores[b] / top if top > 0 else 0.0
    width = min(24.0, max(7.0, 3.0 + n * 0.12))
    height = min(18.0, 2.0 + len(blocks) * 0.3)
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis")
    rows, cols = [], []
    for row, b in enumerate(blocks):
        kept = set(selection.keepset.layers[b])
        pruned = [e for e in range(n) if e not in kept]
        rows += [row] * len(pruned)
        cols += pruned
    ax.scatter(cols, rows, marker="x", s=max(4.0, 600.0 / n), c="red", linewidths=0.8, label="pruned")
    ax.set_yticks(range(len(blocks)), [f"{b} (MTP)" if facts.is_mtp(b) else str(b) for b in blocks])
    ax.set_xlabel("original expert id")
    ax.set_ylabel("block")
    ax.set_title(
        f"{facts.name}: {selection.scores.method}, keep "
        f"{selection.kept_count} of {n}\nscore / block maximum; x = pruned",
        fontsize=9,
    )
    fig.colorbar(image, ax=ax, fraction=0.03)
    fig.tight_layout()
    return save_figure(fig, path)
