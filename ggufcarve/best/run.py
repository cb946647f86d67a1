"""`ggufcarve best`: which model is best in a memory budget, pruned or unpruned, which K and which
quant, decided by measurement.

    result = best(Path("model.gguf"), BestSettings(memory=parse_memory("24GiB"), ladder=Path("ladders/q8-to-iq1.toml"),
                  calibration=(Path("cal.txt"),), heldout=(Path("wiki.txt"), Path("code.txt"))), Path("best"))
    result.report["winner"]["path"]  # models/<family>/<file>.gguf under the output directory

Stages, each timed (`timings`):
  fit         the candidates from fit's exact sizes (`candidates.choose_candidates`);
  calibration one decode pass for every criterion and every K, the imatrix from the same pass
              (`tune`'s, written to work/calibration.imatrix.gguf);
  tournament  every criterion's keep-set at every candidate K scored by masking (`tune`); the
              winner per K is the keep-set its rungs are built from, its masked mean KLD at the
              source's precision the bound of its rungs;
  builds      the unpruned rungs that fit; then per K, in order of its bound, unless the bound is
              no lower than the best measured metric of a fitting unpruned rung (no rung of that K
              is built: `stopped_early`, by how much it lost): prune once, remap the imatrix, the
              K's rungs (`quant.run`: resumable, each rung a job of its own);
  evaluation  every built candidate against the unpruned model on every held-out file, by
              successive halving over chunks (`tune.protocol.schedule`: the better half by the
              metric goes on with twice the chunks; the finalists get every chunk; a round
              scores a candidate from the first chunk again, at most twice a finalist's chunks
              in all; the unpruned rungs, already scored on every chunk, are ranked on the
              round's first chunks of their tables).
The answer: the finalist that fits with the lowest metric that passes the gate.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ggufcarve.best.candidates import PRUNED, UNPRUNED, Candidate
from ggufcarve.errors import BadInput
from ggufcarve.events import Event, Sink, ignore

REPORT = "best"
CHART = "best-pareto.png"
METRICS = ("kld_mean", "kld_p999", "ppl")  # lower is better
DEFAULT_METHODS = ("reap", "frequency", "ean", "weights")
SELECTION_RULE = ("successive halving over held-out chunks by the metric; among the finalists (every chunk scored) that fit the budget "
                  "by their built file plus the context's cache, the lowest metric that passes the gate")
BOUND_RULE = ("a K's masked mean KLD at the source's precision (tune's score) bounds its quantized rungs from below; "
              "when it is no lower than the best measured fitting unpruned rung's, no rung of that K is built")

# The reference release the costs are projected to: Qwen3.6-35B-A3B at Q8_0 (256 routed experts,
# top-8, 40 layers, 34 GiB; 3B of its 35B parameters active per token).
REFERENCE_MODEL = {"name": "35B-A3B Q8_0 (256 experts x 40 layers)", "bytes": 34 * 2**30, "active_fraction": 3 / 35}


@dataclass(frozen=True)
class BestSettings:
    memory: int
    ladder: Path
    heldout: tuple[Path, ...]
    calibration: tuple[Path, ...] = ()
    methods: tuple[str, ...] = DEFAULT_METHODS
    ctx: int = 16384  # the context whose cache counts against the budget
    kv_type: str = "F16"
    eval_ctx: int = 512  # tokens per chunk of the calibration pass and the scoring
    chunks: int | None = None
    max_tokens: int | None = None
    threads: int | None = None
    metric: str = "kld_mean"
    gate: Path | None = None
    gpu_memory: int | None = None
    quantizer: str = "auto"
    llama_cpp_dir: Path | None = None
    only: tuple[str, ...] = ()  # build only these candidate ids, score nothing (a job of several hosts)


@dataclass
class BestResult:
    report: dict[str, Any]
    outputs: list[Path] = field(default_factory=list)


@dataclass
class Plan:
    """What `best` will do, before anything is written (the dry run prints it)."""

    model: Any
    layout: Any
    spec: Any
    fit: Any
    candidates: list[Candidate]
    kept_counts: list[int]  # the pruned K values to tune and build
    seconds: float


def plan_best(source: Path, settings: BestSettings, *, on_event: Sink = ignore) -> Plan:
    """Check the inputs and choose the candidates from fit's sizes; nothing is written."""
    from ggufcarve.best.candidates import choose_candidates
    from ggufcarve.gguf.container import read_model
    from ggufcarve.moe.layout import inspect_layout
    from ggufcarve.quant.fit import plan_fit
    from ggufcarve.quant.kvcache import ContextSettings
    from ggufcarve.quant.quantizer import make_quantizer
    from ggufcarve.quant.spec import load_spec

    started = time.perf_counter()
    if settings.metric not in METRICS:
        raise BadInput(f"--metric {settings.metric!r} is not one of {', '.join(METRICS)}", "kld_mean ranks by mean KLD against the unpruned model")
    if not settings.heldout:
        raise BadInput("best scores candidates on held-out text", "give --heldout FILE (repeatable)")
    if not settings.calibration:
        raise BadInput("best chooses keep-sets from a calibration pass", "give --calibration FILE (repeatable)")
    for path in (*settings.calibration, *settings.heldout):
        if not Path(path).is_file():
            raise BadInput(f"{path}: no such file", "give an existing text file")
    model = read_model(source)
    layout = inspect_layout(model)
    spec = load_spec(settings.ladder)
    fit = plan_fit(model, layout, spec, memory=settings.memory, context=ContextSettings(settings.ctx, settings.kv_type, settings.kv_type),
                   quantizer=make_quantizer(settings.quantizer, settings.llama_cpp_dir), on_event=on_event)
    candidates = choose_candidates(fit)
    if not candidates:
        smallest = min(r.total for r in fit.rows)
        raise BadInput(f"nothing fits in {settings.memory} bytes: the smallest rung with its cache takes {smallest}", "give a larger --memory, a shorter --ctx or --kv-type q8_0")
    kept = sorted({c.kept for c in candidates if c.family == PRUNED})
    return Plan(model, layout, spec, fit, candidates, kept, time.perf_counter() - started)


