"""tune's report: the halving and cliff rules in words, the knee of KLD against K, tune.md and the chart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

CHART = "tune-kld.png"


HALVING_RULE = (
    "successive halving over held-out units spread over every "
    "file; after each round a candidate leaves when its paired "
    "KLD difference to the round's leader exceeds z standard errors (over chunks); the finalists are scored on "
    "every unit"
)
CLIFF_RULE = (
    "the K with the largest rise in slope of mean KLD against K: over the K given in ascending order, "
    "(slope to the next K) - (slope from the previous K); at least 3 K, else none"
)


def knee(points: list[tuple[int, float]]) -> int | None:
    """The K of `points` (K, mean KLD) where the slope of KLD against K rises most (`CLIFF_RULE`):
    below it KLD climbs steeply as experts are dropped, above it the curve is flat."""
    points = sorted(points)
    best, best_rise = None, None
    for (k0, y0), (k1, y1), (k2, y2) in zip(points, points[1:], points[2:]):
        rise = (y2 - y1) / (k2 - k1) - (y1 - y0) / (k1 - k0)
        if best_rise is None or rise > best_rise:
            best, best_rise = k1, rise
    return best


def cliff(candidates: list[dict[str, Any]], methods: tuple[str, ...], keeps: tuple[int, ...]) -> dict[str, Any]:
    """Per method and for the best candidate per K: the curve of mean KLD against K and its knee.
    A method's curve compares its candidates on the units all of them were scored on
    (`kld_mean_common`, when given); the best per K is the winner of each K (scored on every unit)
    when the candidates name one, else the lowest mean KLD."""
    out: dict[str, Any] = {"rule": CLIFF_RULE, "methods": {}}
    for method in methods:
        curve = sorted((c["K"], c.get("kld_mean_common", c["kld_mean"])) for c in candidates if c["method"] == method)
        out["methods"][method] = {"K": knee(curve), "curve": [list(p) for p in curve]}
    best = []
    for k in keeps:
        at_k = [c for c in candidates if c["K"] == k]
        winners = [c for c in at_k if c.get("winner")]
        best.append((k, winners[0]["kld_mean"] if winners else min(c["kld_mean"] for c in at_k)))
    out["best"] = {"K": knee(sorted(best)), "curve": [list(p) for p in sorted(best)]}
    return out


def ranked(candidates: list[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """The candidates of one K: the most chunks first (the finalists), then by mean KLD."""
    return sorted((c for c in candidates if c["K"] == k), key=lambda c: (-c["chunks_scored"], c["kld_mean"], c["id"]))


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# tune: {report['model']['name']}",
        "",
        f"Mean KLD against the unpruned model (llama-perplexity's statistics), pruned experts masked out of routing; "
        f"ctx {report['parameters']['ctx']}, held-out: {', '.join(Path(f['path']).name for f in report['heldout'])}. "
        "Candidates stopped early were scored on fewer chunks: each left "
        "a round of successive halving when its paired KLD difference "
        "to that round's leader exceeded two standard errors (over chunks: tokens of one chunk share their context).",
        "",
    ]
    stable = any("stability" in c for c in report["candidates"])
    if stable:
        lines += [
            "Halves overlap: the method's keep-sets from the first and from the second half of the calibration text, "
            "mean over blocks of |A∩B|/K (1: the calibration decided every choice; near K/experts: chance).",
            "",
        ]
    for k in report["keeps"]:
        lines += [
            f"## K = {k} of {report['model']['expert_count']}",
            "",
            "| rank | method | mean KLD | ± | 99.9% KLD | same top p | PPL | chunks "
            f"| stopped early | identical to |{' halves overlap |' if stable else ''}",
            f"|---:|---|---:|---:|---:|---:|---:|---:|---|---|{'---:|' if stable else ''}",
        ]
        for rank, c in enumerate(ranked(report["candidates"], k), 1):
            name = f"**{c['method']}**" if c["winner"] else c["method"]
            overlap_cell = (f" {c['stability']['overlap']:.3f} |" if "stability" in c else " |") if stable else ""
            lines.append(
                f"| {rank} | {name} | {c['kld_mean']:.4f} | {c['kld_mean_stderr']:.4f} "
                f"| {c['kld_p999']:.4f} | {100 * c['same_top_p']:.2f}% | "
                f"{c['ppl']:.4f} | {c['chunks_scored']} | {'yes' if c['stopped_early'] else 'no'} "
                f"| {c['identical_to'] or ''} |{overlap_cell}"
            )
        lines.append("")
        tied = [c for c in ranked(report["candidates"], k) if c["winner"] and c.get("tie_with")]
        if tied:
            lines += [
                f"Tie within noise: {tied[0]['method']} and "
                f"{', '.join(tied[0]['tie_with'])} differ by less than two standard errors "
                "of their paired KLD difference (over chunks).",
                "",
            ]
        segmented = [c for c in ranked(report["candidates"], k) if len(c.get("segments") or []) > 1]
        if segmented:
            names = [seg["name"] for seg in segmented[0]["segments"]]
            lines += [
                "Mean KLD on each held-out file (its own segment; the same chunks as above):",
                "",
                "| method | " + " | ".join(names) + " |",
                "|---|" + "---:|" * len(names),
            ]
            for c in segmented:
                cells = " | ".join(
                    "–" if seg["kld_mean"] is None else f"{seg['kld_mean']:.4f}" for seg in c["segments"]
                )
                lines.append(f"| {c['method']} | {cells} |")
            lines.append("")
    cliff_of = report.get("cliff")
    if cliff_of and len(report["keeps"]) >= 3:
        lines += [
            "## Cliff",
            "",
            f"Knee of mean KLD against K ({cliff_of['rule']}); each method's curve "
            "compares its candidates on the chunks all of them were scored on.",
            "",
            "| method | knee K | mean KLD at each K |",
            "|---|---:|---|",
        ]
        rows = [*cliff_of["methods"].items(), ("best per K", cliff_of["best"])]
        for method, entry in rows:
            curve = ", ".join(f"{k}: {y:.4f}" for k, y in entry["curve"])
            lines.append(f"| {method} | {entry['K'] if entry['K'] is not None else ''} | {curve} |")
        lines.append("")
    lines += [f"{line}." for line in left_out_lines(report)]
    lines.append(f"Winner written as expert-selection.json: {report['winner']}.")
    return "\n".join(lines) + "\n"


def left_out_lines(report: dict[str, Any]) -> list[str]:
    """One line per method `all` left out: "greedy left out of all: <reason>"."""
    return [f"{method} left out of all: {reason}" for method, reason in report.get("left_out", {}).items()]


MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def method_style(index: int) -> tuple[str, str]:
    """(colour, marker) of the index-th method: tab10's ten colours by seven markers, distinct for 70 methods."""
    return f"C{index % 10}", MARKERS[index % len(MARKERS)]


