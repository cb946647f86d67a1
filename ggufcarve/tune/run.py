"""`ggufcarve tune`: every criterion's keep-set at every K, scored against the unpruned model by
masking inside one loaded model (no pruned file written), by successive halving over held-out chunks.

    result = tune(Path("model.gguf"), TuneSettings(keeps=(8,), methods=("reap", "frequency", "weights"),
                  calibration=(Path("cal.txt"),), heldout=(Path("heldout.txt"),), ctx=256), Path("out"))
    result.winner  # "reap-8": out/expert-selection.json is its selection record

Steps: one calibration decode pass fills every trace criterion (`select.calibrate.calibrate_all`;
the imatrix too when an imatrix method is asked, from the same pass; razor only when asked: its pass
is the heavier one that fills razor as well); zero-shot criteria read the model. `all`
(ALL_METHODS) holds greedy only when its memory estimate (`select.greedy.memory_estimate`) is at
most ALL_SHARE of the memory available (`select.greedy.available_memory`); left out, tune.json's
"left_out" and a line of tune.md say why. Listed by name, greedy is refused before anything runs
when its estimate exceeds `select.greedy.REFUSE_SHARE` of it (`fit_greedy`). Each criterion's
keep-set at each K (`select.keep.choose`, the record `select -o` writes); identical keep-sets are
scored once (`identical_to`). The measurement layer (`measure.tournament`) scores them against
the unpruned model's cached log-probs, masked on the one loaded model: per K the candidates compete
by successive halving decided by the paired difference of the metric's statistic to each round's
leader (`delta_vs_leader`, `delta_stderr`, one entry per round; standard errors over chunks,
`measure.statistics`); the statistics are llama-perplexity's (`evaluate.kld.kld_statistics`) over
every held-out token a candidate was scored on, their standard errors over chunks (the per-token
one as `kld_mean_stderr_tokens`). The winner of a K is the finalist with the lowest mean KLD,
`tie_with` the finalists within z standard errors of it; `expert-selection.json` is the winner at
the first K given.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ggufcarve import settings as S
from ggufcarve.errors import BadInput
from ggufcarve.events import Sink, ignore
from ggufcarve.llama.devices import Compute
from ggufcarve.measure.statistics import DEFAULT_Z
from ggufcarve.select.criteria import ALL_METHODS, IMATRIX_METHODS, TRACE_METHODS, ZERO_SHOT
from ggufcarve.settings import key, required
from ggufcarve.tune.report import CHART, HALVING_RULE, cliff, render_markdown, write_chart
from ggufcarve.tune.stability import overlap, split_text

REPORT = "tune"
ALL_SHARE = 0.5  # greedy's estimate counts a token per byte of the text: on prose 3-4 times the tokens it traces


@dataclass(frozen=True)
class TuneSettings:
    keeps: tuple[int, ...] = required(S.KEEP)
    methods: tuple[str, ...] = key(S.METHODS, ALL_METHODS)
    calibration: tuple[Path, ...] = key(S.CALIBRATION, ())
    heldout: tuple[Path, ...] = key(S.HELDOUT, ())
    ctx: int = key(S.CTX, 512)
    chunks: int | None = key(S.CHUNKS, None)
    max_tokens: int | None = key(S.MAX_TOKENS, None)
    compute: Compute = S.compute_key()  # where every llama.cpp child runs
    seed: int = 0
    stability: bool = key(S.STABILITY, False)
    z: float = key(S.Z, DEFAULT_Z)  # worse than the leader by more than z standard errors (paired): out of a round
    search: bool = key(S.SEARCH, False)  # then the local search from each K's winner (tune.search)
    search_passes: int | None = key(S.SEARCH_PASSES, None)
    imatrix_out: Path | None = None  # also write the calibration pass's imatrix (of the unpruned model) here
    available_memory: int | None = None  # bytes greedy's pass may count on; None: select.greedy.available_memory()


@dataclass
class TuneResult:
    report: dict[str, Any]
    winner: str
    outputs: list[Path] = field(default_factory=list)


def parse_methods(text: str) -> tuple[str, ...]:
    """--methods all|LIST: the criteria in the order given (duplicates dropped); all: ALL_METHODS,
    whose greedy `tune` keeps only when it fits (`fit_greedy`)."""
    from ggufcarve.select.criteria import criterion_named

    if text.strip() == "all":
        return ALL_METHODS
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise BadInput("--methods names no method", "give all, or a list such as reap,frequency,weights")
    for name in names:
        criterion_named(name)
    return tuple(dict.fromkeys(names))


def parse_keeps(text: str) -> tuple[int, ...]:
    try:
        keeps = tuple(dict.fromkeys(int(k) for k in text.split(",") if k.strip()))
    except ValueError:
        raise BadInput(f"--keep {text}: not a list of expert counts", "for example --keep 8 or --keep 4,8,12") from None
    if not keeps:
        raise BadInput("--keep names no expert count", "for example --keep 8 or --keep 4,8,12")
    return keeps


# what a candidate's entry of tune.json takes from its measurement record
RECORD_KEYS = (
    "kld_mean",
    "kld_mean_stderr",
    "kld_mean_stderr_tokens",
    "kld_p999",
    "same_top_p",
    "ppl",
    "ppl_stderr",
    "tokens",
    "segments",
    "chunks_scored",
    "stopped_early",
    "stopped_reason",
    "delta_vs_leader",
    "delta_stderr",
)


def calibration_scores(
    model: Any, layout: Any, settings: TuneSettings, work: Path, on_event: Sink
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The scores of every asked method, the calibration pass's record, and the scores of every criterion the
    pass filled (with `settings.search`, a pass that fills hope's, the search's proxy, runs in any case)."""
    from ggufcarve.select.calibrate import calibrate_all
    from ggufcarve.select.methods import score_model

    methods = settings.methods
    traced = [m for m in methods if m in TRACE_METHODS]
    wants_imatrix = any(m in IMATRIX_METHODS for m in methods) or settings.imatrix_out is not None
    out: dict[str, Any] = {}
    passed: dict[str, Any] = {}
    filled: dict[str, Any] = {}
    if traced or wants_imatrix or settings.search:
        if not settings.calibration:
            raise BadInput(
                f"{', '.join(traced or [m for m in methods if m in IMATRIX_METHODS])} read(s) a calibration pass",
                "give --calibration FILE (repeatable)",
            )
        output_methods = [
            m for m in traced if m not in ("frequency", "greedy")
        ]  # a frequency pass reads the routing alone
        asked = (
            "razor"
            if "razor" in traced
            else (
                output_methods[0]
                if output_methods
                else "greedy"
                if "greedy" in traced
                else "hope"
                if settings.search
                else "frequency"
            )
        )
        imatrix = (settings.imatrix_out or work / "calibration.imatrix.gguf") if wants_imatrix else None
        started = time.perf_counter()
        filled = calibrate_all(
            model,
            layout,
            asked,
            list(settings.calibration),
            ctx=settings.ctx,
            max_tokens=settings.max_tokens,
            compute=settings.compute,
            imatrix_out=imatrix,
            force=True,
            greedy="greedy" in traced,
            available_memory=settings.available_memory,
            on_event=on_event,
        )
        passed = {
            "asked": asked,
            "filled": sorted(filled),
            "imatrix": wants_imatrix,
            "seconds": time.perf_counter() - started,
            "tokens": next(iter(filled.values())).tokens,
        }
        out.update({m: filled[m] for m in traced})
        for m in methods:
            if m in IMATRIX_METHODS:
                out[m] = score_model(model, layout, m, imatrix=imatrix, on_event=on_event)
    for m in methods:
        if m in ZERO_SHOT:
            out[m] = score_model(model, layout, m, seed=settings.seed, on_event=on_event)
    return {m: out[m] for m in methods}, passed, filled


