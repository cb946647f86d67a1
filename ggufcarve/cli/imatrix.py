"""imatrix collect | remap | inspect | convert: importance matrices (GGUF and legacy .dat) for pruned models.

Examples:
    ggufcarve imatrix collect model.gguf --calibration calibration.txt --ctx 512 -o model.imatrix.gguf
    ggufcarve imatrix inspect model.imatrix.gguf
    ggufcarve imatrix remap model.imatrix.gguf --model pruned.gguf -o pruned.imatrix.gguf
    ggufcarve imatrix convert pruned.imatrix.gguf -o pruned.imatrix.dat
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ggufcarve import settings as S
from ggufcarve.cli.options import (
    CalibrationOption,
    ChunkCtxOption,
    ForceOption,
    GpuLayersOption,
    JsonOption,
    KeepFileOption,
    KeepFirstOption,
    KeepIdsOption,
    NCpuMoeOption,
    QuietOption,
    RpcOption,
    TensorSplitOption,
    ThreadsOption,
    command_group,
    option,
    resolve_keepset,
)
from ggufcarve.cli.render import err, escape, new_table, out, progress, ranges, warn
from ggufcarve.errors import BadInput
from ggufcarve.settings import Keep

if TYPE_CHECKING:
    from ggufcarve.gguf.container import GGUFModel
    from ggufcarve.moe.keepset import KeepSet
    from ggufcarve.moe.layout import MoeLayout


app = command_group("Collect, read, convert and remap importance matrices (GGUF and legacy .dat) for pruned models.")
ImatrixFormatOption = Annotated[
    str | None,
    option(S.FORMAT, "Default: from the output's suffix, else the input's format."),
]
ChunkSizeOption = Annotated[
    int | None,
    option(
        S.CHUNK_SIZE,
        "The imatrix was computed with it (llama-imatrix -c; default 512); needed to turn a .dat into GGUF.",
    ),
]


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _imatrix_keepset(
    layout: MoeLayout, pruned: GGUFModel | None, keep: Keep | None, first: int | None, ids: str | None
) -> KeepSet:
    """The keep-set given on the command line, else the one the pruned model records; both must agree."""
    from ggufcarve.moe.keepset import keepset_from_provenance

    recorded = keepset_from_provenance(pruned.get, pruned.path.name) if pruned is not None else None
    if keep is None and first is None and ids is None:
        if recorded is None:
            where = f"{pruned.path} has no ggufcarve.kept_* keys" if pruned is not None else "no --model given"
            raise BadInput(
                f"no keep-set: {where}",
                "give --keep FILE (or --keep-first/--keep-ids), or --model with a model ggufcarve pruned",
            )
        return recorded
    keepset = resolve_keepset(layout, keep, first, ids)
    if recorded is not None and recorded.layers != {b: tuple(v) for b, v in keepset.layers.items()}:
        differ = sorted(
            b for b in set(recorded.layers) | set(keepset.layers) if recorded.layers.get(b) != keepset.layers.get(b)
        )
        raise BadInput(
            f"the keep-set differs from the one {pruned.path if pruned else ''} was "
            f"pruned with (ggufcarve.kept_experts), in block(s) {ranges(differ)}",
            "omit --keep to use the recorded keep-set, or give the model pruned with this keep-set",
        )
    return keepset


@app.command("collect", short_help="Collect the model's imatrix in llama.cpp.")
def imatrix_collect(
    model: Annotated[Path, typer.Argument(help="The model (GGUF, first shard if split), as llama.cpp loads it.")],
    output: Annotated[Path, option(S.OUTPUT, "the GGUF imatrix.")],
    calibration: CalibrationOption = None,
    ctx: ChunkCtxOption = 512,
    chunks: Annotated[
        int | None,
        option(S.CHUNKS, "the calibration text (llama-imatrix --chunks; default: all)."),
    ] = None,
    threads: ThreadsOption = None,
    gpu_layers: GpuLayersOption = None,
    rpc: RpcOption = None,
    tensor_split: TensorSplitOption = None,
    n_cpu_moe: NCpuMoeOption = 0,
    force: ForceOption = False,
    quiet: QuietOption = False,
    as_json: JsonOption = False,
) -> None:
    """Collect the model's importance matrix in llama.cpp's eval callback, as llama-imatrix does.

    The text is tokenized and cut into chunks of --ctx tokens as llama-imatrix cuts it, decoded
    with its batching, and every MUL_MAT / MUL_MAT_ID of a blk.* weight is accumulated as its
    collector does: counts equal llama-imatrix's, in_sum2 the same float32 sums. Written in
    llama-imatrix's GGUF format; imatrix.datasets holds the files' names."""
    from ggufcarve.gguf.container import read_model
    from ggufcarve.imatrix.collect import collect_imatrix

    loaded = read_model(model)
    with progress(not quiet and not as_json) as sink:
        result = collect_imatrix(
            loaded,
            calibration or [],
            output,
            ctx=ctx,
            chunks=chunks,
            compute=S.compute(threads, gpu_layers, rpc, tensor_split, n_cpu_moe),
            force=force,
            on_event=sink,
        )
    if as_json:
        out.print_json(
            json.dumps(
                {
                    "output": str(result.output_path),
                    "bytes": result.output_bytes,
                    "entries": result.entries,
                    "expert_entries": result.expert_entries,
                    "chunk_count": result.chunk_count,
                    "chunk_size": result.chunk_size,
                    "tokens": result.tokens,
                    "datasets": list(result.datasets),
                    "seconds": round(result.seconds, 2),
                }
            )
        )
        return
    out.print(
        f"{result.chunk_count} chunks x {result.chunk_size} tokens of {', '.join(result.datasets)} "
        f"in {result.seconds:.1f} s ({result.tokens / max(result.seconds, 1e-9):,.0f} tokens/s)"
    )
    out.print(
        f"wrote {result.output_path} ({result.entries} entries, {result.expert_entries} "
        f"with per-expert counts, {result.output_bytes:,} bytes)"
    )


@app.command("remap", short_help="Keep the kept experts' rows of an imatrix.")
def imatrix_remap(
    imatrix: Annotated[
        Path,
        typer.Argument(help="imatrix of the unpruned model (GGUF or .dat), as llama-imatrix wrote it. Never modified."),
    ],
    output: Annotated[Path, option(S.OUTPUT, "the imatrix.")],
    keep: KeepFileOption = None,
    keep_first_count: KeepFirstOption = None,
    keep_id_list: KeepIdsOption = None,
    model: Annotated[
        Path | None,
        option(
            S.MODEL,
            "the pruned model: its recorded keep-set is used when --keep is omitted, and the output is checked "
            "against it as llama-quantize will.",
        ),
    ] = None,
    source_model: Annotated[
        Path | None, typer.Option("--source-model", help="The unpruned model: the input is checked against it.")
    ] = None,
    fmt: ImatrixFormatOption = None,
    chunk_size: ChunkSizeOption = None,
    force: Annotated[bool, option(S.FORCE, "an existing output (and its report).")] = False,
    dry_run: Annotated[bool, option(S.DRY_RUN, "validate and print the plan.")] = False,
    report: Annotated[
        Path | None,
        option(S.REPORT, "(default: OUTPUT_DIR/method/<output stem>.imatrix-remap-report.json)."),
    ] = None,
    quiet: Annotated[bool, option(S.QUIET)] = False,
    as_json: Annotated[bool, option(S.JSON, "the plan (with --dry-run) or the report.")] = False,
) -> None:
    """Keep the kept experts' rows of every expert entry, in keep-set order; every other entry unchanged.

    With --model (the pruned model) and/or --source-model (the unpruned one) every entry is checked
    against the model as llama-quantize will. Without a model, a GGUF imatrix and a keep-set by
    block index are enough: the expert count and MoE blocks are read from the imatrix."""
    from ggufcarve.gguf.container import read_model
    from ggufcarve.imatrix.convert import format_from_path
    from ggufcarve.imatrix.remap import default_report_path as imatrix_report_path
    from ggufcarve.imatrix.remap import (
        execute_remap,
        layout_from_imatrix,
        plan_remap,
        resolve_source_layout,
    )
    from ggufcarve.imatrix_format import read_imatrix
    from ggufcarve.moe.layout import inspect_layout

    source_imatrix = read_imatrix(imatrix)
    pruned = read_model(model) if model is not None else None
    source = read_model(source_model) if source_model is not None else None
    if pruned is None and source is None:
        layout = layout_from_imatrix(source_imatrix)
    else:
        layout = resolve_source_layout(
            source_imatrix,
            pruned,
            inspect_layout(pruned) if pruned else None,
            inspect_layout(source) if source else None,
        )
    keepset = _imatrix_keepset(layout, pruned, keep, keep_first_count, keep_id_list)
    if layout.described_by == "imatrix":
        warn(
            f"no model given: {layout.expert_count} experts and MoE blocks "
            f"{ranges(layout.blocks)} read from the imatrix; the size check against a model "
            "and llama.cpp's top-k and group rules were skipped (give --model to run them)",
            label="note",
        )
    suffix_format = format_from_path(output)
    target = fmt or suffix_format or source_imatrix.format
    plan = plan_remap(
        source_imatrix,
        keepset,
        layout,
        output,
        output_format=target,
        chunk_size=chunk_size,
        pruned=pruned,
        source=source,
    )
    warnings = list(plan.warnings)
    if suffix_format is not None and suffix_format != target:
        warnings.append(f"writing a {target} imatrix to a file named {output.name}")
    if plan.losses:
        warnings.append(f"{source_imatrix.format} -> {target} drops: " + "; ".join(plan.losses))
    if target == "gguf" and source_imatrix.format == "dat" and chunk_size is None:
        warnings.append(
            f"a .dat does not record its chunk size; assumed {plan.chunk_size} (pass --chunk-size to set it)"
        )
    for warning in warnings:
        warn(warning)
    if dry_run:
        if as_json:
            out.print_json(
                json.dumps({**plan.to_json(), "report": str(report or imatrix_report_path(output)), "dry_run": True})
            )
            return
        out.print(
            f"dry run, nothing written: {len(plan.tensors)} expert entries {layout.expert_count} -> "
            f"{plan.kept_count} experts, {len(plan.unchanged)} entries unchanged -> {output} ({target})"
        )
        return
    sources = [p for m in (pruned, source) if m is not None for p in m.paths]
    with progress(not quiet and not as_json) as sink:
        result = execute_remap(plan, force=force, report_path=report, sources=sources, on_event=sink)
    if as_json:
        out.print_json(result.report_path.read_text())
        return
    routing = plan.routing
    table = new_table(title=f"imatrix remapped: {layout.expert_count} -> {plan.kept_count} experts")
    for column in ("block", "expert entries", "kept experts", "routing kept"):
        table.add_column(column, justify="right" if column != "kept experts" else "left")
    shares = {b["block"]: b["share_kept"] for b in routing.get("blocks", [])}
    for block in layout.blocks:
        n = sum(1 for t in plan.tensors if t.block == block)
        ids = keepset.layers[block]
        table.add_row(
            f"{block}" + (" (MTP)" if layout.is_mtp(block) else ""),
            str(n),
            ",".join(map(str, ids)),
            _share(shares.get(block)),
        )
    out.print(table)
    overall = (
        f"{_share(routing['share_kept'])} of the calibration's routed (token, slot) pairs went to kept experts"
        if routing["available"]
        else routing["reason"]
    )
    out.print(f"{len(plan.tensors)} entries remapped, {len(plan.unchanged)} unchanged; {overall}")
    out.print(f"wrote {result.output_path} ({target}, {result.output_bytes:,} bytes)")
    out.print(f"report: {result.report_path}")


@app.command("inspect", short_help="Entries, chunks and per-block routing of an imatrix.")
def imatrix_inspect(
    imatrix: Annotated[Path, typer.Argument(help="GGUF or legacy .dat imatrix.")],
    model: Annotated[Path | None, option(S.MODEL, "every entry is checked against it, as llama-quantize will.")] = None,
    as_json: Annotated[bool, option(S.JSON)] = False,
) -> None:
    """Entries, chunks, datasets, and per MoE block the routing counts (never-routed experts).

    The counts show which experts the calibration never routed to and how unevenly the rest were
    used. With --model, every entry is checked against the model as llama-quantize will."""
    from ggufcarve.gguf.container import read_model
    from ggufcarve.imatrix.check import raise_problems, summarize
    from ggufcarve.imatrix_format import read_imatrix

    loaded = read_imatrix(imatrix)
    summary = summarize(loaded, read_model(model) if model is not None else None)
    doc = summary.to_json()
    if as_json:
        out.print_json(json.dumps(doc))
    else:
        table = new_table(title=f"{imatrix.name}: {loaded.format} imatrix", show_header=False, box=None)
        rows = [
            ("entries", f"{len(loaded.entries)} ({summary.expert_entries} expert, {summary.dense_entries} other)"),
            (
                "chunks",
                f"{loaded.chunk_count} x {loaded.chunk_size} tokens"
                if loaded.chunk_size
                else f"{loaded.chunk_count if loaded.chunk_count is not None else '? (no trailer)'} "
                "(a .dat does not record the chunk size)",
            ),
            ("datasets", ", ".join(loaded.datasets) or "-"),
            (
                "per-expert counts",
                "yes"
                if doc["per_expert_counts"]
                else "no" + (" (a .dat holds one ncall per entry)" if loaded.format == "dat" else ""),
            ),
        ]
        if summary.remapped:
            rows.append(
                (
                    "remapped",
                    f"by ggufcarve: {summary.remapped['source_expert_count']} "
                    f"-> {summary.remapped['kept_expert_count']} experts",
                )
            )
        for key, value in rows:
            table.add_row(f"[bold]{key}[/]", escape(str(value)))
        out.print(table)
        if summary.blocks and not doc["per_expert_counts"]:
            out.print(
                f"expert entries in MoE blocks {ranges([b.block for b in summary.blocks])}; "
                "routing per expert unknown (no per-expert counts)"
            )
        elif summary.blocks:
            blocks = new_table(title="routing per MoE block ((token, slot) pairs per expert)")
            for column in ("block", "experts", "routed", "min", "median", "max", "top 25% share", "never routed"):
                blocks.add_column(column, justify="right")
            for b in doc["moe_blocks"]:
                if b["expert_count"] is None:
                    blocks.add_row(str(b["block"]), "?", "-", "-", "-", "-", "-", "no per-expert counts")
                    continue
                zero = b["zero_count_experts"]
                blocks.add_row(
                    str(b["block"]),
                    str(b["expert_count"]),
                    f"{b['routed_total']:,}",
                    str(b["min"]),
                    f"{b['median']:g}",
                    str(b["max"]),
                    _share(b["top_quarter_share"]),
                    f"{len(zero)}: {','.join(map(str, zero[:16]))}{',...' if len(zero) > 16 else ''}" if zero else "0",
                )
            out.print(blocks)
        if summary.model_check is not None:
            for warning in summary.model_check.warnings:
                warn(warning)
            if not summary.model_check.problems:
                out.print(f"fits {model}: every entry names a tensor of the model and has its size")
    if summary.model_check is not None:
        raise_problems(
            list(summary.model_check.problems),
            f"{imatrix} does not fit {model}",
            "llama-quantize fails on these entries; for a pruned model remap the "
            f"source's imatrix: ggufcarve imatrix remap {imatrix} --model {model} -o OUT",
        )


@app.command("convert", short_help="Convert GGUF <-> legacy .dat, as llama-imatrix does.")
def imatrix_convert(
    source: Annotated[Path, typer.Argument(help="GGUF or legacy .dat imatrix. Never modified.")],
    output: Annotated[Path, option(S.OUTPUT, "the imatrix.")],
    fmt: ImatrixFormatOption = None,
    chunk_size: ChunkSizeOption = None,
    force: Annotated[bool, option(S.FORCE, "an existing output.")] = False,
    quiet: Annotated[bool, option(S.QUIET)] = False,
) -> None:
    """GGUF <-> legacy .dat, as llama-imatrix itself converts (some forks' quantizers read only .dat).

    To .dat: per-expert counts are lost (a .dat keeps one ncall per entry); llama-quantize's
    normalised values are unchanged."""
    from ggufcarve.imatrix.convert import convert_file, format_from_path
    from ggufcarve.imatrix_format import read_imatrix

    target = fmt or format_from_path(output)
    if target is None:
        raise BadInput(f"cannot tell the output format from {output.name}", "pass --format gguf or --format dat")
    loaded = read_imatrix(source)
    with progress(not quiet) as sink:
        result = convert_file(loaded, output, target, chunk_size=chunk_size, force=force, on_event=sink)
    if result.conversion.losses:
        err.print(
            f"[yellow]warning:[/] {loaded.format} -> {target} drops: {escape('; '.join(result.conversion.losses))}",
            soft_wrap=True,
            highlight=False,
        )
    if result.conversion.skipped:
        err.print(
            "[yellow]warning:[/] not written (no data, as llama-imatrix "
            f"skips them): {escape(', '.join(result.conversion.skipped))}",
            soft_wrap=True,
            highlight=False,
        )
    if target == "gguf" and chunk_size is None:
        err.print(
            "[yellow]note:[/] a .dat does not record its chunk size; imatrix.chunk_size "
            f"set to {result.conversion.imatrix.chunk_size} (pass --chunk-size to set it)",
            soft_wrap=True,
            highlight=False,
        )
    out.print(
        f"wrote {result.output_path} ({target}, {len(result.conversion.imatrix.entries)} "
        f"entries, {result.output_bytes:,} bytes)"
    )
