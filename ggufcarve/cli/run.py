"""run, demo: the whole pipeline from one plan, and the same on the small MoE shipped with ggufcarve.

Examples:
    ggufcarve demo                          # the trained demo MoE, end to end, into ./ggufcarve-demo
    ggufcarve run plans/frequency-128.toml --dry-run
    ggufcarve run plans/frequency-128.toml
    ggufcarve run plans/frequency-128.toml --force   # every stage again, the release afresh
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ggufcarve import settings as S
from ggufcarve.cli.options import JsonOption, QuietOption, option
from ggufcarve.cli.render import err, escape, new_table, out, progress, size, warn

if TYPE_CHECKING:
    from ggufcarve.pipeline.plan import RunPlan
    from ggufcarve.pipeline.run import RunPreview, RunResult


def _size(n: int | None) -> str:
    return "?" if n is None else size(n)


def _preview_table(preview: RunPreview) -> None:
    table = new_table(
        title=f"run plan{' ' + escape(preview.plan.path.name) if preview.plan.path else ''} (dry run: nothing written)"
    )
    for column in ("stage", "does", "writes", "size", "state"):
        table.add_column(column, overflow="fold", justify="right" if column == "size" else "left")
    for s in preview.stages:
        writes = (
            ", ".join(s.outputs)
            if len(s.outputs) <= 2
            else f"{s.outputs[0]} ... {s.outputs[-1]} ({len(s.outputs)} files)"
        )
        table.add_row(
            s.name,
            escape(s.action),
            escape(writes),
            _size(s.bytes) if s.bytes is not None else "",
            "ran before" if s.done else "",
        )
    out.print(table)
    out.print(
        f"source {preview.plan.source}; release {preview.plan.output}; work {preview.plan.work}",
        highlight=False,
        soft_wrap=True,
    )
    free = "; ".join(f"{escape(d)}: {_size(b)} free" for d, b in preview.free.items())
    out.print(
        f"disk needed: about {_size(preview.bytes_needed)} in work and release ({free})",
        highlight=False,
        soft_wrap=True,
    )
    if preview.reference_bytes:
        out.print(
            f"and up to {_size(preview.reference_bytes)} for the reference's "
            "log-probs (every token, as llama-perplexity keeps them; a plan's "
            "\\[evaluation] top_k = 128 keeps a small cache with an estimated KLD instead)",
            highlight=False,
            soft_wrap=True,
        )


def _result_tables(result: RunResult) -> None:
    table = new_table(title=f"ggufcarve run: {result.plan.output}")
    for column in ("stage", "status", "seconds", "result"):
        table.add_column(column, justify="right" if column == "seconds" else "left", overflow="fold")
    for s in result.stages:
        table.add_row(
            s.name,
            "[green]ran[/]" if s.status == "ran" else "skipped (unchanged)",
            f"{s.seconds:.1f}" if s.status == "ran" else "",
            escape(s.summary),
        )
    out.print(table)
    tuned = _tune_report(result.plan)
    if tuned is not None:
        _tune_table(tuned)
    if result.evaluation:
        from ggufcarve.evaluate.summary import pareto_front
        from ggufcarve.fileio import size_unit

        front = pareto_front(result.evaluation)
        unit, scale = size_unit(max(r["model"]["bytes"] for r in result.evaluation))
        quality = new_table(title="evaluation against the unpruned model, by size (* Pareto front by mean KLD)")
        for column in ("quant", "experts", unit, "PPL", "ΔPPL", "mean KLD", "same top p", "gate"):
            quality.add_column(column, justify="left" if column in ("model", "gate") else "right", overflow="fold")
        for r in sorted(result.evaluation, key=lambda r: (r["model"]["bytes"], r["model"]["name"])):
            gate = r.get("gate") or "-"
            failed = ", ".join(str(f).split()[0] for f in r.get("gate_failed") or [])
            gate = (
                "[green]PASS[/]" if gate == "PASS" else (f"[red]FAIL[/] {escape(failed)}" if gate == "FAIL" else gate)
            )
            experts = f"{r['model'].get('expert_count')}" + ("" if r["model"].get("pruned") else " (unpruned)")
            quality.add_row(
                ("* " if r["model"]["name"] in front else "  ") + escape(str(r["model"]["quant"])),
                experts,
                f"{r['model']['bytes'] / scale:,.2f}",
                f"{r['ppl']:.3f}",
                f"{round(r['ppl_delta_percent'], 2) + 0.0:+.2f}%",
                f"{r['kld_mean']:.5f}",
                f"{100 * r['same_top_p']:.1f}%",
                gate,
            )
        out.print(quality)
    if result.evaluation:
        out.print(
            f"per-model results, charts and summary.md: {result.plan.output / 'evaluation'}",
            highlight=False,
            soft_wrap=True,
        )
    out.print(_tree(result.plan.output))
    out.print(
        f"{result.seconds:.1f} s; verify passed: {len(result.verification.files_ok)} "
        "files match SHA256SUMS and the manifest",
        highlight=False,
    )


def _tune_report(plan: RunPlan) -> dict | None:
    """tune.json of a plan with [selection] method = "tune", as its tune stage wrote it."""
    from ggufcarve.pipeline.stages import TUNE_DIR

    if not plan.selection.tunes:
        return None
    try:
        return json.loads((plan.work / TUNE_DIR / "tune.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _tune_json(plan: RunPlan) -> dict:
    report = _tune_report(plan)
    if report is None:
        return {}
    keys = (
        "id",
        "method",
        "K",
        "kld_mean",
        "kld_mean_stderr",
        "same_top_p",
        "ppl",
        "chunks_scored",
        "stopped_early",
        "identical_to",
        "winner",
    )
    return {
        "tune": {"winner": report["winner"], "candidates": [{k: c.get(k) for k in keys} for c in report["candidates"]]}
    }


def _tune_table(report: dict) -> None:
    from ggufcarve.tune.report import left_out_lines, ranked

    for k in report["keeps"]:
        table = new_table(
            title=f"tune: K = {k} of {report['model']['expert_count']}, mean KLD vs "
            f"the unpruned model (masked), ctx {report['parameters']['ctx']}"
        )
        for column in ("method", "mean KLD", "±", "99.9% KLD", "same top p", "PPL", "chunks"):
            table.add_column(column, justify="left" if column == "method" else "right", overflow="fold")
        for c in ranked(report["candidates"], k):
            name = (
                f"[bold]{escape(c['method'])}[/] (winner)"
                if c["winner"]
                else escape(c["method"]) + (f" (= {escape(c['identical_to'])})" if c["identical_to"] else "")
            )
            table.add_row(
                name,
                f"{c['kld_mean']:.4f}",
                f"{c['kld_mean_stderr']:.4f}",
                f"{c['kld_p999']:.3f}",
                f"{100 * c['same_top_p']:.1f}%",
                f"{c['ppl']:.2f}",
                f"{c['chunks_scored']}" + (" (stopped)" if c["stopped_early"] else ""),
            )
        out.print(table)
    for line in left_out_lines(report):
        out.print(line, highlight=False, soft_wrap=True)
    out.print(
        f"carved: {report['winner']} (the winner at the first K); the table and the cliff: method/tune.md",
        highlight=False,
        soft_wrap=True,
    )


def _tree(directory: Path) -> str:
    lines = [f"{directory}/"]
    entries = sorted(
        p for p in directory.rglob("*") if not any(part.startswith(".") for part in p.relative_to(directory).parts)
    )
    for p in entries:
        rel = p.relative_to(directory)
        indent = "  " * len(rel.parts)
        lines.append(f"{indent}{rel.name}/" if p.is_dir() else f"{indent}{rel.name}  ({_size(p.stat().st_size)})")
    return escape("\n".join(lines))


def _execute(plan: RunPlan, dry_run: bool, force: bool, quiet: bool, as_json: bool) -> None:
    from ggufcarve.errors import OutputError
    from ggufcarve.pipeline.run import execute_run, preview_run

    if dry_run:
        preview = preview_run(plan)
        if as_json:
            out.print_json(
                json.dumps(
                    {
                        "stages": [
                            {
                                "name": s.name,
                                "does": s.action,
                                "writes": list(s.outputs),
                                "bytes": s.bytes,
                                "done": s.done,
                            }
                            for s in preview.stages
                        ],
                        "bytes_needed": preview.bytes_needed,
                        "reference_bytes": preview.reference_bytes,
                        "needed": preview.needed,
                        "free": preview.free,
                        "plan": plan.to_json(),
                    }
                )
            )
        else:
            _preview_table(preview)
        if preview.short:
            probe = preview.short[0]
            raise OutputError(
                f"the run needs about {_size(preview.needed[probe])} but {probe} has {_size(preview.free[probe])} free",
                "free disk space, or set work/output in the plan to a larger "
                "disk (and GGUFCARVE_CACHE for the reference's log-probs)",
            )
        return
    with progress(not quiet and not as_json) as sink:
        result = execute_run(plan, force=force, on_event=sink)
    for warning in result.warnings:
        warn(warning)
    if as_json:
        out.print_json(
            json.dumps(
                {
                    "output": str(plan.output),
                    "work": str(plan.work),
                    "seconds": round(result.seconds, 3),
                    "stages": [
                        {
                            "name": s.name,
                            "status": s.status,
                            "seconds": round(s.seconds, 3),
                            "outputs": s.outputs,
                            "result": s.summary,
                        }
                        for s in result.stages
                    ],
                    "evaluation": [
                        {k: r.get(k) for k in ("ppl", "ppl_delta_percent", "kld_mean", "same_top_p", "gate")}
                        | {"model": r["model"]["file"]}
                        for r in result.evaluation
                    ],
                }
                | _tune_json(plan)
            )
        )
        return
    _result_tables(result)


RunThreadsOption = Annotated[
    int | None,
    option(S.THREADS, "The plan's threads come before the physical cores."),
]


RunGpuLayersOption = Annotated[
    int | None,
    option(S.GPU_LAYERS, "Default: the plan's gpu_layers, else auto."),
]
RunRpcOption = Annotated[str | None, option(S.RPC, "Default: the plan's rpc.")]
RunTensorSplitOption = Annotated[str | None, option(S.TENSOR_SPLIT, "Default: the plan's tensor_split.")]
RunNCpuMoeOption = Annotated[int | None, option(S.N_CPU_MOE, "Default: the plan's n_cpu_moe, else 0.")]


def _with_compute(
    plan: RunPlan,
    threads: int | None,
    gpu_layers: int | None = None,
    rpc: tuple[str, ...] | None = None,
    tensor_split: tuple[float, ...] | None = None,
    n_cpu_moe: int | None = None,
) -> RunPlan:
    """The plan with the command line's compute settings in place of the plan's, where given."""
    from dataclasses import replace

    given = plan.compute
    return replace(
        plan,
        compute=S.compute(
            given.threads if threads is None else threads,
            given.gpu_layers if gpu_layers is None else gpu_layers,
            given.rpc if rpc is None else rpc,
            given.tensor_split if tensor_split is None else tensor_split,
            given.n_cpu_moe if n_cpu_moe is None else n_cpu_moe,
        ),
    )


def run_command(
    plan_file: Annotated[
        Path,
        typer.Argument(
            help="The plan (TOML): source, selection, calibration, imatrix, ladder, evaluation. See plans/."
        ),
    ],
    dry_run: Annotated[
        bool,
        option(S.DRY_RUN, "print the stages, their outputs, sizes and the disk needed; fails when the disk is short."),
    ] = False,
    force: Annotated[
        bool,
        option(S.FORCE, "every stage runs again and the release starts afresh (its old rungs are removed)."),
    ] = False,
    threads: RunThreadsOption = None,
    gpu_layers: RunGpuLayersOption = None,
    rpc: RunRpcOption = None,
    tensor_split: RunTensorSplitOption = None,
    n_cpu_moe: RunNCpuMoeOption = None,
    quiet: QuietOption = False,
    as_json: JsonOption = False,
) -> None:
    """Select, prune, remap the imatrix, quantize the ladder, evaluate, write the card and verify, from one plan;
    finished stages are skipped."""
    from ggufcarve.pipeline.plan import load_plan

    plan = _with_compute(load_plan(plan_file), threads, gpu_layers, rpc, tensor_split, n_cpu_moe)
    _execute(plan, dry_run, force, quiet, as_json)


def demo_command(
    directory: Annotated[Path, typer.Argument(help="Where the demo writes its release and work directories.")] = Path(
        "ggufcarve-demo"
    ),
    dry_run: Annotated[bool, option(S.DRY_RUN, "print the demo's stages.")] = False,
    force: Annotated[bool, option(S.FORCE, "every stage runs again.")] = False,
    threads: RunThreadsOption = None,
    gpu_layers: RunGpuLayersOption = None,
    rpc: RunRpcOption = None,
    tensor_split: RunTensorSplitOption = None,
    n_cpu_moe: RunNCpuMoeOption = None,
    quiet: QuietOption = False,
    as_json: JsonOption = False,
) -> None:
    """The whole pipeline on the small trained MoE shipped with ggufcarve (embedded llama.cpp only, a few minutes on
    2 cores)."""
    from ggufcarve.pipeline.demo import demo_plan, write_demo_plan

    plan = _with_compute(demo_plan(directory), threads, gpu_layers, rpc, tensor_split, n_cpu_moe)
    if not dry_run:
        path = write_demo_plan(directory)
        err.print(f"plan: {path} (run it again with `ggufcarve run {path}`)", highlight=False)
    _execute(plan, dry_run, force, quiet, as_json)
    if not dry_run and not as_json:
        _demo_answer(plan)


def _demo_answer(plan: RunPlan) -> None:
    """The best of the demo's measured models for a budget between its rungs, pruned or not, and why."""
    import tempfile

    from ggufcarve.best.answer import DEMO_BUDGET, answer_for_budget, memory_of
    from ggufcarve.gguf.container import read_model
    from ggufcarve.pipeline.stages import EVALUATION_DIR, read_results, run_compute
    from ggufcarve.placement.kvcache import ContextSettings, context_memory

    if plan.evaluation is None:
        return
    cache = context_memory(read_model(plan.source).get, ContextSettings(plan.evaluation.ctx)).total_bytes
    with tempfile.TemporaryDirectory(prefix="ggufcarve-answer-") as tmp:
        answer = answer_for_budget(
            read_results(plan.output / EVALUATION_DIR),
            DEMO_BUDGET,
            cache,
            directories=[plan.output, plan.work],
            source=plan.source,
            heldout=list(plan.evaluation.heldout_files),
            ctx=plan.evaluation.ctx,
            chunks=plan.evaluation.chunks,
            compute=run_compute(plan),
            work=Path(tmp),
        )
    if answer is None:
        return

    def named(r: dict) -> str:
        m = r["model"]
        family = f"pruned {m['expert_count']} of {m['source_expert_count']}" if m["pruned"] else "unpruned"
        over = f" on {r['chunks_scored']} chunks" if r.get("stopped_early") else ""
        return f"{family} {m['quant']} ({_size(memory_of(r, cache))}, mean KLD {r['kld_mean']:.4f}{over})"

    w, other = answer["winner"], answer["runner_up"]
    out.print(
        f"best in {_size(DEMO_BUDGET)} (llama.cpp's memory at {plan.evaluation.ctx} tokens), "
        f"of the {len(answer['fitting'])} measured models that fit:",
        highlight=False,
        markup=False,
    )
    out.print(f"  {named(w)}", highlight=False, markup=False)
    if other is not None:
        why = (
            "dropping experts costs more than a lower quant"
            if not w["model"]["pruned"]
            else "the higher quant is worth more than the dropped experts"
        )
        out.print(
            f"  vs the best {'pruned' if other['model']['pruned'] else 'unpruned'} model that fits: {named(other)}",
            highlight=False,
            markup=False,
        )
        if other.get("stopped_early") and other["delta_vs_leader"]:
            out.print(
                f"  it left after {other['chunks_scored']} chunks: {other['delta_vs_leader'][-1]:+.4f} "
                f"± {other['delta_stderr'][-1]:.4f} behind that round's "
                "leader (paired KLD, standard error over chunks)",
                highlight=False,
                markup=False,
            )
        out.print(f"  here {why}", highlight=False, markup=False)
    if answer["tie_with"]:
        out.print(
            f"  tie within noise: {', '.join(named(r) for r in answer['tie_with'])}; the answer is the smallest file",
            highlight=False,
            markup=False,
        )
    out.print("  every K and quant for your budget, measured: ggufcarve best --help", highlight=False, markup=False)
