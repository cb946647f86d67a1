"""best's outputs besides best.json: the table (best.md), the Pareto chart and the `ggufcarve run` plan."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ggufcarve.fileio import format_size, size_unit
from ggufcarve.llama.computed import in_words


def _hours(seconds: float | None) -> str:
    return "not projected" if seconds is None else f"{seconds / 3600:.2f} h"


def _speed(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def _cell(value: Any, digits: int = 4) -> str:
    return "" if value is None else f"{value:.{digits}f}"


CHART = "best-pareto.png"  # the metric against memory
SPEED_CHART = "best-speed.png"  # the metric against decode speed, the timed finalists
REASONS = {"halving": "halving", "budget": "over budget", "gate": "gate", "identical": "identical keep-set"}


def stopped_lines(report: dict[str, Any]) -> list[str]:
    """One line per candidate that left before the final round or was not a finalist: why, and by how much it lost
    (closest first)."""
    lines = []
    closest_first = sorted(
        report["candidates"], key=lambda c: (c.get("stopped_reason") != "halving", c.get("lost_by") or 0.0, c["id"])
    )
    for c in closest_first:
        reason = c.get("stopped_reason")
        if reason == "halving":
            lines.append(
                f"{c['id']}: left after {c['chunks_scored']} chunk(s): "
                f"mean KLD {c['lost_by']:+.4f} behind that round's leader "
                f"(paired, ± {c['delta_stderr'][-1]:.4f})"
            )
        elif reason == "budget":
            lines.append(
                f"{c['id']}: over the budget ({format_size(c['file_bytes'] + c['cache_bytes'])} with its cache)"
            )
        elif reason == "gate":
            lines.append(f"{c['id']}: failed the gate ({', '.join(c.get('gate_failed') or [])})")
        elif reason == "identical":
            lines.append(f"{c['id']}: the same keep-set as {c['identical_to']}")
    return lines


def markdown(report: dict[str, Any]) -> str:
    r = report
    metric = r["parameters"]["metric"]
    names = r["heldout"]
    unit = size_unit(max(c["file_bytes"] for c in r["candidates"]))
    lines = [
        f"# best: {r['model']['name']} in {format_size(r['memory_bytes'])}",
        "",
        f"Memory as llama.cpp allocates it at {r['parameters']['ctx']} tokens (weights, KV cache "
        f"{format_size(r['cache']['total_bytes'])}, compute and output buffers) against the budget, "
        f"ranked in tier {r['parameters'].get('tier', 'ram')}; "
        f"scored against the unpruned model on {', '.join(names)} (chunks of "
        f"{r['parameters']['eval_ctx']} tokens). Answer: {r['selection_rule']}.",
        "",
        "Each figure is over the chunks beside it: candidates that "
        "left early were scored on fewer chunks than the finalists, "
        "so compare them by the round they left in (best.json `halving`).",
        "",
        f"| candidate | family | K of N | quant | top-k | file {unit[0]} | fits "
        "| scored by | mean KLD | ± | 99.9% KLD | same top p | PPL | "
        + " | ".join(f"KLD {n}" for n in names)
        + " | decode tok/s | prompt tok/s | chunks | left |",
        "|---|---|---|---|---:|---:|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(names) + "---:|---:|---:|---|",
    ]
    winner = r["winner"]["id"] if r["winner"] else None
    for c in r["candidates"]:
        name = f"**{c['id']}**" if c["id"] == winner else c["id"]
        segs = {s["name"]: s for s in c.get("segments") or []}
        per_file = " | ".join(_cell(segs.get(n, {}).get("kld_mean")) for n in names)
        same = "" if c.get("same_top_p") is None else f"{100 * c['same_top_p']:.2f}%"
        scored = f"mask on {c['masked_on']}" if c.get("scored_by") == "mask" else (c.get("scored_by") or "")
        if c.get("topk_of"):
            scored += f", top-{c['experts_used']} at load"
        lines.append(
            f"| {name} | {c['family']} | {c['kept_experts']} of {c['expert_count']} "
            f"| {c['quant']} | {c.get('experts_used', '')} | {c['file_bytes'] / unit[1]:.2f} | "
            f"{'yes' if c['fits'] else 'no'} | {scored} | {_cell(c.get('kld_mean'))} "
            f"| {_cell(c.get('kld_mean_stderr'))} | {_cell(c.get('kld_p999'))} | "
            f"{same} | {_cell(c.get('ppl'))} | {per_file} | {_speed(c.get('decode_tok_s'))} "
            f"| {_speed(c.get('prompt_tok_s'))} | {c['chunks_scored']} "
            f"| {REASONS.get(c.get('stopped_reason') or '', '')} |"
        )
    lines.append("")
    stopped = stopped_lines(report)
    if stopped:
        lines += ["## Left before the final round", "", *(f"- {line}" for line in stopped), ""]
    if r["winner"]:
        w = r["winner"]
        taken = (
            f"llama.cpp allocates {format_size(w['memory'][0]['total'])} (weights, cache, compute and output buffers)"
            if w.get("memory")
            else f"file {format_size(w['file_bytes'])} + cache {format_size(w['cache_bytes'])}"
        )
        trained = r["model"].get("expert_used_count")
        topk = f", routed to {w['experts_used']} experts per token (trained: {trained})" if w.get("topk_of") else ""
        lines += [
            "## Answer",
            "",
            f"{w['id']} ({w['family']}, {w['kept_experts']} of {w['expert_count']} "
            f"experts, {w['quant']}{topk}): {metric} {w[metric]:.4f}, "
            f"{taken} of {format_size(r['memory_bytes'])}"
            + (f"; decodes at {w['decode_tok_s']:.1f} tok/s (llama-bench)" if w.get("decode_tok_s") else "")
            + ".",
            "",
        ]
        if w.get("tie_with"):
            lines += [
                f"Tie within noise: {', '.join(w['tie_with'])} differ from it by "
                f"less than {r['parameters']['z']:g} standard errors of the paired "
                f"difference (over chunks); the answer is the {r['parameters']['prefer']} of them.",
                "",
            ]
        if w.get("confirmed"):
            k = w["confirmed"]
            lines += [
                f"Confirmed as a file: masked mean KLD {k['masked_kld_mean']:.4f}, the "
                f"built file {k['file_kld_mean']:.4f} ± {k['file_kld_mean_stderr']:.4f}.",
                "",
            ]
        found = r.get("search")
        if found and found.get("searched"):
            moves = sum(len(p["moves"]) for p in found["path"])
            verdict = (
                "better beyond noise there: it is the answer"
                if found["beats_start"]
                else "not better beyond noise there: the answer stays the tournament's"
            )
            lines += [
                f"Search from {found['start']} (`--search`): {moves} move(s) taken, calibration mean KLD "
                f"{found['start_calibration_kld_mean']:.4f} -> {found['calibration_kld_mean']:.4f} in "
                f"{found['passes_used']:.1f} passes ({found['stopped']}); on the held-out text {verdict} "
                f"(difference {found['heldout_vs_start']['mean']:+.4f} ± "
                + (
                    f"{found['heldout_vs_start']['stderr']:.4f}"
                    if found["heldout_vs_start"]["stderr"] is not None
                    else "–"
                )
                + ").",
                "",
            ]
        lines += [f"    {' '.join(w['run_command']['argv'])}", ""]
        if w.get("run_command_override"):
            lines += [
                f"The same with the file at its trained top-k ({w['routed_from']}), the count given at load:",
                "",
                f"    {' '.join(w['run_command_override']['argv'])}",
                "",
            ]
    else:
        lines += ["## Answer", "", "No finalist fits and passes the gate.", ""]
    lines += ["## Charts", "", f"![{metric} against memory]({CHART})", ""]
    if timed_finalists(report):
        lines += [
            f"![{metric} against decode speed]({SPEED_CHART}): the finalists timed by llama-bench, each labelled "
            "K, quant and experts per token; the frontier joins those no faster finalist beats.",
            "",
        ]
    lines += [
        "## Cost",
        "",
        "| stage | seconds | projected for " + r["projection"]["model"] + " | computed on (llama.cpp's loader) |",
        "|---|---:|---:|---|",
    ]
    computed = r.get("computed_on") or {}
    for stage in r["projection"]["stages_seconds"]:
        lines.append(
            f"| {stage} | {report['timings'].get(f'{stage}_seconds', 0.0):.1f} "
            f"| {_hours(r['projection']['stages_seconds'][stage])} "
            f"| {in_words(computed.get(stage)) if stage in computed else '–'} |"
        )
    if "speed" in computed:
        lines.append(f"| speed (the finalists' timing) | | | {in_words(computed['speed'])} |")
    lines += ["", f"Projection rule: {r['projection']['rule']}.", ""]
    if r.get("previous_run_timings"):
        lines += [
            f"This run: {report['timings']['total_seconds']:.1f} s; the run before it in "
            f"this folder: {r['previous_run_timings'].get('total_seconds', 0.0):.1f} s "
            f"(work reused by content: {r['chunks_cached']} chunk(s) of "
            f"scoring{', the keep-sets and imatrix' if r['keep_sets_reused'] else ''}).",
            "",
        ]
    return "\n".join(lines)


def chart(report: dict[str, Any], path: Path) -> None:
    """Metric against memory (file + cache) per family; the budget as a vertical line; hollow: left
    before the final round (fewer chunks); the answer ringed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    metric = report["parameters"]["metric"]
    candidates = [
        c for c in report["candidates"] if c.get(metric) is not None and c.get("stopped_reason") != "identical"
    ]
    unit = size_unit(report["memory_bytes"])
    fig = Figure(figsize=(8, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for family, marker in (("pruned", "o"), ("unpruned", "s")):
        series = sorted((c for c in candidates if c["family"] == family), key=lambda c: c["file_bytes"])
        if not series:
            continue
        xs = [(c["file_bytes"] + c["cache_bytes"]) / unit[1] for c in series]
        line = ax.plot(xs, [c[metric] for c in series], linestyle="none", marker=marker, label=family)[0]
        early = [c for c in series if c["stopped_early"]]
        ax.plot(
            [(c["file_bytes"] + c["cache_bytes"]) / unit[1] for c in early],
            [c[metric] for c in early],
            linestyle="none",
            marker=marker,
            markerfacecolor="white",
            color=line.get_color(),
        )
        best_of_pair: dict[tuple[int, str, Any], dict[str, Any]] = {}
        for c in series:  # one label per (K, quant, N used): its best keep-set
            key = (c["kept_experts"], c["quant"], c.get("experts_used"))
            if key not in best_of_pair or c[metric] < best_of_pair[key][metric]:
                best_of_pair[key] = c
        for c, x in zip(series, xs):
            if best_of_pair[(c["kept_experts"], c["quant"], c.get("experts_used"))] is c:
                ax.annotate(
                    c["id"] + ("" if c.get("built") else " (masked)"),
                    (x, c[metric]),
                    fontsize=6,
                    xytext=(3, 3),
                    textcoords="offset points",
                )
    w = report.get("winner")
    if w and w.get(metric) is not None:
        ax.plot(
            [(w["file_bytes"] + w["cache_bytes"]) / unit[1]],
            [w[metric]],
            linestyle="none",
            marker="o",
            markersize=14,
            markerfacecolor="none",
            markeredgecolor="red",
            label=f"answer: {w['id']}",
        )
    ax.axvline(report["memory_bytes"] / unit[1], color="grey", linestyle="--", label="budget")
    ax.set_yscale("log")
    ax.set_xlabel(f"file + KV cache ({unit[0]})")
    ax.set_ylabel(f"{metric} vs unpruned (nats/token)" if metric.startswith("kld") else f"{metric} (lower is better)")
    ax.set_title(
        "hollow: left before the final round (fewer chunks); (masked): scored "
        "by masking, no file built; one label per K and quant: its best keep-set",
        fontsize=7,
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.12, top=0.93)
    from ggufcarve.fileio import save_figure

    save_figure(fig, path)


def timed_finalists(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The candidates with a measured decode speed and the metric (the finalists timed by llama-bench)."""
    metric = report["parameters"]["metric"]
    return [c for c in report["candidates"] if c.get("decode_tok_s") and c.get(metric) is not None]


def speed_chart(report: dict[str, Any], path: Path) -> bool:
    """The metric against decode tok/s of the timed finalists, each labelled (K, quant, N used), the frontier
    joined, the answer ringed; nothing is written (False) without a timed finalist."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from ggufcarve.evaluate.summary import speed_frontier

    metric = report["parameters"]["metric"]
    points = timed_finalists(report)
    if not points:
        return False
    fig = Figure(figsize=(8, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for family, marker in (("pruned", "o"), ("unpruned", "s")):
        series = [c for c in points if c["family"] == family]
        if series:
            ax.plot([c["decode_tok_s"] for c in series], [c[metric] for c in series], marker=marker,
                    linestyle="none", label=family)  # fmt: skip
        for c in series:
            ax.annotate(
                f"K{c['kept_experts']} {c['quant']} top-{c.get('experts_used')}",
                (c["decode_tok_s"], c[metric]),
                fontsize=6,
                xytext=(3, 3),
                textcoords="offset points",
            )
    frontier = speed_frontier(points, "decode_tok_s", metric)
    ax.plot([c["decode_tok_s"] for c in frontier], [c[metric] for c in frontier], color="grey", linewidth=0.8,
            label="frontier")  # fmt: skip
    w = report.get("winner")
    if w and w.get("decode_tok_s") and w.get(metric) is not None:
        ax.plot([w["decode_tok_s"]], [w[metric]], linestyle="none", marker="o", markersize=14, markerfacecolor="none",
                markeredgecolor="red", label=f"answer: {w['id']}")  # fmt: skip
    ax.set_yscale("log")
    ax.set_xlabel("decode tok/s (llama-bench, each finalist in its own placement)")
    ax.set_ylabel(f"{metric} vs unpruned (nats/token)" if metric.startswith("kld") else f"{metric} (lower is better)")
    ax.set_title("finalists: quality against decode speed; labels: K kept, quant, experts per token", fontsize=7)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.12, top=0.93)
    from ggufcarve.fileio import save_figure

    save_figure(fig, path)
    return True


def plan_document(report: dict[str, Any], source: Path, settings: Any, out_dir: Path, imatrix: Path) -> dict[str, Any]:
    """The `ggufcarve run` plan that carves, quantizes and fully evaluates exactly a pruned winner:
    its keep-set, its quant, the imatrix of best's calibration pass."""
    winner = report["winner"]
    if winner["family"] != "pruned":
        raise ValueError("a run plan carves a keep-set: an unpruned winner is published by publish_command")
    doc: dict[str, Any] = {
        "source": _plan_path(source, out_dir),
        "output": "release",
        "work": "release.work",
        "selection": {"keep": _plan_path(out_dir / winner["keep_set"], out_dir)},
    }
    if imatrix.is_file():
        doc["imatrix"] = {"file": _plan_path(imatrix, out_dir)}
    doc["ladder"] = {
        "spec": _plan_path(settings.ladder, out_dir),
        "only": [winner["quant"]],
        "quantizer": settings.quantizer,
        **({"topk": winner["experts_used"]} if winner.get("topk_of") else {}),
    }
    evaluation: dict[str, Any] = {
        "heldout": [_plan_path(p, out_dir) for p in settings.heldout]
        if len(settings.heldout) > 1
        else _plan_path(settings.heldout[0], out_dir),
        "ctx": settings.eval_ctx,
    }
    if settings.chunks:
        evaluation["chunks"] = settings.chunks
    if settings.gate:
        evaluation["gate"] = _plan_path(settings.gate, out_dir)
    doc["evaluation"] = evaluation
    return doc


def publish_command(report: dict[str, Any], source: Path, settings: Any, out_dir: Path, imatrix: Path) -> list[str]:
    """The command that publishes exactly an unpruned winner: its rung of the ladder, quantized from the
    source with the calibration pass's imatrix (no prune stage)."""
    winner = report["winner"]
    argv = ["ggufcarve", "ladder", "run", _plan_path(settings.ladder, out_dir), "--source", _plan_path(source, out_dir)]
    if imatrix.is_file():
        argv += ["--imatrix", _plan_path(imatrix, out_dir)]
    topk = ["--topk", str(winner["experts_used"])] if winner.get("topk_of") else []
    return [*argv, "--only", winner["quant"], *topk, "-o", "release"]


def _plan_path(path: Path | str, out_dir: Path) -> str:
    """A path as written in best's outputs: relative to out_dir when that climbs at most two folders, else absolute."""
    relative = os.path.relpath(Path(path).resolve(), out_dir.resolve())
    return relative if Path(relative).parts[:3].count("..") < 3 else str(Path(path).resolve())


def write_plan(doc: dict[str, Any], out_dir: Path) -> Path:
    from ggufcarve.fileio import write_text_atomic
    from ggufcarve.pipeline.plan import plan_text

    path = out_dir / "plan.toml"
    write_text_atomic(
        path,
        plan_text(
            doc, "The plan that publishes best's winner (a pruned model), fully evaluated: ggufcarve run plan.toml"
        ),
    )
    return path
