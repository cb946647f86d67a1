"""Evaluate models against one reference: the cached reference log-probs, one child per model, per-model JSON, gate.

The reference is a GGUF model (its log-probs on the held-out text are computed once and cached in
`<cache>/reference-logprobs/`, keyed by the reference's sha256, the text's sha256 and the context:
by default as llama-perplexity's `--kl-divergence-base` file, with a JSON beside it naming what it
holds; with the "topk" store as a top-k cache), a top-k cache file, or a llama-perplexity
`--kl-divergence-base` file (its tokens are scored; no held-out text needed). Each model is loaded
once in a child process that scores every chunk against the reference, measures speed and answers
the QA checks.

Several held-out files are segments: each is scored against its own reference log-probs (cached
per text), chunked on its own (the chunk limit applies per file) and reported as its own record
(`segments`, in the order given); the overall statistics are those of the segments' per-token
tables concatenated, as llama-perplexity computes them over the chunks of all the texts.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ggufcarve import __version__
from ggufcarve.errors import BadInput
from ggufcarve.evaluate import kld
from ggufcarve.evaluate.models import ModelEntry, read_entry
from ggufcarve.evaluate.perplexity import Perplexity, perplexity, read_text
from ggufcarve.evaluate.protocol import REFERENCE_STORES, REFERENCE_TOPK, EvalSettings, Reference, Request
from ggufcarve.evaluate.spawn import run_child
from ggufcarve.events import Event, Sink, ignore
from ggufcarve.llama.tools import find_tool, require_tool

RESULT_SCHEMA_VERSION = 1
GGUF_MAGIC = b"GGUF"


@dataclass
class EvalRun:
    results: list[dict]
    reference: Reference
    out_dir: Path
    files: list[Path] = field(default_factory=list)


@dataclass(frozen=True)
class Segment:
    """One held-out file scored on its own: the file's record (name, bytes, sha256) and its reference log-probs."""

    heldout: dict
    reference: Reference


# a segment record's figures beyond `kld.SEGMENT_KEYS`, under the per-model contract's names
SEGMENT_EXTRA = (
    "ppl_stderr",
    "ppl_reference",
    "ppl_delta_percent",
    "kld_median",
    "kld_p99",
    "kld_max",
    "kld_tail_stderr",
    "rms_dp",
)


def heldout_files(heldout: Path | Sequence[Path] | None) -> list[Path]:
    """The held-out files as a list: none, one path, or several."""
    if heldout is None:
        return []
    if isinstance(heldout, (str, os.PathLike)):
        return [Path(heldout)]
    return [Path(p) for p in heldout]


def _sha256_of(entry: ModelEntry, sink: Sink) -> str:
    """One digest naming a model: its file's sha256, or for a split set the sha256 of the shards' digests in order."""
    from ggufcarve.events import Counter
    from ggufcarve.fileio import sha256_file_cached

    counter = Counter(sink, f"hash {entry.name}", entry.bytes, "bytes")
    digests = [sha256_file_cached(p, counter) for p in entry.files]
    return digests[0] if len(digests) == 1 else hashlib.sha256(",".join(digests).encode()).hexdigest()


def _reference_input(path: Path) -> str:
    with open(path, "rb") as f:
        magic = f.read(4)
    return "gguf" if magic == GGUF_MAGIC else "file"


def _cache_path(cache_dir: Path, ref_sha: str, text_sha: str, settings: EvalSettings) -> Path:
    """Where the reference's log-probs on a text are cached: a base file (full store) or a top-k cache."""
    stem = f"{ref_sha[:16]}-{text_sha[:16]}-ctx{settings.ctx}"
    if settings.reference_store == REFERENCE_TOPK:
        return cache_dir / f"{stem}-top{settings.top_k}-tail{settings.tail_samples}.reflogp"
    return cache_dir / f"{stem}.kld"


def _identity_path(cache: Path) -> Path:
    """The JSON beside a cached base file naming what it holds (a base file has no room for it)."""
    return cache.with_name(cache.name + ".json")


