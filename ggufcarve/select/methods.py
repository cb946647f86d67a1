"""`score_model`, which fills ExpertScores with one criterion of the registry (`select.criteria`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ggufcarve.errors import BadInput
from ggufcarve.events import Sink, ignore
from ggufcarve.fileio import sha256_file_cached
from ggufcarve.gguf.container import GGUFModel
from ggufcarve.llama.devices import CPU, Compute
from ggufcarve.moe.layout import MoeLayout
from ggufcarve.select.criteria import IMATRIX_METHODS, criterion_named
from ggufcarve.select.scores import ExpertScores, ModelFacts


def imatrix_input(path: Path, imatrix: Any) -> dict[str, Any]:
    return {
        "kind": "imatrix",
        "name": path.name,
        "sha256": sha256_file_cached(path),
        "bytes": path.stat().st_size,
        "format": imatrix.format,
        "chunk_count": imatrix.chunk_count,
        "chunk_size": imatrix.chunk_size,
        "datasets": list(imatrix.datasets),
    }


def score_model(
    model: GGUFModel,
    layout: MoeLayout,
    method: str,
    *,
    imatrix: Path | None = None,
    calibration: Sequence[Path] = (),
    seed: int = 0,
    ctx: int = 512,
    max_tokens: int | None = None,
    compute: Compute = CPU,
    on_event: Sink = ignore,
) -> ExpertScores:
    """Score every expert of every MoE block (MTP blocks included) with `method`."""
    spec = criterion_named(method)
    if spec.needs == "imatrix" and imatrix is None:
        raise BadInput(
            f"--method {method} reads an imatrix",
            "give --imatrix FILE (the GGUF imatrix llama-imatrix wrote for this model)",
        )
    if spec.needs != "imatrix" and imatrix is not None:
        raise BadInput(
            f"--imatrix is read only by {', '.join(IMATRIX_METHODS)}, not by {method}",
            "drop --imatrix or choose an imatrix method",
        )
    if spec.needs != "calibration" and calibration:
        raise BadInput(
            f"--method {method} runs no calibration text", "drop --calibration or choose a calibration method"
        )
    if spec.needs == "calibration":
        from ggufcarve.select.calibrate import calibrate

        if not calibration:
            raise BadInput(
                f"--method {method} traces calibration text through llama.cpp",
                "give --calibration FILE (text or JSONL), repeatable",
            )
        return calibrate(
            model,
            layout,
            method,
            calibration,
            ctx=ctx,
            max_tokens=max_tokens,
            compute=compute,
            on_event=on_event,
        )
    facts = ModelFacts.of(model, layout)
    parameters: dict[str, Any] = {}
    inputs: tuple[dict[str, Any], ...] = ()
    if method == "weights":
        from ggufcarve.select.zero_shot import weights_stats

        blocks, rules = weights_stats(model, layout, layout.blocks, on_event)
        parameters["scale_rules"] = rules
    elif method == "aimer":
        from ggufcarve.select.zero_shot import aimer_stats

        blocks = aimer_stats(model, layout, on_event)
        parameters["score"] = (
            "RMS(w) / mean |w| over the expert's weight tensors "
            "pooled: 1 / AIMER's score, so the top K are AIMER's lowest"
        )
    elif method == "router-norm":
        from ggufcarve.select.zero_shot import router_norm_stats

        blocks = router_norm_stats(model, layout)
    elif method == "random":
        from ggufcarve.select.zero_shot import random_stats

        blocks = random_stats(layout, seed)
        parameters["seed"] = seed
    else:
        from ggufcarve.imatrix_format import read_imatrix
        from ggufcarve.select.from_imatrix import imatrix_stats

        if imatrix is None:
            raise BadInput(
                f"--method {method} reads an imatrix",
                "give --imatrix FILE (the GGUF imatrix llama-imatrix wrote for this model)",
            )
        loaded = read_imatrix(imatrix)
        blocks, rules = imatrix_stats(model, layout, loaded, method, on_event)
        if rules:
            parameters["scale_rules"] = rules
        inputs = (imatrix_input(imatrix, loaded),)
    scores = ExpertScores(method=method, model=facts, blocks=blocks, parameters=parameters, inputs=inputs)
    scores.check()
    return scores