def tune_figure(candidates: list[dict[str, Any]], methods: list[str]) -> Any:
    """Mean KLD of each method's candidates against K; at a single K, one bar per method."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=110, layout="constrained")  # no pyplot: no global figure state, no GUI backend
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    keeps = sorted({c["K"] for c in candidates})
    if len(keeps) == 1:
        shown = [m for m in methods if any(c["method"] == m for c in candidates)]
        for i, method in enumerate(shown):
            c = next(c for c in candidates if c["method"] == method)
            colour, _ = method_style(methods.index(method))
            ax.bar(
                i,
                c["kld_mean"],
                color="white" if c["stopped_early"] else colour,
                edgecolor=colour,
                hatch="//" if c["stopped_early"] else None,
                label=method,
            )
        ax.set_xticks(range(len(shown)), shown, rotation=45, ha="right", fontsize=8)
        ax.set_xlabel(f"selection method, K = {keeps[0]} experts kept per block")
        title = "hatched: stopped early by successive halving (fewer chunks)"
    else:
        for i, method in enumerate(methods):
            colour, marker = method_style(i)
            series = sorted((c for c in candidates if c["method"] == method), key=lambda c: c["K"])
            ax.plot(
                [c["K"] for c in series], [c["kld_mean"] for c in series], marker=marker, color=colour, label=method
            )
            early = [c for c in series if c["stopped_early"]]  # scored on fewer chunks: hollow
            ax.plot(
                [c["K"] for c in early],
                [c["kld_mean"] for c in early],
                linestyle="none",
                marker=marker,
                markerfacecolor="white",
                color=colour,
            )
        ax.set_xticks(keeps)
        ax.set_xlabel("experts kept per block (K)")
        ax.legend(fontsize=7, ncol=2)
        title = "hollow: stopped early by successive halving (fewer chunks)"
    ax.set_ylabel("mean KLD vs unpruned (nats/token)")
    ax.set_title(title, fontsize=8)
    ax.grid(True, alpha=0.3)
    return fig


def write_chart(candidates: list[dict[str, Any]], methods: list[str], path: Path) -> None:
    """tune-kld.png: mean KLD against K, a line per method."""
    fig = tune_figure(candidates, methods)
    from ggufcarve.fileio import save_figure

    save_figure(fig, path)
