"""tune: which criterion and K to carve with, measured without writing a pruned file.

Examples:
    ggufcarve tune model.gguf --calibration cal.txt --heldout heldout.txt --keep 8 -o tune/
    ggufcarve tune model.gguf --calibration cal.txt --heldout wiki.txt --heldout code.txt --keep 64,96,128 \\
        --methods reap,frequency,weights --ctx 512 --chunks 32 -o tune/
    ggufcarve prune model.gguf --keep tune/expert-selection.json -o model-pruned.gguf
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ggufcarve import settings as S
from ggufcarve.cli.options import (
    ChunkCtxOption,
    ForceOption,
    GpuLayersOption,
    JsonOption,
    NCpuMoeOption,
    QuietResultOption,
    RpcOption,
    TensorSplitOption,
    ThreadsOption,
    option,
)
from ggufcarve.cli.render import out, progress
from ggufcarve.errors import BadInput, OutputError
from ggufcarve.select.criteria import all_help
from ggufcarve.settings import Keep


def tune_command(
    model: Annotated[Path, typer.Argument(help="The unpruned GGUF model (first shard if split).", show_default=False)],
    output: Annotated[
        Path,
        option(
            S.OUTPUT,
            "DIR: tune.json, tune.md, tune-kld.png, candidates/<method>-<K>.json, expert-selection.json.",
            show_default=False,
        ),
    ],
    keep: Annotated[Keep, option(S.KEEP, "a count or a list of counts (each its own tournament).", show_default=False)],
    heldout: Annotated[list[Path], option(S.HELDOUT, "The keep-sets are scored on it.", show_default=False)],
    calibration: Annotated[
        list[Path] | None, option(S.CALIBRATION, "One decode pass scores every trace criterion.")
    ] = None,
    methods: Annotated[
        str,
        option(
            S.METHODS,
            "all: " + all_help() + " when its memory estimate (a token per byte of the calibration text, at most "
            "--max-tokens) is at most half of the memory available (else left out, with a "
            "line saying so); razor only when listed (a heavier pass). greedy listed is "
            "refused before the pass when its estimate exceeds 80% of the available memory.",
        ),
    ] = "all",
    ctx: ChunkCtxOption = 512,
    chunks: Annotated[
        int | None, option(S.CHUNKS, "the held-out files scored (the finalists get all of their chunks).")
    ] = None,
    max_tokens: Annotated[int | None, option(S.MAX_TOKENS)] = None,
    stability: Annotated[bool, option(S.STABILITY)] = False,
    search: Annotated[
        bool, option(S.SEARCH, "Written as candidates/search-<K>.json and scored on the held-out text.")
    ] = False,
    search_passes: Annotated[int | None, option(S.SEARCH_PASSES)] = None,
    z: Annotated[float | None, option(S.Z, show_default=False)] = None,
    threads: ThreadsOption = None,
    gpu_layers: GpuLayersOption = None,
    rpc: RpcOption = None,
    tensor_split: TensorSplitOption = None,
    n_cpu_moe: NCpuMoeOption = 0,
    force: ForceOption = False,
    quiet: QuietResultOption = False,
    as_json: JsonOption = False,
) -> None:
    """Score every criterion's keep-set at every K against the unpruned model, by masking; write the winner."""
    from ggufcarve.tune.report import left_out_lines, ranked
    from ggufcarve.tune.run import TuneSettings, parse_keeps, parse_methods, tune

    if (output / "tune.json").exists() and not force:
        raise OutputError(
            f"{output / 'tune.json'} already exists", "pass --force to replace it, or choose another -o DIR"
        )
    wanted = keep
    if wanted.file is not None:
        raise BadInput(
            f"--keep {wanted.file}: tune weighs the criteria's keep-sets at each count",
            "give counts (--keep 8 or 8,12); score a keep-set file with ggufcarve eval after ggufcarve prune",
        )
    settings = TuneSettings(
        keeps=parse_keeps(wanted.counts or ""),
        methods=parse_methods(methods),
        calibration=tuple(calibration or ()),
        heldout=tuple(heldout),
        ctx=ctx,
        chunks=chunks,
        max_tokens=max_tokens,
        compute=S.compute(threads, gpu_layers, rpc, tensor_split, n_cpu_moe),
        stability=stability,
        search=search,
        search_passes=search_passes,
        **({} if z is None else {"z": z}),
    )
    with progress(not quiet and not as_json) as sink:
        result = tune(model, settings, output, on_event=sink)
    report = result.report
    if as_json:
        out.print_json(
            json.dumps(
                {
                    "winner": result.winner,
                    "winners": report["winners"],
                    "candidates": report["candidates"],
                    "left_out": report["left_out"],
                    "outputs": [str(p) for p in result.outputs],
                }
            )
        )
        return
    for line in left_out_lines(report):
        out.print(line, markup=False, highlight=False)
    if not quiet:
        for k in report["keeps"]:
            out.print(f"K = {k}:")
            for c in ranked(report["candidates"], k):
                note = f"  (= {c['identical_to']})" if c["identical_to"] else ""
                stopped = f"  stopped after {c['chunks_scored']} chunk(s)" if c["stopped_early"] else ""
                halves = f"  halves overlap {c['stability']['overlap']:.3f}" if "stability" in c else ""
                if "search" in c:
                    found = c["search"]
                    halves = (
                        f"  from {found['start']}: {len(found['path'])} move(s), calibration KLD "
                        f"{found['start_calibration_kld_mean']:.4f} -> {found['calibration_kld_mean']:.4f}"
                    )
                out.print(
                    f"  {c['method']:<15} mean KLD {c['kld_mean']:.4f} ± "
                    f"{c['kld_mean_stderr']:.4f}  99.9% {c['kld_p999']:.4f}  "
                    f"same top {100 * c['same_top_p']:.2f}%  PPL {c['ppl']:.4f}{halves}{stopped}{note}",
                    markup=False,
                    highlight=False,
                )
    out.print(
        f"winner: {result.winner}; written: {output / 'expert-selection.json'}, "
        f"{output / 'tune.md'}, {output / 'tune.json'}",
        markup=False,
        highlight=False,
    )
    if not quiet:
        out.print(
            f"prune with: ggufcarve prune {model} --keep {output / 'expert-selection.json'} -o OUT.gguf",
            markup=False,
            highlight=False,
        )
