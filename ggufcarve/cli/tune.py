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

from ggufcarve.cli.options import ForceOption, GpuLayersOption, JsonOption, QuietOption, ThreadsOption, parse_keep
from ggufcarve.cli.render import out, progress
from ggufcarve.errors import BadInput, OutputError
from ggufcarve.select.criteria import all_help


def tune_command(
    model: Annotated[Path, typer.Argument(help="The unpruned GGUF model (first shard if split).", show_default=False)],
    output: Annotated[
        Path,
        typer.Option(
            "-o",
            "--output",
            help="DIR: tune.json, tune.md, tune-kld.png, candidates/<method>-<K>.json, expert-selection.json.",
            show_default=False,
        ),
    ],
    keep: Annotated[
        str,
        typer.Option(
            "--keep",
            "-k",
            help="Experts kept per MoE block: a count or a list of counts, 8 or 4,8,12 (each its own tournament).",
            show_default=False,
        ),
    ],
    heldout: Annotated[
        list[Path],
        typer.Option("--heldout", help="Held-out text the keep-sets are scored on (repeatable).", show_default=False),
    ],
    calibration: Annotated[
        list[Path] | None,
        typer.Option(
            "--calibration",
            help="Calibration text or JSONL file (repeatable): one decode pass scores every trace criterion.",
        ),
    ] = None,
    methods: Annotated[
        str,
        typer.Option(
            "--methods",
            help="all, or a list such as reap,frequency,weights. all: "
            + all_help()
            + " when its memory estimate (a token per byte of the calibration text, at most "
            "--max-tokens) is at most half of the memory available (else left out, with a "
            "line saying so); razor only when listed (a heavier pass). greedy listed is "
            "refused before the pass when its estimate exceeds 80% of the available memory.",
        ),
    ] = "all",
    ctx: Annotated[
        int,
        typer.Option(
            "--ctx",
            help="Tokens per chunk, of the calibration pass and of the held-out scoring (as llama-perplexity -c).",
        ),
    ] = 512,
    chunks: Annotated[
        int | None,
        typer.Option(
            "--chunks", help="Score at most this many held-out chunks per file (the finalists get all of them)."
        ),
    ] = None,
    max_tokens: Annotated[
        int | None, typer.Option("--max-tokens", help="Trace at most this many calibration tokens (whole chunks).")
    ] = None,
    stability: Annotated[
        bool,
        typer.Option(
            "--stability",
            help="Also build each calibration method's keep-sets from each half of the "
            "calibration text (one more pass per half) and report their overlap per block.",
        ),
    ] = False,
    threads: ThreadsOption = None,
    gpu_layers: GpuLayersOption = 0,
    force: ForceOption = False,
    quiet: QuietOption = False,
    as_json: JsonOption = False,
) -> None:
    """Score every criterion's keep-set at every K against the unpruned model, by masking; write the winner."""
    from ggufcarve.tune.run import TuneSettings, left_out_lines, parse_keeps, parse_methods, ranked, tune

    if (output / "tune.json").exists() and not force:
        raise OutputError(
            f"{output / 'tune.json'} already exists", "pass --force to replace it, or choose another -o DIR"
        )
    wanted = parse_keep(keep)
    if wanted is not None and wanted.file is not None:
        raise BadInput(
            f"--keep {keep}: tune weighs the criteria's keep-sets at each count",
            "give counts (--keep 8 or 8,12); score a keep-set file with ggufcarve eval after ggufcarve prune",
        )
    settings = TuneSettings(
        keeps=parse_keeps(keep),
        methods=parse_methods(methods),
        calibration=tuple(calibration or ()),
        heldout=tuple(heldout),
        ctx=ctx,
        chunks=chunks,
        max_tokens=max_tokens,
        threads=threads,
        gpu_layers=gpu_layers,
        stability=stability,
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
