"""fit: which kept-expert count and which ladder rung fit in a memory budget, from the header alone.

Examples:
    ggufcarve fit Model-Q8_0.gguf --memory 24GiB
    ggufcarve fit Model-Q8_0-00001-of-00003.gguf --memory 24GB --ctx 32768 --kv-type q8_0
    ggufcarve fit Model-Q8_0.gguf --memory 16000MiB --keep 96,128,160 --only Q4_K_M,IQ2_XS --json
    ggufcarve fit Model-Q8_0.gguf --memory 64GiB --gpu-memory 16GiB --keep 128,256 --only Q4_K_M
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ggufcarve import settings as S
from ggufcarve.cli.options import JsonOption, LlamaCppOption, QuietOption, ThreadsOption, one_keep, option
from ggufcarve.cli.render import escape, new_table, out, print_command, progress, size, warn
from ggufcarve.settings import Keep

if TYPE_CHECKING:
    from ggufcarve.events import Sink
    from ggufcarve.llama.devices import Compute
    from ggufcarve.llama.memory import DeviceMemory, MemorySettings
    from ggufcarve.placement.offload import Offload
    from ggufcarve.quant.fit import FitReport


def fit_command(
    model: Annotated[
        Path, typer.Argument(help="GGUF file, or the first shard of a split set (only its header is read).")
    ],
    memory: Annotated[int, option(S.MEMORY, show_default=False)],
    ctx: Annotated[int, option(S.CTX, "the KV cache counted.")] = 16384,
    kv_type: Annotated[str, option(S.KV_TYPE, "q8_0 V needs flash attention, which is assumed on.")] = "f16",
    ladder: Annotated[str | None, option(S.LADDER, "Its rungs are sized.")] = None,
    keep: Annotated[
        Keep | None,
        option(
            S.KEEP,
            "the counts sized; a keep-set file is sized at its count (default: powers of two, multiples of "
            "expert_count/8, the original).",
        ),
    ] = None,
    kept_alias: Annotated[str | None, typer.Option("--k", hidden=True)] = None,
    only: Annotated[list[str] | None, option(S.ONLY, "rungs sized.")] = None,
    imatrix: Annotated[
        Path | None,
        option(
            S.IMATRIX,
            "the one the ladder will use: tensors without an entry get the rung's imatrix_fallback_type "
            "(default: llama-imatrix's coverage, the MTP blocks missing).",
        ),
    ] = None,
    parallel: Annotated[
        int,
        typer.Option("--parallel", help="Sequences (llama.cpp -np): each has its own cache cells and recurrent state."),
    ] = 1,
    swa_full: Annotated[
        bool, typer.Option("--swa-full", help="Full-size cache for sliding-window layers (llama.cpp --swa-full).")
    ] = False,
    gpu_memory: Annotated[
        str | None,
        option(
            S.GPU_MEMORY,
            "each cell also says whether the rung fits the GPU whole (w) or with which llama.cpp --n-cpu-moe N, "
            "from its per-block expert bytes; several sizes place the layers across the GPUs (-ts by their sizes).",
        ),
    ] = None,
    gpu_margin: Annotated[int | None, option(S.GPU_MARGIN, show_default=False)] = None,
    rpc: Annotated[
        str | None,
        option(
            S.RPC,
            "Placements on these devices are measured by llama.cpp's dry load (the budget's placement "
            "is fit's own: --gpu-layers does not apply).",
        ),
    ] = None,
    flash_attn: Annotated[
        str,
        typer.Option(
            "--flash-attn",
            help="Flash attention of the run (llama.cpp -fa): auto, on or off; it changes the compute buffers.",
        ),
    ] = "auto",
    batch: Annotated[int, typer.Option("--batch", help="Logical batch size of the run (llama.cpp -b).")] = 2048,
    ubatch: Annotated[
        int,
        typer.Option("--ubatch", help="Micro-batch size of the run (llama.cpp -ub): the compute buffers grow with it."),
    ] = 512,
    measured: Annotated[
        bool,
        typer.Option(
            "--measured/--file-and-cache",
            help="Count llama.cpp's own dry load (weights, cache, compute "
            "and output buffers), or the file and the cache alone.",
        ),
    ] = True,
    measure_speed: Annotated[
        bool,
        typer.Option(
            "--measure-speed",
            help="Time every row that fits with llama-bench (pp512, tg128, mean of 5) in its placement, on the "
            "devices here (on the CPU where the row runs from RAM or no device is here), on a file of the rung's "
            "tensor shapes and types with zero weights.",
        ),
    ] = False,
    threads: ThreadsOption = None,
    quantizer_choice: Annotated[str, option(S.QUANTIZER, "It answers the dry runs.")] = "auto",
    llama_cpp: LlamaCppOption = None,
    as_json: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Table of kept experts K x ladder rung: predicted file size, cache at --ctx, total, and whether it fits in
    --memory."""
    from ggufcarve.errors import BadInput
    from ggufcarve.gguf.container import read_model
    from ggufcarve.moe.layout import inspect_layout
    from ggufcarve.placement.auto import budget_devices
    from ggufcarve.placement.kvcache import ContextSettings
    from ggufcarve.placement.offload import DEFAULT_MARGIN
    from ggufcarve.quant.fit import parse_kept_counts, plan_fit
    from ggufcarve.quant.quantizer import make_quantizer
    from ggufcarve.quant.spec import DEFAULT_LADDER, find_spec, load_spec
    from ggufcarve.reports import envelope

    budget = memory
    budgets: tuple[int, ...] = gpu_memory or S.Budgets()  # the parser's Budgets: bytes, the devices named
    gpu_budget = budgets[0] if len(budgets) == 1 else None
    margin = DEFAULT_MARGIN if gpu_margin is None else gpu_margin
    cache_type = kv_type.upper()
    if parallel < 1:
        raise BadInput(f"--parallel {parallel} must be positive", "e.g. --parallel 1")
    if ladder is None and not DEFAULT_LADDER.exists():
        raise BadInput(f"the default ladder {DEFAULT_LADDER} is not installed", "give --ladder FILE.toml")
    spec = load_spec(find_spec(ladder) if ladder else DEFAULT_LADDER)
    loaded = read_model(model)
    layout = inspect_layout(loaded)
    wanted = one_keep(keep, kept_alias, "--k")
    kept = None if wanted is None else wanted.counts or (wanted.file.name if wanted.file else None)
    if wanted is not None and wanted.file is not None:
        from ggufcarve.moe.keepset import load_keepset

        counts = [load_keepset(wanted.file, layout).kept_count]
    else:
        counts = parse_kept_counts(wanted.counts, layout) if wanted is not None and wanted.counts else None
    entries = None
    if imatrix is not None:
        from ggufcarve.imatrix_format import read_imatrix

        entries = {e.name for e in read_imatrix(imatrix).entries}
    quantizer = make_quantizer(quantizer_choice, llama_cpp)
    settings = ContextSettings(n_ctx=ctx, type_k=cache_type, type_v=cache_type, n_seq=parallel, swa_full=swa_full)
    from ggufcarve.llama.computed import recording

    with progress(not (quiet or as_json), transient=True) as sink, recording() as computed:
        from ggufcarve.llama.memory import FLASH_ATTN, MemorySettings

        if flash_attn not in FLASH_ATTN:
            raise BadInput(
                f"--flash-attn {flash_attn!r} is not one of {', '.join(FLASH_ATTN)}", "auto is llama.cpp's default"
            )
        run_settings = (
            MemorySettings(
                n_ctx=ctx,
                kv_type=cache_type,
                n_batch=batch,
                n_ubatch=ubatch,
                n_seq=parallel,
                flash_attn=flash_attn,
                swa_full=swa_full,
                compute=S.compute(gpu_layers=0, rpc=rpc, devices=budget_devices(budgets, tuple(rpc or ()))),
            )
            if measured
            else None
        )
        report = plan_fit(
            loaded,
            layout,
            spec,
            memory=budget,
            context=settings,
            quantizer=quantizer,
            kept_counts=counts,
            only=only,
            imatrix_entries=entries,
            gpu_memory=budgets or None,
            gpu_margin=margin,
            measure=run_settings,
            on_event=sink,
        )
        if measure_speed:
            from ggufcarve.llama.tools import physical_cores

            bench_on = S.compute(gpu_layers=0, rpc=rpc, threads=threads or physical_cores())
            report = timed(report, llama_cpp, bench_on, sink, run_settings)

    if as_json:
        inputs = [{"name": p.name, "bytes": p.stat().st_size} for p in loaded.paths]
        parameters = {
            "memory": f"{budget}B",
            "memory_bytes": budget,
            "ctx": ctx,
            "kv_type": cache_type.lower(),
            "parallel": parallel,
            "swa_full": swa_full,
            "flash_attn": flash_attn,
            "batch": batch,
            "ubatch": ubatch,
            "measured": measured,
            "measure_speed": measure_speed,
            **(
                {
                    "gpu_memory": ",".join(f"{b}B" for b in budgets),
                    "gpu_memory_bytes": budgets[0] if len(budgets) == 1 else list(budgets),
                    "gpu_margin": f"{margin}B",
                    "gpu_margin_bytes": margin,
                }
                if budgets
                else {}
            ),
            "ladder": spec.name,
            "ladder_sha256": spec.sha256,
            "k": kept,
            "keep": kept,
            "only": only,
            "imatrix": imatrix.name if imatrix else None,
        }
        doc = envelope(
            "fit",
            inputs=inputs,
            parameters=parameters,
            results=report.to_json(),
            timings={"total_seconds": report.seconds},
        )
        doc["computed_on"] = computed.to_json()  # the dry loads' layers and the timings', by llama.cpp's loader
        doc["sizes_from"]["quantizer"] = {
            k: v for k, v in doc["sizes_from"]["quantizer"].items() if k not in ("path", "python")
        }
        out.print_json(json.dumps(doc, sort_keys=True))
        return

    cache = report.cache
    q = report.quantizer
    out.print(
        f"sizes: {q['backend']} quantizer dry run ({q.get('version')}) on a sparse "
        f"pruned header per K; imatrix coverage: {report.imatrix_assumption}",
        highlight=False,
    )
    for note in cache.notes:
        warn(note, "note" if cache.exact else "warning")
    kinds = [f"KV {size(cache.kv_bytes)} on {sum(1 for x in cache.layers if x.kind != 'recurrent')} attention block(s)"]
    if cache.recurrent_bytes:
        kinds.append(
            f"recurrent state {size(cache.recurrent_bytes)} on "
            f"{sum(1 for x in cache.layers if x.kind == 'recurrent')} block(s)"
        )
    out.print(
        f"cache at {ctx} tokens ({cache_type.lower()}, {cache.cells} "
        f"cells{f', {cache.swa_cells} sliding-window' if cache.swa_cells else ''}): "
        + " + ".join(kinds)
        + f" = {size(cache.total_bytes)}",
        highlight=False,
    )

    from rich.box import SIMPLE_HEAD

    rungs = [r.name for r in spec.select(only)]
    from ggufcarve.fileio import size_unit

    best = report.best()

    unit = size_unit(max(r.rung.bytes for r in report.rows))  # one unit for every cell
    # title and caption as lines of their own: a table's caption wraps to the table's width
    title = (
        f"{loaded.path.name}: {layout.architecture}, {layout.expert_count} experts, top-{layout.expert_used_count}"
        + (f", {layout.group_count} groups" if layout.group_count > 1 else "")
    )
    caption = (
        f"{unit[0]} of the rung file; ✓: "
        + (
            "llama.cpp's measured weights + cache + compute + output buffers"
            if measured
            else f"file + cache {size(cache.total_bytes)}"
        )
        + f" fit in {size(budget)}; *: power of two"
        + (f"; last row: the source's {layout.expert_count}" if layout.expert_count in report.kept_counts else "")
    )
    table = new_table(box=SIMPLE_HEAD, pad_edge=False, padding=(0, 0))
    table.add_column("K", justify="right", no_wrap=True)
    for name in rungs:
        table.add_column(name, justify="right", no_wrap=True)
    for k in report.kept_counts:
        label = f"{k}{'*' if k & (k - 1) == 0 else ' '}"
        cells = []
        for name in rungs:
            row = report.row(k, name)
            figure = size(row.rung.bytes, unit).split()[0]
            cells.append(
                (f"[green]{figure}✓[/]" if row.fits else f"[dim]{figure}[/] ")
                + ("f" if row.rung.fallback else " ")
                + (f"{gpu_cell(row.offload):>4}" if row.offload else "")
                + (f"{placed_cell(row.placed):>4}" if len(budgets) > 1 else "")
            )
        table.add_row(label, *cells)
    out.print(escape(title), highlight=False)
    out.print(table)
    out.print(escape(caption), highlight=False)
    if any(r.rung.fallback for r in report.rows):
        out.print(
            "f: some tensors need an imatrix entry the ladder's imatrix lacks and get "
            f"the rung's imatrix_fallback_type ({escape(report.imatrix_assumption)})",
            highlight=False,
        )
    if best is None:
        out.print(
            f"nothing fits in {size(budget)}: the smallest is {size(min(r.total for r in report.rows))}; "
            "try a shorter --ctx, --kv-type q8_0 or fewer experts (--keep)",
            highlight=False,
        )
    else:
        m = best.memory_measured
        parts = (
            f"weights {size(m.weights)} + cache {size(m.cache)} + compute {size(m.compute)} + output {size(m.output)}"
            if m is not None
            else f"file {size(best.rung.bytes)} + cache {size(best.cache_bytes)}"
        )
        if best.tier in ("gpu", "gpu+cpu") and best.placed is not None:
            placed = best.placed
            out.print(
                f"most experts that fit: K={best.kept} {best.rung.rung} in tier {best.tier}: "
                f"{escape(placed.placement.label())} ({'measured' if placed.measured else 'estimated'})",
                highlight=False,
            )
            for device in placed.devices:
                out.print(device_line(device, placed.budgets.get(device.device)), highlight=False)
            line = report.to_json()["rows"][report.rows.index(best)].get("server", [])
            print_command("run it", line)
        elif best.tier in ("gpu", "gpu+cpu"):
            gpu, host = best.gpu_devices
            parts = (
                f"{gpu.device} {size(gpu.total)} + {size(margin)} margin of "
                f"{size(gpu_budget)}, host {size(host.total)} of {size(budget)}"
            )
            out.print(
                f"most experts that fit: K={best.kept} {best.rung.rung} in tier {best.tier}: {parts}", highlight=False
            )
        else:
            out.print(
                f"most experts that fit: K={best.kept} {best.rung.rung}: {parts} = {size(best.total)} of {size(budget)}"
                + (" (tier ram)" if gpu_budget is not None else ""),
                highlight=False,
            )
    if measure_speed and best is not None and best.speed is not None:
        where = best.speed["speed_placement"]["label"]
        out.print(
            f"speed of K={best.kept} {best.rung.rung} ({escape(where)}): "
            f"decode {best.speed['decode_tok_s']:.1f} tok/s, prompt {best.speed['prompt_tok_s']:.1f} tok/s "
            "(llama-bench tg64/pp512 on zero weights of its shapes and types; --json has every fitting row's)",
            highlight=False,
        )
    if gpu_budget is not None:
        on_device = best is not None and best.placed is not None and best.placed.measured
        counted = (
            "weights + cache + compute (measured: llama.cpp's dry load on the device)"
            if on_device
            else "weights + cache + compute (estimated from the CPU graph's: module placement.offload)"
            if measured
            else "weights + cache"
        )
        out.print(
            f"GPU {size(gpu_budget)} for {counted} + {size(margin)} margin: w fits "
            "whole; N: llama.cpp --n-cpu-moe N keeps the experts of blocks 0..N-1 "
            "in system memory (-ot 'blk\\.(0|..|N-1)\\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU' "
            "is the same); -: not even with every expert there",
            highlight=False,
        )
        if best is not None and best.offload is not None:
            shown = best.offload
            how = (
                "whole"
                if shown.fits_whole
                else f"with {shown.flags} (or -ot '{escape(shown.override)}')"
                if shown.n_cpu_moe
                else "not with any --n-cpu-moe (fewer layers on it, -ngl)"
            )
            out.print(
                f"K={best.kept} {best.rung.rung} on the GPU: {how}; {size(shown.gpu_bytes)} of {size(gpu_budget)}",
                highlight=False,
            )
            if best.placed is None:
                for device in best.gpu_devices:
                    out.print(device_line(device), highlight=False)


