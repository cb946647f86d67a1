"""`ggufcarve best`: which model is best in a memory budget, pruned or unpruned, which K and which
quant, decided by measurement.

    result = best(Path("model.gguf"), BestSettings(memory=parse_memory("24GiB"), ladder=Path("ladders/q8-to-iq1.toml"),
                  calibration=(Path("cal.txt"),), heldout=(Path("wiki.txt"), Path("code.txt"))), Path("best"))
    result.report["winner"]["path"]  # models/<family>/<file>.gguf under the output directory

Stages, each timed (`timings`):
  fit          the (K, quant) pairs from fit's exact sizes (`candidates.choose_candidates`), and for
               each pruned pair whether llama-quantize gives every tensor the type it gives it in
               the unpruned rung of that quant (`quant.fit.types_differ`, from fit's dry runs);
  calibration  one decode pass for every criterion, its keep-set at every candidate K, and the
               imatrix from the same pass (all keyed by the sha256 of the source, the texts and the
               settings, and reused when they match);
  builds       the unpruned rungs of every candidate quant (the ladder's resume: by content), and
               the pruned rungs of the pairs whose types differ (prune, remap the imatrix, quantize);
  tournament   every (K, keep-set, quant) scored against the unpruned model by the one measurement
               layer (`measure.tournament`): masked on the loaded unpruned rung of its quant when
               the types agree (`scored_by` "mask", `masked_on`), else its built file ("file");
               successive halving by paired differences (standard errors over chunks), candidates
               over the budget out before the final round, the gate on every unit, ties within noise;
  confirmation the winner (and `confirm` runners-up) scored by masking are built as real files and
               scored on every chunk; the file's mean KLD must lie within max(2 standard errors,
               1%) of the masked one (`confirmed`), else the run fails naming both.
The answer: the finalist with the lowest metric, or among those tied with it within noise the one
`prefer` names (the smaller file by default).
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ggufcarve.best.builds import build_pruned, build_rungs, keep_sets, override_command, run_command
from ggufcarve.best.candidates import PRUNED, UNPRUNED
from ggufcarve.best.cost import STAGES, device_words, projection, token_read_bytes
from ggufcarve.best.finalists import STANDINS, confirm, measure_speeds, rechecked, route_built_finalists
from ggufcarve.best.plan import BestSettings, Plan, built_record, placed_settings, plan_best
from ggufcarve.errors import BadInput
from ggufcarve.evaluate.kld import SEGMENT_KEYS
from ggufcarve.events import Sink, ignore

if TYPE_CHECKING:  # imported where used: the measurement layer imports numpy
    from ggufcarve.evaluate.gate import Gate
    from ggufcarve.llama.devices import Compute
    from ggufcarve.measure import tournament as mt

REPORT = "best"
# a confirmed file's mean KLD may differ from its masked score by max(2 standard errors, this share)
SELECTION_RULE = (
    "successive halving over held-out units by the paired difference to each round's leader (standard errors "
    "over chunks); among the "
    "finalists that run in the tier ranked in (memory as llama.cpp allocates it: weights, cache, compute and output "
    "buffers, per device) and pass the gate, the lowest metric, or among those tied with it within z standard errors "
    "the one --prefer names"
)


@dataclass
class BestResult:
    report: dict[str, Any]
    outputs: list[Path] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# The search


def _judge(gate: Any, record: dict[str, Any]) -> tuple[bool, list[str]]:
    if gate is None:
        return True, []
    doc = dict(record)
    doc["ppl_delta_percent"] = (
        100.0 * (record["ppl"] / record["ppl_reference"] - 1.0)
        if record.get("ppl") and record.get("ppl_reference")
        else None
    )
    verdict = gate.judge(doc)
    return verdict.verdict == "PASS", list(verdict.failed)


@dataclass(frozen=True)
class _Search:
    """One search's source, settings and plan, and where its files go."""

    source: Path
    settings: BestSettings
    plan: Plan
    out_dir: Path
    work: Path  # out_dir/work: keep-sets, pruned sources, references
    models_dir: Path  # out_dir/models: the rungs, unpruned and pruned
    imatrix: Path  # the calibration pass's imatrix
    base: str  # the model name the rungs are named after
    on_event: Sink

    def pruned_rung(self, keep_file: Path, kept: int, quant: str, method: str) -> Path:
        """The rung `quant` of the source pruned to the keep-set in `keep_file` (K=`kept`), built by
        `builds.build_pruned`."""
        return build_pruned(
            self.plan,
            self.settings,
            keep_file,
            kept,
            quant,
            method,
            self.work,
            self.models_dir,
            self.imatrix,
            self.base,
            self.on_event,
        )