def _cached(cache: Path, ref_sha: str, text_sha: str, settings: EvalSettings) -> kld.ReferenceFile | None:
    """The cached reference when it is complete and of this reference, text and context, holding the chunks this run
    scores."""
    try:
        opened = kld.open_reference(cache)
        if opened.header is not None:
            identity = {
                "reference_sha256": opened.header.reference_sha256,
                "text_sha256": opened.header.text_sha256,
                "text_chunks": opened.header.text_chunks,
                "tail_samples": opened.header.tail_samples,
            }
        else:
            identity = json.loads(_identity_path(cache).read_text())
            if (
                not isinstance(identity, dict)
                or identity.get("n_chunk") != opened.n_chunk
                or identity.get("n_ctx") != opened.n_ctx
            ):
                return None
    except (OSError, ValueError):
        return None  # absent, a dead run's or another version's: computed afresh
    text_chunks = identity.get("text_chunks")
    if not isinstance(text_chunks, int) or opened.n_ctx != settings.ctx:
        return None
    wanted = min(settings.chunks or text_chunks, text_chunks)
    same = (
        identity.get("reference_sha256") == ref_sha
        and identity.get("text_sha256") == text_sha
        and opened.n_chunk >= wanted
    )
    if settings.reference_store == REFERENCE_TOPK and identity.get("tail_samples") != settings.tail_samples:
        return None
    return opened if same else None


def _text_sha256(heldout: Path) -> str:
    try:
        return hashlib.sha256(read_text(heldout.read_bytes())).hexdigest()
    except OSError as err:
        raise BadInput(f"{heldout}: cannot read the held-out text ({err.strerror})", "give a plain text file") from None


def reference_cache_dir(settings: EvalSettings) -> Path:
    """Where the reference's log-probs are cached."""
    from ggufcarve.fileio import cache_root

    return settings.cache_dir or cache_root() / "reference-logprobs"


def reference_disk_bytes(
    reference: Path,
    heldout: Path | Sequence[Path] | None,
    settings: EvalSettings,
    sink: Sink = ignore,
    *,
    hash_reference: bool = True,
) -> int:
    """At most the bytes the reference's log-probs take on disk in this run (0 when they are cached or given as a file),
    summed over the held-out files (one cache each)."""
    return sum(
        _reference_disk_bytes(reference, path, settings, sink, hash_reference=hash_reference)
        for path in heldout_files(heldout)
    )


def _reference_disk_bytes(
    reference: Path, heldout: Path | None, settings: EvalSettings, sink: Sink = ignore, *, hash_reference: bool = True
) -> int:
    """reference_disk_bytes of one held-out file.

    Without `hash_reference` (a dry run) the reference is not read to learn its sha256: a cache is
    found only when the digest is already known, otherwise the cache's full size is counted.

    The cache (and `--save-kl-base`) of a GGUF reference: llama-perplexity's base file, or the top-k
    cache. The held-out text is tokenized only by the run, so its chunk count is bounded here by
    the text's bytes: a token of llama.cpp's tokenizers spells at least one byte of the text,
    apart from a BOS and a leading-space marker.
    """
    if not reference.is_file() or _reference_input(reference) != "gguf" or heldout is None:
        return 0
    entry = read_entry(reference)
    try:
        n_tokens = len(read_text(heldout.read_bytes())) + 2
    except OSError as err:
        raise BadInput(f"{heldout}: cannot read the held-out text ({err.strerror})", "give a plain text file") from None
    n_chunk = n_tokens // settings.ctx
    if settings.chunks:
        n_chunk = min(n_chunk, settings.chunks)
    if n_chunk < 1:
        return 0
    base = kld.base_file_bytes(settings.ctx, entry.n_vocab, n_chunk)
    if hash_reference:
        ref_sha: str | None = _sha256_of(entry, sink)
    else:
        from ggufcarve.fileio import cached_sha256

        digests = [cached_sha256(p) for p in entry.files]
        ref_sha = (
            None
            if None in digests
            else digests[0]
            if len(digests) == 1
            else hashlib.sha256(",".join(map(str, digests)).encode()).hexdigest()
        )
    text_sha = _text_sha256(heldout)
    cache = _cache_path(reference_cache_dir(settings), ref_sha or "0" * 64, text_sha, settings)
    if settings.reference_store == REFERENCE_TOPK:
        header = kld.ReferenceHeader(
            "0" * 64,
            "0" * 64,
            settings.ctx,
            entry.n_vocab,
            n_chunk,
            settings.top_k,
            False,
            0,
            n_chunk,
            settings.tail_samples,
        )
        cache_bytes = header.file_bytes
    else:
        cache_bytes = base
    cached = ref_sha is not None and _cached(cache, ref_sha, text_sha, settings) is not None
    return (0 if cached else cache_bytes) + (base if settings.kl_base_out is not None else 0)


