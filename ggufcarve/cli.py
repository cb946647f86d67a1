"""The ggufcarve command line. The only module that prints.

Examples:
    ggufcarve inspect model.gguf
    ggufcarve inspect model-00001-of-00003.gguf --json
    ggufcarve prune model.gguf --keep kept_expert_indices.json -o pruned.gguf
    ggufcarve prune model.gguf --keep-first 128 -o pruned.gguf --dry-run
    ggufcarve check-prune model.gguf pruned.gguf --keep kept_expert_indices.json
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Callable, Iterator, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from ggufcarve import __version__
from ggufcarve.container import GGUFModel, read_model
from ggufcarve.errors import BadInput, CarveError
from ggufcarve.keepset import KeepSet, keep_first, keep_ids, keepset_from_provenance, load_keepset, parse_id_list
from ggufcarve.moe import MoeLayout, inspect_layout
from ggufcarve.prune import ProgressEvent, check_prune, default_report_path, execute, parse_size, plan_prune

app = typer.Typer(help="Cut routed experts out of Mixture-of-Experts GGUF files, byte for byte.", no_args_is_help=True, add_completion=False)
out = Console()
err = Console(stderr=True)

KeepOption = Annotated[Optional[Path], typer.Option("--keep", help="Keep-set JSON: ours, kept_expert_indices.json, carve_manifest.json or expert-selection.json.")]
KeepFirstOption = Annotated[Optional[int], typer.Option("--keep-first", help="Keep experts 0..K-1 in every MoE block.")]
KeepIdsOption = Annotated[Optional[str], typer.Option("--keep-ids", help="Keep these ids in every MoE block, e.g. 0,2,4-7.")]


def _version(value: bool) -> None:
    if value:
        out.print(f"ggufcarve {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")] = False,
) -> None:
    """ggufcarve: expert pruning, imatrix remapping and quantization ladders for MoE GGUF models."""


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


@contextmanager
def _progress(enabled: bool) -> Iterator[Callable[[ProgressEvent], None]]:
    """An event sink drawing one byte progress bar per stage."""
    if not enabled:
        yield lambda event: None
        return
    bars = Progress(
        TextColumn("{task.description:<12}"), BarColumn(), DownloadColumn(binary_units=True), TransferSpeedColumn(), TimeRemainingColumn(), console=err, transient=False
    )
    tasks: dict[str, Any] = {}

    def sink(event: ProgressEvent) -> None:
        if event.stage not in tasks:
            tasks[event.stage] = bars.add_task(event.stage, total=event.total or None)  # 0: size not known ahead
        bars.update(tasks[event.stage], advance=event.advance)

    with bars:
        yield sink


def _resolve_keepset(layout: MoeLayout, keep: Optional[Path], first: Optional[int], ids: Optional[str]) -> KeepSet:
    given = [x is not None for x in (keep, first, ids)]
    if sum(given) != 1:
        raise BadInput("give exactly one of --keep FILE, --keep-first K, --keep-ids LIST", "for example --keep kept_expert_indices.json")
    if keep is not None:
        return load_keepset(keep, layout)
    if first is not None:
        return keep_first(layout, first)
    return keep_ids(layout, parse_id_list(ids or ""))


def _layout_table(model: GGUFModel, layout: MoeLayout) -> Table:
    table = Table(title=f"{model.path.name}: {layout.architecture}", show_header=False, box=None)
    rows = [
        ("files", ", ".join(p.name for p in model.paths)),
        ("blocks", f"{layout.block_count} ({layout.nextn_layers} MTP)" if layout.nextn_layers else str(layout.block_count)),
        ("MoE blocks", f"{len(layout.layers)}: {_ranges(layout.blocks)}" + (f" (MTP: {_ranges([b for b in layout.blocks if layout.is_mtp(b)])})" if layout.nextn_layers else "")),
        ("experts", f"{layout.expert_count}, top-{layout.expert_used_count}"),
        ("groups", f"{layout.group_count}, {layout.group_used_count} used" if layout.group_count > 1 else "none"),
        ("shared experts", str(layout.shared_expert_count)),
        ("routing", f"{layout.routing.gating}: {layout.routing.note}"),
        ("size", f"{_gib(model.total_bytes)}; experts {_gib(layout.expert_bytes)} ({100 * layout.expert_bytes / max(layout.total_bytes, 1):.1f}% of tensor data)"),
    ]
    for key, value in rows:
        table.add_row(f"[bold]{key}[/]", value)
    return table


def _ranges(blocks: Any) -> str:
    blocks = list(blocks)
    parts, start = [], None
    for i, b in enumerate(blocks):
        if start is None:
            start = b
        if i + 1 == len(blocks) or blocks[i + 1] != b + 1:
            parts.append(str(start) if start == b else f"{start}-{b}")
            start = None
    return ",".join(parts)


@app.command()
def inspect(
    model: Annotated[Path, typer.Argument(help="GGUF file, or the first shard of a split set.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the layout as JSON.")] = False,
) -> None:
    """Show the MoE layout: experts, MoE blocks (MTP included), expert-axis tensors and sizes."""
    loaded = read_model(model)
    layout = inspect_layout(loaded)
    if as_json:
        out.print_json(json.dumps({"files": [str(p) for p in loaded.paths], **layout.to_json()}))
        return
    out.print(_layout_table(loaded, layout))
    tensors = Table(title="expert-axis tensors (per MoE block)")
    for column in ("tensor", "role", "shape", "type", "bytes/expert"):
        tensors.add_column(column, justify="right" if column == "bytes/expert" else "left")
    seen: dict[str, tuple[Any, ...]] = {}
    for layer in layout.layers:
        for t in layer.tensors:
            suffix = t.name.split(".", 2)[2]
            row = (suffix + (" (MTP)" if layer.is_mtp else ""), t.role, "x".join(map(str, t.shape)), t.type_name, f"{t.bytes_per_expert:,}")
            seen.setdefault(row[0] + row[2] + row[3], row)
    for row in seen.values():
        tensors.add_row(*row)
    out.print(tensors)


@app.command()
def prune(
    model: Annotated[Path, typer.Argument(help="Source GGUF file, or the first shard of a split set. Never modified.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Output .gguf path (split outputs get -0000i-of-0000N).")],
    keep: KeepOption = None,
    keep_first_count: KeepFirstOption = None,
    keep_id_list: KeepIdsOption = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan and write nothing.")] = False,
    no_provenance: Annotated[bool, typer.Option("--no-provenance", help="Do not add ggufcarve.* keys.")] = False,
    split_max_size: Annotated[Optional[str], typer.Option("--split-max-size", help="Re-shard the output, e.g. 50G or 512M (as llama-gguf-split).")] = None,
    merge: Annotated[bool, typer.Option("--merge", help="Write a split source as one file.")] = False,
    report: Annotated[Optional[Path], typer.Option("--report", help="Where to write the pruning report [default: OUTPUT_DIR/method/pruning-report.json].")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan (with --dry-run) or the result as JSON.")] = False,
) -> None:
    """Keep K experts per MoE block: kept slabs and router rows copied as raw bytes, then verified."""
    loaded = read_model(model)
    layout = inspect_layout(loaded)
    keepset = _resolve_keepset(layout, keep, keep_first_count, keep_id_list)
    plan = plan_prune(loaded, layout, keepset, output, provenance=not no_provenance, split_max_size=parse_size(split_max_size) if split_max_size else None, merge=merge)
    for warning in plan.warnings:
        err.print(f"[yellow]warning:[/] {escape(warning)}", soft_wrap=True, highlight=False)
    if dry_run:
        if as_json:
            out.print_json(json.dumps(plan.to_json()))
            return
        summary = plan.to_json()
        table = Table(title="prune plan (dry run: nothing written)", show_header=False, box=None)
        table.add_row("[bold]experts[/]", f"{layout.expert_count} -> {plan.kept_count} in {len(layout.layers)} MoE blocks")
        table.add_row("[bold]tensors[/]", f"{len(summary['tensors_pruned'])} sliced, {summary['tensors_total'] - len(summary['tensors_pruned'])} copied whole")
        for key, change in summary["changed_keys"].items():
            table.add_row(f"[bold]{key}[/]", f"{change['before']} -> {change['after']}")
        table.add_row("[bold]bytes in[/]", f"{plan.bytes_in:,} ({_gib(plan.bytes_in)})")
        for f in plan.files:
            table.add_row("[bold]output[/]", f"{f.path}: {f.size:,} bytes ({_gib(f.size)}), {len(f.tensors)} tensors")
        table.add_row("[bold]report[/]", str(report or default_report_path(plan)))
        out.print(table)
        return
    with _progress(not quiet and not as_json) as sink:
        result = execute(plan, loaded, force=force, on_event=sink, report_path=report)
    if as_json:
        out.print_json(json.dumps({**plan.to_json(), "report": str(result.report_path), "timings": result.timings, "verified_tensors": len(result.verification.tensors)}))
        return
    table = Table(title="pruned and verified")
    for column in ("output", "bytes", "GiB", "tensors", "sliced"):
        table.add_column(column, justify="left" if column == "output" else "right")
    for f in plan.files:
        table.add_row(str(f.path), f"{f.size:,}", f"{f.size / 2**30:.2f}", str(len(f.tensors)), str(sum(t.pruned for t in f.tensors)))
    out.print(table)
    t = result.timings
    out.print(
        f"experts {layout.expert_count} -> {plan.kept_count}; {plan.bytes_in:,} -> {plan.bytes_out:,} bytes; "
        f"{len(result.verification.tensors)} tensors and {result.verification.keys_checked} keys verified (xxh3-128) in {t['total_seconds']:.1f} s"
    )
    out.print(f"report: {result.report_path}")


@app.command("check-prune")
def check_prune_command(
    source: Annotated[Path, typer.Argument(help="The unpruned source GGUF (first shard if split).")],
    output: Annotated[Path, typer.Argument(help="The pruned GGUF (first shard if split).")],
    keep: KeepOption = None,
    keep_first_count: KeepFirstOption = None,
    keep_id_list: KeepIdsOption = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars.")] = False,
) -> None:
    """Re-check a pruned file against its source: every tensor hash and every key.

    Without a keep-set option, the one the output records in its ggufcarve.kept_* keys is used."""
    src = read_model(source)
    layout = inspect_layout(src)
    pruned = read_model(output)
    recorded = keepset_from_provenance(pruned.get, pruned.path.name)
    if recorded is not None and keep is None and keep_first_count is None and keep_id_list is None:
        keepset = recorded
    else:
        keepset = _resolve_keepset(layout, keep, keep_first_count, keep_id_list)
    with _progress(not quiet) as sink:
        verification = check_prune(src, layout, keepset, pruned, on_event=sink)
    if not verification.ok:
        failures = Table(title="check-prune failures")
        failures.add_column("what")
        failures.add_column("problem")
        for problem in verification.problems:
            failures.add_row("metadata", problem)
        for t in verification.tensors:
            if not t.ok:
                failures.add_row(t.name, f"xxh3 {t.output_xxh3[:16]} != expected {t.expected_xxh3[:16]}")
        err.print(failures)
        verification.raise_if_failed(f"{output}")
    out.print(f"OK: {len(verification.tensors)} tensors and {verification.keys_checked} keys of {output} match {source} with {layout.expert_count} -> {keepset.kept_count} experts")


# === toolchain, ladder, verify (issue 4) =========================================================
# Owned by the ladder work; keep other commands outside this section.

toolchain_app = typer.Typer(help="Find, probe and build the llama.cpp tools ggufcarve runs.", no_args_is_help=True)
app.add_typer(toolchain_app, name="toolchain")
LlamaCppOption = Annotated[Optional[Path], typer.Option("--llama-cpp", help="Directory holding llama.cpp tools (DIR, DIR/bin or DIR/build/bin). Env: GGUFCARVE_LLAMA_CPP.")]


@toolchain_app.command("show")
def toolchain_show(
    llama_cpp: LlamaCppOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print as JSON.")] = False,
) -> None:
    """Which llama.cpp tools were found where: build, commit, flavour, sha256; and the libllama backend."""
    from ggufcarve.toolchain import show_toolchain

    chain = show_toolchain(llama_cpp)
    if as_json:
        out.print_json(json.dumps(chain.to_json()))
        return
    table = Table(title="llama.cpp tools")
    for column in ("tool", "found in", "path", "build", "commit", "flavour", "sha256"):
        table.add_column(column)
    for name, info in chain.tools.items():
        if info is None:
            table.add_row(name, "[red]missing[/]", "", "", "", "", "")
        else:
            build = f"{info.version or ''} b{info.build_number}" if info.build_number is not None else "?"
            table.add_row(name, info.origin, info.path, build.strip(), info.commit or "?", info.flavour + ("" if info.works else " [red](probe failed)[/]"), info.sha256[:12])
    out.print(table)
    lib = chain.libllama
    out.print(f"libllama backend: llama-cpp-python {chain.llama_cpp_python or 'not installed'}" + (f", {lib['path']} (sha256 {lib['sha256'][:12]})" if lib else " [red](libllama not found)[/]"))
    out.print(f"cache: {chain.cache_bin}")
    if any(info is None for info in chain.tools.values()):
        out.print("build the missing tools with: ggufcarve toolchain build")


@toolchain_app.command("build")
def toolchain_build(
    force: Annotated[bool, typer.Option("--force", help="Rebuild even when the cache has the tools.")] = False,
    jobs: Annotated[Optional[int], typer.Option("--jobs", "-j", help="Parallel compile jobs (default: CPU count).")] = None,
    from_dir: Annotated[Optional[Path], typer.Option("--from", help="Install tools already built from the same source (a build's bin dir) instead of compiling.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
) -> None:
    """Compile llama-quantize, llama-imatrix, llama-perplexity and llama-gguf-split into ggufcarve's cache.

    From the llama.cpp source in the llama-cpp-python sdist of the installed version; about 10-13
    minutes on 2 cores, once per version."""
    from ggufcarve.toolchain import ToolchainEvent, build_tools, install_prebuilt

    if from_dir is not None:
        bin_dir, copied = install_prebuilt(from_dir, origin=f"copied from {from_dir}", force=force)
        out.print(f"installed: {bin_dir}" if copied else f"already cached (pass --force to replace): {bin_dir}")
        return
    if quiet:
        bin_dir = build_tools(None, jobs=jobs, force=force)
    else:
        bars = Progress(TextColumn("{task.description:<10}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"), TextColumn("{task.fields[line]}"), console=err, transient=False)
        with bars:
            task = bars.add_task("toolchain", total=1.0, line="")

            def sink(event: ToolchainEvent) -> None:
                fields: dict[str, Any] = {"description": event.stage, "line": escape(event.message[-70:])}
                if event.fraction is not None:
                    fields["completed"] = event.fraction
                bars.update(task, **fields)

            bin_dir = build_tools(sink, jobs=jobs, force=force)
    out.print(f"tools ready in {bin_dir}")


ladder_app = typer.Typer(help="Quantization ladders: every rung from one pruned source, hashed and recorded.", no_args_is_help=True)
app.add_typer(ladder_app, name="ladder")


@ladder_app.command("run")
def ladder_run(
    spec: Annotated[Path, typer.Argument(help="Ladder spec, e.g. ladders/q8-to-iq1.toml.")],
    source: Annotated[Path, typer.Option("--source", help="The pruned model to requantize (first shard if split). Never modified.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Output directory for the rungs, quant-manifest.json and SHA256SUMS.")],
    imatrix: Annotated[Optional[Path], typer.Option("--imatrix", help="imatrix for the source (remapped to the pruned experts); needed by IQ rungs.")] = None,
    only: Annotated[Optional[list[str]], typer.Option("--only", help="Run only these rungs (repeat or comma-separate), e.g. Q4_K_M,IQ2_XS.")] = None,
    keep_going: Annotated[bool, typer.Option("--keep-going", help="Continue past a failed rung.")] = False,
    quantizer_choice: Annotated[str, typer.Option("--quantizer", help="auto | binary | libllama | PATH to llama-quantize. auto prefers a found binary.")] = "auto",
    llama_cpp: LlamaCppOption = None,
    model_name: Annotated[Optional[str], typer.Option("--model-name", help="{model} in file names (default: the source name without its quant tag).")] = None,
    threads: Annotated[Optional[int], typer.Option("--threads", "-t", help="Quantizer threads (default: all cores).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate and print the plan; run nothing.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
) -> None:
    """Quantize every rung of SPEC from --source into -o DIR; resumable; writes quant-manifest.json and SHA256SUMS."""
    from ggufcarve.ladder import LadderEvent, load_spec, plan_ladder, run_ladder
    from ggufcarve.toolchain import make_quantizer

    ladder_spec = load_spec(spec)
    quantizer = make_quantizer(quantizer_choice, llama_cpp)
    plan = plan_ladder(ladder_spec, source, output, quantizer=quantizer, imatrix=imatrix, only=only, model_name=model_name, nthreads=threads or os.cpu_count(), hash_inputs=not dry_run)
    for warning in plan.warnings:
        err.print(f"[yellow]warning:[/] {escape(warning)}", soft_wrap=True, highlight=False)
    described = quantizer.describe()
    err.print(f"quantizer: {described['backend']} {described['path']}" + (f" (build {described['build']}, {described['commit']})" if described.get("build") is not None else f" ({described.get('version')})"), highlight=False)
    if dry_run:
        table = Table(title=f"ladder {ladder_spec.name} (dry run: nothing written)")
        for column in ("rung", "output", "est. GiB", "imatrix fallback", "command"):
            table.add_column(column, overflow="fold")
        for p in plan.rungs:
            table.add_row(p.rung.name, str(p.output), f"{p.estimated_bytes / 2**30:.2f}", f"{len(p.fallback)} -> {p.rung.imatrix_fallback_type}" if p.fallback else "", escape(" ".join(quantizer.argv(p.job))))
        out.print(table)
        return
    if quiet:
        result = run_ladder(plan, keep_going=keep_going)
    else:
        bars = Progress(TextColumn("{task.description:<10}"), BarColumn(), TextColumn("{task.fields[count]:>9}"), TextColumn("{task.fields[info]}"), console=err, transient=False)
        tasks: dict[str, Any] = {}

        def sink(event: LadderEvent) -> None:
            if event.rung is None:
                return
            if event.rung not in tasks:
                tasks[event.rung] = bars.add_task(event.rung, total=1, info="", count="")
            task = tasks[event.rung]
            if event.kind == "tensor":
                bars.update(task, completed=event.done, total=event.total, count=f"{event.done}/{event.total}", info=escape(event.message[:40]))
            elif event.kind == "rung-start":
                bars.update(task, info="starting")
            elif event.kind == "rung-done":
                bars.update(task, completed=bars.tasks[task].total, info=f"hashing; {escape(event.message)}")
            elif event.kind == "hashed":
                bars.update(task, info=f"done, sha256 {event.message[:12]}")
            elif event.kind == "rung-skipped":
                bars.update(task, completed=1, total=1, count="skipped", info="unchanged (sha256 verified)")
            elif event.kind == "rung-corrupt":
                bars.update(task, info=f"[yellow]{escape(event.message)}[/]")
            elif event.kind == "rung-failed":
                bars.update(task, info=f"[red]failed: {escape(event.message)}[/]")

        with bars:
            result = run_ladder(plan, keep_going=keep_going, on_event=sink)
    table = Table(title=f"ladder {ladder_spec.name}: {output}")
    for column in ("rung", "size GiB", "bits/weight", "sha256", "seconds", "status"):
        table.add_column(column, justify="left" if column in ("rung", "sha256", "status") else "right")
    for r in result.rungs:
        status = {"built": "[green]built[/]", "skipped": "skipped (unchanged)", "failed": f"[red]FAILED[/]: {escape(r.error or '')}", "not run": "not run"}[r.status]
        table.add_row(r.name, f"{r.gib:.2f}" if r.bytes else "", f"{r.bits_per_weight:.2f}" if r.bits_per_weight else "", (r.sha256 or "")[:12], f"{r.seconds:.1f}", status)
    out.print(table)
    out.print(f"manifest: {result.manifest_path}; sums: {result.sums_path}; {result.seconds:.1f} s total, {result.quantizer_seconds:.1f} s in the quantizer")
    if result.failed:
        raise typer.Exit(1)


@app.command("verify")
def verify_command(
    directory: Annotated[Path, typer.Argument(help="A ladder output directory (with SHA256SUMS and quant-manifest.json).")],
    ignore_missing: Annotated[bool, typer.Option("--ignore-missing", help="Do not fail for files listed in SHA256SUMS that are absent (as sha256sum -c --ignore-missing).")] = False,
    jobs: Annotated[Optional[int], typer.Option("--jobs", "-j", help="Files hashed in parallel (default: CPU count).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
) -> None:
    """Check a ladder directory before publishing: sums, manifest, GGUF structure, expert counts."""
    from ggufcarve.verify import verify_dir

    if quiet or as_json:
        report = verify_dir(directory, ignore_missing=ignore_missing, workers=jobs)
    else:
        bars = Progress(TextColumn("{task.description:<8}"), BarColumn(), DownloadColumn(binary_units=True), TransferSpeedColumn(), TimeRemainingColumn(), console=err, transient=True)
        with bars:
            task = bars.add_task("sha256", total=None)

            def progress(n: int, total: int) -> None:
                bars.update(task, advance=n, total=total)

            report = verify_dir(directory, ignore_missing=ignore_missing, workers=jobs, progress=progress)
    if as_json:
        out.print_json(json.dumps(report.to_json()))
    elif report.ok:
        rate = report.bytes_hashed / max(report.seconds, 1e-9) / 2**20
        out.print(f"OK: {len(report.files_ok)} files of {directory} match SHA256SUMS and the manifest" + (f"; expert_count {report.expert_count}" if report.expert_count is not None else "") + f" ({report.bytes_hashed / 2**30:.2f} GiB in {report.seconds:.1f} s, {rate:.0f} MiB/s, {report.workers} threads)")
    else:
        table = Table(title=f"verify {directory}: {len(report.failures)} failure(s)")
        table.add_column("file")
        table.add_column("problem")
        for f in report.failures:
            table.add_row(escape(f.path), escape(f.problem))
        err.print(table)
    if not report.ok:
        raise typer.Exit(1)

# === end of toolchain, ladder, verify section ====================================================


# === imatrix (issue 3) ===========================================================================
# Owned by the imatrix work; keep other commands outside this section.

imatrix_app = typer.Typer(help="Read, convert and remap importance matrices (GGUF and legacy .dat) for pruned models.", no_args_is_help=True)
app.add_typer(imatrix_app, name="imatrix")
ImatrixFormatOption = Annotated[Optional[str], typer.Option("--format", help="Output format: gguf or dat [default: from the output's suffix, else the input's format].")]
ChunkSizeOption = Annotated[
    Optional[int], typer.Option("--chunk-size", help="Tokens per chunk the imatrix was computed with, needed to turn a .dat into GGUF (llama-imatrix -c; default 512).")
]


def _share(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _imatrix_keepset(layout: MoeLayout, pruned: Optional[GGUFModel], keep: Optional[Path], first: Optional[int], ids: Optional[str]) -> KeepSet:
    """The keep-set given on the command line, else the one the pruned model records; both must agree."""
    recorded = keepset_from_provenance(pruned.get, pruned.path.name) if pruned is not None else None
    if keep is None and first is None and ids is None:
        if recorded is None:
            where = f"{pruned.path} has no ggufcarve.kept_* keys" if pruned is not None else "no --model given"
            raise BadInput(f"no keep-set: {where}", "give --keep FILE (or --keep-first/--keep-ids), or --model with a model ggufcarve pruned")
        return recorded
    keepset = _resolve_keepset(layout, keep, first, ids)
    if recorded is not None and recorded.layers != {b: tuple(v) for b, v in keepset.layers.items()}:
        differ = sorted(b for b in set(recorded.layers) | set(keepset.layers) if recorded.layers.get(b) != keepset.layers.get(b))
        raise BadInput(
            f"the keep-set differs from the one {pruned.path if pruned else ''} was pruned with (ggufcarve.kept_experts), in block(s) {_ranges(differ)}",
            "omit --keep to use the recorded keep-set, or give the model pruned with this keep-set",
        )
    return keepset


@imatrix_app.command("remap")
def imatrix_remap(
    imatrix: Annotated[Path, typer.Argument(help="imatrix of the unpruned model (GGUF or .dat), as llama-imatrix wrote it. Never modified.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Output imatrix path.")],
    keep: KeepOption = None,
    keep_first_count: KeepFirstOption = None,
    keep_id_list: KeepIdsOption = None,
    model: Annotated[Optional[Path], typer.Option("--model", help="The pruned model: its recorded keep-set is used when --keep is omitted, and the output is checked against it as llama-quantize will.")] = None,
    source_model: Annotated[Optional[Path], typer.Option("--source-model", help="The unpruned model: the input is checked against it.")] = None,
    fmt: ImatrixFormatOption = None,
    chunk_size: ChunkSizeOption = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output (and its report).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate and print the plan; write nothing.")] = False,
    report: Annotated[Optional[Path], typer.Option("--report", help="Where to write the report [default: OUTPUT_DIR/method/imatrix-remap-report.json].")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan (with --dry-run) or the report as JSON.")] = False,
) -> None:
    """Keep the kept experts' rows of every expert entry, in keep-set order; every other entry unchanged.

    Needs --model (the pruned model) or --source-model (the unpruned one), or both: the model gives
    the MoE layout the keep-set refers to (mtp_<j> keys, expert count) and the sizes to check."""
    from ggufcarve.imatrix import default_report_path as imatrix_report_path
    from ggufcarve.imatrix import encoded_size, execute_remap, format_from_path, plan_remap, read_imatrix, resolve_source_layout

    if model is None and source_model is None:
        raise BadInput("imatrix remap needs the model: give --model PRUNED.gguf and/or --source-model SOURCE.gguf", "the model gives the MoE layout the keep-set refers to and the tensor sizes llama-quantize checks")
    source_imatrix = read_imatrix(imatrix)
    pruned = read_model(model) if model is not None else None
    source = read_model(source_model) if source_model is not None else None
    layout = resolve_source_layout(source_imatrix, pruned, inspect_layout(pruned) if pruned else None, inspect_layout(source) if source else None)
    keepset = _imatrix_keepset(layout, pruned, keep, keep_first_count, keep_id_list)
    suffix_format = format_from_path(output)
    target = fmt or suffix_format or source_imatrix.format
    plan = plan_remap(source_imatrix, keepset, layout, output, output_format=target, chunk_size=chunk_size, pruned=pruned, source=source)
    warnings = list(plan.warnings)
    if suffix_format is not None and suffix_format != target:
        warnings.append(f"writing a {target} imatrix to a file named {output.name}")
    if plan.losses:
        warnings.append(f"{source_imatrix.format} -> {target} drops: " + "; ".join(plan.losses))
    if target == "gguf" and source_imatrix.format == "dat" and chunk_size is None:
        warnings.append(f"a .dat does not record its chunk size; assumed {plan.chunk_size} (pass --chunk-size to set it)")
    for warning in warnings:
        err.print(f"[yellow]warning:[/] {escape(warning)}", soft_wrap=True, highlight=False)
    if dry_run:
        if as_json:
            out.print_json(json.dumps({**plan.to_json(), "report": str(report or imatrix_report_path(output)), "dry_run": True}))
            return
        out.print(f"dry run, nothing written: {len(plan.tensors)} expert entries {layout.expert_count} -> {plan.kept_count} experts, {len(plan.unchanged)} entries unchanged -> {output} ({target})")
        return
    sources = [p for m in (pruned, source) if m is not None for p in m.paths]
    total = encoded_size(plan.output)
    with _progress(not quiet and not as_json) as sink:
        result = execute_remap(plan, force=force, report_path=report, sources=sources, progress=lambda n: sink(ProgressEvent("write", n, total)))
    if as_json:
        out.print_json(result.report_path.read_text())
        return
    routing = plan.routing
    table = Table(title=f"imatrix remapped: {layout.expert_count} -> {plan.kept_count} experts")
    for column in ("block", "expert entries", "kept experts", "routing kept"):
        table.add_column(column, justify="right" if column != "kept experts" else "left")
    shares = {b["block"]: b["share_kept"] for b in routing.get("blocks", [])}
    for block in layout.blocks:
        n = sum(1 for t in plan.tensors if t.block == block)
        ids = keepset.layers[block]
        table.add_row(f"{block}" + (" (MTP)" if layout.is_mtp(block) else ""), str(n), ",".join(map(str, ids)), _share(shares.get(block)))
    out.print(table)
    overall = f"{_share(routing['share_kept'])} of the calibration's routed (token, slot) pairs went to kept experts" if routing["available"] else routing["reason"]
    out.print(f"{len(plan.tensors)} entries remapped, {len(plan.unchanged)} unchanged; {overall}")
    out.print(f"wrote {result.output_path} ({target}, {result.output_bytes:,} bytes)")
    out.print(f"report: {result.report_path}")


@imatrix_app.command("inspect")
def imatrix_inspect(
    imatrix: Annotated[Path, typer.Argument(help="GGUF or legacy .dat imatrix.")],
    model: Annotated[Optional[Path], typer.Option("--model", help="Also check every entry against this model, as llama-quantize will.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print as JSON.")] = False,
) -> None:
    """Entries, chunks, datasets, and per MoE block the routing counts (never-routed experts).

    The counts show which experts the calibration never routed to and how unevenly the rest were
    used. With --model, every entry is checked against the model as llama-quantize will."""
    from ggufcarve.imatrix import raise_problems, read_imatrix, summarize

    loaded = read_imatrix(imatrix)
    summary = summarize(loaded, read_model(model) if model is not None else None)
    doc = summary.to_json()
    if as_json:
        out.print_json(json.dumps(doc))
    else:
        table = Table(title=f"{imatrix.name}: {loaded.format} imatrix", show_header=False, box=None)
        rows = [
            ("entries", f"{len(loaded.entries)} ({summary.expert_entries} expert, {summary.dense_entries} other)"),
            ("chunks", f"{loaded.chunk_count} x {loaded.chunk_size} tokens" if loaded.chunk_size else f"{loaded.chunk_count if loaded.chunk_count is not None else '? (no trailer)'} (a .dat does not record the chunk size)"),
            ("datasets", ", ".join(loaded.datasets) or "-"),
            ("per-expert counts", "yes" if doc["per_expert_counts"] else "no" + (" (a .dat holds one ncall per entry)" if loaded.format == "dat" else "")),
        ]
        if summary.remapped:
            rows.append(("remapped", f"by ggufcarve: {summary.remapped['source_expert_count']} -> {summary.remapped['kept_expert_count']} experts"))
        for key, value in rows:
            table.add_row(f"[bold]{key}[/]", escape(str(value)))
        out.print(table)
        if summary.blocks and not doc["per_expert_counts"]:
            out.print(f"expert entries in MoE blocks {_ranges([b.block for b in summary.blocks])}; routing per expert unknown (no per-expert counts)")
        elif summary.blocks:
            blocks = Table(title="routing per MoE block ((token, slot) pairs per expert)")
            for column in ("block", "experts", "routed", "min", "median", "max", "top 25% share", "never routed"):
                blocks.add_column(column, justify="right")
            for b in doc["moe_blocks"]:
                if b["expert_count"] is None:
                    blocks.add_row(str(b["block"]), "?", "-", "-", "-", "-", "-", "no per-expert counts")
                    continue
                zero = b["zero_count_experts"]
                blocks.add_row(
                    str(b["block"]), str(b["expert_count"]), f"{b['routed_total']:,}", str(b["min"]), f"{b['median']:g}", str(b["max"]), _share(b["top_quarter_share"]),
                    f"{len(zero)}: {','.join(map(str, zero[:16]))}{',...' if len(zero) > 16 else ''}" if zero else "0",
                )
            out.print(blocks)
        if summary.model_check is not None:
            for warning in summary.model_check.warnings:
                err.print(f"[yellow]warning:[/] {escape(warning)}", soft_wrap=True, highlight=False)
            if not summary.model_check.problems:
                out.print(f"fits {model}: every entry names a tensor of the model and has its size")
    if summary.model_check is not None:
        raise_problems(
            list(summary.model_check.problems),
            f"{imatrix} does not fit {model}",
            f"llama-quantize fails on these entries; for a pruned model remap the source's imatrix: ggufcarve imatrix remap {imatrix} --model {model} -o OUT",
        )


@imatrix_app.command("convert")
def imatrix_convert(
    source: Annotated[Path, typer.Argument(help="GGUF or legacy .dat imatrix. Never modified.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Output imatrix path.")],
    fmt: ImatrixFormatOption = None,
    chunk_size: ChunkSizeOption = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
) -> None:
    """GGUF <-> legacy .dat, as llama-imatrix itself converts (some forks' quantizers read only .dat).

    To .dat: per-expert counts are lost (a .dat keeps one ncall per entry); llama-quantize's
    normalised values are unchanged."""
    from ggufcarve.imatrix import convert_file, format_from_path, read_imatrix

    target = fmt or format_from_path(output)
    if target is None:
        raise BadInput(f"cannot tell the output format from {output.name}", "pass --format gguf or --format dat")
    loaded = read_imatrix(source)
    with _progress(not quiet) as sink:
        result = convert_file(loaded, output, target, chunk_size=chunk_size, force=force, progress=lambda n: sink(ProgressEvent("write", n, 0)))
    if result.conversion.losses:
        err.print(f"[yellow]warning:[/] {loaded.format} -> {target} drops: {escape('; '.join(result.conversion.losses))}", soft_wrap=True, highlight=False)
    if result.conversion.skipped:
        err.print(f"[yellow]warning:[/] not written (no data, as llama-imatrix skips them): {escape(', '.join(result.conversion.skipped))}", soft_wrap=True, highlight=False)
    if target == "gguf" and chunk_size is None:
        err.print(f"[yellow]note:[/] a .dat does not record its chunk size; imatrix.chunk_size set to {result.conversion.imatrix.chunk_size} (pass --chunk-size to set it)", soft_wrap=True, highlight=False)
    out.print(f"wrote {result.output_path} ({target}, {len(result.conversion.imatrix.entries)} entries, {result.output_bytes:,} bytes)")

# === end of imatrix section ======================================================================


def _print_error(message: str, hint: str) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}" + (f" [dim](hint: {escape(hint)})[/]" if hint else ""), soft_wrap=True, highlight=False)


def main() -> None:
    debug = os.environ.get("GGUFCARVE_DEBUG") == "1"
    try:
        app()
    except CarveError as error:
        if debug:
            raise
        _print_error(error.message, error.hint)
        sys.exit(error.exit_code)
    except OSError as error:  # a file vanished, a permission or the disk failed outside the checked paths
        if debug:
            raise
        where = f"{error.filename}: " if error.filename else ""
        _print_error(f"{where}{error.strerror or error}", "check the path, its permissions and the free disk space, then run again (GGUFCARVE_DEBUG=1 shows where)")
        sys.exit(1)
