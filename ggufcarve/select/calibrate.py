"""Scoring experts from a calibration run through llama.cpp itself (llama-cpp-python, eval callback),
and the importance matrix of the same run.

`calibrate` runs one decode pass (`ggufcarve.llama.decode`) over the calibration documents,
tokenized, chunked and batched exactly as llama-imatrix does (`ggufcarve.llama.calibration`), in
the child a command started ahead (`ggufcarve.select.prestart`) or a new one. Its consumers:
  * the selection criteria (`ggufcarve.select.from_trace.statistics`): the MoE nodes they read,
    folded block by block into mergeable per-expert statistics of every criterion the pass fills
    (`calibrate_all` returns them all; `calibrate` the one asked for);
  * for `greedy` (asked, or with `greedy=True` beside another criterion), the backward
    elimination of `ggufcarve.select.greedy`, which holds the block inputs and outputs of every
    token and eliminates once the decode has ended; the statistics consumer runs the pass of the
    criterion asked beside it (a reap pass when greedy alone is asked);
  * with `imatrix_out`, the importance matrix (`ggufcarve.imatrix.collect.IMATRIX_CONSUMER`):
    llama-imatrix's statistics of every MUL_MAT / MUL_MAT_ID of a blk.* weight, written as
    llama-imatrix would write them from the same text and --ctx.
Progress: events of stage "calibrate" in tokens.

MTP blocks are not run by llama.cpp's decode graph: they are scored by the weights rule, noted in
their block record (and have no imatrix entries, as with llama-imatrix).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ggufcarve.errors import BadInput, ToolFailed
from ggufcarve.events import Sink, ignore
from ggufcarve.fileio import check_outputs
from ggufcarve.gguf.container import GGUFModel
from ggufcarve.llama.calibration import Batching, check_chunking, read_calibration
from ggufcarve.llama.decode import DecodeRequest, decode, default_threads
from ggufcarve.llama.devices import CPU, Compute
from ggufcarve.moe.layout import MoeLayout
from ggufcarve.placement.auto import resolve
from ggufcarve.select.criteria import TRACE_METHODS
from ggufcarve.select.from_trace import TraceStatistics, statistics_consumer
from ggufcarve.select.scores import BlockStats, ExpertScores, ModelFacts

DEFAULT_CTX = 512
MTP_NOTE = "MTP block: llama.cpp's decode graph does not run it; scored by the weights rule"


def calibrate(model: GGUFModel, layout: MoeLayout, method: str, files: Sequence[Path], **options: Any) -> ExpertScores:
    """Trace the calibration files through llama.cpp and score every expert with `method` (the
    options of `calibrate_all`)."""
    return calibrate_all(model, layout, method, files, **options)[method]


def calibrate_all(
    model: GGUFModel,
    layout: MoeLayout,
    method: str,
    files: Sequence[Path],
    *,
    ctx: int = DEFAULT_CTX,
    max_tokens: int | None = None,
    compute: Compute = CPU,
    imatrix_out: Path | None = None,
    force: bool = False,
    greedy: bool = False,
    available_memory: int | None = None,
    on_event: Sink = ignore,
) -> dict[str, ExpertScores]:
    """One decode pass over the calibration files: the scores of every criterion it fills
    (`from_trace.filled_by(method)`), by criterion name. Each record's parameters name the pass
    ("pass": the decode consumer, the criterion it was asked for and every criterion it filled).

    With `imatrix_out`, the same decode also collects the model's importance matrix, written
    there as llama-imatrix would write it from the same text and --ctx (refused if it exists,
    unless `force`). With `greedy` (or `method` "greedy") the same decode also runs the greedy
    elimination; its record's "pass" names the consumer "greedy", and its "greedy" parameter holds
    per block the removal order and error(S) after each removal; before the pass, greedy is refused
    when its memory estimate exceeds greedy.REFUSE_SHARE of `available_memory` (None:
    `greedy.available_memory()`, /proc/meminfo's)."""
    from ggufcarve.select.zero_shot import weights_stats

    if method not in TRACE_METHODS:
        raise BadInput(f"{method} is not a calibration method", f"one of {', '.join(TRACE_METHODS)}")
    asked = method
    greedy = greedy or method == "greedy"
    if greedy:
        from ggufcarve.select.experts import activation_of
        from ggufcarve.select.greedy import check_routing

        activation_of(layout.architecture)
        check_routing(layout)
        method = "reap" if method == "greedy" else method
    if method == "razor" and layout.expert_used_count < 2:
        raise BadInput("razor needs at least 2 experts per token (top-k >= 2)", "use reap or ean for top-1 routing")
    if method == "razor":
        from ggufcarve.select.experts import activation_of

        activation_of(layout.architecture)
    check_chunking(ctx, max_tokens)
    compute = resolve(compute, model.path, ctx)
    calibration = read_calibration(files)
    if greedy:
        from ggufcarve.select.greedy import check_memory

        check_memory(layout, calibration, ctx, max_tokens, default_threads(compute.threads), available_memory)
    consumers = [statistics_consumer(method)]
    if greedy:
        from ggufcarve.select.greedy import GREEDY_CONSUMER

        consumers.append(GREEDY_CONSUMER)
    if imatrix_out is not None:
        from ggufcarve.imatrix.collect import IMATRIX_CONSUMER

        check_outputs([Path(imatrix_out)], list(model.paths), 0, force)
        consumers.append(IMATRIX_CONSUMER)
    batching = Batching.of(ctx)
    request = DecodeRequest(
        os.fspath(model.path),
        tuple(consumers),
        batching,
        documents=tuple(f.documents for f in calibration),
        max_tokens=max_tokens,
        compute=compute,
    )
    run = decode(request, what=f"calibrating {model.path.name}", stage="calibrate", on_event=on_event)
    if imatrix_out is not None:
        from ggufcarve.imatrix.collect import write_collected

        write_collected(
            run.outputs[IMATRIX_CONSUMER.name],
            [f.path.name for f in calibration],
            ctx,
            Path(imatrix_out),
            tokens=run.tokens,
            seconds=run.seconds,
            force=force,
            sources=list(model.paths),
            on_event=on_event,
        )
    statistics = TraceStatistics.from_arrays(run.outputs["statistics"], layout.expert_count)
    traced = [b for b in layout.blocks if b in statistics.counts]
    untraced = [b for b in layout.blocks if b not in traced]
    missing = [b for b in untraced if not layout.is_mtp(b)]
    if missing:
        raise ToolFailed(
            f"the trace of {model.path.name} has no MoE nodes for block(s) {missing}",
            "the llama.cpp graph of this architecture does not go through build_moe_ffn",
        )
    parameters: dict[str, Any] = {
        "ctx": ctx,
        "max_tokens": max_tokens,
        "micro_batch": batching.micro_batch,
        "sequences": batching.sequences,
        "chunks": run.chunks,
        "pass": {
            "decode": "calibration",
            "consumer": "statistics",
            "asked": asked,
            "statistics": [*statistics.filled, *(["greedy"] if greedy else [])],
        },
    }
    extra: dict[int, BlockStats] = {}
    if untraced:
        extra, rules = weights_stats(model, layout, untraced, on_event, note=MTP_NOTE)
        parameters["scale_rules"] = rules
    inputs = tuple(f.record(n) for f, n in zip(calibration, run.file_tokens))
    facts = ModelFacts.of(model, layout)
    out: dict[str, ExpertScores] = {}
    for name in statistics.filled:
        scores = ExpertScores(name, facts, {**statistics.blocks(name), **extra}, parameters, inputs, run.tokens)
        scores.check()
        out[name] = scores
    if greedy:
        out["greedy"] = greedy_scores(run.outputs["greedy"], statistics, facts, extra, parameters, inputs, run.tokens)
    return out


def greedy_scores(
    arrays: dict[str, Any],
    statistics: TraceStatistics,
    facts: ModelFacts,
    extra: dict[int, BlockStats],
    parameters: dict[str, Any],
    inputs: tuple[dict[str, Any], ...],
    tokens: int,
) -> ExpertScores:
    """The greedy consumer's eliminations as ExpertScores (statistic "rank": 1 + removal step)."""
    from ggufcarve.select.greedy import eliminations

    done = eliminations(arrays)
    blocks: dict[int, BlockStats] = dict(extra)
    record: dict[str, Any] = {}
    for block, result in done.items():
        blocks[block] = BlockStats(
            "greedy", "rank", counts=statistics.counts.get(block), sums=result.scores(facts.expert_count)
        )
        record[str(block)] = {
            "removed": result.removed,
            "error": result.errors,
            "survivors": result.survivors,
            "evaluated_pairs": result.evaluated,
            "seconds": round(result.seconds, 3),
            "routing_agrees": float(arrays[f"agrees:{block}"]),
        }
    passed = {**parameters["pass"], "consumer": "greedy", "consumers": ["statistics", "greedy"]}
    scores = ExpertScores("greedy", facts, blocks, {**parameters, "pass": passed, "greedy": record}, inputs, tokens)
    scores.check()
    return scores
