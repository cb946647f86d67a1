"""Evaluate models against one reference: the cached reference log-probs, one child per model, per-model JSON, gate.

The reference is a GGUF model (its top-k log-probs on the held-out text are computed once and
cached in `<cache>/reference-logprobs/`, keyed by the reference's sha256, the text's sha256, the
context and top-k), a top-k cache file, or a llama-perplexity `--kl-divergence-base` file (its
tokens are scored; no held-out text needed). Each model is loaded once in a child process that
scores every chunk against the reference, measures speed and answers the QA checks.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ggufcarve import __version__
from ggufcarve.errors import BadInput, OutputError, ToolFailed
from ggufcarve.evaluate import kld
from ggufcarve.evaluate.gate import Gate
from ggufcarve.evaluate.models import ModelEntry, read_entry
from ggufcarve.evaluate.perplexity import Perplexity, perplexity, read_text
from ggufcarve.evaluate.speed import SpeedSettings
from ggufcarve.events import Event, Sink, ignore
from ggufcarve.llama.tools import find_tool, require_tool

RESULT_SCHEMA_VERSION = 1
CHILD_IDLE_TIMEOUT = 3600.0  # seconds without a progress line (one chunk, one QA answer) before the child is stopped
GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class EvalSettings:
    ctx: int = 512
    chunks: int | None = None
    threads: int = max(1, (os.cpu_count() or 2))
    top_k: int = kld.DEFAULT_TOP_K
    speed: SpeedSettings | None = SpeedSettings()
    gate: Gate | None = None
    qa_checks: list[dict] | None = None
    cross_check: bool = False
    kl_base_out: Path | None = None  # also write the reference's log-probs as a llama-perplexity base file
    llama_cpp_dir: Path | None = None
    cache_dir: Path | None = None


@dataclass
class Reference:
    """The reference as used: a GGUF model (entry set) or a reference file, and the file the children read."""

    label: str
    kind: str  # "gguf", "topk" or "base"
    sha256: str
    file: Path  # the top-k cache or base file the children compare with
    entry: ModelEntry | None = None
    top_k: int | None = None  # log-probs per token of a top-k cache; None for a base file (full vocabulary)
    cached: bool = False  # its top-k log-probs came from the cache
    seconds: float = 0.0  # spent computing its top-k log-probs in this run


@dataclass
class EvalRun:
    results: list[dict]
    reference: Reference
    out_dir: Path
    files: list[Path] = field(default_factory=list)


def _sha256_of(entry: ModelEntry, sink: Sink) -> str:
    """One digest naming a model: its file's sha256, or for a split set the sha256 of the shards' digests in order."""
    from ggufcarve.events import Counter
    from ggufcarve.fileio import sha256_file_cached

    counter = Counter(sink, f"hash {entry.name}", entry.bytes, "bytes")
    digests = [sha256_file_cached(p, counter) for p in entry.files]
    return digests[0] if len(digests) == 1 else hashlib.sha256(",".join(digests).encode()).hexdigest()


def run_child(request, what: str, sink: Sink, work: Path, outputs: dict[str, tuple[Path, str]] | None = None) -> dict:
    """Run the evaluation child for one request; its progress lines become chunk events of stage `what`.

    `outputs` maps a file the child writes to the path an error names and the hint's other place
    to write to (a temp file to its final name); files it does not name are work files.
    """
    from ggufcarve.evaluate.child import OS_ERROR, PROGRESS_PREFIX
    from ggufcarve.fileio import write_failed
    from ggufcarve.llama import launch

    request_path = work / f"{what}.request.json".replace(" ", "_")
    request.write(request_path)
    os_errors: list[dict] = []

    def on_line(line: str) -> None:
        if line.startswith(PROGRESS_PREFIX + OS_ERROR + " "):
            os_errors.append(json.loads(line[len(PROGRESS_PREFIX + OS_ERROR) + 1:]))
        elif line.startswith(PROGRESS_PREFIX):
            kind, done, total = line[1:].split()
            sink(Event(what if kind == "chunk" else f"{what} QA", int(done), int(total), "chunks" if kind == "chunk" else "steps"))

    finished = launch.run([sys.executable, "-m", "ggufcarve.evaluate.child", str(request_path)], on_line=on_line, idle_timeout=CHILD_IDLE_TIMEOUT)
    if os_errors:
        error = os_errors[0]
        shown, elsewhere = (outputs or {}).get(error["filename"], (Path(error["filename"] or work), "set TMPDIR to a directory with more room"))
        raise write_failed(OSError(error["errno"], error["strerror"]), shown, elsewhere)
    launch.check(finished, f"evaluating {Path(request.model).name} in libllama", "the last lines are llama.cpp's own; check that the model loads (ggufcarve inspect MODEL)")
    result = json.loads(Path(request.result_out).read_text())
    if "engine_error" in result:
        raise ToolFailed(f"{Path(request.model).name}: {result['engine_error']}", "check that llama.cpp loads the model (ggufcarve inspect)")
    if "no_space" in result:
        short = result["no_space"]
        shown, elsewhere = (outputs or {}).get(short["path"], (Path(short["path"]), "set TMPDIR to a directory with more room"))
        raise OutputError(f"{shown.name} needs {short['bytes'] / 2**20:.1f} MiB but {shown.parent} has {short['free'] / 2**20:.1f} MiB free",
                          f"free disk space or {elsewhere}; nothing was written")
    return result


def _reference_input(path: Path) -> str:
    with open(path, "rb") as f:
        magic = f.read(4)
    return "gguf" if magic == GGUF_MAGIC else "file"


def prepare_reference(path: Path, heldout: Path | None, settings: EvalSettings, work: Path, sink: Sink = ignore) -> Reference:
    """The reference file the children compare with: a given top-k cache or base file, or the cached top-k log-probs of a GGUF reference."""
    from ggufcarve.evaluate.child import Request
    from ggufcarve.fileio import cache_root, remove_dead_temps, temp_path_for

    if not path.is_file():
        raise BadInput(f"{path}: no such reference file", "give the unpruned model (GGUF), a top-k cache or a llama-perplexity --kl-divergence-base file")
    if _reference_input(path) == "file":
        if settings.kl_base_out is not None:
            raise BadInput("--save-kl-base writes the log-probs of a GGUF reference", "give the reference model itself as --reference")
        try:
            opened = kld.open_reference(path)
        except ValueError as err:
            raise BadInput(str(err), "give the unpruned model (GGUF) or a file written by llama-perplexity --kl-divergence-base") from None
        from ggufcarve.fileio import sha256_file_cached

        digest = opened.header.reference_sha256 if opened.header else sha256_file_cached(path)
        return Reference(path.name, opened.kind, digest, path, top_k=opened.header.top_k if opened.header else None)
    entry = read_entry(path)
    if heldout is None:
        raise BadInput("--heldout is needed with a GGUF reference", "give a held-out text file, or a llama-perplexity --kl-divergence-base file as --reference")
    try:
        text = read_text(heldout.read_bytes())
    except OSError as err:
        raise BadInput(f"{heldout}: cannot read the held-out text ({err.strerror})", "give a plain text file") from None
    ref_sha = _sha256_of(entry, sink)
    text_sha = hashlib.sha256(text).hexdigest()
    cache_dir = settings.cache_dir or cache_root() / "reference-logprobs"
    cache_dir.mkdir(parents=True, exist_ok=True)
    cache = cache_dir / f"{ref_sha[:16]}-{text_sha[:16]}-ctx{settings.ctx}-top{settings.top_k}.reflogp"
    if cache.exists() and settings.kl_base_out is None:
        try:
            opened = kld.open_reference(cache)
            header = opened.header
            wanted = min(settings.chunks or header.text_chunks, header.text_chunks)
            if header.reference_sha256 == ref_sha and header.text_sha256 == text_sha and header.n_chunk >= wanted:
                return Reference(entry.name, "gguf", ref_sha, cache, entry, top_k=header.top_k, cached=True)
        except ValueError:
            pass  # a cache of a dead run or another version: computed afresh below
    started = time.monotonic()
    # The child writes the cache (and the base file) under this process's temp names; they are
    # renamed into place only once it succeeded (it fsyncs them first), so a cache under its final
    # name is always complete, and a stopped or failed run leaves none.
    remove_dead_temps(cache_dir, cache.name.__eq__)
    temp = temp_path_for(cache)
    request = Request(model=str(entry.path), threads=settings.threads, n_ctx=settings.ctx, result_out=str(work / "reference.result.json"),
                      text=str(heldout), max_chunks=settings.chunks, cache_out=str(temp), top_k=settings.top_k,
                      cache_identity={"reference_sha256": ref_sha, "text_sha256": text_sha})
    outputs = {str(temp): (cache, "choose another --cache directory")}
    base_temp = None
    if settings.kl_base_out is not None:
        settings.kl_base_out.parent.mkdir(parents=True, exist_ok=True)
        remove_dead_temps(settings.kl_base_out.parent, settings.kl_base_out.name.__eq__)
        base_temp = temp_path_for(settings.kl_base_out)
        request.base_out = str(base_temp)
        outputs[str(base_temp)] = (settings.kl_base_out, "choose another --save-kl-base path")
    try:
        result = run_child(request, f"reference {entry.name}", sink, work, outputs)
        if "bad_input" in result:
            raise BadInput(f"{heldout}: {result['bad_input']}", "give a longer --heldout text or a smaller --ctx")
        os.replace(temp, cache)
        if base_temp is not None:
            os.replace(base_temp, settings.kl_base_out)
    finally:
        temp.unlink(missing_ok=True)
        if base_temp is not None:
            base_temp.unlink(missing_ok=True)
    return Reference(entry.name, "gguf", ref_sha, cache, entry, top_k=settings.top_k, seconds=time.monotonic() - started)


def check_vocabularies(models: list[ModelEntry], reference: ModelEntry | None, reference_file: Path | None = None) -> None:
    """Every model must share the reference's vocabulary: KL divergence compares distributions over the same tokens."""
    n_vocab = kld.open_reference(reference_file).n_vocab if reference is None and reference_file is not None else None
    for entry in models:
        if reference is not None and entry.vocab_sha256 != reference.vocab_sha256:
            raise BadInput(f"{entry.path.name}: its vocabulary ({entry.n_vocab} tokens) differs from the reference {reference.path.name}'s ({reference.n_vocab} tokens)",
                           "compare models of one family: quants and pruned versions of the reference")
        if n_vocab is not None and entry.n_vocab != n_vocab:
            raise BadInput(f"{entry.path.name}: its vocabulary has {entry.n_vocab} tokens, the reference file {reference_file.name} {n_vocab}",
                           "compare models of the reference's family")