# ---------------------------------------------------------------------------------------------
# Measured speed and the cost estimate


def expert_bytes(model: Any) -> int:
    """Bytes of the routed experts' tensors (the `_exps` tensors of llama.cpp's names)."""
    return sum(t.nbytes for t in model.tensors if "_exps." in t.name)


def active_fraction(model: Any, layout: Any) -> float:
    """The share of the file's bytes one token reads: every tensor but the routed experts, and top-k of n of those."""
    total = model.total_bytes
    experts = expert_bytes(model)
    return (total - experts + experts * layout.expert_used_count / layout.expert_count) / total


def measure_speed(source: Path, plan: Plan, settings: BestSettings, work: Path, on_event: Sink = ignore) -> dict[str, Any]:
    """The machine's speed on this model for a few seconds: the quantizer's bytes per second (the
    source quantized to the ladder's last rung without an imatrix need, when the source is at most
    2 GiB) and prompt decoding in tokens per second (two chunks of the first held-out file), plus
    the token counts of the calibration and held-out texts."""
    from ggufcarve.evaluate.protocol import Request
    from ggufcarve.evaluate.spawn import run_child
    from ggufcarve.llama.tools import physical_cores
    from ggufcarve.quant.quantizer import QuantizeJob, make_quantizer

    threads = settings.threads or physical_cores()
    out: dict[str, Any] = {"threads": threads}
    decode_seconds, decode_tokens = 0.0, 0
    for role, paths in (("heldout", settings.heldout), ("calibration", settings.calibration)):
        total = 0
        for number, path in enumerate(paths):
            request = Request(model=str(source), threads=threads, n_ctx=settings.eval_ctx, result_out=str(work / f"speed-{role}-{number}.json"),
                              text=str(path), max_chunks=2 if role == "heldout" and number == 0 else 1)
            result = run_child(request, f"measure {path.name}", on_event, work)
            if "bad_input" in result:
                raise BadInput(f"{path}: {result['bad_input']}", "give a longer text or a smaller --eval-ctx")
            total += int(result["n_tokens"])
            if role == "heldout" and number == 0:
                decode_seconds, decode_tokens = float(result.get("score_seconds", 0.0)), int(result["n_chunk"]) * int(result["n_ctx"])
        out[f"{role}_tokens"] = total
    out["decode_tok_s"] = decode_tokens / decode_seconds if decode_seconds > 0 else None
    out["quantize_bytes_s"] = None
    rung = next((r for r in reversed(plan.spec.rungs) if not r.needs_imatrix), None)
    if rung is not None and plan.model.total_bytes <= 2 * 2**30:
        quantizer = make_quantizer(settings.quantizer, settings.llama_cpp_dir)
        target = work / "speed-quantized.gguf"
        job = QuantizeJob(source, target, rung.ftype, None, True, rung.output_tensor_type, rung.token_embedding_type, rung.tensor_types, rung.pure, False, threads)
        started = time.perf_counter()
        run = quantizer.run(job)
        seconds = time.perf_counter() - started
        target.unlink(missing_ok=True)
        if run.returncode == 0 and seconds > 0:
            out["quantize_bytes_s"] = plan.model.total_bytes / seconds
            out["quantize_rung"] = rung.name
    return out