def half_scores(model: Any, layout: Any, settings: TuneSettings, work: Path, on_event: Sink) -> list[dict[str, Any]]:
    """The calibration-reading methods' scores from each half of the calibration text (one pass per half)."""
    methods = tuple(m for m in settings.methods if m not in ZERO_SHOT)
    if not methods:
        return []
    halves: list[list[Path]] = [[], []]
    for number, path in enumerate(settings.calibration):
        for side, text in enumerate(split_text(path)):
            half_path = work / f"half{side}" / f"{number}-{Path(path).name}"
            half_path.parent.mkdir(exist_ok=True)
            half_path.write_text(text, encoding="utf-8")
            halves[side].append(half_path)
    max_tokens = (
        None
        if settings.max_tokens is None
        else max(settings.ctx, settings.max_tokens // 2 // settings.ctx * settings.ctx)
    )
    out = []
    for side, files in enumerate(halves):
        half = TuneSettings(
            keeps=settings.keeps,
            methods=methods,
            calibration=tuple(files),
            heldout=settings.heldout,
            ctx=settings.ctx,
            max_tokens=max_tokens,
            compute=settings.compute,
            seed=settings.seed,
            available_memory=settings.available_memory,
        )
        out.append(calibration_scores(model, layout, half, work / f"half{side}", on_event)[0])
    return out


def fit_greedy(layout: Any, settings: TuneSettings) -> tuple[TuneSettings, dict[str, str]]:
    """The settings tune runs and the methods it leaves out, with the reason. Methods equal to
    ALL_METHODS (`--methods all`, a plan's methods = "all") keep greedy when its estimate is at
    most ALL_SHARE of the available memory; greedy listed by name is refused (BadInput) when its
    estimate exceeds REFUSE_SHARE of it."""
    from dataclasses import replace

    from ggufcarve.fileio import format_size
    from ggufcarve.llama.calibration import read_calibration
    from ggufcarve.llama.decode import default_threads
    from ggufcarve.select.greedy import available_memory, check_memory, memory_estimate, token_bound

    if "greedy" not in settings.methods or not settings.calibration:
        return settings, {}
    calibration = read_calibration(settings.calibration)
    threads = default_threads(settings.compute.threads)
    available = available_memory() if settings.available_memory is None else settings.available_memory
    if settings.methods != ALL_METHODS:
        check_memory(layout, calibration, settings.ctx, settings.max_tokens, threads, available)
        return settings, {}
    estimate = memory_estimate(layout, token_bound(calibration, settings.ctx, settings.max_tokens), threads)
    if available is not None and estimate.peak <= ALL_SHARE * available:
        return settings, {}
    reason = (
        f"needs up to {format_size(estimate.peak)} of the {format_size(available)} "
        f"of memory available; all runs it within {ALL_SHARE:.0%}"
        if available is not None
        else "the memory available is unknown (no /proc/meminfo)"
    )
    return replace(settings, methods=tuple(m for m in settings.methods if m != "greedy")), {"greedy": reason}


def reference_bytes(source: Path, settings: TuneSettings) -> int:
    """At most the bytes of the unpruned model's log-prob records the reference cache keeps: llama-perplexity's base
    records (`evaluate.kld.base_file_bytes`) of every held-out
    file, its chunk count bounded by the text's bytes as `evaluate.reference.reference_disk_bytes` bounds
    it (a token of llama.cpp's tokenizers spells at least one byte, apart from a BOS and a
    leading-space marker)."""
    from ggufcarve.evaluate import kld
    from ggufcarve.evaluate.models import read_entry
    from ggufcarve.evaluate.perplexity import read_text

    n_vocab = read_entry(Path(source)).n_vocab
    total = 0
    for path in settings.heldout:
        try:
            n_tokens = len(read_text(Path(path).read_bytes())) + 2
        except OSError as err:
            raise BadInput(
                f"{path}: cannot read the held-out text ({err.strerror})", "give a plain text file"
            ) from None
        n_chunk = (
            n_tokens // settings.ctx if settings.chunks is None else min(n_tokens // settings.ctx, settings.chunks)
        )
        if n_chunk >= 1:
            total += kld.base_file_bytes(settings.ctx, n_vocab, n_chunk)
    return total


def tune(source: Path, settings: TuneSettings, out_dir: Path, *, on_event: Sink = ignore) -> TuneResult:
    """Run the tournament and write tune.json, tune.md, tune-kld.png, candidates/ and expert-selection.json under
    `out_dir`."""
    from ggufcarve.gguf.container import read_model
    from ggufcarve.measure.statistics import check_z
    from ggufcarve.moe.kept import kept_count
    from ggufcarve.moe.layout import inspect_layout
    from ggufcarve.placement.auto import placed_settings

    if not settings.heldout:
        raise BadInput("tune scores keep-sets on held-out text", "give --heldout FILE (repeatable)")
    check_z(settings.z)
    settings = placed_settings(settings, source, settings.ctx)
    if settings.search:
        from ggufcarve.tune.search import check_search

        check_search(settings.calibration)
    if out_dir.exists() and not out_dir.is_dir():
        raise BadInput(
            f"-o {out_dir} is a file; tune writes a folder of results there",
            "give a folder path (it is made when missing)",
        )
    from ggufcarve.evaluate.perplexity import read_text

    for path in (*settings.calibration, *settings.heldout):
        if not Path(path).is_file():
            raise BadInput(f"{path}: no such file", "give an existing text file")
        if not read_text(Path(path).read_bytes()).strip():
            raise BadInput(f"{path}: the text is empty", "give a text file with content")
    started = time.perf_counter()
    model = read_model(source)
    layout = inspect_layout(model)
    for k in settings.keeps:
        kept_count(layout, k, None)
        if k == layout.expert_count:
            raise BadInput(
                f"--keep {k} keeps every one of the {k} experts: nothing to prune",
                f"give K below {k}, e.g. --keep {max(layout.expert_used_count, k // 2)}",
            )
    asked = settings.methods
    settings, left_out = fit_greedy(layout, settings)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = out_dir / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    shutil.rmtree(
        out_dir / "candidates", ignore_errors=True
    )  # the run owns it: no keep-set of an earlier run stays beside this one's
    (out_dir / "candidates").mkdir()
    try:
        from ggufcarve.evaluate.protocol import EvalSettings
        from ggufcarve.evaluate.reference import check_room, reference_cache_dir

        cache = reference_cache_dir(EvalSettings(speed=None))
        cache.mkdir(parents=True, exist_ok=True)
        check_room(
            cache / "the unpruned model's log-probs",
            reference_bytes(model.path, settings),
            "free room in the cache (GGUFCARVE_CACHE), or give fewer --chunks",
        )
        from ggufcarve.llama.computed import recording

        with recording() as computed:
            return _tune(model, layout, settings, out_dir, work, started, on_event, asked, left_out, computed)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _tune(
    model: Any,
    layout: Any,
    settings: TuneSettings,
    out_dir: Path,
    work: Path,
    started: float,
    on_event: Sink,
    asked: tuple[str, ...],
    left_out: dict[str, str],
    computed: Any,
) -> TuneResult:
    from ggufcarve.fileio import write_text_atomic
    from ggufcarve.llama.computed import stage
    from ggufcarve.llama.masking import required_nodes
    from ggufcarve.llama.tools import physical_cores
    from ggufcarve.measure.tournament import Candidate, MeasureSettings, measure, measure_tables, prepare_segments
    from ggufcarve.moe.keepset import KeepSet
    from ggufcarve.reports import envelope
    from ggufcarve.select.keep import choose

    timings: dict[str, float] = {}
    with stage("calibration"):
        scores, passed, filled = calibration_scores(model, layout, settings, work, on_event)
    timings["calibration_seconds"] = passed.get("seconds", 0.0)
    halves: list[dict[str, Any]] = []
    if settings.stability:
        started_halves = time.perf_counter()
        with stage("calibration"):
            halves = half_scores(model, layout, settings, work, on_event)
        timings["stability_seconds"] = time.perf_counter() - started_halves
    candidates: list[dict[str, Any]] = []
    seen: dict[tuple, str] = {}
    keep_of: dict[str, dict[str, list[int]]] = {}
    groups: list[list[str]] = []
    texts: dict[str, str] = {}
    for k in settings.keeps:
        group = []
        for method, method_scores in scores.items():
            cid = f"{method}-{k}"
            selection = choose(method_scores, k)
            text = json.dumps(selection.record({}), indent=1, sort_keys=True, allow_nan=False) + "\n"
            texts[cid] = text
            write_text_atomic(out_dir / "candidates" / f"{cid}.json", text)
            key = tuple(sorted(selection.keepset.layers.items()))
            entry: dict[str, Any] = {"id": cid, "method": method, "K": k, "identical_to": seen.get(key)}
            if halves and method in halves[0]:
                a, b = (
                    {str(blk): list(ids) for blk, ids in choose(h[method], k).keepset.layers.items()} for h in halves
                )
                entry["stability"] = overlap(a, b)
            if key not in seen:
                seen[key] = cid
                keep_of[cid] = {str(b): list(ids) for b, ids in sorted(selection.keepset.layers.items())}
                group.append(cid)
            candidates.append(entry)
        groups.append(group)
    compute = settings.compute.with_threads(settings.compute.threads or physical_cores())
    reference_started = time.perf_counter()
    with stage("references"):
        segments = prepare_segments(
            model.path,
            settings.heldout,
            chunk_ctx=settings.ctx,
            chunks=settings.chunks,
            compute=compute,
            work=work,
            on_event=on_event,
        )
    timings["reference_seconds"] = time.perf_counter() - reference_started
    pool = [
        Candidate(
            cid,
            model.path,
            keep={int(b): ids for b, ids in keep.items()},
            group=str(k),
            required_nodes=tuple(
                f"{node}:{block}"
                for node, block in required_nodes(layout, KeepSet({int(b): tuple(ids) for b, ids in keep.items()}))
            ),
        )
        for k, group in zip(settings.keeps, groups)
        for cid in group
        for keep in [keep_of[cid]]
    ]
    with stage("tournament"):
        measured = measure(
            pool,
            segments,
            MeasureSettings(compute, z=settings.z, prefer="metric", tables=measure_tables()),
            work,
            on_event=on_event,
        )
    timings["score_seconds"] = measured.seconds
    searched: list[dict[str, Any]] = []
    if settings.search:
        from ggufcarve.tune.search import search_winners

        search_started = time.perf_counter()
        with stage("search"):
            searched = search_winners(
                model, layout, settings, filled["hope"], measured, segments, keep_of, compute, work, out_dir, on_event
            )
        timings["search_seconds"] = time.perf_counter() - search_started
    common = {}
    for method in scores:
        ids = [c["identical_to"] or c["id"] for c in candidates if c["method"] == method]
        n = min(len(measured.tables[i]) for i in ids)
        for c in candidates:
            if c["method"] == method:
                common[c["id"]] = measured.statistics_on(c["identical_to"] or c["id"], n)["kld_mean"]
    for entry in candidates:
        source_id = entry["identical_to"] or entry["id"]
        record = measured.records[source_id]
        entry.update({key: record.get(key) for key in RECORD_KEYS})
        entry.update(
            ppl_base=record.get("ppl_reference"),
            kld_mean_per_file=[seg["kld_mean"] for seg in record.get("segments", [])],
            kld_mean_common=common[entry["id"]],
            winner=False,
            tie_with=[],
        )
    winners = {str(k): measured.groups[str(k)]["winner"] for k in settings.keeps}
    for entry in candidates:
        if entry["id"] in winners.values():
            entry.update(winner=True, tie_with=measured.records[entry["id"]]["tie_with"])
    for found in searched:
        record = found["record"]
        entry = {
            "id": found["id"],
            "method": "search",
            "K": found["K"],
            "identical_to": None,
            **{key: record.get(key) for key in RECORD_KEYS},
            "ppl_base": record.get("ppl_reference"),
            "kld_mean_per_file": [seg["kld_mean"] for seg in record.get("segments", [])],
            "kld_mean_common": record.get("kld_mean"),
            "winner": False,
            "tie_with": [],
            "search": found["search"],
        }
        candidates.append(entry)
        texts[found["id"]] = found["text"]
        if found["search"]["beats_start"]:  # the K's winner is worse than the search's result beyond noise
            start = next(c for c in candidates if c["id"] == found["search"]["start"])
            start.update(winner=False, tie_with=[])
            entry["winner"] = True
            winners[str(found["K"])] = found["id"]
    winner = winners[str(settings.keeps[0])]
    if winner is None:
        raise BadInput("no candidate was scored on every held-out chunk", "give longer held-out text")
    write_text_atomic(out_dir / "expert-selection.json", texts[winner])
    timings["total_seconds"] = time.perf_counter() - started
    results = {
        "model": {
            "name": model.path.name,
            "architecture": layout.architecture,
            "expert_count": layout.expert_count,
            "expert_used_count": layout.expert_used_count,
        },
        "heldout": [{"path": seg.name, "n_ctx": seg.n_ctx, "n_chunk": seg.n_chunk} for seg in segments],
        "calibration_pass": {k: v for k, v in passed.items() if k != "seconds"},
        "keeps": list(settings.keeps),
        "winner": winner,
        "winners": winners,
        "halving": [
            {"K": k, "candidates": groups[number], **measured.groups[str(k)]} for number, k in enumerate(settings.keeps)
        ],
        "halving_rule": HALVING_RULE,
        "cliff": cliff(candidates, settings.methods, settings.keeps),
        "candidates": candidates,
        "left_out": left_out,
        "kld_method": "llama-perplexity's --kl-divergence from the unpruned model's full "
        "log-probs (base records, 16 bits), the pruned experts masked out of routing",
        "scoring_placement": compute.record(),
        "computed_on": computed.to_json(),
    }

    report = envelope(
        REPORT,
        inputs=[
            {"kind": "model", "name": model.path.name},
            *({"kind": "calibration", "name": p.name} for p in settings.calibration),
            *({"kind": "heldout", "name": p.name} for p in settings.heldout),
        ],
        parameters={
            "keeps": list(settings.keeps),
            "methods": list(asked),
            "ctx": settings.ctx,
            "chunks": settings.chunks,
            "max_tokens": settings.max_tokens,
            "seed": settings.seed,
            "stability": settings.stability,
            "search": settings.search,
            "search_passes": settings.search_passes,
        },
        results=results,
        timings=timings,
    )
    write_text_atomic(out_dir / "tune.json", json.dumps(report, indent=1, sort_keys=True, allow_nan=False) + "\n")
    write_text_atomic(out_dir / "tune.md", render_markdown(report))
    write_chart(candidates, list(settings.methods), out_dir / CHART)
    outputs = [
        out_dir / "tune.json",
        out_dir / "tune.md",
        out_dir / CHART,
        out_dir / "expert-selection.json",
        *(out_dir / "candidates" / f"{c['id']}.json" for c in candidates),
    ]
    return TuneResult(report, winner, outputs)