def check_room(path: Path, needed: int, elsewhere: str) -> None:
    """One-line OutputError when the file system of `path` has fewer than `needed` bytes free."""
    import shutil

    from ggufcarve.errors import OutputError

    free = shutil.disk_usage(path.parent).free
    if free < needed:
        raise OutputError(
            f"{path.name} needs {needed / 2**20:.1f} MiB but {path.parent} has {free / 2**20:.1f} MiB free",
            f"free disk space or {elsewhere}; nothing was written",
        )


def _save_base(opened: kld.ReferenceFile, n_chunk: int, path: Path) -> None:
    """--save-kl-base from a cached base file: its first n_chunk chunks, under a temp name renamed into place."""
    from ggufcarve.fileio import atomic_file

    path.parent.mkdir(parents=True, exist_ok=True)
    check_room(path, kld.base_file_bytes(opened.n_ctx, opened.n_vocab, n_chunk), "choose another --save-kl-base path")
    with atomic_file(path, "choose another --save-kl-base path") as temp:
        kld.copy_base(opened, temp, n_chunk)


def prepare_reference(
    path: Path, heldout: Path | None, settings: EvalSettings, work: Path, sink: Sink = ignore
) -> Reference:
    """The reference file the children compare with: a given top-k cache or base file, or the cached log-probs of a
    GGUF reference.

    A GGUF reference's log-probs are kept as llama-perplexity's base file (every token, the default)
    or, with `settings.reference_store` "topk", as a top-k cache.
    """
    from ggufcarve.fileio import atomic_file, remove_dead_temps, temp_path_for

    if settings.reference_store not in REFERENCE_STORES:
        raise BadInput(
            f"reference store {settings.reference_store!r}: not one of {', '.join(REFERENCE_STORES)}",
            "full keeps every token's log-prob as llama-perplexity does",
        )
    if not path.is_file():
        raise BadInput(
            f"{path}: no such reference file",
            "give the unpruned model (GGUF), a top-k cache or a llama-perplexity --kl-divergence-base file",
        )
    if _reference_input(path) == "file":
        if settings.kl_base_out is not None:
            raise BadInput(
                "--save-kl-base writes the log-probs of a GGUF reference",
                "give the reference model itself as --reference",
            )
        try:
            opened = kld.open_reference(path)
        except ValueError as err:
            raise BadInput(
                str(err), "give the unpruned model (GGUF) or a file written by llama-perplexity --kl-divergence-base"
            ) from None
        from ggufcarve.fileio import sha256_file_cached

        digest = opened.header.reference_sha256 if opened.header else sha256_file_cached(path)
        return Reference(
            path.name,
            opened.kind,
            digest,
            path,
            top_k=opened.header.top_k if opened.header else None,
            tail_samples=opened.header.tail_samples if opened.header else 0,
        )
    entry = read_entry(path)
    if heldout is None:
        raise BadInput(
            "--heldout is needed with a GGUF reference",
            "give a held-out text file, or a llama-perplexity --kl-divergence-base file as --reference",
        )
    text_sha = _text_sha256(heldout)
    ref_sha = _sha256_of(entry, sink)
    topk = settings.reference_store == REFERENCE_TOPK
    cache_dir = reference_cache_dir(settings)
    cache_dir.mkdir(parents=True, exist_ok=True)
    cache = _cache_path(cache_dir, ref_sha, text_sha, settings)
    store = {"top_k": settings.top_k, "tail_samples": settings.tail_samples} if topk else {}
    opened = _cached(cache, ref_sha, text_sha, settings)
    if opened is not None and (settings.kl_base_out is None or not topk):
        if settings.kl_base_out is not None:
            text_chunks = json.loads(_identity_path(cache).read_text())["text_chunks"]
            _save_base(opened, min(settings.chunks or text_chunks, text_chunks), settings.kl_base_out)
        return Reference(entry.name, "gguf", ref_sha, cache, entry, cached=True, **store)
    started = time.monotonic()
    # The child writes the cache (and the base file) under this process's temp names; they are
    # renamed into place only once it succeeded (it fsyncs them first), so a cache under its final
    # name is always complete, and a stopped or failed run leaves none. A cached base file counts
    # only with the JSON naming it, written after it.
    remove_dead_temps(cache_dir, cache.name.__eq__)
    temp = temp_path_for(cache)
    request = Request(
        model=str(entry.path),
        threads=settings.threads,
        gpu_layers=settings.gpu_layers,
        n_ctx=settings.ctx,
        result_out=str(work / "reference.result.json"),
        text=str(heldout),
        max_chunks=settings.chunks,
        top_k=settings.top_k,
        tail_samples=settings.tail_samples,
        cache_identity={"reference_sha256": ref_sha, "text_sha256": text_sha},
    )
    if topk:
        request.cache_out = str(temp)
    else:
        request.base_out = str(temp)
    outputs = {str(temp): (cache, "choose another --cache directory")}
    base_temp = None
    if settings.kl_base_out is not None and topk:
        settings.kl_base_out.parent.mkdir(parents=True, exist_ok=True)
        remove_dead_temps(settings.kl_base_out.parent, settings.kl_base_out.name.__eq__)
        base_temp = temp_path_for(settings.kl_base_out)
        request.base_out = str(base_temp)
        outputs[str(base_temp)] = (settings.kl_base_out, "choose another --save-kl-base path")
    try:
        result = run_child(request, f"reference {entry.name}", sink, work, outputs)
        if "bad_input" in result:
            raise BadInput(f"{heldout}: {result['bad_input']}", "give a longer --heldout text or a smaller --ctx")
        if not topk:
            _identity_path(cache).unlink(missing_ok=True)
        os.replace(temp, cache)
        if base_temp is not None:
            os.replace(base_temp, settings.kl_base_out)
    finally:
        temp.unlink(missing_ok=True)
        if base_temp is not None:
            base_temp.unlink(missing_ok=True)
    if not topk:
        identity = {
            "reference_sha256": ref_sha,
            "text_sha256": text_sha,
            "n_ctx": result["n_ctx"],
            "n_chunk": result["n_chunk"],
            "text_chunks": result["n_tokens"] // result["n_ctx"],
        }
        with atomic_file(_identity_path(cache), "choose another --cache directory") as identity_temp:
            identity_temp.write_text(json.dumps(identity, sort_keys=True) + "\n")
        if settings.kl_base_out is not None:
            _save_base(kld.open_reference(cache), result["n_chunk"], settings.kl_base_out)
    return Reference(entry.name, "gguf", ref_sha, cache, entry, seconds=time.monotonic() - started, **store)


