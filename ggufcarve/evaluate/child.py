"""The evaluation child: one model loaded once in libllama, scored chunk by chunk, timed, asked the QA checks.

Run as `python -m ggufcarve.evaluate.child` through the one launcher (llama.cpp aborts the process
on failed asserts); it speaks the child-task protocol of `ggufcarve.llama.child`. The request
(`ggufcarve.evaluate.protocol.Request`) names the model, the text or the reference file whose
tokens are scored, and what to write:
  * `table_out`: the per-token table (float64 rows of `kld.TOKEN_COLUMNS`) appended chunk by chunk;
  * `segments`: instead of `reference_in` and `table_out`, one pair per held-out file, scored in
    turn by the one loaded model (the result's `segments` holds each one's chunking);
  * `cache_out`: the top-k cache of this model as a reference; `base_out`: its llama-perplexity
    base file;
  * the result file (`result_out`): a JSON summary (vocabulary, token count, chunking, speed, QA
    outputs, or a `bad_input` message).
Progress is reported in chunks and QA steps; a model libllama cannot load is a "failed" error, a
reference file that would not fit or a failed write an "os" error.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from ggufcarve.evaluate.protocol import CHUNK_TASK, LOOP_TASK, QA_TASK, Request
from ggufcarve.evaluate.tables import PERPLEXITY_BATCH
from ggufcarve.llama import child


def _progress(task: str, done: int, total: int) -> None:
    child.progress(task, done, total, "chunks" if task == CHUNK_TASK else "steps")


def _score(engine, request: Request, result: dict, span: tuple[int, int] | None = None) -> np.ndarray | None:
    """Score every chunk; the tokens scored, or None when the input is refused (`result["bad_input"]` says why).

    `span` (chunks scored before these, chunks in all) places the progress within several segments."""
    from ggufcarve.evaluate import kld
    from ggufcarve.evaluate.perplexity import (
        chunk_tokens,
        plan_chunks,
        read_text,
        scored_targets,
    )

    reference = kld.open_reference(Path(request.reference_in)) if request.reference_in else None
    if reference is not None:
        if reference.n_vocab != engine.n_vocab:
            result["bad_input"] = (
                f"the reference has a vocabulary of {reference.n_vocab} tokens, this model {engine.n_vocab}"
            )
            return None
        tokens = reference.tokens
        chunking = reference.chunking
        if request.max_chunks:
            chunking = type(chunking)(chunking.n_ctx, min(chunking.n_chunk, request.max_chunks))
    else:
        tokens = engine.tokenize(read_text(Path(request.text).read_bytes()))
        try:
            chunking = plan_chunks(len(tokens), request.n_ctx, request.max_chunks)
        except ValueError as err:
            result["bad_input"] = str(err)
            result["n_tokens"] = int(len(tokens))
            return None
    result.update(
        n_tokens=int(len(tokens)),
        n_ctx=chunking.n_ctx,
        n_chunk=chunking.n_chunk,
        add_bos=engine.add_bos,
        bos=engine.bos,
    )
    cache = base = None
    header = None
    if request.cache_out:
        header = kld.ReferenceHeader(
            n_ctx=chunking.n_ctx,
            n_vocab=engine.n_vocab,
            n_chunk=chunking.n_chunk,
            top_k=request.top_k,
            add_bos=engine.add_bos,
            bos=engine.bos,
            text_chunks=len(tokens) // chunking.n_ctx,
            tail_samples=request.tail_samples,
            **request.cache_identity,
        )
    sizes = {
        request.cache_out: header.file_bytes if header else 0,
        request.base_out: kld.base_file_bytes(chunking.n_ctx, engine.n_vocab, chunking.n_chunk)
        if request.base_out
        else 0,
    }
    short = _too_little_space({Path(k): v for k, v in sizes.items() if k})
    if short is not None:
        raise child.ShortOfSpace(short["path"], short["bytes"], short["free"])
    if header is not None:
        cache = kld.CacheWriter(Path(request.cache_out), header, tokens)
    if request.base_out:
        base = kld.BaseWriter(Path(request.base_out), chunking.n_ctx, engine.n_vocab, chunking.n_chunk, tokens)
    table_file = kld.DurableWriter(Path(request.table_out)) if request.table_out else None
    reference_chunks = reference.chunks(chunking.n_chunk) if reference is not None else None
    n_seq = max(1, PERPLEXITY_BATCH // chunking.n_ctx)
    context = engine.context(chunking.n_ctx, n_seq, min(PERPLEXITY_BATCH, n_seq * chunking.n_ctx))
    started = time.perf_counter()
    before, total = span or (0, chunking.n_chunk)
    try:
        _progress(CHUNK_TASK, before, total)
        for group in range(0, chunking.n_chunk, n_seq):
            indices = range(group, min(chunking.n_chunk, group + n_seq))
            group_logits = context.chunk_logits(
                [chunk_tokens(tokens, chunking, i, engine.add_bos, engine.bos) for i in indices], chunking.first
            )
            for index, logits in zip(indices, group_logits):
                _score_chunk(
                    index,
                    logits[: chunking.scored_per_chunk],
                    scored_targets(tokens, chunking, index),
                    request,
                    reference,
                    reference_chunks,
                    cache,
                    base,
                    table_file,
                )
                _progress(CHUNK_TASK, before + index + 1, total)
    finally:
        context.close()
        for writer in (cache, base):
            if writer is not None:
                writer.close()
        if table_file is not None:
            table_file.close()
    result["score_seconds"] = time.perf_counter() - started
    return tokens


def _score_segments(engine, request: Request, result: dict) -> np.ndarray | None:
    """Score each segment's reference file in turn into its own table (`_score`); result["segments"]
    holds each one's chunking, the top level their sums. The first segment's tokens, or None when
    one is refused."""
    from dataclasses import replace

    from ggufcarve.evaluate import kld

    counts = []
    for segment in request.segments or []:
        n_chunk = kld.open_reference(Path(segment["reference_in"])).n_chunk
        counts.append(min(n_chunk, request.max_chunks) if request.max_chunks else n_chunk)
    result["segments"] = []
    first = None
    for number, segment in enumerate(request.segments or []):
        part: dict = {}
        tokens = _score(
            engine,
            replace(request, reference_in=segment["reference_in"], table_out=segment["table_out"], segments=None),
            part,
            (sum(counts[:number]), sum(counts)),
        )
        result["segments"].append(part)
        if tokens is None:
            result["bad_input"] = part["bad_input"]
            return None
        first = tokens if first is None else first
    parts = result["segments"]
    result.update(
        n_tokens=sum(p["n_tokens"] for p in parts),
        n_ctx=parts[0]["n_ctx"],
        n_chunk=sum(p["n_chunk"] for p in parts),
        add_bos=parts[0]["add_bos"],
        bos=parts[0]["bos"],
        score_seconds=sum(p["score_seconds"] for p in parts),
    )
    return first


def _too_little_space(sizes: dict[Path, int]) -> dict | None:
    """The first file system that cannot hold the reference files to be written there (path, bytes needed, bytes
    free), or None."""
    import shutil

    by_device: dict[int, tuple[Path, int]] = {}
    for path, size in sizes.items():
        device = os.stat(path.parent).st_dev
        first, total = by_device.get(device, (path, 0))
        by_device[device] = (first, total + size)
    for path, total in by_device.values():
        free = shutil.disk_usage(path.parent).free
        if free < total:
            return {"path": str(path), "bytes": total, "free": free}
    return None


def _score_chunk(
    index: int,
    logits: np.ndarray,
    targets: np.ndarray,
    request: Request,
    reference,
    reference_chunks,
    cache,
    base,
    table_file,
) -> None:
    """One chunk's scored logits: the reference files it writes, its per-token table against the reference."""
    from ggufcarve.evaluate import kld

    if base is not None:
        base.write(logits)
    if reference_chunks is None and cache is None and table_file is None:
        return  # the base file is all this pass writes
    if reference_chunks is not None:
        records = next(reference_chunks)
        table = (
            kld.compare_topk(logits, targets, records)
            if reference.kind == "topk"
            else kld.compare_base(logits, targets, records)
        )
    else:
        logprobs = kld.log_softmax(logits)
        if cache is not None:
            rng = np.random.default_rng([kld.TAIL_SEED, index])
            cache.write(kld.topk_records(logprobs, targets, request.top_k, request.tail_samples, rng))
        table = np.zeros((len(targets), kld.TOKEN_COLUMNS))
        table[:, kld.NLL] = -logprobs[np.arange(len(targets)), targets]
        table[:, kld.NLL_BASE] = table[:, kld.NLL]
        table[:, kld.SAME_TOP] = 1.0
    if table_file is not None:
        table_file.write_bytes(np.ascontiguousarray(table, dtype="<f8").tobytes())