def estimate(plan: Plan, settings: BestSettings, speed: dict[str, Any]) -> dict[str, Any]:
    """Upper estimates of each stage's seconds from the measured speed (None where not measured)."""
    rate, qrate = speed.get("decode_tok_s"), speed.get("quantize_bytes_s")
    cal_tokens = speed["calibration_tokens"] if settings.max_tokens is None else min(settings.max_tokens, speed["calibration_tokens"])
    held = speed["heldout_tokens"]
    if settings.chunks:
        held = min(held, settings.chunks * settings.eval_ctx * len(settings.heldout))
    n_keep_sets = len(plan.kept_counts) * len(settings.methods)
    n_built = len(plan.candidates)
    source_bytes = plan.model.total_bytes
    stages = {
        "calibration": cal_tokens / rate if rate else None,
        "tournament": (1 + 2 * n_keep_sets) * held / rate if rate else None,  # the reference, then each keep-set at most twice its share
        "builds": (len(plan.kept_counts) + n_built) * source_bytes / qrate if qrate else None,  # a prune and a quantization of the source's size each
        "evaluation": (len(settings.heldout) + 2 * n_built) * held / rate if rate else None,  # references, then candidates by halving
    }
    known = [v for v in stages.values() if v is not None]
    return {"stages": stages, "total": sum(known) if len(known) == len(stages) else None,
            "disk_bytes": sum(c.file_bytes for c in plan.candidates) + len(plan.kept_counts) * source_bytes}


def projection(model: Any, layout: Any, timings: dict[str, float]) -> dict[str, Any]:
    """The measured stage seconds scaled to REFERENCE_MODEL: decoding stages by the bytes one
    token reads (file bytes x active fraction), builds by the file bytes; the same texts, K
    values and candidate count assumed."""
    decode_scale = REFERENCE_MODEL["bytes"] * REFERENCE_MODEL["active_fraction"] / (model.total_bytes * active_fraction(model, layout))
    build_scale = REFERENCE_MODEL["bytes"] / model.total_bytes
    scaled = {stage: timings.get(f"{stage}_seconds", 0.0) * (build_scale if stage == "builds" else decode_scale)
              for stage in ("calibration", "tournament", "builds", "evaluation")}
    return {"model": REFERENCE_MODEL["name"], "rule": "decoding stages x (bytes read per token there / here); builds x (file bytes there / here)",
            "decode_scale": decode_scale, "build_scale": build_scale, "stages_seconds": scaled, "total_seconds": sum(scaled.values())}


# ---------------------------------------------------------------------------------------------
# How to run a candidate


def offload_arguments(path: Path, cache_bytes: int, gpu_memory: int | None) -> tuple[list[str], dict[str, Any] | None]:
    """The llama.cpp arguments that place `path` on a GPU of `gpu_memory` bytes, and the offload
    record (quant.offload: the file whole, else the smallest --n-cpu-moe N from the per-block
    expert bytes of the rung file, with the equal -ot regex; none when even every expert on the
    CPU leaves too much for the GPU)."""
    if gpu_memory is None:
        return [], None
    from ggufcarve.gguf.container import read_model
    from ggufcarve.quant.offload import plan_offload, weight_placement

    offload = plan_offload(weight_placement(read_model(path)), gpu_memory=gpu_memory, cache_bytes=cache_bytes)
    record = {**offload.to_json(), "placement": offload.label()}
    if offload.n_cpu_moe is None:
        return [], record
    return ["-ngl", "99", *(["--n-cpu-moe", str(offload.n_cpu_moe)] if offload.n_cpu_moe else [])], record


