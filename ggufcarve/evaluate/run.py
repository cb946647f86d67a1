"""Evaluate models against one reference: one child per model, per-model JSON, gate.

The reference's log-probs come from evaluate.reference (computed once, cached). Each model is
loaded once in a child process that scores every chunk against the reference, measures speed and
answers the QA checks.

Several held-out files are segments: each is scored against its own reference log-probs (cached
per text), chunked on its own (the chunk limit applies per file) and reported as its own record
(`segments`, in the order given); the overall statistics are those of the segments' per-token
tables concatenated, as llama-perplexity computes them over the chunks of all the texts.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ggufcarve import __version__
from ggufcarve.errors import BadInput
from ggufcarve.evaluate import kld
from ggufcarve.evaluate.models import ModelEntry, read_entry
from ggufcarve.evaluate.perplexity import Perplexity, perplexity
from ggufcarve.evaluate.protocol import EvalSettings, Reference, Request
from ggufcarve.evaluate.reference import (
    Segment,
    check_segments,
    heldout_files,
    heldout_record,
    prepare_segments,
    reference_cache_dir,
    reference_input,
)
from ggufcarve.evaluate.spawn import run_child
from ggufcarve.events import Event, Sink, ignore
from ggufcarve.llama.tools import find_tool, require_tool

RESULT_SCHEMA_VERSION = 1


@dataclass
class EvalRun:
    results: list[dict]
    reference: Reference
    out_dir: Path
    files: list[Path] = field(default_factory=list)


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

    memory = measure_memory(path, MemorySettings(n_ctx, compute=settings.compute))
    return {
        "memory": [memory.to_json()],
        "memory_settings": {
            "n_ctx": n_ctx,
            "kv_type": "f16",
            "n_batch": 2048,
            "n_ubatch": 512,
            "gpu_layers": settings.compute.gpu_layers,
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
        compute=settings.child_compute,
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
        result["speed"] = bench_speed(bench, entry.path, settings.speed, settings.child_compute).to_json()
    if "bad_input" in result:
        raise BadInput(
            f"{entry.path.name}: {result['bad_input']}",
            result.get("bad_input_hint", "compare models of the reference's family"),
        )
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
        # where the speed was measured: the run's placement (no endpoint addresses) and the machine's CPU threads
        "speed_placement": settings.child_compute.key() if result.get("speed") else None,
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
            settings.child_compute,
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
        compute=settings.child_compute,
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
    from ggufcarve.placement.auto import placed_settings

    largest = max([Path(reference_path), *(m.path for m in models)], key=lambda p: p.stat().st_size)
    settings = placed_settings(settings, largest, settings.ctx)
    # directories this run creates: on failure those left empty are removed (deepest first)
    made = _missing_dirs(
        [
            out_dir,
            reference_cache_dir(settings),
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
    from ggufcarve.llama.computed import recording
    from ggufcarve.llama.computed import stage as computed_stage

    files = heldout_files(heldout)
    check_segments(files, reference_path, settings)
    out_dir.mkdir(parents=True, exist_ok=True)
    # matplotlib (about 0.5 s to import) loads while the libllama children run; the charts need it last
    threading.Thread(target=load_charting, name="ggufcarve-import-charts", daemon=True).start()
    with tempfile.TemporaryDirectory(prefix="ggufcarve-eval-") as tmp:  # requests, results, per-token tables
        work = Path(tmp)
        if reference_path.is_file() and reference_input(reference_path) == "gguf":
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
        held = [s.heldout for s in segments] if segments else heldout_record(files[0] if files else None)
        for entry in models:
            with recording() as computed:
                with computed_stage("evaluation"):
                    doc = evaluate_model(
                        entry, reference, settings, work, sink, reference_qa, segments, reference_loops
                    )
                if cross is not None:
                    doc["cross_check"] = cross.check(entry, doc, sink)
                for record, check in zip(doc.get("segments") or [], crosses):
                    record["cross_check"] = check.check(
                        entry, {"ppl": record["ppl"], "parameters": doc["parameters"]}, sink
                    )
            doc["heldout"] = held
            doc["computed_on"] = computed.to_json()
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
