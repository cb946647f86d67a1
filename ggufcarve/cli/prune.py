"""inspect, prune, check-prune: the MoE layout of a model, and cutting experts out of it.

Examples:
    ggufcarve inspect model.gguf
    ggufcarve inspect model-00001-of-00003.gguf --json
    ggufcarve prune model.gguf --keep kept_expert_indices.json -o pruned.gguf
    ggufcarve prune model.gguf --keep-first 128 -o pruned.gguf --dry-run
    ggufcarve prune model.gguf --keep-first 128 --topk 6 -o pruned-top6.gguf
    ggufcarve topk model.gguf 6 -o model-top6.gguf
    ggufcarve check-prune model.gguf pruned.gguf
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ggufcarve import settings as S
from ggufcarve.cli.options import (
    KeepFileOption,
    KeepFirstOption,
    KeepIdsOption,
    option,
    resolve_keepset,
)
from ggufcarve.cli.render import err, new_table, out, progress, ranges, size, warn

if TYPE_CHECKING:
    from rich.table import Table

    from ggufcarve.gguf.container import GGUFModel
    from ggufcarve.moe.layout import MoeLayout
    from ggufcarve.prune.plan import PrunePlan


def _layout_table(model: GGUFModel, layout: MoeLayout) -> Table:
    table = new_table(title=f"{model.path.name}: {layout.architecture}", show_header=False, box=None)
    rows = [
        ("files", ", ".join(p.name for p in model.paths)),
        (
            "blocks",
            f"{layout.block_count} ({layout.nextn_layers} MTP)" if layout.nextn_layers else str(layout.block_count),
        ),
        (
            "MoE blocks",
            f"{len(layout.layers)}: {ranges(layout.blocks)}"
            + (f" (MTP: {ranges([b for b in layout.blocks if layout.is_mtp(b)])})" if layout.nextn_layers else ""),
        ),
        ("experts", f"{layout.expert_count}, top-{layout.expert_used_count}"),
        ("groups", f"{layout.group_count}, {layout.group_used_count} used" if layout.group_count > 1 else "none"),
        ("shared experts", str(layout.shared_expert_count)),
        (
            "routing",
            layout.routing.describe()
            + (
                "; MTP blocks have their own experts"
                if layout.nextn_layers and any(layout.is_mtp(b) for b in layout.blocks)
                else ""
            ),
        ),
        (
            "size",
            f"{size(model.total_bytes)}; experts {size(layout.expert_bytes)} "
            f"({100 * layout.expert_bytes / max(layout.total_bytes, 1):.1f}% of tensor data)",
        ),
    ]
    for key, value in rows:
        table.add_row(f"[bold]{key}[/]", value)
    return table


def inspect(
    model: Annotated[Path, typer.Argument(help="GGUF file, or the first shard of a split set.")],
    as_json: Annotated[bool, option(S.JSON, "the layout.")] = False,
) -> None:
    """Show the MoE layout: experts, MoE blocks (MTP included), expert-axis tensors and sizes."""
    from ggufcarve.gguf.container import read_model
    from ggufcarve.moe.layout import inspect_layout

    loaded = read_model(model)
    layout = inspect_layout(loaded)
    if as_json:
        out.print_json(json.dumps({"files": [str(p) for p in loaded.paths], **layout.to_json()}))
        return
    out.print(_layout_table(loaded, layout))
    tensors = new_table(title="expert-axis tensors (per MoE block)")
    for column in ("tensor", "role", "shape", "type", "bytes/expert"):
        tensors.add_column(column, justify="right" if column == "bytes/expert" else "left")
    seen: dict[str, tuple[Any, ...]] = {}
    for layer in layout.layers:
        for t in layer.tensors:
            suffix = t.name.split(".", 2)[2]
            row = (
                suffix + (" (MTP)" if layer.is_mtp else ""),
                t.role,
                "x".join(map(str, t.shape)),
                t.type_name,
                f"{t.bytes_per_expert:,}",
            )
            seen.setdefault(row[0] + row[2] + row[3], row)
    for row in seen.values():
        tensors.add_row(*row)
    out.print(tensors)


ReportOption = Annotated[
    Path | None, option(S.REPORT, "(default: OUTPUT_DIR/method/<output stem>.pruning-report.json).")
]


def prune(
    model: Annotated[Path, typer.Argument(help="Source GGUF file, or the first shard of a split set. Never modified.")],
    output: Annotated[Path, option(S.OUTPUT, "the .gguf (split outputs get -0000i-of-0000N).")],
    keep: KeepFileOption = None,
    keep_first_count: KeepFirstOption = None,
    keep_id_list: KeepIdsOption = None,
    force: Annotated[bool, option(S.FORCE, "an existing output.")] = False,
    dry_run: Annotated[bool, option(S.DRY_RUN, "print the plan.")] = False,
    no_provenance: Annotated[bool, typer.Option("--no-provenance", help="Do not add ggufcarve.* keys.")] = False,
    split_max_size: Annotated[str | None, option(S.SPLIT_MAX_SIZE)] = None,
    merge: Annotated[bool, option(S.MERGE, "a split source is written as one file.")] = False,
    topk: Annotated[str | None, option(S.TOPK, "One count, at most K.")] = None,
    report: ReportOption = None,
    quiet: Annotated[bool, option(S.QUIET)] = False,
    as_json: Annotated[bool, option(S.JSON, "the plan (with --dry-run) or the result.")] = False,
) -> None:
    """Keep K experts per MoE block: kept slabs and router rows copied as raw bytes, then verified."""
    from ggufcarve.gguf.container import read_model
    from ggufcarve.moe.experts_used import with_experts_used
    from ggufcarve.moe.layout import inspect_layout
    from ggufcarve.prune.plan import parse_size, plan_prune
    from ggufcarve.prune.report import save_keep_file

    used = S.one_used_count(topk)
    loaded = read_model(model)
    layout = inspect_layout(loaded)
    keepset = resolve_keepset(
        layout if used is None else with_experts_used(layout, used), keep, keep_first_count, keep_id_list
    )
    plan = plan_prune(
        loaded,
        layout,
        keepset,
        output,
        provenance=not no_provenance,
        split_max_size=parse_size(split_max_size) if split_max_size else None,
        merge=merge,
        experts_used=used,
    )
    if _write_plan(plan, loaded, force=force, dry_run=dry_run, report=report, quiet=quiet, as_json=as_json):
        if keep is not None and keep.file is not None:
            save_keep_file(plan, keep.file)  # beside the report: `ladder run` publishes it with the pruned model


def _write_plan(
    plan: PrunePlan, loaded: GGUFModel, *, force: bool, dry_run: bool, report: Path | None, quiet: bool, as_json: bool
) -> bool:
    """Print the plan (dry run), or write and verify it and print the result; whether it wrote."""
    from ggufcarve.prune.execute import execute
    from ggufcarve.prune.report import default_report_path

    layout = plan.layout
    for warning in plan.warnings:
        warn(warning)
    if dry_run:
        if as_json:
            out.print_json(json.dumps(plan.to_json()))
            return False
        summary = plan.to_json()
        table = new_table(title="prune plan (dry run: nothing written)", show_header=False, box=None)
        table.add_row(
            "[bold]experts[/]", f"{layout.expert_count} -> {plan.kept_count} in {len(layout.layers)} MoE blocks"
        )
        table.add_row(
            "[bold]tensors[/]",
            f"{len(summary['tensors_pruned'])} sliced, "
            f"{summary['tensors_total'] - len(summary['tensors_pruned'])} copied whole",
        )
        for key, change in summary["changed_keys"].items():
            table.add_row(f"[bold]{key}[/]", f"{change['before']} -> {change['after']}")
        table.add_row("[bold]bytes in[/]", f"{plan.bytes_in:,} ({size(plan.bytes_in)})")
        for f in plan.files:
            table.add_row("[bold]output[/]", f"{f.path}: {f.size:,} bytes ({size(f.size)}), {len(f.tensors)} tensors")
        table.add_row("[bold]report[/]", str(report or default_report_path(plan)))
        out.print(table)
        return False
    with progress(not quiet and not as_json) as sink:
        result = execute(plan, loaded, force=force, on_event=sink, report_path=report)
    if as_json:
        out.print_json(
            json.dumps(
                {
                    **plan.to_json(),
                    "report": str(result.report_path),
                    "timings": result.timings,
                    "verified_tensors": len(result.verification.tensors),
                }
            )
        )
        return True
    table = new_table(title="pruned and verified" if plan.pruned else "rewritten and verified")
    for column in ("output", "bytes", "size", "tensors", "sliced"):
        table.add_column(column, justify="left" if column == "output" else "right")
    for f in plan.files:
        table.add_row(
            str(f.path), f"{f.size:,}", size(f.size), str(len(f.tensors)), str(sum(t.pruned for t in f.tensors))
        )
    out.print(table)
    t = result.timings
    used = plan.to_json()["expert_used_count"]
    out.print(
        f"experts {layout.expert_count} -> {plan.kept_count}"
        + (f", used per token {used['before']} -> {used['after']}" if used["before"] != used["after"] else "")
        + f"; {plan.bytes_in:,} -> {plan.bytes_out:,} bytes; "
        f"{len(result.verification.tensors)} tensors and {result.verification.keys_checked} "
        f"keys verified (xxh3-128) in {t['total_seconds']:.1f} s"
    )
    out.print(f"report: {result.report_path}")
    return True


def topk_command(
    model: Annotated[Path, typer.Argument(help="Source GGUF file, or the first shard of a split set. Never modified.")],
    experts_used: Annotated[
        int, typer.Argument(metavar="N", help="Experts each token is routed to in the copy ({arch}.expert_used_count).")
    ],
    output: Annotated[Path, option(S.OUTPUT, "the .gguf (a split source gives the same shards).")],
    force: Annotated[bool, option(S.FORCE, "an existing output.")] = False,
    dry_run: Annotated[bool, option(S.DRY_RUN, "print the plan.")] = False,
    split_max_size: Annotated[str | None, option(S.SPLIT_MAX_SIZE)] = None,
    merge: Annotated[bool, option(S.MERGE, "a split source is written as one file.")] = False,
    report: ReportOption = None,
    quiet: Annotated[bool, option(S.QUIET)] = False,
    as_json: Annotated[bool, option(S.JSON, "the plan (with --dry-run) or the result.")] = False,
) -> None:
    """A copy routed to N experts per token: every tensor and every other key byte for byte
    (with {arch}.expert_feed_forward_length added where the file derives the width from N), verified."""
    from ggufcarve.gguf.container import read_model
    from ggufcarve.moe.keepset import keep_first
    from ggufcarve.moe.layout import inspect_layout
    from ggufcarve.prune.plan import parse_size, plan_prune

    loaded = read_model(model)
    layout = inspect_layout(loaded)
    plan = plan_prune(
        loaded,
        layout,
        keep_first(layout, layout.expert_count),
        output,
        provenance=False,
        split_max_size=parse_size(split_max_size) if split_max_size else None,
        merge=merge,
        experts_used=experts_used,
    )
    _write_plan(plan, loaded, force=force, dry_run=dry_run, report=report, quiet=quiet, as_json=as_json)


def check_prune_command(
    source: Annotated[Path, typer.Argument(help="The unpruned source GGUF (first shard if split).")],
    output: Annotated[Path, typer.Argument(help="The pruned GGUF (first shard if split).")],
    keep: KeepFileOption = None,
    keep_first_count: KeepFirstOption = None,
    keep_id_list: KeepIdsOption = None,
    quiet: Annotated[bool, option(S.QUIET)] = False,
) -> None:
    """Re-check a pruned file against its source: every tensor hash and every key.

    Without a keep-set option, the one the output records in its ggufcarve.kept_* keys is used."""
    from ggufcarve.gguf.container import read_model
    from ggufcarve.moe.keepset import keep_first, keepset_from_provenance
    from ggufcarve.moe.layout import inspect_layout
    from ggufcarve.prune.check import check_prune

    src = read_model(source)
    layout = inspect_layout(src)
    pruned = read_model(output)
    recorded = keepset_from_provenance(pruned.get, pruned.path.name)
    unspecified = keep is None and keep_first_count is None and keep_id_list is None
    if recorded is not None and unspecified:
        keepset = recorded
    elif unspecified and inspect_layout(pruned).expert_count == layout.expert_count:
        keepset = keep_first(layout, layout.expert_count)  # a `topk` copy: every expert
    else:
        keepset = resolve_keepset(layout, keep, keep_first_count, keep_id_list)
    with progress(not quiet) as sink:
        verification = check_prune(src, layout, keepset, pruned, on_event=sink)
    if not verification.ok:
        failures = new_table(title="check-prune failures")
        failures.add_column("what")
        failures.add_column("problem")
        for problem in verification.problems:
            failures.add_row("metadata", problem)
        for t in verification.tensors:
            if not t.ok:
                failures.add_row(t.name, f"xxh3 {t.output_xxh3[:16]} != expected {t.expected_xxh3[:16]}")
        err.print(failures)
        verification.raise_if_failed(f"{output}")
    out.print(
        f"OK: {len(verification.tensors)} tensors and {verification.keys_checked} keys of "
        f"{output} match {source} with {layout.expert_count} -> {keepset.kept_count} experts"
    )
