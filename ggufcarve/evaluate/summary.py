"""summary.md and the charts of an evaluation: the release table, the quality table, and pruned vs unpruned at equal
size.

At equal size: every model is compared with the model of each other family whose size is
closest (by size ratio); the better one by mean KLD is marked. A model is on the Pareto front
when no other model is at most its size with a lower mean KLD.

With several held-out files (segments) summary.md adds a table of each model's figures per file
and size-vs-kld-segments.png the mean KLD against size per file.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from ggufcarve import listing
from ggufcarve.evaluate.speed import speed_text
from ggufcarve.fileio import format_size, size_unit, write_failed
from ggufcarve.listing import add_loop_column

KLD_CHART = "size-vs-kld.png"
PPL_CHART = "size-vs-ppl.png"
SEGMENT_CHART = "size-vs-kld-segments.png"
SPEED_CHART = "speed-vs-kld.png"  # mean KLD against decode tok/s, where two or more files were timed
SUMMARY = "summary.md"


def _fmt(value, digits: int = 4, percent: bool = False) -> str:
    if value is None:
        return "–"
    if percent:
        return f"{100 * value:.2f}%"
    return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:.0f}"


def pareto_front(results: list[dict]) -> set[str]:
    """Names of the evaluated models on the Pareto front of mean KLD against file size (listing.pareto_front)."""
    return {
        r["model"]["name"]
        for r in listing.pareto_front(results, lambda r: r["model"]["bytes"], lambda r: r["kld_mean"])
    }


def equal_size_pairs(results: list[dict]) -> list[tuple[dict, dict]]:
    """(model, the closest-size model of another family) for every model and every other family."""
    pairs = []
    families = sorted({r["model"]["family"] for r in results})
    for r in results:
        for family in families:
            if family == r["model"]["family"]:
                continue
            others = [o for o in results if o["model"]["family"] == family]
            if others:
                closest = min(
                    others, key=lambda o: (abs(math.log(o["model"]["bytes"] / r["model"]["bytes"])), o["model"]["name"])
                )
                pairs.append((r, closest))
    return pairs


def _by_size(results: list[dict]) -> list[dict]:
    return sorted(results, key=lambda r: (r["model"]["bytes"], r["model"]["name"]))


def _kld_note(doc: dict) -> str:
    """How the KLD figures were computed, in one sentence."""
    params, method = doc.get("parameters", {}), doc.get("kld_method")
    if params.get("kld_full_vocabulary"):
        return (
            "KLD from the reference's full distributions, as llama-perplexity "
            "--kl-divergence computes it (every token; its base file stores them in 16 bits)."
        )
    if method == "topk-sampled-tail":
        return (
            f"KLD estimated from the reference's top-{params.get('top_k')} log-probs "
            f"and {params.get('tail_samples')} sampled tail tokens per token: "
            "the mean is unbiased, ± the sampling's standard error (`kld_tail_stderr` "
            "in each JSON); percentiles are of per-token estimates."
        )
    return (
        f"KLD from the reference's top-{params.get('top_k')} log-probs "
        "with the rest as one outcome: a lower bound of the KLD."
    )


def render_summary(results: list[dict], reference_label: str, charts: list[str]) -> str:
    ordered = _by_size(results)
    params = ordered[0]["parameters"] if ordered else {}
    lines = [f"# Evaluation against {reference_label}", ""]
    lines.append(
        f"Context {params.get('ctx')}, {params.get('chunks')} chunks ({params.get('scored_tokens')} scored tokens), "
        f"{params.get('threads')} threads; " + _kld_note(ordered[0] if ordered else {})
    )
    lines += [
        "",
        "## Release",
        "",
        "| Artifact | Size | Passed | Exact vs baseline | Median decode tok/s | Gate |",
        "|---|---|---|---|---|---|",
    ]
    for r in ordered:
        passed = f"{r['qa_passed']}/{r['qa_total']}" if r.get("qa_total") else "–"
        gate = r.get("gate") or "–"
        if r.get("gate_failed"):
            gate += " (" + "; ".join(r["gate_failed"]) + ")"
        lines.append(
            f"| {r['model']['file']} | {format_size(r['model']['bytes'])} | {passed} | "
            f"{_fmt(r.get('qa_exact_vs_reference'), percent=True)} | {speed_text(r, 'tg', unit=False)} | {gate} |"
        )
    add_loop_column(lines, ordered)
    lines += [
        "",
        "## Quality",
        "",
        "| Quant | Size | PPL | Δ vs reference | ± | mean KLD | 99% KLD | same top p |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in ordered:
        lines.append(
            f"| {r['model']['quant']} ({r['model']['name']}) | {format_size(r['model']['bytes'])} | "
            f"{r['ppl']:.4f} | {round(r['ppl_delta_percent'], 2) + 0.0:+.2f}% | {r['ppl_stderr']:.4f} | "
            f"{r['kld_mean']:.6f} | {r['kld_p99']:.6f} | {100 * r['same_top_p']:.2f}% |"
        )
    front = pareto_front(results)
    lines += [
        "",
        "## Pruned vs unpruned at equal size",
        "",
        "Sorted by size. *Closest other* is the model of another family "
        "nearest in size; ✓ marks the one with the lower mean KLD.",
        "",
        "| Model | Family | Size | mean KLD | PPL | Pareto front | Closest other (size, mean KLD) |",
        "|---|---|---|---|---|---|---|",
    ]
    pairs: dict[str, list[str]] = {}
    for r, other in equal_size_pairs(results):
        mark = "✓" if r["kld_mean"] < other["kld_mean"] else "✗"
        pairs.setdefault(r["model"]["name"], []).append(
            f"{mark} vs {other['model']['name']} ({format_size(other['model']['bytes'])}, {other['kld_mean']:.4f})"
        )
    for r in ordered:
        name = r["model"]["name"]
        lines.append(
            f"| {name} | {r['model']['family']} | {format_size(r['model']['bytes'])} | "
            f"{r['kld_mean']:.6f} | {r['ppl']:.4f} | {'yes' if name in front else ''} | "
            f"{'; '.join(pairs.get(name, [])) or '–'} |"
        )
    lines += segment_table(ordered)
    if charts:
        lines += ["", *[f"![{c}]({c})" for c in charts]]
    return "\n".join(lines) + "\n"


def segment_table(ordered: list[dict]) -> list[str]:
    """## Segments: per model its overall figures and each held-out file's; none with one file."""
    if not any(r.get("segments") for r in ordered):
        return []
    modes = {r.get("gate_segments") for r in ordered if r.get("gate_segments")}
    mode = next(iter(modes)) if len(modes) == 1 else None
    gate_note = {
        "every": " The gate requires every file to pass.",
        "overall": " The gate judges the overall figures; each file's verdict is reported.",
    }.get(mode or "", "")
    lines = [
        "",
        "## Segments",
        "",
        "Each held-out file scored on its own against the reference's "
        "log-probs on it; *all* is every file's tokens together." + gate_note,
        "",
        "| Model | Size | Held-out file | Tokens | PPL | Δ vs "
        "reference | mean KLD | ± | 99.9% KLD | same top p | Gate |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ordered:
        rows = [("*all*", r, r.get("gate") or "–")]
        rows += [
            (
                s["name"],
                s,
                (s.get("gate") or "–") + (" (" + "; ".join(s["gate_failed"]) + ")" if s.get("gate_failed") else ""),
            )
            for s in r.get("segments") or []
        ]
        for label, f, gate in rows:
            tokens = f.get("tokens", (f.get("parameters") or {}).get("scored_tokens"))
            lines.append(
                f"| {r['model']['name']} | {format_size(r['model']['bytes'])} | {label} | "
                f"{tokens} | {f['ppl']:.4f} | {round(f['ppl_delta_percent'], 2) + 0.0:+.2f}% | "
                f"{f['kld_mean']:.6f} | {f['kld_mean_stderr']:.6f} | "
                f"{f['kld_p999']:.6f} | {100 * f['same_top_p']:.2f}% | {gate} |"
            )
    return lines


Stage = Callable[[Path], Path]  # an output's final path -> the temp path to write it to (renamed later)


def load_charting() -> None:
    """Import what draw_charts uses (matplotlib's Figure and Agg canvas)."""
    import matplotlib.backends.backend_agg
    import matplotlib.figure  # noqa: F401


def draw_charts(results: list[dict], out_dir: Path, stage: Stage) -> list[str]:
    """size-vs-kld.png and size-vs-ppl.png: one series per family, the Pareto front (by mean KLD) dashed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = []
    front = pareto_front(results)
    unit, scale = size_unit(max(r["model"]["bytes"] for r in results))
    for metric, label, file_name in (
        ("kld_mean", "mean KLD vs reference (nats/token)", KLD_CHART),
        ("ppl", "perplexity", PPL_CHART),
    ):
        fig = Figure(figsize=(7, 4.5), dpi=110)  # no pyplot: no global figure state, no GUI backend
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for family in sorted({r["model"]["family"] for r in results}):
            series = _by_size([r for r in results if r["model"]["family"] == family])
            xs, ys = [r["model"]["bytes"] / scale for r in series], [r[metric] for r in series]
            ax.plot(xs, ys, marker="o", label=family)
            for r, x, y in zip(series, xs, ys):
                ax.annotate(r["model"]["quant"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        on_front = _by_size([r for r in results if r["model"]["name"] in front])
        if len(on_front) > 1:
            ax.plot(
                [r["model"]["bytes"] / scale for r in on_front],
                [r[metric] for r in on_front],
                linestyle="--",
                color="grey",
                linewidth=1,
                label="Pareto front (mean KLD)",
            )
        ax.set_xlabel(f"file size ({unit})")
        ax.set_ylabel(label)
        if metric == "kld_mean" and all(r[metric] > 0 for r in results):
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.subplots_adjust(left=0.12, right=0.97, bottom=0.12, top=0.96)
        fig.savefig(stage(out_dir / file_name), format="png")
        names.append(file_name)
    if any(r.get("segments") for r in results):
        names.append(_segment_chart(results, out_dir, stage, unit, scale))
    timed = [r for r in results if r.get("tg_tok_s") and r.get("kld_mean") is not None]
    if len(timed) > 1:
        names.append(_speed_chart(timed, out_dir, stage))
    return names


def speed_frontier(points: list[dict], speed: str, metric: str) -> list[dict]:
    """The points no other point beats at once in `metric` (lower) and in `speed` (higher), fastest first."""
    frontier, best = [], float("inf")
    for point in sorted(points, key=lambda p: (-p[speed], p[metric])):
        if point[metric] < best:
            frontier.append(point)
            best = point[metric]
    return frontier


def _speed_chart(timed: list[dict], out_dir: Path, stage: Stage) -> str:
    """speed-vs-kld.png: mean KLD against decode tok/s, one series per family, each point its quant, the
    frontier (no faster file better) dashed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for family in sorted({r["model"]["family"] for r in timed}):
        series = [r for r in timed if r["model"]["family"] == family]
        ax.plot([r["tg_tok_s"] for r in series], [r["kld_mean"] for r in series], marker="o", linestyle="none",
                label=family)  # fmt: skip
        for r in series:
            ax.annotate(r["model"]["quant"], (r["tg_tok_s"], r["kld_mean"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=7)  # fmt: skip
    frontier = speed_frontier(timed, "tg_tok_s", "kld_mean")
    if len(frontier) > 1:
        ax.plot([r["tg_tok_s"] for r in frontier], [r["kld_mean"] for r in frontier], linestyle="--", color="grey",
                linewidth=1, label="frontier")  # fmt: skip
    ax.set_xlabel("decode tok/s")
    ax.set_ylabel("mean KLD vs reference (nats/token)")
    if all(r["kld_mean"] > 0 for r in timed):
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.12, top=0.96)
    fig.savefig(stage(out_dir / SPEED_CHART), format="png")
    return SPEED_CHART


def _segment_chart(results: list[dict], out_dir: Path, stage: Stage, unit: str, scale: float) -> str:
    """size-vs-kld-segments.png: mean KLD against size, one colour per held-out file, one line style per family."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    names = list(dict.fromkeys(s["name"] for r in results for s in r.get("segments") or []))
    families = sorted({r["model"]["family"] for r in results})
    styles, markers = ("-", "--", ":", "-."), ("o", "s", "^", "D")
    values = []
    for number, name in enumerate(names):
        colour = f"C{number % 10}"
        for f_number, family in enumerate(families):
            series = [
                (r["model"]["bytes"] / scale, s["kld_mean"])
                for r in _by_size([r for r in results if r["model"]["family"] == family])
                for s in r.get("segments") or []
                if s["name"] == name
            ]
            if series:
                values += [y for _, y in series]
                ax.plot(
                    *zip(*series),
                    color=colour,
                    linestyle=styles[f_number % len(styles)],
                    marker=markers[f_number % len(markers)],
                    label=f"{name} ({family})" if len(families) > 1 else name,
                )
    ax.set_xlabel(f"file size ({unit})")
    ax.set_ylabel("mean KLD vs reference (nats/token)")
    if values and all(v > 0 for v in values):
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.12, top=0.96)
    fig.savefig(stage(out_dir / SEGMENT_CHART), format="png")
    return SEGMENT_CHART


def write_summary(results: list[dict], reference_label: str, out_dir: Path, stage: Stage) -> list[Path]:
    """Write the charts and summary.md to the temp paths `stage` gives; returns their final paths."""
    if not results:
        return []
    summary = stage(out_dir / SUMMARY)
    charts = draw_charts(results, out_dir, stage)
    try:
        summary.write_text(render_summary(results, reference_label, charts), encoding="utf-8")
    except OSError as err:  # the last path staged is a chart's: name summary.md here
        raise write_failed(err, out_dir / SUMMARY) from None
    return [out_dir / SUMMARY, *(out_dir / c for c in charts)]
