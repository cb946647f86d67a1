"""The tune child: one model loaded once in libllama; the reference scored without a mask, every
candidate keep-set scored with the pruned experts taken out of routing (`llama.masking.RoutingMask`,
its keep-set swapped between decodes), over the held-out chunks by successive halving
(`tune.protocol`).

Run as `python -m ggufcarve.tune.child` through the one launcher; it speaks the child-task
protocol of `ggufcarve.llama.child`. Chunks are tokenized, cut and decoded as the evaluation child
decodes them (llama-perplexity's chunking, n_batch 2048 // n_ctx chunks side by side). The
reference's log-probs are kept as llama-perplexity's base records (16 bits per vocabulary entry,
`kld.base_records`) in the work directory, and each candidate's per-token table is computed from
them with `kld.compare_base`: the table `ggufcarve eval` computes for a pruned file against its
unpruned reference. Tables are written as <candidate>-<file index>.npy (float64 rows of
kld.TOKEN_COLUMNS, chunk order); the result JSON holds the rounds, each candidate's chunks
scored and the mask's node counts. A finalist's chunks are decoded in the groups `eval` decodes
them in (its last round goes back to the start of a group of n_seq chunks), so that its
micro-batches hold the tokens they hold there.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from ggufcarve.llama import child
from ggufcarve.tune.protocol import CHUNK_TASK, Request, first_slice, schedule


def _tune(request: Request, out: Path) -> None:
    from ggufcarve.errors import ToolFailed
    from ggufcarve.evaluate import kld
    from ggufcarve.evaluate.child import PERPLEXITY_BATCH
    from ggufcarve.evaluate.engine import Engine, EngineError
    from ggufcarve.evaluate.perplexity import chunk_tokens, plan_chunks, read_text, scored_targets
    from ggufcarve.llama.masking import RoutingMask

    work = Path(request.work)
    result: dict = {"files": [], "candidates": {}, "groups": []}
    try:
        started = time.perf_counter()
        engine = Engine(request.model, request.threads)
        result["load_seconds"] = time.perf_counter() - started
        files = []
        for text in request.texts:
            tokens = engine.tokenize(read_text(Path(text).read_bytes()))
            try:
                chunking = plan_chunks(len(tokens), request.n_ctx, request.max_chunks)
            except ValueError as err:
                raise child_refusal(f"{Path(text).name}: {err}") from None
            files.append((tokens, chunking))
            result["files"].append({"path": text, "n_tokens": int(len(tokens)), "n_ctx": chunking.n_ctx, "n_chunk": chunking.n_chunk})
        n_chunks = max(c.n_chunk for _, c in files)
        plans = [schedule(len(group), n_chunks) for group in request.groups]
        n_seq = max(1, PERPLEXITY_BATCH // request.n_ctx)

        def resume(prev: int, final: bool) -> int:
            """The first chunk a round decodes: the finalists go back to the start of the group of
            n_seq chunks `ggufcarve eval` decodes side by side."""
            return (prev // n_seq) * n_seq if final else prev

        total = sum(c.n_chunk for _, c in files) + sum(
            alive * sum(min(n, c.n_chunk) - min(resume(prev, i == len(plan) - 1), c.n_chunk) for _, c in files)
            for plan in plans for i, ((alive, n), prev) in enumerate(zip(plan, [0] + [n for _, n in plan[:-1]])))
        done = 0
        mask = RoutingMask()
        context = engine.context(request.n_ctx, n_seq, min(PERPLEXITY_BATCH, n_seq * request.n_ctx), eval_callback=mask)

        def decode(f: int, start: int, stop: int):
            tokens, chunking = files[f]
            for group in range(start, stop, n_seq):
                indices = range(group, min(stop, group + n_seq))
                logits = context.chunk_logits([chunk_tokens(tokens, chunking, i, engine.add_bos, engine.bos) for i in indices], chunking.first)
                if mask.errors:
                    raise ToolFailed(f"the routing mask failed: {mask.errors[0]}", "this architecture cannot be masked: score keep-sets by pruning files")
                for index, rows in zip(indices, logits):
                    yield index, rows[: chunking.scored_per_chunk], scored_targets(tokens, chunking, index)

        try:
            child.progress(CHUNK_TASK, 0, total, "chunks")
            started = time.perf_counter()
            references = []
            for f, (_tokens, chunking) in enumerate(files):
                nv = kld.base_values_per_token(engine.n_vocab)
                base = np.lib.format.open_memmap(work / f"reference-{f}.npy", mode="w+", dtype=np.uint16, shape=(chunking.n_chunk, chunking.scored_per_chunk, nv))
                mask.keep = {}
                for index, rows, _targets in decode(f, 0, chunking.n_chunk):
                    base[index] = kld.base_records(rows)
                    done += 1
                    child.progress(CHUNK_TASK, done, total, "chunks")
                references.append(base)
            result["reference_seconds"] = time.perf_counter() - started
            started = time.perf_counter()
            tables: dict[str, list[list[np.ndarray]]] = {cid: [[] for _ in files] for cid in request.candidates}
            scored: dict[str, int] = dict.fromkeys(request.candidates, 0)

            def score(cid: str, upto: int, final: bool) -> None:
                nonlocal done
                mask.keep = {int(b): tuple(int(i) for i in ids) for b, ids in request.candidates[cid].items()}
                mask.masked = {}
                for f, (_tokens, chunking) in enumerate(files):
                    start, stop = min(resume(scored[cid], final), chunking.n_chunk), min(upto, chunking.n_chunk)
                    del tables[cid][f][start:]
                    for index, rows, targets in decode(f, start, stop):
                        tables[cid][f].append(kld.compare_base(rows, targets, references[f][index]))
                        done += 1
                        child.progress(CHUNK_TASK, done, total, "chunks")
                if mask.masked:
                    result["candidates"].setdefault(cid, {})["masked"] = sorted(mask.masked)
                scored[cid] = upto

            def mean_kld(cid: str) -> float:
                rows = [t for per_file in tables[cid] for t in per_file]
                return float(np.concatenate(rows)[:, kld.KLD].mean())

            for group, plan in zip(request.groups, plans):
                alive = list(group)
                rounds = []
                for number, (count, upto) in enumerate(plan):
                    alive = alive[:count]
                    for cid in alive:
                        score(cid, upto, number == len(plan) - 1)
                    ranked = sorted(alive, key=lambda c: (mean_kld(c), group.index(c)))
                    rounds.append({"chunks": upto, "candidates": list(alive), "mean_kld": {c: mean_kld(c) for c in alive}})
                    alive = ranked
                for cid in group:
                    result["candidates"].setdefault(cid, {}).update(chunks=scored[cid], stopped_early=scored[cid] < n_chunks)
                result["groups"].append({"candidates": list(group), "first_slice": first_slice(len(group), n_chunks), "rounds": rounds, "winner": alive[0]})
            result["score_seconds"] = time.perf_counter() - started
        finally:
            context.close()
        for cid, per_file in tables.items():
            for f, parts in enumerate(per_file):
                np.save(work / f"{cid}-{f}.npy", np.concatenate(parts) if parts else np.zeros((0, kld.TOKEN_COLUMNS)))
        engine.close()
    except EngineError as err:
        raise ToolFailed(f"{Path(request.model).name}: {err}", "check that llama.cpp loads the model (ggufcarve inspect)") from None
    temp = out.with_name(out.name + f".{os.getpid()}.tmp")
    temp.write_text(json.dumps(result, sort_keys=True))
    os.replace(temp, out)


def child_refusal(message: str) -> Exception:
    from ggufcarve.errors import BadInput

    return BadInput(message, "give a longer held-out text or a smaller --ctx")


def main(argv: list[str] | None = None) -> int:
    return child.serve(Request, _tune, argv)


if __name__ == "__main__":
    child.exit_now(main())