def prepare_segments(
    path: Path, heldout: Path | Sequence[Path] | None, settings: EvalSettings, work: Path, sink: Sink = ignore
) -> tuple[Reference, list[Segment]]:
    """The reference (`prepare_reference`) and, with several held-out files, one Segment per file
    with its own reference log-probs (none with one file); the Reference returned then names them
    all: cached when every one was, the seconds spent on all. Pass both to `evaluate_model`."""
    files = heldout_files(heldout)
    _check_segments(files, path, settings)
    if len(files) < 2:
        return prepare_reference(path, files[0] if files else None, settings, work, sink), []
    segments = [Segment(_heldout_record(file), prepare_reference(path, file, settings, work, sink)) for file in files]
    joined = replace(
        segments[0].reference,
        cached=all(s.reference.cached for s in segments),
        seconds=sum(s.reference.seconds for s in segments),
    )
    return joined, segments


def check_vocabularies(
    models: list[ModelEntry], reference: ModelEntry | None, reference_file: Path | None = None
) -> None:
    """Every model must share the reference's vocabulary: KL divergence compares distributions over the same tokens."""
    n_vocab = kld.open_reference(reference_file).n_vocab if reference is None and reference_file is not None else None
    for entry in models:
        if reference is not None and entry.vocab_sha256 != reference.vocab_sha256:
            raise BadInput(
                f"{entry.path.name}: its vocabulary ({entry.n_vocab} tokens) differs "
                f"from the reference {reference.path.name}'s ({reference.n_vocab} tokens)",
                "compare models of one family: quants and pruned versions of the reference",
            )
        if n_vocab is not None and entry.n_vocab != n_vocab:
            raise BadInput(
                f"{entry.path.name}: its vocabulary has {entry.n_vocab} "
                f"tokens, the reference file {reference_file.name} {n_vocab}",
                "compare models of the reference's family",
            )


KLD_METHODS = {
    "base-file": "llama-perplexity's: every token's log-prob from its 16-bit --kl-divergence-base file",
    "topk-exact": "exact: the top-k cache holds every token",
    "topk-sampled-tail": "top-k log-probs exact, the tail's part estimated "
    "from sampled tail tokens (unbiased; kld_tail_stderr)",
    "topk-lower-bound": "top-k log-probs and the tail as one outcome: a lower bound",
}


