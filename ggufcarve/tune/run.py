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

import numpy as np

from ggufcarve import settings as S
from ggufcarve.errors import BadInput
from ggufcarve.events import Sink, ignore
from ggufcarve.llama.devices import Compute
from ggufcarve.measure.statistics import DEFAULT_Z
from ggufcarve.select.criteria import ALL_METHODS, IMATRIX_METHODS, TRACE_METHODS, ZERO_SHOT
from ggufcarve.settings import key, required

REPORT = "tune"
CHART = "tune-kld.png"
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
    z: float = (
        DEFAULT_Z  # a candidate leaves a round when worse than the leader by more than z standard errors (paired)
    )
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


def split_text(path: Path) -> tuple[str, str]:
    """A calibration file's two halves: a JSONL file's records split in half by count; a text file
    split at the line break nearest its middle character."""
    text = Path(path).read_text(encoding="utf-8")
    if Path(path).suffix.lower() == ".jsonl":
        lines = [line for line in text.splitlines() if line.strip()]
        half = len(lines) // 2
        return "\n".join(lines[:half]) + "\n", "\n".join(lines[half:]) + "\n"
    middle = len(text) // 2
    before, after = text.rfind("\n", 0, middle), text.find("\n", middle)
    candidates = [i for i in (before, after) if 0 <= i < len(text) - 1]
    if not candidates:
        raise BadInput(
            f"{path}: one line only, no half to split off",
            "give calibration text of several lines, or leave out --stability",
        )
    cut = min(candidates, key=lambda i: abs(i - middle)) + 1
    return text[:cut], text[cut:]


def overlap(a: dict[str, list[int]], b: dict[str, list[int]]) -> dict[str, Any]:
    """Per block |A∩B|/|A| of two keep-sets (block -> kept expert ids), and its mean over blocks."""
    per_block = [len(set(a[blk]) & set(b[blk])) / len(a[blk]) for blk in sorted(a, key=int) if a[blk]]
    return {"overlap": float(np.mean(per_block)) if per_block else 1.0, "per_block": per_block}


def _half_scores(model: Any, layout: Any, settings: TuneSettings, work: Path, on_event: Sink) -> list[dict[str, Any]]:
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

    if not settings.heldout:
        raise BadInput("tune scores keep-sets on held-out text", "give --heldout FILE (repeatable)")
    check_z(settings.z)
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
        return _tune(model, layout, settings, out_dir, work, started, on_event, asked, left_out)
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
) -> TuneResult:
    from ggufcarve.fileio import write_text_atomic
    from ggufcarve.llama.masking import required_nodes
    from ggufcarve.llama.tools import physical_cores
    from ggufcarve.measure.tournament import Candidate, MeasureSettings, measure, measure_tables, prepare_segments
    from ggufcarve.moe.keepset import KeepSet
    from ggufcarve.reports import envelope
    from ggufcarve.select.keep import choose

    timings: dict[str, float] = {}
    scores, passed, filled = calibration_scores(model, layout, settings, work, on_event)
    timings["calibration_seconds"] = passed.get("seconds", 0.0)
    halves: list[dict[str, Any]] = []
    if settings.stability:
        started_halves = time.perf_counter()
        halves = _half_scores(model, layout, settings, work, on_event)
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
    _chart(candidates, settings, out_dir / CHART)
    outputs = [
        out_dir / "tune.json",
        out_dir / "tune.md",
        out_dir / CHART,
        out_dir / "expert-selection.json",
        *(out_dir / "candidates" / f"{c['id']}.json" for c in candidates),
    ]
    return TuneResult(report, winner, outputs)


HALVING_RULE = (
    "successive halving over held-out units spread over every "
    "file; after each round a candidate leaves when its paired "
    "per-token KLD difference to the round's leader exceeds z standard errors; the finalists are scored on every unit"
)
CLIFF_RULE = (
    "the K with the largest rise in slope of mean KLD against K: over the K given in ascending order, "
    "(slope to the next K) - (slope from the previous K); at least 3 K, else none"
)


