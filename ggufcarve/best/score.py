"""One model scored against the unpruned model on every held-out file: each file is its own segment.

The reference's log-probs per file are llama-perplexity's base file (`evaluate.run.prepare_reference`,
cached); the model is scored by the evaluation child (`evaluate.child`, the one `ggufcarve eval`
runs), on the first `max_chunks` chunks of each file. The statistics are llama-perplexity's
(`evaluate.kld.kld_statistics`) over the per-token tables: overall over every file's tokens, and
per file (`candidate_statistics`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ggufcarve.errors import BadInput
from ggufcarve.events import Sink, ignore


@dataclass
class Segment:
    name: str  # the held-out file's name
    path: Path
    reference: Any  # evaluate.protocol.Reference
    n_chunk: int  # chunks scored at most (the reference file's, capped by --chunks)


@dataclass
class Tables:
    """A model's per-token tables (evaluate.kld.TOKEN_COLUMNS), one per segment, and the chunks each covers."""

    tables: list[np.ndarray]
    chunks: list[int]

    def first(self, n_chunks: int) -> Tables:
        """The rows of the first `n_chunks` chunks of each segment (every chunk scores the same number of tokens)."""
        out, counts = [], []
        for table, chunks in zip(self.tables, self.chunks):
            keep = min(chunks, n_chunks)
            per_chunk = len(table) // chunks if chunks else 0
            out.append(table[: keep * per_chunk])
            counts.append(keep)
        return Tables(out, counts)

    @property
    def max_chunks(self) -> int:
        return max(self.chunks) if self.chunks else 0


def references_per_file(source: Path, heldout: list[Path], settings: Any, work: Path, sink: Sink = ignore) -> list[Segment]:
    """The unpruned model's log-probs on every held-out file (cached across runs)."""
    from ggufcarve.evaluate import kld
    from ggufcarve.evaluate.run import prepare_reference

    segments = []
    names = [p.name for p in heldout]
    for path in heldout:
        reference = prepare_reference(source, path, settings, work, sink)
        n_chunk = kld.open_reference(reference.file).n_chunk
        if settings.chunks:
            n_chunk = min(n_chunk, settings.chunks)
        name = path.name if names.count(path.name) == 1 else str(path)
        segments.append(Segment(name, path, reference, n_chunk))
    return segments


def score_model(path: Path, label: str, segments: list[Segment], settings: Any, work: Path, max_chunks: int, sink: Sink = ignore) -> Tables:
    """Score `path` on the first `max_chunks` chunks of every segment: its per-token tables."""
    from ggufcarve.evaluate import kld
    from ggufcarve.evaluate.protocol import Request
    from ggufcarve.evaluate.spawn import run_child

    tables, chunks = [], []
    for number, segment in enumerate(segments):
        n = min(max_chunks, segment.n_chunk)
        table_path = work / f"{label}-{number}.tokens.f64"
        request = Request(model=str(path), threads=settings.threads, n_ctx=settings.ctx, result_out=str(work / f"{label}-{number}.result.json"),
                          reference_in=str(segment.reference.file), max_chunks=n, table_out=str(table_path))
        result = run_child(request, f"{label} on {segment.name}", sink, work)
        if "bad_input" in result:
            raise BadInput(f"{path.name}: {result['bad_input']}", "compare models of the reference's family")
        tables.append(np.fromfile(table_path, dtype="<f8").reshape(-1, kld.TOKEN_COLUMNS))
        table_path.unlink()
        chunks.append(int(result["n_chunk"]))
    return Tables(tables, chunks)


def _record(table: np.ndarray) -> dict[str, Any]:
    from ggufcarve.evaluate.kld import kld_statistics

    if len(table) < 2:
        return {"kld_mean": None, "kld_mean_stderr": None, "kld_p999": None, "same_top_p": None, "ppl": None, "tokens": len(table)}
    stats = kld_statistics(table)
    return {"kld_mean": stats.kld_mean, "kld_mean_stderr": stats.kld_mean_stderr, "kld_p999": stats.kld["p999"], "same_top_p": stats.same_top_p,
            "ppl": stats.ppl, "ppl_reference": stats.ppl_base, "rms_dp": stats.rms_dp, "kld_p99": stats.kld["p99"], "tokens": stats.count}


def candidate_statistics(tables: Tables, names: list[str]) -> dict[str, Any]:
    """The overall statistics over every segment's tokens, and `segments`: one record per held-out
    file {name, kld_mean, kld_mean_stderr, kld_p999, same_top_p, ppl, tokens}."""
    from ggufcarve.evaluate.kld import segment_statistics as segment_record

    overall = _record(np.concatenate(tables.tables) if tables.tables else np.zeros((0, 6)))
    return {**overall, "segments": [segment_record(name, table) for name, table in zip(names, tables.tables)]}