def best(
    source: Path, settings: BestSettings, out_dir: Path, *, plan: Plan | None = None, on_event: Sink = ignore
) -> BestResult:
    """Search the candidates; write best.json, best.md, best-pareto.png (and best-speed.png with timed finalists)
    and plan.toml under `out_dir`, the models under out_dir/models."""
    from ggufcarve.llama.computed import recording, stage
    from ggufcarve.llama.tools import physical_cores
    from ggufcarve.quant.ladder_plan import model_name_from

    started = time.perf_counter()
    with recording() as computed:
        settings = placed_settings(settings, source)
        plan = plan or plan_best(source, settings, on_event=on_event)
        wanted = _wanted(plan, settings)
        previous_timings = _previous_timings(out_dir)
        timings: dict[str, float] = {"fit_seconds": plan.seconds}
        out_dir.mkdir(parents=True, exist_ok=True)
        work = out_dir / "work"
        work.mkdir(exist_ok=True)
        imatrix = work / "calibration.imatrix.gguf"
        compute = settings.compute.with_threads(settings.compute.threads or physical_cores())
        gate = None
        if settings.gate is not None:
            from ggufcarve.evaluate.gate import load_gate

            gate = load_gate(settings.gate)

        sets: dict[int, dict[str, Any]] = {}
        reused = False
        if plan.kept_counts:
            with stage("calibration"):
                sets, timings["calibration_seconds"], reused = keep_sets(
                    source, plan, settings, work, imatrix, on_event
                )
        search = _Search(
            source=source,
            settings=settings,
            plan=plan,
            out_dir=out_dir,
            work=work,
            models_dir=out_dir / "models",
            imatrix=imatrix,
            base=model_name_from(source),
            on_event=on_event,
        )

        t0 = time.perf_counter()
        rungs = _unpruned_rungs(search, wanted)
        records, pool = _candidate_records(search, sets, rungs, wanted)
        timings["builds_seconds"] = time.perf_counter() - t0

        measured = None
        searched: dict[str, Any] | None = None
        if wanted is None:
            with stage("tournament"):
                measured, segments, measure_settings, tournament_timings = _tournament(
                    search, records, pool, compute, gate
                )
            timings.update(tournament_timings)
            if settings.search and measured.groups[""]["winner"] is not None:
                from ggufcarve.best.search import search_winner

                t0 = time.perf_counter()
                with stage("search"):
                    searched = search_winner(search, records, measured, segments, measure_settings, rungs, compute)
                timings["search_seconds"] = time.perf_counter() - t0
            with stage("confirmation"):
                timings["confirmation_seconds"], confirm_builds = confirm(
                    search, records, rungs, measured, segments, measure_settings
                )
            timings["builds_seconds"] += confirm_builds  # the confirmations' builds count as builds
        for name in STAGES:
            timings.setdefault(f"{name}_seconds", 0.0)

        winner = None
        if measured is not None and measured.groups[""]["winner"] is not None:
            timings["builds_seconds"] += route_built_finalists(search, records, measured.groups[""])
            t0 = time.perf_counter()
            with stage("speed"):
                measure_speeds(search, records, measured.groups[""], compute)
            timings["speed_seconds"] = time.perf_counter() - t0

            def build_finalist(cid: str) -> None:
                with stage("confirmation"):
                    scored, built = confirm(search, records, rungs, measured, segments, measure_settings, ids=[cid])
                timings["confirmation_seconds"] += scored
                timings["builds_seconds"] += built
                t0 = time.perf_counter()
                with stage("speed"):
                    measure_speeds(search, records, measured.groups[""], compute, ids=[cid])
                timings["speed_seconds"] += time.perf_counter() - t0

            winner = rechecked(records, measured.groups[""], settings, build_finalist)
            if winner["scored_by"] in STANDINS and not winner.get("confirmed"):  # routed from a built file, unscored
                with stage("confirmation"):
                    scored, built = confirm(
                        search, records, rungs, measured, segments, measure_settings, ids=[winner["id"]]
                    )
                timings["confirmation_seconds"] += scored
                timings["builds_seconds"] += built
        _complete_records(records, settings, out_dir)
        timings["total_seconds"] = time.perf_counter() - started

        report = _report(search, records, winner, measured, timings, wanted, reused, previous_timings)
        report["scoring_placement"] = compute.record()
        report["computed_on"] = computed.to_json()
        if searched is not None:
            report["search"] = searched
        outputs = _write_outputs(search, report, winner) if wanted is None else []
        return BestResult(report, outputs)


