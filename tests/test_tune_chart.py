"""tune-kld.png without looking at pixels: every method has its own (colour, marker), a single K is
drawn as one bar per method, and the title lies inside the figure."""

from __future__ import annotations

import pytest

METHODS = [f"method-{i}" for i in range(13)]


def _candidates(keeps):
    return [
        {"method": m, "K": k, "kld_mean": 0.01 * (i + 1) + 0.1 / k, "stopped_early": i % 3 == 0}
        for i, m in enumerate(METHODS)
        for k in keeps
    ]


def _title_inside(fig):
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)
    box, frame = fig.axes[0].title.get_window_extent(renderer), fig.bbox
    return frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1


def test_every_method_has_its_own_colour_and_marker_over_several_keeps():
    from matplotlib.colors import to_rgba

    from ggufcarve.tune.report import tune_figure

    fig = tune_figure(_candidates([4, 6, 8]), METHODS)
    lines = [line for line in fig.axes[0].get_lines() if line.get_label() in METHODS]
    assert sorted(line.get_label() for line in lines) == sorted(METHODS)
    styles = {(to_rgba(line.get_color()), line.get_marker()) for line in lines}
    assert len(styles) == len(METHODS)
    assert _title_inside(fig)


def test_a_single_keep_is_one_bar_per_method():
    from ggufcarve.tune.report import tune_figure

    fig = tune_figure(_candidates([8]), METHODS)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == METHODS
    bars = ax.patches
    assert len(bars) == len(METHODS) and [b.get_height() for b in bars] == pytest.approx(
        [0.01 * (i + 1) + 0.1 / 8 for i in range(13)]
    )
    low, high = ax.get_xlim()
    assert low < 0 and high > len(METHODS) - 1 and high - low < len(METHODS) + 2  # the bars, not a span around one K
    assert _title_inside(fig)
