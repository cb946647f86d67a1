"""The measurement child: one model loaded once in libllama; every job's candidate scored on its
units, the dropped experts taken out of routing (`llama.masking.RoutingMask`, its keep-set swapped
between jobs; no callback at all when no job masks).

Run as `python -m ggufcarve.measure.child` through the one launcher; it speaks the child-task
protocol of `ggufcarve.llama.child` (request: `measure.protocol.Request`). Served in a session
(`child.Session`), the child keeps its model and contexts loaded from one request to the next
(the tournament's rounds on one file): only a request for another model or placement loads again.
Chunks are cut from the reference's tokens and decoded as the evaluation child decodes them
(llama-perplexity's chunking, n_batch 2048 // n_ctx chunks side by side, a unit being one such
group), and compared with the reference's records as `ggufcarve eval` compares them (`kld.compare_base` for a base file,
`kld.compare_topk` for a top-k cache). The result JSON holds, per job, the mask's node counts and
its seconds.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from ggufcarve.llama import child
from ggufcarve.llama.devices import Compute
from ggufcarve.measure.protocol import CHUNK_TASK, Request


class _Loaded:
    """The model the child holds between requests, and its contexts by (n_ctx, n_seq, n_batch, masked)."""

    key: tuple[str, str] | None = None
    engine = None
    contexts: dict = {}
    masks: dict = {}

    @classmethod
    def engine_for(cls, model: str, compute: Compute):
        from ggufcarve.evaluate.engine import Engine

        key = (model, json.dumps(compute.to_json(), sort_keys=True))
        if cls.key != key:
            cls.release()
            cls.engine = Engine(model, compute, "measure")
            cls.key = key
        return cls.engine

    @classmethod
    def context_for(cls, n_ctx: int, n_seq: int, n_batch: int, masking: bool):
        from ggufcarve.llama.masking import RoutingMask

        shape = (n_ctx, n_seq, n_batch, masking)
        if shape not in cls.contexts:
            mask = RoutingMask() if masking else None
            cls.contexts[shape] = cls.engine.context(n_ctx, n_seq, n_batch, eval_callback=mask)
            cls.masks[shape] = mask
        return cls.contexts[shape], cls.masks[shape]

    @classmethod
    def release(cls) -> None:
        for context in cls.contexts.values():
            context.close()
        cls.contexts, cls.masks = {}, {}
        if cls.engine is not None:
            cls.engine.close()
        cls.engine, cls.key = None, None


def _measure(request: Request, out: Path) -> None:
    from ggufcarve.errors import BadInput, ToolFailed
    from ggufcarve.evaluate import kld
    from ggufcarve.evaluate.engine import EngineError
    from ggufcarve.evaluate.perplexity import chunk_tokens, scored_targets
    from ggufcarve.evaluate.tables import PERPLEXITY_BATCH

    references = [kld.open_reference(Path(p)) for p in request.references]
    n_ctx = {r.n_ctx for r in references}
    if len(n_ctx) != 1:
        raise BadInput(
            f"the references were scored at different chunk sizes ({', '.join(map(str, sorted(n_ctx)))})",
            "score every held-out file at one --chunk-ctx",
        )
    n_ctx_value = n_ctx.pop()
    result: dict = {"jobs": {}}
    try:
        started = time.perf_counter()
        before = _Loaded.engine
        engine = _Loaded.engine_for(request.model, request.compute)
        result["load_seconds"] = time.perf_counter() - started
        result["loaded"] = engine is not before  # false: the model of an earlier request of this session
        result["n_vocab"] = engine.n_vocab
        for ref in references:
            if ref.n_vocab != engine.n_vocab:
                raise BadInput(
                    f"{Path(request.model).name}: the reference has a vocabulary "
                    f"of {ref.n_vocab} tokens, this model {engine.n_vocab}",
                    "compare models of the reference's family",
                )
        n_seq = max(1, PERPLEXITY_BATCH // n_ctx_value)
        masking = any(job.keep is not None for job in request.jobs)
        context, mask = _Loaded.context_for(n_ctx_value, n_seq, min(PERPLEXITY_BATCH, n_seq * n_ctx_value), masking)
        files = [open(ref.path, "rb") for ref in references]
        total = sum(count for job in request.jobs for _, _, count in job.units)
        done = 0
        try:
            child.progress(CHUNK_TASK, 0, total, "chunks")
            for job in request.jobs:
                job_started = time.perf_counter()
                if mask is not None:
                    mask.keep = {int(b): tuple(int(i) for i in ids) for b, ids in (job.keep or {}).items()}
                    mask.masked = {}
                with open(job.table_out, "wb") as table_file:
                    for segment, first, count in job.units:
                        ref = references[segment]
                        chunking = ref.chunking
                        if first < 0 or count < 1 or first + count > chunking.n_chunk or count > n_seq:
                            raise BadInput(
                                f"unit {first}+{count} of held-out file "
                                f"{segment}: outside its {chunking.n_chunk} chunks",
                                "a ggufcarve bug",
                            )
                        indices = range(first, first + count)
                        logits = context.chunk_logits(
                            [chunk_tokens(ref.tokens, chunking, i, engine.add_bos, engine.bos) for i in indices],
                            chunking.first,
                        )
                        if mask is not None and mask.errors:
                            raise ToolFailed(
                                f"the routing mask failed: {mask.errors[0]}",
                                "this architecture cannot be masked: score keep-sets by pruning files",
                            )
                        for index, rows in zip(indices, logits):
                            rows = rows[: chunking.scored_per_chunk]
                            targets = scored_targets(ref.tokens, chunking, index)
                            records = ref.chunk(files[segment], index)
                            table = (
                                kld.compare_topk(rows, targets, records)
                                if ref.kind == "topk"
                                else kld.compare_base(rows, targets, records)
                            )
                            table_file.write(np.ascontiguousarray(table, dtype="<f8").tobytes())
                            done += 1
                            child.progress(CHUNK_TASK, done, total, "chunks")
                result["jobs"][job.id] = {
                    "masked": sorted(mask.masked) if mask is not None else [],
                    "seconds": time.perf_counter() - job_started,
                }
        finally:
            for f in files:
                f.close()
    except EngineError as err:
        _Loaded.release()
        raise ToolFailed(
            f"{Path(request.model).name}: {err}", "check that llama.cpp loads the model (ggufcarve inspect)"
        ) from None
    temp = out.with_name(out.name + f".{os.getpid()}.tmp")
    temp.write_text(json.dumps(result, sort_keys=True))
    os.replace(temp, out)


def main(argv: list[str] | None = None) -> int:
    return child.serve(Request, _measure, argv)


if __name__ == "__main__":
    child.exit_now(main())