def _memory(path: Path, n_ctx: int, settings: EvalSettings) -> dict[str, Any]:
    """What llama.cpp allocates to run the model as it was evaluated (its context of `n_ctx`
    tokens, an f16 cache), from its own dry load (llama.memory): one object per device."""
    from ggufcarve.llama.memory import MemorySettings, measure_memory

    memory = measure_memory(path, MemorySettings(n_ctx, gpu_layers=settings.gpu_layers))
    return {
        "memory": [memory.to_json()],
        "memory_settings": {
            "n_ctx": n_ctx,
            "kv_type": "f16",
            "n_batch": 2048,
            "n_ubatch": 512,
            "gpu_layers": settings.gpu_layers,
        },
    }


def kld_method(reference: Reference, n_vocab: int) -> str:
    """How the KLD against this reference is computed (KLD_METHODS)."""
    if reference.top_k is None:
        return "base-file"
    if reference.top_k >= n_vocab:
        return "topk-exact"
    return "topk-sampled-tail" if reference.tail_samples > 1 else "topk-lower-bound"


def _contract(
    stats: kld.KldStatistics,
    ppl: Perplexity,
    ppl_reference: Perplexity,
    qa: dict | None,
    speed: dict | None,
    method: str,
) -> dict:
    """The per-model figures under their contract names."""
    return {
        "ppl": ppl.ppl,
        "ppl_stderr": ppl.ppl_stderr,
        "ppl_reference": ppl_reference.ppl,
        "ppl_delta_percent": 100.0 * (ppl.ppl / ppl_reference.ppl - 1.0),
        "kld_mean": stats.kld_mean,
        "kld_mean_stderr": stats.kld_mean_stderr,
        "kld_median": stats.kld["median"],
        "kld_p99": stats.kld["p99"],
        "kld_p999": stats.kld["p999"],
        "kld_max": stats.kld["max"],
        "kld_method": method,
        "kld_tail_stderr": stats.kld_tail_stderr,
        "kld_bound": 0.0 if method in ("base-file", "topk-exact") else None,  # no bound is given for an estimate
        "same_top_p": stats.same_top_p,
        "rms_dp": stats.rms_dp,
        "qa_passed": qa["passed"] if qa else None,
        "qa_total": qa["total"] if qa else None,
        "qa_exact_vs_reference": qa.get("exact_vs_reference") if qa else None,
        "pp_tok_s": speed["pp_tok_s"] if speed else None,
        "tg_tok_s": speed["tg_tok_s"] if speed else None,
        **_spreads(speed),
    }


def _spreads(speed: dict | None) -> dict:
    """pp_tok_s_spread and tg_tok_s_spread ((max - min) / median of the timed runs; None with one run)
    and speed_noisy (either above NOISY_SPREAD; None when not measured)."""
    from ggufcarve.evaluate.speed import NOISY_SPREAD, spread

    if not speed:
        return {"pp_tok_s_spread": None, "tg_tok_s_spread": None, "speed_noisy": None}
    pp, tg = spread(speed.get("pp_runs") or []), spread(speed.get("tg_runs") or [])
    return {
        "pp_tok_s_spread": pp,
        "tg_tok_s_spread": tg,
        "speed_noisy": any(x is not None and x > NOISY_SPREAD for x in (pp, tg)),
    }


