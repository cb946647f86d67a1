"""score, select: which experts to keep, from the weights, an imatrix or a calibration trace.

Examples:
    ggufcarve select model.gguf --method weights --keep 128 -o selection.json
    ggufcarve select model.gguf --method imatrix-counts --imatrix model.imatrix.gguf --ratio 0.5 -o selection.json
    ggufcarve select model.gguf --method reap --calibration code.jsonl --calibration chat.jsonl --keep 128 -o \\
        selection.json
    ggufcarve score model.gguf --method imatrix-energy --imatrix model.imatrix.gguf -o scores.json
    ggufcarve select scores.json --keep 128 --protect 0,7 -o selection.json
    ggufcarve score --merge part1.json part2.json -o scores.json
    ggufcarve select --compare a.json b.json
    ggufcarve prune model.gguf --keep selection.json -o model-128e.gguf
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ggufcarve import settings as S
from ggufcarve.cli.options import (
    CalibrationOption,
    ChunkCtxOption,
    ForceOption,
    GpuLayersOption,
    JsonOption,
    NCpuMoeOption,
    QuietOption,
    QuietResultOption,
    RpcOption,
    TensorSplitOption,
    ThreadsOption,
    option,
)
from ggufcarve.cli.render import new_table, out, progress, ranges, warn
from ggufcarve.errors import BadInput
from ggufcarve.select.criteria import TRACE_METHODS, method_help
from ggufcarve.settings import Keep

if TYPE_CHECKING:
    from ggufcarve.gguf.container import GGUFModel
    from ggufcarve.llama.devices import Compute
    from ggufcarve.moe.layout import MoeLayout
    from ggufcarve.select.keep import Selection
    from ggufcarve.select.scores import ExpertScores

SourcesArgument = Annotated[
    list[Path] | None,
    typer.Argument(
        help="A GGUF model (first shard if split), or a SCORES.json written by `ggufcarve score`.", show_default=False
    ),
]
MethodOption = Annotated[str | None, option(S.METHOD, method_help())]
ImatrixOption = Annotated[Path | None, option(S.IMATRIX, "for imatrix-counts and imatrix-energy.")]
SeedOption = Annotated[int, option(S.SEED)]
MaxTokensOption = Annotated[int | None, option(S.MAX_TOKENS)]


def _read_model(source: Path) -> tuple[GGUFModel, MoeLayout]:
    from ggufcarve.gguf.container import read_model
    from ggufcarve.moe.layout import inspect_layout

    model = read_model(source)
    return model, inspect_layout(model)


def _calibrate_ahead(method: str | None, calibration: list[Path] | None) -> None:
    """With a calibration method and files, the llama.cpp child starts now, its start-up beside ours."""
    from ggufcarve.select.prestart import prestart

    if method in TRACE_METHODS and calibration:
        prestart()


def _score(
    model: GGUFModel,
    layout: MoeLayout,
    method: str | None,
    imatrix: Path | None,
    calibration: list[Path],
    seed: int,
    ctx: int,
    max_tokens: int | None,
    compute: Compute,
    quiet: bool,
) -> ExpertScores:
    from ggufcarve.select.methods import score_model

    if method is None:
        raise BadInput(
            f"scoring {model.path.name} needs --method",
            "for example --method weights (zero-shot) or --method imatrix-counts --imatrix FILE",
        )
    with progress(not quiet) as sink:
        return score_model(
            model,
            layout,
            method,
            imatrix=imatrix,
            calibration=calibration,
            seed=seed,
            ctx=ctx,
            max_tokens=max_tokens,
            compute=compute,
            on_event=sink,
        )


def _write(path: Path, text: str, sources: list[Path], force: bool) -> None:
    from ggufcarve.fileio import check_outputs, write_text_atomic

    check_outputs([path], sources, len(text), force)
    write_text_atomic(path, text)


def score_command(
    sources: SourcesArgument = None,
    output: Annotated[Path | None, option(S.OUTPUT, "SCORES.json.")] = None,
    method: MethodOption = None,
    imatrix: ImatrixOption = None,
    calibration: CalibrationOption = None,
    seed: SeedOption = 0,
    ctx: ChunkCtxOption = 512,
    max_tokens: MaxTokensOption = None,
    threads: ThreadsOption = None,
    gpu_layers: GpuLayersOption = None,
    rpc: RpcOption = None,
    tensor_split: TensorSplitOption = None,
    n_cpu_moe: NCpuMoeOption = 0,
    merge: Annotated[bool, option(S.MERGE, "the scores files given as arguments (shards of one run).")] = False,
    force: ForceOption = False,
    quiet: QuietOption = False,
) -> None:
    """Score every expert of every MoE block (MTP included) and write the mergeable statistics."""
    _calibrate_ahead(method, calibration)
    from ggufcarve.select.run import refuse_existing
    from ggufcarve.select.scores import merge_scores, read_scores

    sources = sources or []
    if output is None:
        raise BadInput("give -o SCORES.json", "the scores are written to a JSON file")
    refuse_existing(output, force)
    if merge:
        scores = merge_scores(read_scores(p) for p in sources)
    else:
        if len(sources) != 1:
            raise BadInput(
                f"give one model to score ({len(sources)} given)",
                "ggufcarve score MODEL.gguf --method weights -o scores.json, or --merge A.json B.json",
            )
        scores = _score(
            *_read_model(sources[0]),
            method,
            imatrix,
            calibration or [],
            seed,
            ctx,
            max_tokens,
            S.compute(threads, gpu_layers, rpc, tensor_split, n_cpu_moe),
            quiet,
        )
    _write(output, scores.dumps(), sources, force)
    out.print(
        f"{scores.method} scores of {scores.model.name}: {len(scores.blocks)} "
        f"MoE blocks x {scores.model.expert_count} experts"
        + (f", {scores.tokens:,} tokens" if scores.tokens else "")
        + f" -> {output}"
    )


def _selection_table(selection: Selection) -> Any:
    facts = selection.scores.model
    table = new_table(
        title=f"{facts.name}: {selection.scores.method}, keep {selection.kept_count} of {facts.expert_count}"
    )
    for column in ("block", "rule", "kept", "pruned", "kept score share"):
        table.add_column(column, justify="left" if column in ("block", "rule") else "right")
    scores = selection.scores.scores()
    for b, stats in sorted(selection.scores.blocks.items()):
        kept = selection.keepset.layers[b]
        total = float(scores[b].sum())
        share = f"{100 * float(scores[b][list(kept)].sum()) / total:.1f}%" if total > 0 else "-"
        pruned = sorted(set(range(facts.expert_count)) - set(kept))
        table.add_row(f"{b} (MTP)" if facts.is_mtp(b) else str(b), stats.rule, ranges(kept), ranges(pruned), share)
    return table


def _compare(a: Path, b: Path, as_json: bool) -> None:
    from ggufcarve.select.keep import compare

    rows = compare(_layers_of(a), _layers_of(b))
    if as_json:
        out.print_json(json.dumps({"a": a.name, "b": b.name, "blocks": rows}))
        return
    table = new_table(title=f"{a.name} (A) vs {b.name} (B)")
    for column in ("block", "K", "overlap |A∩B|/K", "only in A", "only in B"):
        table.add_column(column, justify="right" if column in ("block", "K", "overlap |A∩B|/K") else "left")
    for row in rows:
        table.add_row(
            str(row["block"]),
            str(row["kept"]),
            f"{row['overlap']:.3f}",
            ",".join(map(str, row["only_a"])) or "-",
            ",".join(map(str, row["only_b"])) or "-",
        )
    out.print(table)
    mean = sum(r["overlap"] for r in rows) / len(rows) if rows else 1.0
    out.print(f"mean overlap {mean:.3f} over {len(rows)} blocks")


def _layers_of(path: Path) -> dict[int, tuple[int, ...]]:
    """The per-block kept ids of a selection or keep-set file keyed by block index."""
    from ggufcarve.reports import read_json

    doc = read_json(path, "selection file", "give two selection files written by ggufcarve select")
    layers = doc.get("layers") if isinstance(doc, dict) else None
    if not isinstance(layers, dict) or not all(str(k).isdigit() and isinstance(v, list) for k, v in layers.items()):
        raise BadInput(
            f'{path}: no "layers" mapping of block index to kept ids',
            "compare files written by ggufcarve select (or keep-sets in its format)",
        )
    return {int(k): tuple(int(i) for i in v) for k, v in layers.items()}


def one_count(wanted: Keep | None) -> int | None:
    """select's --keep: one count; a list or a keep-set file is refused with where it belongs."""
    if wanted is None:
        return None
    if wanted.file is not None:
        raise BadInput(
            f"--keep {wanted.file}: a keep-set file is a selection already",
            f"prune with it: ggufcarve prune MODEL --keep {wanted.file} -o OUT.gguf",
        )
    if not (wanted.counts or "").strip().isdigit():
        raise BadInput(
            f"--keep {wanted.counts}: select writes one selection",
            "give one count; ggufcarve tune --keep 8,12 weighs several",
        )
    return int(wanted.counts or 0)


