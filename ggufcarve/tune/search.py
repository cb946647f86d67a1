"""`tune --search`: from each K's tournament winner, the local search of `measure.search` on the calibration
text, its result written as candidates/search-<K>.json (a keep-set file `prune --keep` reads, with the path
of moves taken) and scored on the held-out text beside the tournament's candidates.

The proxy is HOPE's pair sums, filled by the same calibration pass as the criteria (`hope`'s
statistics; `measure.search.pairwise_moves`). The moves are scored on the calibration text only, by masking against the
unpruned model's log-probs on it (llama-perplexity's base file, as the held-out references). The result
then meets the K's winner on the held-out text (paired, on every unit): it becomes the K's winner only when
the winner is worse than it beyond noise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ggufcarve.errors import BadInput
from ggufcarve.events import Sink
from ggufcarve.llama.calibration import JSONL_SUFFIXES
from ggufcarve.llama.devices import Compute


def check_search(calibration: tuple[Path, ...]) -> None:
    """The search scores moves on calibration text by llama-perplexity's chunking: text files."""
    if not calibration:
        raise BadInput("--search scores its moves on the calibration text", "give --calibration FILE (repeatable)")
    jsonl = [p.name for p in calibration if Path(p).suffix.lower() in JSONL_SUFFIXES]
    if jsonl:
        raise BadInput(
            f"--search scores moves on plain calibration text, and {', '.join(jsonl)} is JSONL",
            "give the calibration documents as a text file for the search",
        )


def default_passes(calibration_chunks: int, measured: Any, group: dict[str, Any], heldout: list[Any]) -> int:
    """The search's budget when none is given: what tune decoded for this K, in passes over the calibration
    text (its calibration pass, the held-out reference and the tournament's chunks), at least 2; so that
    tune --search costs about twice tune."""
    tournament = sum(measured.records[c]["chunks_scored"] for c in group["rounds"][0]["candidates"])
    reference = sum(s.n_chunk for s in heldout)
    return max(2, round((calibration_chunks + reference + tournament) / max(calibration_chunks, 1)))


def search_winners(
    model: Any,
    layout: Any,
    settings: Any,
    hope: Any,
    measured: Any,
    segments: list[Any],
    keep_of: dict[str, dict[str, list[int]]],
    compute: Compute,
    work: Path,
    out_dir: Path,
    on_event: Sink,
) -> list[dict[str, Any]]:
    """Per K of `settings.keeps`: the search from the K's winner in `measured` (its keep-set in `keep_of`), its
    keep-set file written, its held-out record. `hope`: the calibration pass's hope scores (the proxy)."""
    from ggufcarve.fileio import write_text_atomic
    from ggufcarve.llama.masking import required_nodes
    from ggufcarve.measure.search import SearchSettings, local_search, pairwise_moves
    from ggufcarve.measure.statistics import metric_column, paired_difference
    from ggufcarve.measure.tournament import Candidate, MeasureSettings, measure, measure_tables, prepare_segments
    from ggufcarve.moe.keepset import KeepSet
    from ggufcarve.reports import envelope

    calibration = prepare_segments(
        model.path, settings.calibration, chunk_ctx=settings.ctx, chunks=None, compute=compute, work=work
    )
    calibration_chunks = sum(s.n_chunk for s in calibration)
    pairs = {
        b: stats.pair_sums for b, stats in hope.blocks.items() if stats.statistic == "pairwise" and not layout.is_mtp(b)
    }
    propose = pairwise_moves(pairs, layout.group_count)
    scoring = MeasureSettings(compute, z=settings.z, prefer="metric", tables=measure_tables())

    def nodes(keep: Any) -> tuple[str, ...]:
        keepset = KeepSet({int(b): tuple(ids) for b, ids in keep.items()})
        return tuple(f"{node}:{block}" for node, block in required_nodes(layout, keepset))

    out = []
    for k in settings.keeps:
        group = measured.groups[str(k)]
        winner = group["winner"]
        if winner is None:
            continue
        start = {int(b): tuple(ids) for b, ids in keep_of[winner].items()}
        passes = settings.search_passes or default_passes(calibration_chunks, measured, group, segments)
        found = local_search(
            model.path,
            start,
            propose,
            calibration,
            scoring,
            SearchSettings(passes=passes),
            work,
            required_nodes=nodes,
            on_event=on_event,
        )
        cid = f"search-{k}"
        heldout = measure(
            [
                Candidate(winner, model.path, keep=start, group=str(k), required_nodes=nodes(start)),
                Candidate(cid, model.path, keep=found.keep, group=str(k), required_nodes=nodes(found.keep)),
            ],
            segments,
            scoring,
            work,
            on_event=on_event,
        )
        column = metric_column(scoring.metric)
        pair = paired_difference(
            heldout.table(winner)[:, column], heldout.table(cid)[:, column], heldout.per_chunk, scoring.metric
        )
        record = {
            "start": winner,
            "start_calibration_kld_mean": found.start_kld,
            "calibration_kld_mean": found.kld,
            "path": found.path,
            "steps": len(found.steps),
            "passes": passes,
            "passes_used": found.passes_used,
            "seconds": found.seconds,
            "stopped": found.stopped,
            "heldout_vs_start": pair.to_json(),
            "beats_start": pair.worse_beyond(settings.z),
        }
        doc = envelope(
            "selection",
            inputs=[
                {"kind": "model", "name": model.path.name},
                *({"kind": "calibration", "name": p.name} for p in settings.calibration),
            ],
            parameters={"keep": k, "method": "search", "start": winner, "search_passes": passes, "z": settings.z},
            results={
                "layers": {str(b): list(ids) for b, ids in sorted(found.keep.items())},
                "kept_count": k,
                "source_expert_count": layout.expert_count,
                "method": "search",
                "search": {**record, "steps_detail": found.steps},
            },
            timings={"search_seconds": found.seconds},
        )
        text = json.dumps(doc, indent=1, sort_keys=True, allow_nan=False) + "\n"
        write_text_atomic(out_dir / "candidates" / f"{cid}.json", text)
        out.append({"id": cid, "K": k, "record": heldout.records[cid], "search": record, "text": text})
    return out