def run_command(path: Path, settings: BestSettings, cache_bytes: int) -> dict[str, Any]:
    """The llama-server command line of a candidate at the budget's context."""
    argv = ["llama-server", "-m", path.name, "-c", str(settings.ctx)]
    if settings.kv_type != "F16":
        argv += ["-ctk", settings.kv_type.lower(), "-ctv", settings.kv_type.lower(), "-fa", "on"]
    gpu, offload = offload_arguments(path, cache_bytes, settings.gpu_memory)
    return {"argv": argv + gpu, "gpu": offload}


# ---------------------------------------------------------------------------------------------
# Builds


def _tune(source: Path, plan: Plan, settings: BestSettings, out_dir: Path, imatrix: Path, on_event: Sink) -> dict[str, Any]:
    """tune's report for the candidate K values: the one written under out_dir/tune when its
    parameters and its inputs' names match and no input changed after it, else a new run."""
    from ggufcarve.tune.run import TuneSettings, tune

    tune_dir = out_dir / "tune"
    parameters = {"keeps": plan.kept_counts, "methods": list(settings.methods), "ctx": settings.eval_ctx, "chunks": settings.chunks, "max_tokens": settings.max_tokens}
    inputs = [{"kind": "model", "name": source.name}, *({"kind": "calibration", "name": p.name} for p in settings.calibration),
              *({"kind": "heldout", "name": p.name} for p in settings.heldout)]
    try:
        previous = json.loads((tune_dir / "tune.json").read_text())
        newest_input = max(p.stat().st_mtime for p in (source, *settings.calibration, *settings.heldout))
        if (imatrix.is_file() and all(previous["parameters"].get(k) == v for k, v in parameters.items()) and previous["inputs"] == inputs
                and (tune_dir / "tune.json").stat().st_mtime >= newest_input):
            previous["reused"] = True
            return previous
    except (OSError, ValueError, KeyError):
        pass
    result = tune(source, TuneSettings(keeps=tuple(plan.kept_counts), methods=settings.methods, calibration=settings.calibration, heldout=settings.heldout,
                                       ctx=settings.eval_ctx, chunks=settings.chunks, max_tokens=settings.max_tokens, threads=settings.threads, imatrix_out=imatrix),
                  tune_dir, on_event=on_event)
    return result.report


def _ladder(spec_path: Path, source: Path, out_dir: Path, rungs: list[str], imatrix: Path | None, name: str, settings: BestSettings, on_event: Sink) -> dict[str, Path]:
    from ggufcarve.errors import ToolFailed
    from ggufcarve.quant.quantizer import make_quantizer
    from ggufcarve.quant.run import plan_ladder, run_ladder
    from ggufcarve.quant.spec import load_spec

    spec = load_spec(spec_path)
    needs = any(r.needs_imatrix for r in spec.select(rungs))
    ladder_plan = plan_ladder(spec, source, out_dir, quantizer=make_quantizer(settings.quantizer, settings.llama_cpp_dir), imatrix=imatrix if needs else None,
                              only=rungs, model_name=name, nthreads=settings.threads, on_event=on_event)
    result = run_ladder(ladder_plan, on_event=on_event)
    if result.failed:
        failed = result.failed[0]
        raise ToolFailed(f"rung {failed.name} failed: {failed.error}", "see the quantizer's last lines; run best again (built rungs are kept)")
    return {p.rung.name: p.output for p in ladder_plan.rungs}