def knee(points: list[tuple[int, float]]) -> int | None:
    """The K of `points` (K, mean KLD) where the slope of KLD against K rises most (`CLIFF_RULE`):
    below it KLD climbs steeply as experts are dropped, above it the curve is flat."""
    points = sorted(points)
    best, best_rise = None, None
    for (k0, y0), (k1, y1), (k2, y2) in zip(points, points[1:], points[2:]):
        rise = (y2 - y1) / (k2 - k1) - (y1 - y0) / (k1 - k0)
        if best_rise is None or rise > best_rise:
            best, best_rise = k1, rise
    return best


def cliff(candidates: list[dict[str, Any]], methods: tuple[str, ...], keeps: tuple[int, ...]) -> dict[str, Any]:
    """Per method and for the best candidate per K: the curve of mean KLD against K and its knee.
    A method's curve compares its candidates on the units all of them were scored on
    (`kld_mean_common`, when given); the best per K is the winner of each K (scored on every unit)
    when the candidates name one, else the lowest mean KLD."""
    out: dict[str, Any] = {"rule": CLIFF_RULE, "methods": {}}
    for method in methods:
        curve = sorted((c["K"], c.get("kld_mean_common", c["kld_mean"])) for c in candidates if c["method"] == method)
        out["methods"][method] = {"K": knee(curve), "curve": [list(p) for p in curve]}
    best = []
    for k in keeps:
        at_k = [c for c in candidates if c["K"] == k]
        winners = [c for c in at_k if c.get("winner")]
        best.append((k, winners[0]["kld_mean"] if winners else min(c["kld_mean"] for c in at_k)))
    out["best"] = {"K": knee(sorted(best)), "curve": [list(p) for p in sorted(best)]}
    return out