def _contract(stats: kld.KldStatistics, ppl: Perplexity, ppl_reference: Perplexity, qa: dict | None, speed: dict | None) -> dict:
    """The per-model figures under their contract names."""
    return {
        "ppl": ppl.ppl, "ppl_stderr": ppl.ppl_stderr, "ppl_reference": ppl_reference.ppl,
        "ppl_delta_percent": 100.0 * (ppl.ppl / ppl_reference.ppl - 1.0),
        "kld_mean": stats.kld_mean, "kld_mean_stderr": stats.kld_mean_stderr, "kld_median": stats.kld["median"],
        "kld_p99": stats.kld["p99"], "kld_p999": stats.kld["p999"], "kld_max": stats.kld["max"], "kld_bound": stats.kld_bound,
        "same_top_p": stats.same_top_p, "rms_dp": stats.rms_dp,
        "qa_passed": qa["passed"] if qa else None, "qa_total": qa["total"] if qa else None,
        "qa_exact_vs_reference": qa.get("exact_vs_reference") if qa else None,
        "pp_tok_s": speed["pp_tok_s"] if speed else None, "tg_tok_s": speed["tg_tok_s"] if speed else None,
    }


def evaluate_model(entry: ModelEntry, reference: Reference, settings: EvalSettings, work: Path, sink: Sink = ignore,
                   reference_qa: list[dict] | None = None) -> dict:
    """Score one model against the reference (and time it, and ask it the QA checks): the per-model result document."""
    from ggufcarve.evaluate.child import Request

    started = time.monotonic()
    table_path = work / f"{entry.name}.tokens.f64"
    bench = None
    if settings.speed is not None and settings.speed.engine != "libllama":
        bench = find_tool("llama-bench", settings.llama_cpp_dir) if settings.speed.engine == "auto" else require_tool("llama-bench", settings.llama_cpp_dir)
    request = Request(model=str(entry.path), threads=settings.threads, n_ctx=settings.ctx, result_out=str(work / f"{entry.name}.result.json"),
                      reference_in=str(reference.file), max_chunks=settings.chunks, table_out=str(table_path),
                      speed=asdict(settings.speed) if settings.speed and bench is None else None, qa=settings.qa_checks)
    result = run_child(request, entry.name, sink, work)
    if bench is not None and settings.speed is not None and "bad_input" not in result:
        from ggufcarve.evaluate.speed import bench_speed

        sink(Event(entry.name, 0, 0, "chunks", "llama-bench"))
        result["speed"] = bench_speed(bench, entry.path, settings.speed, settings.threads).to_json()
    if "bad_input" in result:
        raise BadInput(f"{entry.path.name}: {result['bad_input']}", "compare models of the reference's family")
    table = np.fromfile(table_path, dtype="<f8").reshape(-1, kld.TOKEN_COLUMNS)
    table_path.unlink()
    stats = kld.kld_statistics(table)
    ppl = perplexity(table[:, kld.NLL])
    qa = None
    if settings.qa_checks is not None and "qa" in result:
        from ggufcarve.evaluate.qa import summarize

        qa = summarize(settings.qa_checks, result["qa"], reference_qa)
    doc = {
        "schema_version": RESULT_SCHEMA_VERSION,
        "tool": {"name": "ggufcarve", "version": __version__},
        "model": {"name": entry.name, "file": entry.path.name, "files": [{"name": p.name, "bytes": p.stat().st_size} for p in entry.files],
                  "bytes": entry.bytes, "gib": round(entry.gib, 4), "quant": entry.quant, "family": entry.family,
                  "architecture": entry.architecture, "expert_count": entry.expert_count, "source_expert_count": entry.source_expert_count,
                  "pruned": entry.pruned},
        "reference": {"name": reference.label, "kind": reference.kind, "sha256": reference.sha256, "log_probs_cached": reference.cached,
                      "log_probs_seconds": round(reference.seconds, 3)},
        "parameters": {"ctx": result["n_ctx"], "chunks": result["n_chunk"], "scored_tokens": stats.count, "threads": settings.threads,
                       "top_k": reference.top_k, "kld_full_vocabulary": reference.top_k is None or reference.top_k >= entry.n_vocab},
        **_contract(stats, ppl, perplexity(table[:, kld.NLL_BASE]), qa, result.get("speed")),
        "kl_divergence": stats.to_json(),
        "speed": result.get("speed"),
        "qa": qa,
        "timings": {"load_seconds": round(result.get("load_seconds", 0.0), 3), "score_seconds": round(result.get("score_seconds", 0.0), 3),
                    "total_seconds": round(time.monotonic() - started, 3)},
    }
    verdict = settings.gate.judge(doc) if settings.gate else None
    doc["gate"] = verdict.verdict if verdict else None
    doc["gate_failed"] = verdict.failed if verdict else []
    doc["gate_not_measured"] = verdict.not_measured if verdict else []
    doc["gate_thresholds"] = dict(settings.gate.thresholds) if settings.gate else None
    doc["gate_source"] = settings.gate.source if settings.gate else None
    return doc


