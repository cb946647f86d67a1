"""best's outputs besides best.json: the table (best.md), the Pareto chart and the `ggufcarve run` plan."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ggufcarve.fileio import format_size, size_unit


def _cell(value: Any, digits: int = 4) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def front(candidates: list[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    """The fitting finalists on the Pareto front of metric against file size (none smaller and better), smallest first."""
    scored = sorted((c for c in candidates if c.get("built") and not c["stopped_early"] and c.get(metric) is not None and c["fits"]),
                    key=lambda c: (c["file_bytes"], c[metric]))
    out: list[dict[str, Any]] = []
    for c in scored:
        if not out or c[metric] < out[-1][metric]:
            out.append(c)
    return out


def stopped_lines(report: dict[str, Any]) -> list[str]:
    """One line per candidate stopped early: why, and by how much it lost."""
    metric = report["parameters"]["metric"]
    lines = []
    for c in report["candidates"]:
        if c["stopped_reason"] == "bound":
            lines.append(f"{c['id']}: not built: masked mean KLD of K={c['kept_experts']} at the source's precision is "
                         f"{c['masked_kld_mean']:.4f}, {c['lost_by']:+.4f} above the best measured fitting unpruned rung")
        elif c["stopped_reason"] == "halving":
            lines.append(f"{c['id']}: stopped after {c['chunks_scored']} chunk(s) of halving, {metric} {c['lost_by']:+.4f} behind that round's leader")
    return lines


def markdown(report: dict[str, Any]) -> str:
    r = report
    metric = r["parameters"]["metric"]
    names = r["heldout"]
    unit = size_unit(max(c["file_bytes"] for c in r["candidates"]))
    lines = [f"# best: {r['model']['name']} in {format_size(r['memory_bytes'])}", "",
             f"File + KV cache at {r['parameters']['ctx']} tokens ({format_size(r['cache']['total_bytes'])}) against the budget; "
             f"scored against the unpruned model on {', '.join(names)} (ctx {r['parameters']['eval_ctx']}). Answer: {r['selection_rule']}.", "",
             f"| candidate | family | K of N | quant | file {unit[0]} | fits | mean KLD | ± | 99.9% KLD | same top p | PPL | "
             + " | ".join(f"KLD {n}" for n in names) + " | chunks | stopped early |",
             "|---|---|---|---|---:|---|---:|---:|---:|---:|---:|" + "---:|" * len(names) + "---:|---|"]
    winner = r["winner"]["id"] if r["winner"] else None
    for c in r["candidates"]:
        name = f"**{c['id']}**" if c["id"] == winner else c["id"]
        segs = {s["name"]: s for s in c.get("segments", [])}
        per_file = " | ".join(_cell(segs.get(n, {}).get("kld_mean")) for n in names)
        stopped = {"bound": "bound, not built", "halving": "halving"}.get(c["stopped_reason"] or "", "")
        same = "" if c.get("same_top_p") is None else f"{100 * c['same_top_p']:.2f}%"
        lines.append(f"| {name} | {c['family']} | {c['kept_experts']} of {c['expert_count']} | {c['quant']} | {c['file_bytes'] / unit[1]:.2f} | "
                     f"{'yes' if c['fits'] else 'no'} | {_cell(c.get('kld_mean'))} | {_cell(c.get('kld_mean_stderr'))} | {_cell(c.get('kld_p999'))} | {same} | "
                     f"{_cell(c.get('ppl'))} | {per_file} | {c['chunks_scored']} | {stopped} |")
    lines.append("")
    stopped = stopped_lines(report)
    if stopped:
        lines += ["## Stopped early", "", *(f"- {line}" for line in stopped), ""]
    if r["winner"]:
        w = r["winner"]
        lines += ["## Answer", "", f"{w['id']} ({w['family']}, {w['kept_experts']} of {w['expert_count']} experts, {w['quant']}): {metric} {w[metric]:.4f}, "
                  f"file {format_size(w['file_bytes'])} + cache {format_size(w['cache_bytes'])} of {format_size(r['memory_bytes'])}.", "",
                  f"    {' '.join(w['run_command']['argv'])}", ""]
    else:
        lines += ["## Answer", "", "No finalist fits and passes the gate.", ""]
    lines += ["## Cost", "", "| stage | seconds | projected for " + r["projection"]["model"] + " |", "|---|---:|---:|"]
    for stage in ("calibration", "tournament", "builds", "evaluation"):
        lines.append(f"| {stage} | {report['timings'].get(f'{stage}_seconds', 0.0):.1f} | {r['projection']['stages_seconds'][stage] / 3600:.1f} h |")
    lines += ["", f"Projection rule: {r['projection']['rule']}.", ""]
    return "\n".join(lines)


def chart(report: dict[str, Any], path: Path) -> None:
    """Metric against memory (file + cache) per family; the budget as a vertical line; hollow: stopped early."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    metric = report["parameters"]["metric"]
    candidates = [c for c in report["candidates"] if c.get(metric) is not None]
    unit = size_unit(report["memory_bytes"])
    fig = Figure(figsize=(7, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for family, marker in (("pruned", "o"), ("unpruned", "s")):
        series = sorted((c for c in candidates if c["family"] == family), key=lambda c: c["file_bytes"])
        if not series:
            continue
        xs = [(c["file_bytes"] + c["cache_bytes"]) / unit[1] for c in series]
        line = ax.plot(xs, [c[metric] for c in series], linestyle="none", marker=marker, label=family)[0]
        early = [c for c in series if c["stopped_early"]]
        ax.plot([(c["file_bytes"] + c["cache_bytes"]) / unit[1] for c in early], [c[metric] for c in early], linestyle="none", marker=marker,
                markerfacecolor="white", color=line.get_color())
        for c, x in zip(series, xs):
            ax.annotate(c["id"], (x, c[metric]), fontsize=6, xytext=(3, 3), textcoords="offset points")
    bounded = [c for c in report["candidates"] if c["stopped_reason"] == "bound"]
    if bounded:
        ax.plot([(c["file_bytes"] + c["cache_bytes"]) / unit[1] for c in bounded], [c["masked_kld_mean"] for c in bounded],
                linestyle="none", marker="x", color="grey", label="not built: its K's masked KLD (a lower bound)")
    ax.axvline(report["memory_bytes"] / unit[1], color="grey", linestyle="--", label="budget")
    ax.set_yscale("log")
    ax.set_xlabel(f"file + KV cache ({unit[0]})")
    ax.set_ylabel(f"{metric} vs unpruned")
    ax.set_title("hollow: stopped early (fewer chunks)", fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.12, top=0.93)
    from ggufcarve.fileio import save_figure

    save_figure(fig, path)


def plan_document(report: dict[str, Any], source: Path, settings: Any, out_dir: Path, imatrix: Path) -> dict[str, Any]:
    """The `ggufcarve run` plan that builds and fully evaluates the winner and its neighbours on the front
    (one K per plan: the winner's, or the nearest pruned neighbour's; the unpruned ones as [evaluation] unpruned)."""
    metric = report["parameters"]["metric"]
    winner = report["winner"]
    on_front = front(report["candidates"], metric)
    ids = [c["id"] for c in on_front]
    at = ids.index(winner["id"]) if winner["id"] in ids else None
    neighbours = [winner] + ([c for i, c in enumerate(on_front) if at is not None and abs(i - at) == 1])
    pruned = [c for c in neighbours if c["family"] == "pruned"]
    bounds = report["bounds"]
    if pruned:
        kept = pruned[0]["kept_experts"]
    elif bounds:
        kept = max(int(k) for k in bounds)
    else:
        kept = None
    def rel(path: Path | str) -> str:
        """A plan path: relative to the plan file when that climbs at most two folders, else absolute."""
        relative = os.path.relpath(Path(path).resolve(), out_dir.resolve())
        return relative if Path(relative).parts[:3].count("..") < 3 else str(Path(path).resolve())

    doc: dict[str, Any] = {"source": rel(source), "output": "release", "work": "release.work"}
    if kept is not None:
        doc["selection"] = {"keepset": rel(out_dir / "tune" / "candidates" / f"{bounds[str(kept)]['keep_set']}.json")}
    only = sorted({c["quant"] for c in neighbours if c["family"] == "pruned" and c["kept_experts"] == kept}) or [winner["quant"]]
    unpruned = sorted({c["quant"] for c in neighbours if c["family"] == "unpruned"})
    if imatrix.is_file():
        doc["imatrix"] = {"file": rel(imatrix)}
    doc["ladder"] = {"spec": rel(settings.ladder), "only": only, "quantizer": settings.quantizer}
    evaluation: dict[str, Any] = {"heldout": [rel(p) for p in settings.heldout] if len(settings.heldout) > 1 else rel(settings.heldout[0]), "ctx": settings.eval_ctx}
    if settings.chunks:
        evaluation["chunks"] = settings.chunks
    if settings.gate:
        evaluation["gate"] = rel(settings.gate)
    if unpruned:
        evaluation["unpruned"] = unpruned
    doc["evaluation"] = evaluation
    return doc


def write_plan(doc: dict[str, Any], out_dir: Path) -> Path:
    from ggufcarve.fileio import write_text_atomic
    from ggufcarve.pipeline.plan import plan_text

    path = out_dir / "plan.toml"
    write_text_atomic(path, plan_text(doc, "The plan that publishes best's winner and its neighbours on the front, fully evaluated: ggufcarve run plan.toml"))
    return path