def _wanted(plan: Plan, settings: BestSettings) -> set[str] | None:
    """The candidate ids --only names (None: every candidate); an id that is not a candidate is a BadInput."""
    ids = {c.id for c in plan.candidates if c.family == UNPRUNED} | {
        f"{c.id}-{m}" for c in plan.candidates if c.family == PRUNED for m in settings.methods
    }
    wanted = set(settings.only) if settings.only else None
    if wanted is not None and (unknown := wanted - ids):  # before anything is written
        raise BadInput(f"--only {', '.join(sorted(unknown))}: not a candidate", f"candidates: {', '.join(sorted(ids))}")
    return wanted


def _unpruned_rungs(search: _Search, wanted: set[str] | None) -> dict[str, Path]:
    """The unpruned rungs built (quant -> file): every quant of the plan, or under --only the quants of the unpruned
    candidates named and of the pruned candidates named whose types agree with the unpruned rung's."""
    plan, settings = search.plan, search.settings
    quants = [
        q
        for q in plan.quants
        if wanted is None
        or any(i == f"unpruned-{q}" for i in wanted)
        or any(
            c.quant == q and f"{c.id}-{m}" in wanted and not plan.types[(c.kept, c.quant)]
            for c in plan.candidates
            if c.family == PRUNED
            for m in settings.methods
        )
    ]
    return (
        build_rungs(
            settings.ladder,
            search.source,
            search.models_dir / UNPRUNED,
            quants,
            search.imatrix if search.imatrix.is_file() else None,
            search.base,
            settings,
            search.on_event,
        )
        if quants
        else {}
    )