def select_command(
    sources: SourcesArgument = None,
    output: Annotated[
        Path | None,
        option(
            S.OUTPUT,
            "SELECTION.json (a keep-set `ggufcarve prune --keep` reads); the heatmap goes beside it as .png.",
        ),
    ] = None,
    method: MethodOption = None,
    keep: Annotated[
        Keep | None, option(S.KEEP, "one count (select writes one selection; tune weighs several).")
    ] = None,
    ratio: Annotated[float | None, option(S.RATIO)] = None,
    imatrix: ImatrixOption = None,
    calibration: CalibrationOption = None,
    seed: SeedOption = 0,
    ctx: ChunkCtxOption = 512,
    max_tokens: MaxTokensOption = None,
    threads: ThreadsOption = None,
    gpu_layers: GpuLayersOption = None,
    rpc: RpcOption = None,
    tensor_split: TensorSplitOption = None,
    n_cpu_moe: NCpuMoeOption = 0,
    protect: Annotated[str | None, option(S.PROTECT)] = None,
    protect_super_experts: Annotated[bool, option(S.PROTECT_SUPER_EXPERTS)] = False,
    heatmap: Annotated[
        bool, typer.Option("--heatmap/--no-heatmap", help="Write SELECTION.png beside the selection.")
    ] = True,
    compare_files: Annotated[bool, option(S.COMPARE)] = False,
    force: ForceOption = False,
    quiet: QuietResultOption = False,
    as_json: JsonOption = False,
) -> None:
    """Choose the experts to keep per MoE block (MTP included) and write the selection record."""
    _calibrate_ahead(method, calibration)
    from ggufcarve.select.run import SelectSettings, is_gguf, select_to_file

    sources = sources or []
    if compare_files:
        if len(sources) != 2:
            raise BadInput(
                f"--compare needs two selection files ({len(sources)} given)",
                "ggufcarve select --compare A.json B.json",
            )
        _compare(sources[0], sources[1], as_json)
        return
    if len(sources) != 1:
        raise BadInput(
            f"give one model or scores file ({len(sources)} given)",
            "ggufcarve select MODEL.gguf --method weights --keep K -o selection.json",
        )
    if output is None:
        raise BadInput(
            "give -o SELECTION.json", "the selection is written to a JSON file that `ggufcarve prune --keep` reads"
        )
    source = sources[0]
    settings = SelectSettings(
        method,
        one_count(keep),
        ratio,
        imatrix,
        tuple(calibration or ()),
        seed,
        ctx,
        max_tokens,
        protect,
        protect_super_experts,
        heatmap,
        compute=S.compute(threads, gpu_layers, rpc, tensor_split, n_cpu_moe),
    )
    with progress(not quiet and not as_json) as sink:
        result = select_to_file(source, settings, output, force=force, on_event=sink)
    selection, record, png, kept = (
        result.selection,
        result.record,
        output.with_suffix(".png"),
        result.selection.kept_count,
    )
    for warning in selection.warnings:
        warn(warning)
    if as_json:
        out.print_json(
            json.dumps(
                {
                    "selection": str(output),
                    "heatmap": str(png) if heatmap else None,
                    "kept_count": kept,
                    "layers": record["layers"],
                }
            )
        )
        return
    if not quiet:  # -q: the result line alone
        out.print(_selection_table(selection))
    model_name = source if is_gguf(source) else "MODEL.gguf"
    out.print(f"selection: {output}" + (f"; heatmap: {png}" if heatmap else ""))
    if not quiet:
        out.print(f"prune with: ggufcarve prune {model_name} --keep {output} -o OUT.gguf")