def _prune(plan: Plan, keep_file: Path, kept: int, work: Path, imatrix: Path, on_event: Sink) -> tuple[Path, Path]:
    """The source pruned to the keep-set of `keep_file`, and the imatrix remapped to it (kept when already written)."""
    from ggufcarve.gguf.container import read_model
    from ggufcarve.imatrix.formats import read_imatrix
    from ggufcarve.imatrix.remap import execute_remap, plan_remap, resolve_source_layout
    from ggufcarve.moe.keepset import keepset_from_provenance, load_keepset
    from ggufcarve.moe.layout import inspect_layout
    from ggufcarve.prune.execute import execute
    from ggufcarve.prune.plan import plan_prune

    keepset = load_keepset(keep_file, plan.layout)
    pruned_path = work / f"pruned-K{kept}.gguf"
    remapped = work / f"pruned-K{kept}.imatrix.gguf"
    if pruned_path.is_file() and remapped.is_file():
        existing = read_model(pruned_path)
        recorded = keepset_from_provenance(existing.get, pruned_path.name)
        if recorded is not None and recorded.layers == keepset.layers:
            return pruned_path, remapped
    prune_plan = plan_prune(plan.model, plan.layout, keepset, pruned_path)
    execute(prune_plan, plan.model, force=True, on_event=on_event)
    source_imatrix = read_imatrix(imatrix)
    pruned = read_model(pruned_path)
    layout = resolve_source_layout(source_imatrix, pruned, inspect_layout(pruned), plan.layout)
    remap_plan = plan_remap(source_imatrix, keepset, layout, remapped, output_format="gguf", pruned=pruned, source=plan.model)
    execute_remap(remap_plan, force=True, sources=[*pruned.paths, *plan.model.paths], on_event=on_event)
    return pruned_path, remapped


# ---------------------------------------------------------------------------------------------
# The search


def _metric(record: dict[str, Any], metric: str) -> float:
    value = record.get(metric)
    return math.inf if value is None else float(value)


def _judge(gate: Any, record: dict[str, Any]) -> tuple[bool, list[str]]:
    if gate is None:
        return True, []
    doc = dict(record)
    doc["ppl_delta_percent"] = 100.0 * (record["ppl"] / record["ppl_reference"] - 1.0) if record.get("ppl") and record.get("ppl_reference") else None
    verdict = gate.judge(doc)
    return verdict.verdict == "PASS", list(verdict.failed)


