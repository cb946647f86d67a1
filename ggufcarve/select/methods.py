"""The registry of selection criteria and `score_model`, which fills ExpertScores with one of them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ggufcarve.errors import BadInput
from ggufcarve.events import Sink, ignore
from ggufcarve.fileio import sha256_file_cached
from ggufcarve.gguf.container import GGUFModel
from ggufcarve.moe.layout import MoeLayout
from ggufcarve.select.scores import ExpertScores, ModelFacts


@dataclass(frozen=True)
class Method:
    name: str
    needs: str  # "model", "imatrix" or "calibration"
    summary: str


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("weights", "model", "||router row|| x scale energy of the expert's weights (zero-shot, one read of the model)"),
        Method("router-norm", "model", "||router row|| alone"),
        Method("random", "model", "seeded uniform scores (a baseline)"),
        Method("imatrix-counts", "imatrix", "routed (token, slot) counts an imatrix recorded per expert"),
        Method("imatrix-energy", "imatrix", "mean ||h||^2 of the tokens routed to each expert, from ffn_down_exps in_sum2"),
        Method("imatrix-msan", "imatrix", "msan estimated from an imatrix, no pass: sum_c E[h_c^2] ||W_down[:, c]||^2; ranks like the traced msan to Spearman 0.89-0.97 per block (mean 0.91-0.94) on the demo model: a ranking aid, not a measurement"),
        Method("frequency", "calibration", "routed (token, slot) counts in llama.cpp's own routing of the calibration text"),
        Method("ean", "calibration", "mean ||f_e(x)|| over the tokens routed to e (expert output norm)"),
        Method("ean-sum", "calibration", "sum of ||f_e(x)|| over the tokens routed to e (REAP's EAN sum form: frequency x ean)"),
        Method("msan", "calibration", "mean ||f_e(x)||^2 over the tokens routed to e (mean squared activation norm)"),
        Method("mone", "calibration", "MoNE: routed count x output variance E||f_e - mean f_e||^2 over the tokens routed to e (ungated outputs)"),
        Method("reap", "calibration", "mean g_e ||f_e(x)|| over the tokens routed to e, g the weight llama.cpp applied"),
        Method("razor", "calibration", "conditional RMS of the output change when e is deleted and the router's next expert takes its place"),
        Method("greedy", "calibration", "backward elimination per block: drop the expert whose removal raises mean ||y - y_S||^2 of the block's routed output least (routing recomputed over S); "
               "opt-in: on the demo model mean KLD at K=4/8/12 0.712/0.114/0.0064 against reap's 0.861/0.135/0.0095, for 1.7x the pass time and 11x its peak memory (tokens x experts x n_embd per block)"),
    )
}


def method_named(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise BadInput(f"unknown method {name!r}", f"choose one of {', '.join(METHODS)}") from None


def imatrix_input(path: Path, imatrix: Any) -> dict[str, Any]:
    return {
        "kind": "imatrix", "name": path.name, "sha256": sha256_file_cached(path), "bytes": path.stat().st_size, "format": imatrix.format,
        "chunk_count": imatrix.chunk_count, "chunk_size": imatrix.chunk_size, "datasets": list(imatrix.datasets),
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
    threads: int | None = None,
    gpu_layers: int = 0,
    on_event: Sink = ignore,
) -> ExpertScores:
    """Score every expert of every MoE block (MTP blocks included) with `method`."""
    spec = method_named(method)
    if spec.needs == "imatrix" and imatrix is None:
        raise BadInput(f"--method {method} reads an imatrix", "give --imatrix FILE (the GGUF imatrix llama-imatrix wrote for this model)")
    if spec.needs != "imatrix" and imatrix is not None:
        raise BadInput(f"--imatrix is read only by {', '.join(m.name for m in METHODS.values() if m.needs == 'imatrix')}, not by {method}", "drop --imatrix or choose an imatrix method")
    if spec.needs != "calibration" and calibration:
        raise BadInput(f"--method {method} runs no calibration text", "drop --calibration or choose a calibration method")
    if spec.needs == "calibration":
        from ggufcarve.select.calibrate import calibrate

        if not calibration:
            raise BadInput(f"--method {method} traces calibration text through llama.cpp", "give --calibration FILE (text or JSONL), repeatable")
        return calibrate(model, layout, method, calibration, ctx=ctx, max_tokens=max_tokens, threads=threads, gpu_layers=gpu_layers, on_event=on_event)
    facts = ModelFacts.of(model, layout)
    parameters: dict[str, Any] = {}
    inputs: tuple[dict[str, Any], ...] = ()
    if method == "weights":
        from ggufcarve.select.zero_shot import weights_stats

        blocks, rules = weights_stats(model, layout, layout.blocks, on_event)
        parameters["scale_rules"] = rules
    elif method == "router-norm":
        from ggufcarve.select.zero_shot import router_norm_stats

        blocks = router_norm_stats(model, layout)
    elif method == "random":
        from ggufcarve.select.zero_shot import random_stats

        blocks = random_stats(layout, seed)
        parameters["seed"] = seed
    else:
        from ggufcarve.imatrix.formats import read_imatrix
        from ggufcarve.select.from_imatrix import imatrix_stats

        if imatrix is None:
            raise BadInput(f"--method {method} reads an imatrix", "give --imatrix FILE (the GGUF imatrix llama-imatrix wrote for this model)")
        loaded = read_imatrix(imatrix)
        blocks, rules = imatrix_stats(model, layout, loaded, method, on_event)
        if rules:
            parameters["scale_rules"] = rules
        inputs = (imatrix_input(imatrix, loaded),)
    scores = ExpertScores(method=method, model=facts, blocks=blocks, parameters=parameters, inputs=inputs)
    scores.check()
    return scores
