"""Selecting to a file: score a model (or read a scores file), choose K experts per block, write the
selection record and its heatmap. `ggufcarve select` and the run pipeline's select stage both call
`select_to_file`, so a plan writes the record the command writes.

    settings = SelectSettings(method="reap", keep=128, calibration=(Path("code.jsonl"),))
    result = select_to_file(Path("model.gguf"), settings, Path("selection.json"))
    result.keepset  # the keep-set the written file holds, as `ggufcarve prune --keep` reads it
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ggufcarve import settings as S
from ggufcarve.errors import BadInput, OutputError
from ggufcarve.events import Sink, ignore
from ggufcarve.llama.devices import Compute
from ggufcarve.select.criteria import SUPER_EXPERT_METHODS, criterion_named
from ggufcarve.settings import key, required


@dataclass(frozen=True)
class SelectSettings:
    method: str | None = required(S.METHOD)  # None: the source is a scores file, whose method is used
    keep: int | None = key(S.KEEP, None)
    ratio: float | None = key(S.RATIO, None)
    imatrix: Path | None = key(S.IMATRIX, None)
    calibration: tuple[Path, ...] = key(S.CALIBRATION, ())
    seed: int = key(S.SEED, 0)
    ctx: int = key(S.CTX, 512)
    max_tokens: int | None = key(S.MAX_TOKENS, None)
    protect: str | None = key(S.PROTECT, None)  # ids for every block (0,5,9-11) or a keep-set-like JSON file
    protect_super_experts: bool = key(S.PROTECT_SUPER_EXPERTS, False)
    heatmap: bool = True
    imatrix_out: Path | None = None  # with a calibration method: the model's imatrix from the same pass
    compute: Compute = S.compute_key()  # where the calibration pass runs


@dataclass(frozen=True)
class SelectResult:
    selection: Any  # select.keep.Selection
    record: dict[str, Any]
    path: Path
    heatmap: Path | None
    keepset: Any  # moe.keepset.KeepSet: what `load_keepset(path)` gives, without reading it back
    outputs: tuple[Path, ...]  # every file written: the record, the heatmap, the imatrix


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except FileNotFoundError:
        raise BadInput(f"{path}: no such file", "give a GGUF model or a scores JSON file") from None


def refuse_existing(path: Path, force: bool) -> None:
    if path.exists() and not force:
        raise OutputError(f"output {path} already exists", "pass --force to replace it, or choose another path")


def select_to_file(
    source: Path,
    settings: SelectSettings,
    output: Path,
    *,
    force: bool = False,
    model: Any = None,
    layout: Any = None,
    on_event: Sink = ignore,
) -> SelectResult:
    """Choose the experts to keep and write OUTPUT (the selection record, a keep-set) and, with
    `settings.heatmap`, OUTPUT.png. Everything the options can refuse is refused before the
    model is scored. `model`/`layout`: the source already read."""
    from ggufcarve.fileio import check_outputs, sha256_file_cached, write_text_atomic
    from ggufcarve.moe.keepset import KeepSet
    from ggufcarve.moe.kept import kept_count
    from ggufcarve.placement.auto import placed_settings
    from ggufcarve.select.keep import choose, protected_from
    from ggufcarve.select.scores import ModelFacts, read_scores

    settings = placed_settings(settings, source, settings.ctx)
    png = output.with_suffix(".png")
    refuse_existing(output, force)
    if settings.heatmap:
        refuse_existing(png, force)
    from_scores: tuple[dict[str, Any], ...] = ()
    scores = None
    if model is not None or is_gguf(source):
        if model is None:
            from ggufcarve.gguf.container import read_model
            from ggufcarve.moe.layout import inspect_layout

            model = read_model(source)
            layout = inspect_layout(model)
        facts = ModelFacts.of(model, layout)
    else:
        if settings.imatrix is not None or settings.calibration:
            raise BadInput(
                f"{source.name} is a scores file: --imatrix and --calibration apply when scoring a model",
                "drop them, or give the model instead",
            )
        scores = read_scores(source)
        if settings.method is not None and settings.method != scores.method:
            raise BadInput(
                f"{source.name} holds {scores.method} scores, not {settings.method}",
                f"drop --method or score the model with --method {settings.method}",
            )
        facts = scores.model
        from_scores = ({"kind": "scores", "name": source.name, "sha256": sha256_file_cached(source)},)
    kept = kept_count(facts.layout(), settings.keep, settings.ratio)
    protected = protected_from(settings.protect, facts)
    if settings.protect_super_experts and scores is None and settings.method not in SUPER_EXPERT_METHODS:
        raise BadInput(
            "--protect-super-experts needs per-expert maximum "
            f"outputs, which --method {settings.method} does not record",
            f"use --method {', '.join(SUPER_EXPERT_METHODS[:-1])} or {SUPER_EXPERT_METHODS[-1]}",
        )
    started = time.perf_counter()
    outputs = [output]
    if scores is None:
        scores = _score(model, layout, settings, on_event)
        if settings.imatrix_out is not None:
            outputs.append(settings.imatrix_out)
    selection = choose(
        scores, kept, protected, settings.protect_super_experts, ratio=settings.ratio, sources=from_scores
    )
    record = selection.record({"total_seconds": time.perf_counter() - started})
    text = json.dumps(record, indent=1, sort_keys=True, allow_nan=False) + "\n"
    check_outputs([output], [source], len(text), force)
    write_text_atomic(output, text)
    heatmap = None
    if settings.heatmap:
        from ggufcarve.select.heatmap import write_heatmap

        heatmap = write_heatmap(selection, png)
        outputs.append(heatmap)
    keepset = KeepSet.as_written(selection.keepset, record, text.encode(), output.name)
    return SelectResult(selection, record, output, heatmap, keepset, tuple(outputs))


def _score(model: Any, layout: Any, settings: SelectSettings, on_event: Sink) -> Any:
    from ggufcarve.select.methods import score_model

    method = settings.method
    if method is None:
        raise BadInput(
            f"scoring {model.path.name} needs --method",
            "for example --method weights (zero-shot) or --method imatrix-counts --imatrix FILE",
        )
    if settings.imatrix_out is not None:
        if criterion_named(method).needs != "calibration":
            raise BadInput(
                f"--method {method} traces no calibration text, so it cannot collect an imatrix in the same pass",
                "collect the imatrix with `ggufcarve imatrix collect`",
            )
        from ggufcarve.select.calibrate import calibrate

        return calibrate(
            model,
            layout,
            method,
            list(settings.calibration),
            ctx=settings.ctx,
            max_tokens=settings.max_tokens,
            compute=settings.compute,
            on_event=on_event,
            imatrix_out=settings.imatrix_out,
            force=True,
        )
    return score_model(
        model,
        layout,
        method,
        imatrix=settings.imatrix,
        calibration=list(settings.calibration),
        seed=settings.seed,
        ctx=settings.ctx,
        max_tokens=settings.max_tokens,
        compute=settings.compute,
        on_event=on_event,
    )