def evaluate_model(
    entry: ModelEntry,
    reference: Reference,
    settings: EvalSettings,
    work: Path,
    sink: Sink = ignore,
    reference_qa: list[dict] | None = None,
    segments: Sequence[Segment] | None = None,
    reference_loops: list[dict] | None = None,
) -> dict:
    """Score one model against the reference (and time it, ask it the QA checks, continue the loop
    prompts): the per-model result document.

    With `segments` each is scored against its own reference (`reference` then names them all) and
    reported under "segments"; the overall figures are those of their tables concatenated."""

    started = time.monotonic()
    if segments:
        table_paths = [work / f"{entry.name}.segment{number}.tokens.f64" for number in range(len(segments))]
        parts = [
            {"reference_in": str(s.reference.file), "table_out": str(path)} for s, path in zip(segments, table_paths)
        ]
    else:
        table_paths, parts = [work / f"{entry.name}.tokens.f64"], None
    bench = None
    if settings.speed is not None and settings.speed.engine != "libllama":
        bench = (
            find_tool("llama-bench", settings.llama_cpp_dir)
            if settings.speed.engine == "auto"
            else require_tool("llama-bench", settings.llama_cpp_dir)
        )
    request = Request(
        model=str(entry.path),
        threads=settings.threads,
        gpu_layers=settings.gpu_layers,
        n_ctx=settings.ctx,
        result_out=str(work / f"{entry.name}.result.json"),
        reference_in=None if parts else str(reference.file),
        max_chunks=settings.chunks,
        table_out=None if parts else str(table_paths[0]),
        speed=asdict(settings.speed) if settings.speed and bench is None else None,
        qa=settings.qa_checks,
        segments=parts,
        loops=settings.loops.request() if settings.loops else None,
    )
    result = run_child(request, entry.name, sink, work)
    if bench is not None and settings.speed is not None and "bad_input" not in result:
        from ggufcarve.evaluate.speed import bench_speed

        sink(Event(entry.name, 0, 0, "chunks", "llama-bench"))
        result["speed"] = bench_speed(
            bench, entry.path, settings.speed, settings.threads, settings.gpu_layers
        ).to_json()
    if "bad_input" in result:
        raise BadInput(f"{entry.path.name}: {result['bad_input']}", "compare models of the reference's family")
    tables = []
    for path in table_paths:
        tables.append(np.fromfile(path, dtype="<f8").reshape(-1, kld.TOKEN_COLUMNS))
        path.unlink()
    _cache_tables(entry, reference, segments, tables, result, settings)
    table = tables[0] if len(tables) == 1 else np.concatenate(tables)
    stats = kld.kld_statistics(table)
    method = kld_method(reference, entry.n_vocab)
    ppl = perplexity(table[:, kld.NLL])
    qa = None
    if settings.qa_checks is not None and "qa" in result:
        from ggufcarve.evaluate.qa import summarize

        qa = summarize(settings.qa_checks, result["qa"], reference_qa)
    doc = {
        "schema_version": RESULT_SCHEMA_VERSION,
        "tool": {"name": "ggufcarve", "version": __version__},
        "model": {
            "name": entry.name,
            "file": entry.path.name,
            "files": [{"name": p.name, "bytes": p.stat().st_size} for p in entry.files],
            "bytes": entry.bytes,
            "gib": round(entry.gib, 4),
            "quant": entry.quant,
            "family": entry.family,
            "architecture": entry.architecture,
            "expert_count": entry.expert_count,
            "source_expert_count": entry.source_expert_count,
            "pruned": entry.pruned,
        },
        "reference": {
            "name": reference.label,
            "kind": reference.kind,
            "sha256": reference.sha256,
            "log_probs_cached": reference.cached,
            "log_probs_seconds": round(reference.seconds, 3),
        },
        "parameters": {
            "ctx": result["n_ctx"],
            "chunks": result["n_chunk"],
            "scored_tokens": stats.count,
            "threads": settings.threads,
            "top_k": reference.top_k,
            "tail_samples": reference.tail_samples if reference.top_k is not None else None,
            "kld_full_vocabulary": method in ("base-file", "topk-exact"),
        },
        **_contract(stats, ppl, perplexity(table[:, kld.NLL_BASE]), qa, result.get("speed"), method),
        "kl_divergence": stats.to_json(),
        **_memory(entry.path, result["n_ctx"], settings),
        "speed": result.get("speed"),
        "qa": qa,
        "timings": {
            "load_seconds": round(result.get("load_seconds", 0.0), 3),
            "score_seconds": round(result.get("score_seconds", 0.0), 3),
            "total_seconds": round(time.monotonic() - started, 3),
        },
    }
    doc.update(_loop_figures(result, settings, reference_loops))
    verdict = settings.gate.judge(doc) if settings.gate else None
    doc["gate"] = verdict.verdict if verdict else None
    doc["gate_failed"] = verdict.failed if verdict else []
    doc["gate_not_measured"] = verdict.not_measured if verdict else []
    doc["gate_thresholds"] = dict(settings.gate.thresholds) if settings.gate else None
    doc["gate_source"] = settings.gate.source if settings.gate else None
    if segments:
        doc["segments"] = [
            _segment_record(s.heldout["name"], t, part["n_chunk"], method)
            for s, t, part in zip(segments, tables, result["segments"])
        ]
        _judge_segments(doc, settings.gate)
    return doc


def _cache_tables(
    entry: ModelEntry,
    reference: Reference,
    segments: Sequence[Segment] | None,
    tables: list[np.ndarray],
    result: dict,
    settings: EvalSettings,
) -> None:
    """Each held-out file's table into the content-keyed cache of the measurement layer
    (`evaluate.tables`), when the model's sha256 is known already (a hash is not computed for it)."""
    from ggufcarve.evaluate.tables import reference_identity, store_file_tables, table_cache
    from ggufcarve.fileio import cached_sha256

    digest = cached_sha256(entry.path) if len(entry.files) == 1 else None
    if digest is None:
        return
    parts = result["segments"] if segments else [result]
    references = [s.reference for s in segments] if segments else [reference]
    for ref, table, part in zip(references, tables, parts):
        store_file_tables(
            table_cache(),
            digest,
            reference_identity(ref.sha256, ref.file),
            part["n_ctx"],
            table,
            part["n_chunk"],
            settings.threads,
            settings.gpu_layers,
        )