def ranked(candidates: list[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """The candidates of one K: the most chunks first (the finalists), then by mean KLD."""
    return sorted((c for c in candidates if c["K"] == k), key=lambda c: (-c["chunks_scored"], c["kld_mean"], c["id"]))


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# tune: {report['model']['name']}",
        "",
        f"Mean KLD against the unpruned model (llama-perplexity's statistics), pruned experts masked out of routing; "
        f"ctx {report['parameters']['ctx']}, held-out: {', '.join(Path(f['path']).name for f in report['heldout'])}. "
        "Candidates stopped early were scored on fewer chunks: each left "
        "a round of successive halving when its paired per-token KLD "
        "difference to that round's leader exceeded two standard errors.",
        "",
    ]
    stable = any("stability" in c for c in report["candidates"])
    if stable:
        lines += [
            "Halves overlap: the method's keep-sets from the first and from the second half of the calibration text, "
            "mean over blocks of |A∩B|/K (1: the calibration decided every choice; near K/experts: chance).",
            "",
        ]
    for k in report["keeps"]:
        lines += [
            f"## K = {k} of {report['model']['expert_count']}",
            "",
            "| rank | method | mean KLD | ± | 99.9% KLD | same top p | PPL | chunks "
            f"| stopped early | identical to |{' halves overlap |' if stable else ''}",
            f"|---:|---|---:|---:|---:|---:|---:|---:|---|---|{'---:|' if stable else ''}",
        ]
        for rank, c in enumerate(ranked(report["candidates"], k), 1):
            name = f"**{c['method']}**" if c["winner"] else c["method"]
            overlap_cell = (f" {c['stability']['overlap']:.3f} |" if "stability" in c else " |") if stable else ""
            lines.append(
                f"| {rank} | {name} | {c['kld_mean']:.4f} | {c['kld_mean_stderr']:.4f} "
                f"| {c['kld_p999']:.4f} | {100 * c['same_top_p']:.2f}% | "
                f"{c['ppl']:.4f} | {c['chunks_scored']} | {'yes' if c['stopped_early'] else 'no'} "
                f"| {c['identical_to'] or ''} |{overlap_cell}"
            )
        lines.append("")
        tied = [c for c in ranked(report["candidates"], k) if c["winner"] and c.get("tie_with")]
        if tied:
            lines += [
                f"Tie within noise: {tied[0]['method']} and "
                f"{', '.join(tied[0]['tie_with'])} differ by less than two standard errors "
                "of their paired per-token KLD difference.",
                "",
            ]
        segmented = [c for c in ranked(report["candidates"], k) if len(c.get("segments") or []) > 1]
        if segmented:
            names = [seg["name"] for seg in segmented[0]["segments"]]
            lines += [
                "Mean KLD on each held-out file (its own segment; the same chunks as above):",
                "",
                "| method | " + " | ".join(names) + " |",
                "|---|" + "---:|" * len(names),
            ]
            for c in segmented:
                cells = " | ".join(
                    "–" if seg["kld_mean"] is None else f"{seg['kld_mean']:.4f}" for seg in c["segments"]
                )
                lines.append(f"| {c['method']} | {cells} |")
            lines.append("")
    cliff_of = report.get("cliff")
    if cliff_of and len(report["keeps"]) >= 3:
        lines += [
            "## Cliff",
            "",
            f"Knee of mean KLD against K ({cliff_of['rule']}); each method's curve "
            "compares its candidates on the chunks all of them were scored on.",
            "",
            "| method | knee K | mean KLD at each K |",
            "|---|---:|---|",
        ]
        rows = [*cliff_of["methods"].items(), ("best per K", cliff_of["best"])]
        for method, entry in rows:
            curve = ", ".join(f"{k}: {y:.4f}" for k, y in entry["curve"])
            lines.append(f"| {method} | {entry['K'] if entry['K'] is not None else ''} | {curve} |")
        lines.append("")
    lines += [f"{line}." for line in left_out_lines(report)]
    lines.append(f"Winner written as expert-selection.json: {report['winner']}.")
    return "\n".join(lines) + "\n"


def left_out_lines(report: dict[str, Any]) -> list[str]:
    """One line per method `all` left out: "greedy left out of all: <reason>"."""
    return [f"{method} left out of all: {reason}" for method, reason in report.get("left_out", {}).items()]


MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def method_style(index: int) -> tuple[str, str]:
    """(colour, marker) of the index-th method: tab10's ten colours by seven markers, distinct for 70 methods."""
    return f"C{index % 10}", MARKERS[index % len(MARKERS)]


def tune_figure(candidates: list[dict[str, Any]], methods: list[str]) -> Any:
    """Mean KLD of each method's candidates against K; at a single K, one bar per method."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=110, layout="constrained")  # no pyplot: no global figure state, no GUI backend
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    keeps = sorted({c["K"] for c in candidates})
    if len(keeps) == 1:
        shown = [m for m in methods if any(c["method"] == m for c in candidates)]
        for i, method in enumerate(shown):
            c = next(c for c in candidates if c["method"] == method)
            colour, _ = method_style(methods.index(method))
            ax.bar(
                i,
                c["kld_mean"],
                color="white" if c["stopped_early"] else colour,
                edgecolor=colour,
                hatch="//" if c["stopped_early"] else None,
                label=method,
            )
        ax.set_xticks(range(len(shown)), shown, rotation=45, ha="right", fontsize=8)
        ax.set_xlabel(f"selection method, K = {keeps[0]} experts kept per block")
        title = "hatched: stopped early by successive halving (fewer chunks)"
    else:
        for i, method in enumerate(methods):
            colour, marker = method_style(i)
            series = sorted((c for c in candidates if c["method"] == method), key=lambda c: c["K"])
            ax.plot(
                [c["K"] for c in series], [c["kld_mean"] for c in series], marker=marker, color=colour, label=method
            )
            early = [c for c in series if c["stopped_early"]]  # scored on fewer chunks: hollow
            ax.plot(
                [c["K"] for c in early],
                [c["kld_mean"] for c in early],
                linestyle="none",
                marker=marker,
                markerfacecolor="white",
                color=colour,
            )
        ax.set_xticks(keeps)
        ax.set_xlabel("experts kept per block (K)")
        ax.legend(fontsize=7, ncol=2)
        title = "hollow: stopped early by successive halving (fewer chunks)"
    ax.set_ylabel("mean KLD vs unpruned (nats/token)")
    ax.set_title(title, fontsize=8)
    ax.grid(True, alpha=0.3)
    return fig


def _chart(candidates: list[dict[str, Any]], settings: TuneSettings, path: Path) -> None:
    fig = tune_figure(candidates, list(settings.methods))
    from ggufcarve.fileio import save_figure

    save_figure(fig, path)