def _candidate_records(
    search: _Search, sets: dict[int, dict[str, Any]], rungs: dict[str, Path], wanted: set[str] | None
) -> tuple[dict[str, dict[str, Any]], list[mt.Candidate]]:
    """Every candidate's record (id -> record, in plan order) and the tournament's pool. An unpruned rung is scored
    by its file; a pruned candidate whose keep-set is identical to another method's is not scored; one whose types
    agree with the unpruned rung's is masked on that rung (not scored under --only); one whose types differ is built
    (prune, remap the imatrix, quantize) and scored by its file."""
    from ggufcarve.llama.masking import required_nodes
    from ggufcarve.measure import tournament as mt
    from ggufcarve.moe.keepset import load_keepset

    plan, settings = search.plan, search.settings
    layout = plan.layout
    records: dict[str, dict[str, Any]] = {}
    pool: list[mt.Candidate] = []
    read = functools.cache(token_read_bytes)  # bytes one token reads of each file (prefer = "faster")
    for c in plan.candidates:
        if c.family == UNPRUNED:
            if wanted is not None and c.id not in wanted:
                continue
            path = rungs[c.quant]
            size = path.stat().st_size
            records[c.id] = {
                **c.to_json(),
                "file_bytes": size,
                **built_record(path, settings, plan.tier),
                "predicted_file_bytes": c.file_bytes,
                "memory_estimated_total": c.estimated_total,
                "selection": "none (every expert kept)",
                "keep_set": None,
                "scored_by": "file",
                "masked_on": None,
                "types_match": True,
                "built": True,
                "path": path,
            }
            pool.append(
                mt.Candidate(c.id, path, None, fits=records[c.id]["fits"], file_bytes=size, read_bytes=read(path))
            )
            continue
        differ = plan.types[(c.kept, c.quant)]
        for method, entry in sets[c.kept].items():
            cid = f"{c.id}-{method}"
            if wanted is not None and cid not in wanted:
                continue
            record = {
                **c.to_json(),
                "id": cid,
                "predicted_file_bytes": c.file_bytes,
                "selection": method,
                "keep_set": f"work/keep-sets/{entry['file'].name}",
                "identical_to": None if entry["identical_to"] is None else f"{c.id}-{entry['identical_to']}",
                "types_match": not differ,
                "types_differ": [list(t) for t in differ[:8]],
                "built": False,
                "path": None,
            }
            records[cid] = record
            if entry["identical_to"] is not None:
                record.update(scored_by=None, masked_on=None)
                continue
            keepset = load_keepset(entry["file"], layout)
            if not differ:
                if wanted is not None:
                    continue
                record.update(scored_by="mask", masked_on=rungs[c.quant].name)
                nodes = tuple(f"{node}:{block}" for node, block in required_nodes(layout, keepset))
                pool.append(
                    mt.Candidate(
                        cid,
                        rungs[c.quant],
                        keepset.layers,
                        fits=c.fits,
                        file_bytes=c.file_bytes,
                        read_bytes=read(rungs[c.quant]),  # a mask reads what its rung reads: top-k of its experts
                        required_nodes=nodes,
                    )
                )
            else:
                name, was, unpruned_type = differ[0]
                record.update(
                    scored_by="file",
                    masked_on=None,
                    scored_by_reason=f"llama-quantize gives {len(differ)} tensor(s) another type "
                    f"at K={c.kept} ({name}: {was}, unpruned {unpruned_type})",
                )
                path = search.pruned_rung(entry["file"], c.kept, c.quant, method)
                size = path.stat().st_size
                record.update(
                    built=True,
                    path=path,
                    file_bytes=size,
                    **built_record(path, settings, plan.tier),
                    memory_estimated_total=c.estimated_total,
                )
                pool.append(mt.Candidate(cid, path, None, fits=record["fits"], file_bytes=size, read_bytes=read(path)))
    for record in records.values():
        record["experts_used"] = layout.expert_used_count
    return records, pool


# a trained candidate's record fields its used-count variants share (what it is, not how it scored or was built)
VARIANT_FIELDS = (
    "kept_experts", "expert_count", "quant", "family", "file_bytes", "cache_bytes", "fits", "tier", "tiers", "memory",
    "memory_source", "predicted_file_bytes", "memory_estimated_total", "selection", "keep_set", "types_match",
    "types_differ", "masked_on", "placement", "n_cpu_moe",
)  # fmt: skip


def _used_count_variants(
    search: _Search, records: dict[str, dict[str, Any]], pool: list[mt.Candidate]
) -> Callable[[Sequence[str]], list[mt.Candidate]]:
    """`measure`'s expand: for each survivor of the first round, its candidates at the --topk counts (at most its K),
    scored on the same file with the used count overridden at load (and masked as it is): `<id>-topN`, records
    `experts_used` N and `topk_of` the trained candidate."""
    from dataclasses import replace

    from ggufcarve.moe.experts_used import experts_used_overrides

    plan = search.plan
    by_id = {c.id: c for c in pool}
    read = functools.cache(token_read_bytes)

    def expand(survivors: Sequence[str]) -> list[mt.Candidate]:
        added = []
        for cid in survivors:
            parent, record = by_id.get(cid), records[cid]
            if parent is None or record.get("topk_of"):
                continue
            for n in plan.used_counts:
                if n > record["kept_experts"]:
                    continue
                vid = f"{cid}-top{n}"
                records[vid] = {
                    **{k: record[k] for k in VARIANT_FIELDS if k in record},
                    "id": vid,
                    "experts_used": n,
                    "topk_of": cid,
                    "scored_by": "mask" if record["scored_by"] == "mask" else "override",
                    "identical_to": None,
                    "built": False,
                    "path": None,
                }
                added.append(
                    replace(
                        parent,
                        id=vid,
                        overrides=experts_used_overrides(plan.model, plan.layout, n),
                        read_bytes=read(parent.model, n),
                    )
                )
        return added

    return expand