def _segment_record(name: str, table: np.ndarray, chunks: int, method: str) -> dict:
    """One segment's record: `kld.segment_statistics` (the shape tune and best share), its chunks and SEGMENT_EXTRA."""
    stats = kld.kld_statistics(table)
    figures = _contract(stats, perplexity(table[:, kld.NLL]), perplexity(table[:, kld.NLL_BASE]), None, None, method)
    return {**kld.segment_statistics(name, table), "chunks": chunks, **{key: figures[key] for key in SEGMENT_EXTRA}}


def _judge_segments(doc: dict, gate) -> None:
    """Each segment's own verdict (gate, gate_failed); with the gate's segments "every" a failed segment fails the
    model."""
    if gate is None:
        return
    for record in doc["segments"]:
        verdict = gate.judge(record)
        record["gate"], record["gate_failed"] = verdict.verdict, verdict.failed
    doc["gate_segments"] = gate.segments
    failed = [f"{r['name']}: {f}" for r in doc["segments"] for f in r["gate_failed"]]
    if gate.segments == "every" and failed:
        doc["gate"] = "FAIL"
        doc["gate_failed"] = [*doc["gate_failed"], *failed]


def reference_outputs(entry: ModelEntry, settings: EvalSettings, work: Path, sink: Sink) -> list[dict]:
    """The reference model's answers to the QA checks, the yardstick of exact-output agreement."""
    return reference_answers(entry, settings, work, sink).get("qa", [])


def reference_answers(entry: ModelEntry, settings: EvalSettings, work: Path, sink: Sink) -> dict:
    """The reference model's QA answers ("qa") and loop continuations ("loops"), from one load."""
    request = Request(
        model=str(entry.path),
        threads=settings.threads,
        gpu_layers=settings.gpu_layers,
        n_ctx=settings.ctx,
        result_out=str(work / "reference-qa.result.json"),
        qa=settings.qa_checks,
        loops=settings.loops.request() if settings.loops else None,
    )
    return run_child(request, f"reference {entry.name}", sink, work)


def _loop_figures(result: dict, settings: EvalSettings, reference_loops: list[dict] | None) -> dict:
    """loop_share, loop_share_reference and the loop record (ggufcarve.evaluate.loops); all None without --loops."""
    if settings.loops is None or "loops" not in result:
        return {"loop_share": None, "loop_share_reference": None, "loops": None}
    from ggufcarve.evaluate.loops import summarize_loops

    record = summarize_loops(result["loops"], settings.loops, reference_loops)
    return {"loop_share": record["share"], "loop_share_reference": record["reference_share"], "loops": record}


def result_text(doc: dict) -> str:
    """A per-model result document as written: indented JSON, keys sorted, no NaN."""
    return json.dumps(doc, indent=1, sort_keys=True, allow_nan=False) + "\n"


def _heldout_record(heldout: Path | None) -> dict | None:
    """The held-out text file as the results record it (name, bytes, sha256); None with a reference file."""
    if heldout is None:
        return None
    from ggufcarve.fileio import sha256_file_cached

    return {"name": heldout.name, "bytes": heldout.stat().st_size, "sha256": sha256_file_cached(heldout)}


def evaluate(
    models: list[ModelEntry],
    reference_path: Path,
    heldout: Path | Sequence[Path] | None,
    settings: EvalSettings,
    out_dir: Path,
    sink: Sink = ignore,
) -> EvalRun:
    """Evaluate every model against the reference; write DIR/<name>.json per model, DIR/summary.md and the charts.

    `heldout`: one file, or several (segments: module docstring).

    The files are written together once every model is done, each under its temp name, fsynced and
    renamed (summary.md last): a run that fails or is stopped part way leaves none of them, and
    removes the directories it created that are left empty (never one that existed before).
    """
    from ggufcarve.fileio import cache_root

    # directories this run creates: on failure those left empty are removed (deepest first)
    made = _missing_dirs(
        [
            out_dir,
            settings.cache_dir or cache_root() / "reference-logprobs",
            *([settings.kl_base_out.parent] if settings.kl_base_out is not None else []),
        ]
    )
    try:
        return _evaluate(models, reference_path, heldout, settings, out_dir, sink)
    except BaseException:
        for directory in made:
            try:
                directory.rmdir()  # only when empty
            except OSError:
                pass
        raise