def best(source: Path, settings: BestSettings, out_dir: Path, *, plan: Plan | None = None, on_event: Sink = ignore) -> BestResult:
    """Search the candidates; write best.json, best.md, best-pareto.png and plan.toml under `out_dir`, the models under out_dir/models."""
    import tempfile

    from ggufcarve.best.render import chart, markdown, plan_document, write_plan
    from ggufcarve.best.score import candidate_statistics, references_per_file, score_model
    from ggufcarve.evaluate.protocol import EvalSettings
    from ggufcarve.fileio import write_text_atomic
    from ggufcarve.llama.tools import physical_cores
    from ggufcarve.quant.run import model_name_from
    from ggufcarve.reports import envelope
    from ggufcarve.tune.protocol import schedule

    started = time.perf_counter()
    plan = plan or plan_best(source, settings, on_event=on_event)
    wanted = set(settings.only) if settings.only else None
    if wanted is not None and (unknown := wanted - {c.id for c in plan.candidates}):  # before anything is written
        raise BadInput(f"--only {', '.join(sorted(unknown))}: not a candidate", f"candidates: {', '.join(c.id for c in plan.candidates)}")
    timings: dict[str, float] = {"fit_seconds": plan.seconds}
    out_dir.mkdir(parents=True, exist_ok=True)
    work = out_dir / "work"
    work.mkdir(exist_ok=True)
    models_dir = out_dir / "models"
    imatrix = work / "calibration.imatrix.gguf"
    gate = None
    if settings.gate is not None:
        from ggufcarve.evaluate.gate import load_gate

        gate = load_gate(settings.gate)

    tuned = _tune(source, plan, settings, out_dir, imatrix, on_event) if plan.kept_counts else None
    if tuned is not None:  # a reused tune counts with the seconds it took when it ran
        timings["calibration_seconds"] = tuned["timings"].get("calibration_seconds", 0.0)
        timings["tournament_seconds"] = tuned["timings"].get("total_seconds", 0.0) - timings["calibration_seconds"]
    bound: dict[int, dict[str, Any]] = {}
    if tuned is not None:
        by_id = {c["id"]: c for c in tuned["candidates"]}
        for k in plan.kept_counts:
            winner = by_id[tuned["winners"][str(k)]]
            bound[k] = {"keep_set": winner["id"], "method": winner["method"], "kld_mean": winner["kld_mean"], "file": out_dir / "tune" / "candidates" / f"{winner['id']}.json"}

    base = model_name_from(source)
    records: dict[str, dict[str, Any]] = {}
    for c in plan.candidates:
        records[c.id] = {**c.to_json(), "predicted_file_bytes": c.file_bytes, "selection": None, "keep_set": None, "masked_kld_mean": None, "built": False, "stopped_early": False,
                         "stopped_reason": None, "lost_by": None, "chunks_scored": 0, "path": None, "segments": [],
                         **dict.fromkeys(("kld_mean", "kld_mean_stderr", "kld_p999", "same_top_p", "ppl"))}
        if c.family == PRUNED:
            b = bound[c.kept]
            records[c.id].update(selection=b["method"], keep_set=b["keep_set"], masked_kld_mean=b["kld_mean"])
        else:
            records[c.id]["selection"] = "none (every expert kept)"

    eval_settings = EvalSettings(ctx=settings.eval_ctx, chunks=settings.chunks, threads=settings.threads or physical_cores(), speed=None)
    tables: dict[str, Any] = {}
    build_seconds = 0.0
    eval_seconds = 0.0
    with tempfile.TemporaryDirectory(prefix="ggufcarve-best-") as tmp:
        scratch = Path(tmp)
        segments = []
        names: list[str] = []
        if wanted is None:
            t0 = time.perf_counter()
            segments = references_per_file(source, list(settings.heldout), eval_settings, scratch, on_event)
            names = [s.name for s in segments]
            eval_seconds += time.perf_counter() - t0
        n_chunks = max((s.n_chunk for s in segments), default=0)

        def built(c: Candidate, path: Path) -> None:
            size = path.stat().st_size
            records[c.id].update(built=True, path=path, file_bytes=size, fits=size + c.cache_bytes <= settings.memory)

        # the unpruned rungs first: their measurements bound the pruned K values
        unpruned = [c for c in plan.candidates if c.family == UNPRUNED and (wanted is None or c.id in wanted)]
        if unpruned:
            t0 = time.perf_counter()
            paths = _ladder(settings.ladder, source, models_dir / UNPRUNED,
                            [c.quant for c in unpruned], imatrix if imatrix.is_file() else None, base, settings, on_event)
            for c in unpruned:
                built(c, paths[c.quant])
            build_seconds += time.perf_counter() - t0
        best_unpruned = math.inf
        if wanted is None:
            t0 = time.perf_counter()
            for c in unpruned:
                tables[c.id] = score_model(records[c.id]["path"], c.id, segments, eval_settings, scratch, n_chunks, on_event)
                stats = candidate_statistics(tables[c.id], names)
                records[c.id].update(stats, chunks_scored=tables[c.id].max_chunks)
                passed, _ = _judge(gate, stats)
                if records[c.id]["fits"] and passed:
                    best_unpruned = min(best_unpruned, _metric(stats, "kld_mean"))
            eval_seconds += time.perf_counter() - t0

        for k in sorted(plan.kept_counts, key=lambda k: bound[k]["kld_mean"]):
            rungs = [c for c in plan.candidates if c.family == PRUNED and c.kept == k and (wanted is None or c.id in wanted)]
            if not rungs:
                continue
            lower = bound[k]["kld_mean"]
            if wanted is None and lower >= best_unpruned:
                for c in rungs:
                    records[c.id].update(stopped_early=True, stopped_reason="bound", lost_by=lower - best_unpruned)
                on_event(Event("best", 0, 0, "steps", f"not building K={k}, its masked mean KLD {lower:.4f} is no lower than {best_unpruned:.4f} measured"))
                continue
            t0 = time.perf_counter()
            pruned_path, remapped = _prune(plan, bound[k]["file"], k, work, imatrix, on_event)
            paths = _ladder(settings.ladder, pruned_path, models_dir / f"K{k}", [c.quant for c in rungs], remapped, f"{base}-{k}e", settings, on_event)
            for c in rungs:
                built(c, paths[c.quant])
            build_seconds += time.perf_counter() - t0
        timings["builds_seconds"] = build_seconds

        halving: list[dict[str, Any]] = []
        if wanted is None:
            t0 = time.perf_counter()
            pool = [cid for cid, r in records.items() if r["built"]]
            alive = list(pool)
            rounds = schedule(len(alive), n_chunks) if alive else []
            for number, (_, chunks) in enumerate(rounds):
                for cid in alive:
                    have = tables.get(cid)
                    if have is None or have.max_chunks < min(chunks, n_chunks):
                        tables[cid] = score_model(records[cid]["path"], cid, segments, eval_settings, scratch, chunks, on_event)
                stats = {cid: candidate_statistics(tables[cid].first(chunks), names) for cid in alive}
                ranked = sorted(alive, key=lambda cid: (_metric(stats[cid], settings.metric), cid))
                last = number == len(rounds) - 1
                keep = ranked if last else ranked[: math.ceil(len(ranked) / 2)]
                halving.append({"chunks": chunks, "scored": ranked, "kept": keep})
                for cid in ranked:
                    records[cid].update(stats[cid], chunks_scored=max(tables[cid].first(chunks).chunks))
                if not last:
                    leader = _metric(stats[keep[0]], settings.metric)
                    for cid in ranked[len(keep):]:
                        records[cid].update(stopped_early=True, stopped_reason="halving",
                                            lost_by=_metric(records[cid], settings.metric) - leader)
                alive = keep
            eval_seconds += time.perf_counter() - t0
    timings["evaluation_seconds"] = eval_seconds

    for r in records.values():
        if r["built"] and r.get("kld_mean") is not None:
            r["gate_passed"], r["gate_failed"] = _judge(gate, r)
            r["run_command"] = run_command(Path(r["path"]), settings, r["cache_bytes"])
    finalists = [r for r in records.values() if r["built"] and not r["stopped_early"] and r.get("kld_mean") is not None]
    passing = [r for r in finalists if r["fits"] and r["gate_passed"]]
    winner = min(passing, key=lambda r: (_metric(r, settings.metric), r["file_bytes"])) if passing else None
    timings["total_seconds"] = time.perf_counter() - started
    for stage in ("calibration", "tournament"):
        timings.setdefault(f"{stage}_seconds", 0.0)

    def public(r: dict[str, Any]) -> dict[str, Any]:
        doc = {k: v for k, v in r.items() if k != "path"}
        doc["path"] = str(Path(r["path"]).relative_to(out_dir)) if r["path"] else None
        return doc

    candidates = [public(r) for r in sorted(records.values(), key=lambda r: (r["file_bytes"], r["id"]))]
    results = {
        "model": {"name": source.name, "architecture": plan.layout.architecture, "expert_count": plan.layout.expert_count,
                  "expert_used_count": plan.layout.expert_used_count, "bytes": plan.model.total_bytes},
        "memory_bytes": settings.memory, "cache": plan.fit.cache.to_json(),
        "heldout": [p.name for p in settings.heldout],
        "candidates": candidates,
        "winner": public(winner) if winner else None,
        "kept_counts": plan.kept_counts,
        "bounds": {str(k): {kk: vv for kk, vv in b.items() if kk != "file"} for k, b in bound.items()},
        "halving": halving,
        "selection_rule": SELECTION_RULE, "bound_rule": BOUND_RULE,
        "projection": projection(plan.model, plan.layout, timings),
        "only": sorted(wanted) if wanted else None,
        "tune_reused": bool(tuned and tuned.get("reused")),
    }
    parameters = {"memory_bytes": settings.memory, "ctx": settings.ctx, "kv_type": settings.kv_type.lower(), "eval_ctx": settings.eval_ctx,
                  "chunks": settings.chunks, "max_tokens": settings.max_tokens, "methods": list(settings.methods), "metric": settings.metric,
                  "gate": settings.gate.name if settings.gate else None, "gpu_memory_bytes": settings.gpu_memory, "ladder": plan.spec.name}
    report = envelope(REPORT, inputs=[{"kind": "model", "name": source.name}, *({"kind": "calibration", "name": p.name} for p in settings.calibration),
                                      *({"kind": "heldout", "name": p.name} for p in settings.heldout)],
                      parameters=parameters, results=results, timings=timings)
    outputs: list[Path] = []
    if wanted is None:
        write_text_atomic(out_dir / "best.json", json.dumps(report, indent=1, sort_keys=True, allow_nan=False) + "\n")
        write_text_atomic(out_dir / "best.md", markdown(report))
        chart(report, out_dir / CHART)
        outputs = [out_dir / "best.json", out_dir / "best.md", out_dir / CHART]
        if winner is not None:
            outputs.append(write_plan(plan_document(report, source, settings, out_dir, imatrix), out_dir))
    return BestResult(report, outputs)