def _tournament(
    search: _Search, records: dict[str, dict[str, Any]], pool: list[mt.Candidate], compute: Compute, gate: Gate | None
) -> tuple[mt.Measurement, list[mt.Segment], mt.MeasureSettings, dict[str, float]]:
    """The unpruned model's references on the held-out files and the tournament of `pool` on them
    (`measure.tournament`). Each scored record in `records` takes its figures; a record whose keep-set is identical
    to a scored one's takes that one's figures, stopped early as "identical". Returns the measurement, the segments
    and measurement settings it was scored with, and the seconds of the references and of the tournament."""
    from ggufcarve.measure import tournament as mt

    settings = search.settings
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    segments = mt.prepare_segments(
        search.source,
        settings.heldout,
        chunk_ctx=settings.eval_ctx,
        chunks=settings.chunks,
        compute=compute,
        work=search.work,
        on_event=search.on_event,
    )
    timings["references_seconds"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    measure_settings = mt.MeasureSettings(
        compute,
        z=settings.z,
        metric=settings.metric,
        prefer=settings.prefer,
        gate=(lambda stats: _judge(gate, stats)) if gate is not None else None,
        tables=mt.measure_tables(),
        # a speed target weighs used counts: a faster, worse candidate stays for the speed it is then timed at
        keep_faster=bool(search.plan.used_counts) and (settings.min_decode is not None or settings.prefer == "faster"),
    )
    expand = _used_count_variants(search, records, pool) if search.plan.used_counts else None
    measured = mt.measure(pool, segments, measure_settings, search.work, on_event=search.on_event, expand=expand)
    timings["tournament_seconds"] = time.perf_counter() - t0
    for cid, r in measured.records.items():
        records[cid].update(
            {k: v for k, v in r.items() if k not in ("id", "group", "fits", "finalist")}, finalist=r["finalist"]
        )
    for r in records.values():  # identical keep-sets: the figures of the one scored
        if r.get("identical_to") and r["identical_to"] in measured.records:
            twin = records[r["identical_to"]]
            r.update(
                {k: twin.get(k) for k in (*SEGMENT_KEYS, "chunks_scored", "segments")},
                stopped_early=True,
                stopped_reason="identical",
                lost_by=None,
            )
    return measured, segments, measure_settings, timings


def _complete_records(records: dict[str, dict[str, Any]], settings: BestSettings, out_dir: Path) -> None:
    """Gives each built record its run command, and each record the figures of a candidate not scored where it has
    none (0 chunks, not stopped, no KLD, top-token agreement or perplexity)."""
    for r in records.values():
        if r["built"]:
            r["run_command"] = run_command(Path(r["path"]), settings, r.get("placement"))
            if r.get("routed_from"):
                r["run_command_override"] = override_command(
                    out_dir / r["routed_from"], r["experts_used"], settings, r.get("placement")
                )
        r.setdefault("chunks_scored", 0)
        r.setdefault("stopped_early", False)
        r.setdefault("stopped_reason", None)
        for key in ("kld_mean", "kld_mean_stderr", "kld_p999", "same_top_p", "ppl"):
            r.setdefault(key, None)


def _public(record: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """A record as best.json shows it: its path relative to `out_dir`, last."""
    doc = {k: v for k, v in record.items() if k != "path"}
    doc["path"] = str(Path(record["path"]).relative_to(out_dir)) if record["path"] else None
    return doc


def _report(
    search: _Search,
    records: dict[str, dict[str, Any]],
    winner: dict[str, Any] | None,
    measured: mt.Measurement | None,
    timings: dict[str, float],
    wanted: set[str] | None,
    reused: bool,
    previous_timings: dict[str, float] | None,
) -> dict[str, Any]:
    """best.json's document: the report envelope of the inputs, the parameters, the results (the model, the
    candidates by file size, the winner, the halving, the projection, the command that publishes the winner) and
    the timings."""
    from ggufcarve.best.render import publish_command
    from ggufcarve.reports import envelope

    source, settings, plan, out_dir = search.source, search.settings, search.plan, search.out_dir
    layout = plan.layout
    candidates = [_public(r, out_dir) for r in sorted(records.values(), key=lambda r: (r["file_bytes"], r["id"]))]
    results = {
        "model": {
            "name": source.name,
            "architecture": layout.architecture,
            "expert_count": layout.expert_count,
            "expert_used_count": layout.expert_used_count,
            "bytes": plan.model.total_bytes,
        },
        "memory_bytes": settings.memory,
        "cache": plan.fit.cache.to_json(),
        "heldout": [p.name for p in settings.heldout],
        "candidates": candidates,
        "winner": _public(winner, out_dir) if winner else None,
        "kept_counts": plan.kept_counts,
        "halving": measured.groups[""] if measured is not None else None,
        "units": [list(u) for u in measured.units] if measured is not None else [],
        "selection_rule": SELECTION_RULE,
        "projection": projection(plan.model, layout, timings, device_words(settings.compute)),
        "only": sorted(wanted) if wanted else None,
        "keep_sets_reused": reused,
        "chunks_decoded": measured.decoded_chunks if measured is not None else 0,
        "chunks_cached": measured.cached_chunks if measured is not None else 0,
        "previous_run_timings": previous_timings,
    }
    if winner is not None and winner["family"] == UNPRUNED:  # published by the ladder alone: no prune stage
        results["publish"] = {"command": publish_command({"winner": winner}, source, settings, out_dir, search.imatrix)}
    elif winner is not None:
        results["publish"] = {"command": ["ggufcarve", "run", "plan.toml"]}
    parameters = {
        "memory_bytes": settings.memory,
        "ctx": settings.ctx,
        "kv_type": settings.kv_type.lower(),
        "eval_ctx": settings.eval_ctx,
        "chunk_ctx": settings.eval_ctx,
        "keep": settings.keep_counts or (settings.keep_file.name if settings.keep_file else None),
        "chunks": settings.chunks,
        "max_tokens": settings.max_tokens,
        "methods": list(settings.methods),
        "metric": settings.metric,
        "gate": settings.gate.name if settings.gate else None,
        "gpu_memory_bytes": (settings.gpu_memory[0] if len(settings.gpu_memory) == 1 else list(settings.gpu_memory))
        if settings.gpu_memory
        else None,
        "tier": plan.tier,
        "tier_asked": settings.tier,
        "ladder": plan.spec.name,
        "confirm": settings.confirm,
        "prefer": settings.prefer,
        "z": settings.z,
        "topk": settings.topk if isinstance(settings.topk, str) or settings.topk is None else list(settings.topk),
        "used_counts_weighed": list(plan.used_counts),
    }
    return envelope(
        REPORT,
        inputs=[
            {"kind": "model", "name": source.name},
            *({"kind": "calibration", "name": p.name} for p in settings.calibration),
            *({"kind": "heldout", "name": p.name} for p in settings.heldout),
        ],
        parameters=parameters,
        results=results,
        timings=timings,
    )


def _write_outputs(search: _Search, report: dict[str, Any], winner: dict[str, Any] | None) -> list[Path]:
    """Writes best.json, best.md and the chart under out_dir, removes an earlier plan.toml and writes the plan of a
    pruned winner; returns the files written."""
    from ggufcarve.best.render import CHART, SPEED_CHART, chart, markdown, plan_document, speed_chart, write_plan
    from ggufcarve.fileio import write_text_atomic

    out_dir = search.out_dir
    write_text_atomic(out_dir / "best.json", json.dumps(report, indent=1, sort_keys=True, allow_nan=False) + "\n")
    write_text_atomic(out_dir / "best.md", markdown(report))
    chart(report, out_dir / CHART)
    outputs = [out_dir / "best.json", out_dir / "best.md", out_dir / CHART]
    (out_dir / SPEED_CHART).unlink(missing_ok=True)  # an earlier run's finalists
    if speed_chart(report, out_dir / SPEED_CHART):
        outputs.append(out_dir / SPEED_CHART)
    (out_dir / "plan.toml").unlink(missing_ok=True)  # a plan of an earlier answer would publish another model
    if winner is not None and winner["family"] == PRUNED:
        outputs.append(
            write_plan(plan_document(report, search.source, search.settings, out_dir, search.imatrix), out_dir)
        )
    return outputs


def _previous_timings(out_dir: Path) -> dict[str, float] | None:
    """The timings of the run that wrote out_dir/best.json before this one (reported apart from this run's)."""
    try:
        return json.loads((out_dir / "best.json").read_text())["timings"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