def _evaluate(request: Request, out: Path) -> None:
    from ggufcarve.errors import ToolFailed
    from ggufcarve.evaluate.engine import Engine, EngineError

    result: dict = {}
    try:
        started = time.perf_counter()
        engine = Engine(request.model, request.compute, request.TASK)
        result["load_seconds"] = time.perf_counter() - started
        result["n_vocab"] = engine.n_vocab
        tokens = None
        if request.segments:
            tokens = _score_segments(engine, request, result)
        elif request.text or request.reference_in:
            tokens = _score(engine, request, result)
        if "bad_input" not in result and request.speed is not None and request.compute.offloads:
            from ggufcarve.llama.devices import offload_devices

            if not offload_devices(request.compute.rpc):
                result["bad_input"] = (
                    f"this llama-cpp-python has no GPU or RPC device, so --gpu-layers {request.compute.gpu_layers} "
                    "would time the CPU"
                )
                result["bad_input_hint"] = (
                    "install llama-cpp-python with a GPU backend (docs/gpus.md), or --gpu-layers 0"
                )
        if "bad_input" not in result and request.speed is not None:
            from ggufcarve.evaluate.speed import SpeedSettings, measure

            settings = SpeedSettings(**request.speed)
            prompt = tokens if tokens is not None and len(tokens) else np.arange(3, engine.n_vocab, dtype=np.int32)
            context = engine.context(max(settings.pp_tokens, settings.tg_tokens + 1))
            try:
                result["speed"] = measure(context, settings, prompt, engine.threads).to_json()
            finally:
                context.close()
        if "bad_input" not in result and request.qa:
            from ggufcarve.evaluate.qa import run_checks

            result["qa"] = run_checks(engine, request.qa, lambda done, total: _progress(QA_TASK, done, total))
        if "bad_input" not in result and request.loops:
            from ggufcarve.evaluate.loops import run_loops

            result["loops"] = run_loops(
                engine,
                request.loops["prompts"],
                request.loops["tokens"],
                lambda done, total: _progress(LOOP_TASK, done, total),
            )
        engine.close()
    except EngineError as err:
        raise ToolFailed(
            f"{Path(request.model).name}: {err}", "check that llama.cpp loads the model (ggufcarve inspect)"
        ) from None
    _write_result(out, result)


def main(argv: list[str] | None = None) -> int:
    return child.serve(Request, _evaluate, argv)


def _write_result(path: Path, result: dict) -> None:
    """The result JSON under this process's temp name, renamed into place."""
    from ggufcarve.fileio import temp_path_for

    temp = temp_path_for(path)
    try:
        try:
            temp.write_text(json.dumps(result, sort_keys=True))
        except OSError as err:
            raise OSError(err.errno, err.strerror, str(path)) from None
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


if __name__ == "__main__":
    child.exit_now(main())