def timed(
    report: FitReport, llama_cpp: Path | None, compute: Compute, sink: Sink, measure: MemorySettings | None
) -> FitReport:
    """The report with every fitting row's llama-bench speed (quant.fit.measure_speeds); `measure`:
    the run's memory settings, for a faster variant's dry load."""
    from ggufcarve.errors import ToolMissing
    from ggufcarve.evaluate.speed import BENCH_METHOD, bench_speed
    from ggufcarve.llama.tools import find_tool
    from ggufcarve.quant.fit import measure_speeds

    tool = find_tool("llama-bench", llama_cpp)
    if tool is None:
        raise ToolMissing("--measure-speed needs llama-bench", "build it: ggufcarve toolchain build")

    def bench(path: Path, placed: Compute, flags: tuple[str, ...]) -> object:
        return bench_speed(tool, path, BENCH_METHOD, placed, flags=list(flags))

    on_device = bool(compute.rpc) or any(r.load is not None and r.load.gpu_devices for r in report.rows)
    return measure_speeds(report, bench, compute, on_device, sink, measure, BENCH_METHOD)


def device_line(device: DeviceMemory, limit: int | None = None) -> str:
    """One device's row: weights + cache + compute + output = total (of its budget), what is estimated."""
    estimated = f" ({', '.join(device.estimated)} estimated)" if device.estimated else ""
    return (
        f"  {device.device}: weights {size(device.weights)} + cache {size(device.cache)} "
        f"+ compute {size(device.compute)} + output {size(device.output)} = {size(device.total)}"
        + (f" of {size(limit)}" if limit else "")
        + estimated
    )


def placed_cell(placed: object) -> str:
    """w (whole on the GPUs), N (the experts of N blocks on the CPU) or - (no placement fits)."""
    if placed is None:
        return "-"
    n = placed.placement.n_cpu_moe  # type: ignore[attr-defined]
    return "w" if not n else str(n)


def gpu_cell(offload: Offload) -> str:
    """w (whole), N (--n-cpu-moe N) or - (no N fits)."""
    return "w" if offload.fits_whole else "-" if offload.n_cpu_moe is None else str(offload.n_cpu_moe)
