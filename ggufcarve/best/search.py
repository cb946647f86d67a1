"""`best --search`: the local search of `measure.search` from the tournament's winner, when it is a pruned
candidate scored by mask: its keep-set masked on the unpruned rung of its quant, moves scored on the
calibration text against the unpruned model's log-probs there, ranked by the pairwise proxy of the
calibration pass (HOPE's pair sums, kept beside the criteria's scores: `best.builds.keep_sets`).

The result is a candidate of its own (`<winner>-search`, selection "search"), scored by mask on the held-out
text beside the winner (paired, every unit). It replaces the winner only when the winner is worse than it
beyond noise; it is then the finalist the confirmation builds and scores as a file, as any masked winner.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ggufcarve.llama.devices import Compute

PROXY_SCORES = "search-proxy.scores.json"  # in work/keep-sets/: hope's scores of the calibration pass


def search_winner(
    search: Any,
    records: dict[str, dict[str, Any]],
    measured: Any,
    segments: list[Any],
    measure_settings: Any,
    rungs: dict[str, Path],
    compute: Compute,
) -> dict[str, Any]:
    """The search from the winner (module docstring); returns what best.json's `search` says of it. The new
    candidate goes into `records` and, when it wins, into `measured`'s decision and tables."""
    from dataclasses import replace

    from ggufcarve.fileio import write_text_atomic
    from ggufcarve.llama.masking import required_nodes
    from ggufcarve.measure import tournament as mt
    from ggufcarve.measure.search import SearchSettings, local_search, pairwise_moves
    from ggufcarve.measure.statistics import metric_column, paired_difference
    from ggufcarve.moe.keepset import KeepSet, load_keepset
    from ggufcarve.select.scores import read_scores

    settings, layout = search.settings, search.plan.layout
    decision = measured.groups[""]
    winner = records[decision["winner"]]
    if winner.get("scored_by") != "mask":
        return {"searched": False, "why": "the winner keeps every expert or is scored as its own file"}
    if winner.get("topk_of"):
        return {
            "searched": False,
            "why": f"the winner routes {winner['experts_used']} experts per token: the search moves keep-sets at the "
            "trained count",
        }
    start = load_keepset(search.out_dir / winner["keep_set"], layout).layers
    proxy = read_scores(search.work / "keep-sets" / PROXY_SCORES)
    pairs = {b: s.pair_sums for b, s in proxy.blocks.items() if s.statistic == "pairwise" and not layout.is_mtp(b)}
    calibration = mt.prepare_segments(
        search.source, settings.calibration, chunk_ctx=settings.eval_ctx, chunks=None, compute=compute, work=search.work
    )
    calibration_chunks = sum(s.n_chunk for s in calibration)
    scored = measured.decoded_chunks + measured.cached_chunks  # the tournament's chunks, whatever the cache held
    passes = settings.search_passes or max(2, round(scored / max(calibration_chunks, 1)))
    rung = rungs[winner["quant"]]

    def nodes(keep: Any) -> tuple[str, ...]:
        keepset = KeepSet({int(b): tuple(ids) for b, ids in keep.items()})
        return tuple(f"{node}:{block}" for node, block in required_nodes(layout, keepset))

    scoring = replace(measure_settings, prefer="metric", gate=None)
    found = local_search(
        rung,
        start,
        pairwise_moves(pairs, layout.group_count),
        calibration,
        scoring,
        SearchSettings(passes=passes),
        search.work,
        required_nodes=nodes,
        on_event=search.on_event,
    )
    cid = f"{winner['id']}-search"
    keep_path = search.work / "keep-sets" / f"{cid}.json"
    doc = {**KeepSet(found.keep).to_json(), "search": {**found.to_json(), "start": winner["id"]}}
    write_text_atomic(keep_path, json.dumps(doc, indent=1, sort_keys=True, allow_nan=False) + "\n")
    heldout = mt.measure(
        [
            mt.Candidate(winner["id"], rung, keep=start, required_nodes=nodes(start)),
            mt.Candidate(cid, rung, keep=found.keep, required_nodes=nodes(found.keep)),
        ],
        segments,
        replace(scoring, first_units=None),
        search.work,
        on_event=search.on_event,
    )
    column = metric_column(settings.metric)
    pair = paired_difference(
        heldout.table(winner["id"])[:, column], heldout.table(cid)[:, column], heldout.per_chunk, settings.metric
    )
    beats = pair.worse_beyond(settings.z)
    said = {
        "searched": True,
        "start": winner["id"],
        "candidate": cid,
        "path": found.path,
        "start_calibration_kld_mean": found.start_kld,
        "calibration_kld_mean": found.kld,
        "passes": passes,
        "passes_used": found.passes_used,
        "seconds": found.seconds,
        "stopped": found.stopped,
        "heldout_vs_start": pair.to_json(),
        "beats_start": beats,
    }
    record = heldout.records[cid]
    records[cid] = {
        **winner,
        **{k: v for k, v in record.items() if k not in ("id", "group", "fits", "finalist", "winner", "leader")},
        "id": cid,
        "selection": "search",
        "keep_set": f"work/keep-sets/{keep_path.name}",
        "identical_to": None,
        "winner": False,
        "leader": False,
        "tie_with": [],
        "search": said,
    }
    if beats:
        winner.update(winner=False, replaced_because=f"{cid} (the search from it) is better beyond noise")
        records[cid].update(winner=True, finalist=True)
        decision.update(winner=cid, finalists=[*decision["finalists"], cid])
        measured.tables[cid] = heldout.tables[cid]
        measured.records[cid] = record
    return said