def _missing_dirs(paths: list[Path]) -> list[Path]:
    """The directories among `paths` and their parents that do not exist yet, deepest first."""
    missing: set[Path] = set()
    for path in paths:
        path = path.absolute()
        while not path.exists() and path != path.parent:
            missing.add(path)
            path = path.parent
    return sorted(missing, key=lambda p: len(p.parts), reverse=True)


def _check_segments(files: list[Path], reference_path: Path, settings: EvalSettings) -> None:
    """Several held-out files need a GGUF reference (a reference file holds one text's log-probs) and distinct names."""
    if len(files) < 2:
        return
    if reference_path.is_file() and _reference_input(reference_path) != "gguf":
        raise BadInput(
            f"{reference_path.name} holds the log-probs of one text, and {len(files)} held-out files are given",
            "give the reference model (GGUF) as --reference, or one --heldout",
        )
    if settings.kl_base_out is not None:
        raise BadInput(
            f"--save-kl-base writes one text's log-probs, and {len(files)} held-out files are given",
            "give one --heldout with --save-kl-base",
        )
    names = [p.name for p in files]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise BadInput(
            f"two held-out files are named {twice}: each names its segment", "give the held-out files distinct names"
        )


def _evaluate(
    models: list[ModelEntry],
    reference_path: Path,
    heldout: Path | Sequence[Path] | None,
    settings: EvalSettings,
    out_dir: Path,
    sink: Sink,
) -> EvalRun:
    from ggufcarve.evaluate.summary import load_charting, write_summary
    from ggufcarve.fileio import atomic_file

    files = heldout_files(heldout)
    _check_segments(files, reference_path, settings)
    out_dir.mkdir(parents=True, exist_ok=True)
    # matplotlib (about 0.5 s to import) loads while the libllama children run; the charts need it last
    threading.Thread(target=load_charting, name="ggufcarve-import-charts", daemon=True).start()
    with tempfile.TemporaryDirectory(prefix="ggufcarve-eval-") as tmp:  # requests, results, per-token tables
        work = Path(tmp)
        if reference_path.is_file() and _reference_input(reference_path) == "gguf":
            check_vocabularies(models, read_entry(reference_path))  # before the reference pass, which can take long
        reference, segments = prepare_segments(reference_path, files, settings, work, sink)
        check_vocabularies(models, reference.entry, reference.file)
        reference_qa = reference_loops = None
        if (settings.qa_checks is not None or settings.loops is not None) and reference.entry is not None:
            answers = reference_answers(reference.entry, settings, work, sink)
            reference_qa = answers.get("qa", []) if settings.qa_checks is not None else None
            reference_loops = answers.get("loops") if settings.loops is not None else None
        cross = None
        crosses = []
        if settings.cross_check:
            from ggufcarve.evaluate.crosscheck import CrossCheck

            if segments:  # llama-perplexity on each file: its figures beside each segment's
                for number, (path, segment) in enumerate(zip(files, segments)):
                    (work / f"segment{number}").mkdir()
                    crosses.append(
                        CrossCheck.prepare(
                            reference_path, segment.reference, path, settings, work / f"segment{number}", sink
                        )
                    )
            else:
                cross = CrossCheck.prepare(reference_path, reference, files[0] if files else None, settings, work, sink)
        results = []
        held = [s.heldout for s in segments] if segments else _heldout_record(files[0] if files else None)
        for entry in models:
            doc = evaluate_model(entry, reference, settings, work, sink, reference_qa, segments, reference_loops)
            if cross is not None:
                doc["cross_check"] = cross.check(entry, doc, sink)
            for record, check in zip(doc.get("segments") or [], crosses):
                record["cross_check"] = check.check(
                    entry, {"ppl": record["ppl"], "parameters": doc["parameters"]}, sink
                )
            doc["heldout"] = held
            results.append(doc)
    with ExitStack() as staged:  # renamed in reverse order of staging, each only if all were written

        def stage(path: Path) -> Path:
            return staged.enter_context(atomic_file(path))

        summary_files = write_summary(results, reference.label, out_dir, stage)
        files = []
        for entry, doc in zip(models, results):
            path = out_dir / f"{entry.name}.json"
            stage(path).write_text(result_text(doc), encoding="utf-8")
            files.append(path)
    return EvalRun(results, reference, out_dir, files + summary_files)