def result_text(doc: dict) -> str:
    """A per-model result document as written: indented JSON, keys sorted, no NaN."""
    return json.dumps(doc, indent=1, sort_keys=True, allow_nan=False) + "\n"


def _heldout_record(heldout: Path | None) -> dict | None:
    """The held-out text file as the results record it (name, bytes, sha256); None with a reference file."""
    if heldout is None:
        return None
    from ggufcarve.fileio import sha256_file_cached

    return {"name": heldout.name, "bytes": heldout.stat().st_size, "sha256": sha256_file_cached(heldout)}


def evaluate(models: list[ModelEntry], reference_path: Path, heldout: Path | None, settings: EvalSettings, out_dir: Path, sink: Sink = ignore) -> EvalRun:
    """Evaluate every model against the reference; write DIR/<name>.json per model, DIR/summary.md and the charts.

    The files are written together once every model is done, each under its temp name, fsynced and
    renamed (summary.md last): a run that fails or is stopped part way leaves none of them.
    """
    from ggufcarve.evaluate.summary import load_charting, write_summary
    from ggufcarve.fileio import atomic_file

    out_dir.mkdir(parents=True, exist_ok=True)
    # matplotlib (about 0.5 s to import) loads while the libllama children run; the charts need it last
    threading.Thread(target=load_charting, name="ggufcarve-import-charts", daemon=True).start()
    with tempfile.TemporaryDirectory(prefix="ggufcarve-eval-") as tmp:  # requests, results, per-token tables
        work = Path(tmp)
        if reference_path.is_file() and _reference_input(reference_path) == "gguf":
            check_vocabularies(models, read_entry(reference_path))  # before the reference pass, which can take long
        reference = prepare_reference(reference_path, heldout, settings, work, sink)
        check_vocabularies(models, reference.entry, reference.file)
        reference_qa = None
        if settings.qa_checks is not None and reference.entry is not None:
            from ggufcarve.evaluate.qa import reference_outputs

            reference_qa = reference_outputs(reference.entry, settings, work, sink)
        cross = None
        if settings.cross_check:
            from ggufcarve.evaluate.crosscheck import CrossCheck

            cross = CrossCheck.prepare(reference_path, reference, heldout, settings, work, sink)
        results = []
        held = _heldout_record(heldout)
        for entry in models:
            doc = evaluate_model(entry, reference, settings, work, sink, reference_qa)
            if cross is not None:
                doc["cross_check"] = cross.check(entry, doc, sink)
            doc["heldout"] = held
            results.append(doc)
    with ExitStack() as staged:  # renamed in reverse order of staging, each only if all were written

        def stage(path: Path) -> Path:
            return staged.enter_context(atomic_file(path))

        summary_files = write_summary(results, reference, out_dir, stage)
        files = []
        for entry, doc in zip(models, results):
            path = out_dir / f"{entry.name}.json"
            stage(path).write_text(result_text(doc), encoding="utf-8")
            files.append(path)
    return EvalRun(results, reference, out_dir, files + summary_files)
