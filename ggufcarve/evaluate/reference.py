"""The reference's log-probs on the held-out text: computed once by a libllama child and cached.

The reference is a GGUF model (its log-probs on the held-out text are computed once and cached in
`<cache>/reference-logprobs/`, keyed by the reference's sha256, the text's sha256 and the context:
by default as llama-perplexity's `--kl-divergence-base` file, with a JSON beside it naming what it
holds; with the "topk" store as a top-k cache), a top-k cache file, or a llama-perplexity
`--kl-divergence-base` file (its tokens are scored; no held-out text needed).

Several held-out files are segments: each is scored against its own reference log-probs (cached
per text).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ggufcarve.errors import BadInput
from ggufcarve.evaluate import kld
from ggufcarve.evaluate.models import ModelEntry, read_entry
from ggufcarve.evaluate.perplexity import read_text
from ggufcarve.evaluate.protocol import REFERENCE_STORES, REFERENCE_TOPK, EvalSettings, Reference, Request
from ggufcarve.evaluate.spawn import run_child
from ggufcarve.events import Sink, ignore

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class Segment:
    """One held-out file scored on its own: the file's record (name, bytes, sha256) and its reference log-probs."""

    heldout: dict
    reference: Reference


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


def reference_input(path: Path) -> str:
    with open(path, "rb") as f:
        magic = f.read(4)
    return "gguf" if magic == GGUF_MAGIC else "file"


def _cache_path(cache_dir: Path, ref_sha: str, text_sha: str, settings: EvalSettings) -> Path:
    """Where the reference's log-probs on a text are cached: a base file (full store) or a top-k cache.
    The name holds what changes the numbers besides the model and the text: the context, and the
    llama.cpp that computed them and where (`computed_by`)."""
    stem = f"{ref_sha[:16]}-{text_sha[:16]}-ctx{settings.ctx}-{computed_by(settings)}"
    if settings.reference_store == REFERENCE_TOPK:
        return cache_dir / f"{stem}-top{settings.top_k}-tail{settings.tail_samples}.reflogp"
    return cache_dir / f"{stem}.kld"


def computed_by(settings: EvalSettings) -> str:
    """A short key of the llama.cpp (version and backend) and the placement, devices and threads
    the reference's log-probs are computed with (`Compute.key`): a CPU reference is not taken for a
    GPU or RPC run, whose kernels round differently."""
    from ggufcarve.llama.tools import llama_cpp_version

    doc = {"llama_cpp": llama_cpp_version(), **settings.child_compute.key()}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:12]


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
    if not reference.is_file() or reference_input(reference) != "gguf" or heldout is None:
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
    if reference_input(path) == "file":
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
        compute=settings.child_compute,
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
    check_segments(files, path, settings)
    if len(files) < 2:
        return prepare_reference(path, files[0] if files else None, settings, work, sink), []
    segments = [Segment(heldout_record(file), prepare_reference(path, file, settings, work, sink)) for file in files]
    joined = replace(
        segments[0].reference,
        cached=all(s.reference.cached for s in segments),
        seconds=sum(s.reference.seconds for s in segments),
    )
    return joined, segments


def heldout_record(heldout: Path | None) -> dict | None:
    """The held-out text file as the results record it (name, bytes, sha256); None with a reference file."""
    if heldout is None:
        return None
    from ggufcarve.fileio import sha256_file_cached

    return {"name": heldout.name, "bytes": heldout.stat().st_size, "sha256": sha256_file_cached(heldout)}


def check_segments(files: list[Path], reference_path: Path, settings: EvalSettings) -> None:
    """Several held-out files need a GGUF reference (a reference file holds one text's log-probs) and distinct names."""
    if len(files) < 2:
        return
    if reference_path.is_file() and reference_input(reference_path) != "gguf":
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
