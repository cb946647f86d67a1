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
               successive halving by paired per-token differences, candidates over the budget or
               failing the gate out before the final round, ties within noise reported;
  confirmation the winner (and `confirm` runners-up) scored by masking are built as real files and
               scored on every chunk; the file's mean KLD must lie within max(2 standard errors,
               1%) of the masked one (`confirmed`), else the run fails naming both.
The answer: the finalist with the lowest metric, or among those tied with it within noise the one
`prefer` names (the smaller file by default).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ggufcarve.best.candidates import PRUNED, UNPRUNED, Candidate
from ggufcarve.errors import BadInput, CarveError, ToolFailed
from ggufcarve.events import Sink, ignore
from ggufcarve.measure.statistics import DEFAULT_Z, METRICS, PREFERENCES
from ggufcarve.select.criteria import BEST_DEFAULT

REPORT = "best"
CHART = "best-pareto.png"
# a confirmed file's mean KLD may differ from its masked score by max(2 standard errors, this share)
CONFIRM_RELATIVE = 0.01
SELECTION_RULE = (
    "successive halving over held-out units by the paired per-token difference to each round's leader; among the "
    "finalists that run in the tier ranked in (memory as llama.cpp allocates it: weights, cache, compute and output "
    "buffers, per device) and pass the gate, the lowest metric, or among those tied with it within z standard errors "
    "the one --prefer names"
)

# The reference release the costs are projected to: Qwen3.6-35B-A3B at Q8_0 (256 routed experts,
# top-8, 40 layers, 34 GiB; 3B of its 35B parameters active per token).
REFERENCE_MODEL = {"name": "35B-A3B Q8_0 (256 experts x 40 layers)", "bytes": 34 * 2**30, "active_fraction": 3 / 35}


@dataclass(frozen=True)
class BestSettings:
    memory: int
    ladder: Path
    heldout: tuple[Path, ...]
    calibration: tuple[Path, ...] = ()
    methods: tuple[str, ...] = BEST_DEFAULT
    ctx: int = 16384  # the context whose cache counts against the budget
    kv_type: str = "F16"
    eval_ctx: int = 512  # tokens per chunk of the calibration pass and the scoring
    chunks: int | None = None
    max_tokens: int | None = None
    threads: int | None = None
    gpu_layers: int = 0  # layers offloaded to the accelerator in every llama.cpp child
    metric: str = "kld_mean"
    gate: Path | None = None
    gpu_memory: int | None = None
    keep_counts: str | None = None  # the K values weighed, as written (quant.fit.parse_kept_counts); None: fit's grid
    keep_file: Path | None = None  # a keep-set weighed at its K beside the criteria's (selection "keep-file")
    tier: str | None = (
        None  # quant.offload.TIERS: where the answer must run; None: the fastest tier any candidate runs in
    )
    quantizer: str = "auto"
    llama_cpp_dir: Path | None = None
    only: tuple[str, ...] = ()  # build only these candidate ids, score nothing (a job of several hosts)
    confirm: int = 1  # runners-up built and scored as files besides the winner
    prefer: str = "smaller"  # among candidates tied with the leader: smaller | faster | metric
    z: float = DEFAULT_Z


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
    kept_counts: list[int]  # the pruned K values
    quants: list[str]  # the unpruned rungs built (every candidate's quant, in ladder order)
    types: dict[
        tuple[int, str], list[tuple[str, str, str]]
    ]  # (K, quant) -> tensors whose type differs from the unpruned rung's
    seconds: float
    tier: str = "ram"  # the tier the candidates are ranked in (quant.offload.TIERS)


def run_memory_settings(settings: BestSettings) -> Any:
    """The run whose memory counts against the budget: llama-server's defaults at --ctx and --kv-type
    (a quantized V cache needs flash attention: on with q8_0, llama.cpp's auto otherwise)."""
    from ggufcarve.llama.memory import MemorySettings

    return MemorySettings(
        settings.ctx,
        settings.kv_type,
        flash_attn="on" if settings.kv_type.upper() != "F16" else "auto",
        gpu_layers=settings.gpu_layers,
    )


def measured_memory(path: Path, settings: BestSettings) -> Any:
    """Where a built file runs (quant.offload.Placed): llama.cpp's dry load of it at the run's
    settings, per device in the fastest tier it runs in, its offload and its tiers."""
    from ggufcarve.gguf.container import read_model
    from ggufcarve.llama.memory import dry_load, weight_bytes
    from ggufcarve.quant.offload import place, weight_placement

    load = dry_load(path, run_memory_settings(settings))
    return place(
        weight_placement(read_model(path)),
        weight_bytes(path),
        load,
        memory=settings.memory,
        gpu_memory=settings.gpu_memory,
    )


def built_record(path: Path, settings: BestSettings, tier: str) -> dict[str, Any]:
    """The memory keys of a built file's record: `memory` per device running in `tier`, its
    fastest `tier`, its `tiers`, and `fits` (it runs in `tier`)."""
    placed = measured_memory(path, settings)
    return {
        "memory": [d.to_json() for d in placed.devices(tier)],
        "memory_source": "measured: llama.cpp's dry load of the built file",
        "tier": placed.tiers[0],
        "tiers": list(placed.tiers),
        "fits": tier in placed.tiers,
    }


def plan_best(source: Path, settings: BestSettings, *, on_event: Sink = ignore) -> Plan:
    """Check the inputs and choose the candidates from fit's sizes; nothing is written."""
    from ggufcarve.best.candidates import choose_candidates
    from ggufcarve.evaluate.perplexity import read_text
    from ggufcarve.gguf.container import read_model
    from ggufcarve.moe.layout import inspect_layout
    from ggufcarve.quant.fit import plan_fit, types_differ
    from ggufcarve.quant.kvcache import ContextSettings
    from ggufcarve.quant.offload import TIERS
    from ggufcarve.quant.quantizer import make_quantizer
    from ggufcarve.quant.spec import load_spec

    started = time.perf_counter()
    if settings.metric not in METRICS:
        raise BadInput(
            f"--metric {settings.metric!r} is not one of {', '.join(METRICS)}",
            "kld_mean ranks by mean KLD against the unpruned model",
        )
    if settings.prefer not in PREFERENCES:
        raise BadInput(
            f"--prefer {settings.prefer!r} is not one of {', '.join(PREFERENCES)}",
            "smaller answers a tie within noise with the smaller file",
        )
    if settings.confirm < 0:
        raise BadInput(f"--confirm {settings.confirm}: a count of runners-up", "give 0 to confirm the winner alone")
    if not settings.heldout:
        raise BadInput("best scores candidates on held-out text", "give --heldout FILE (repeatable)")
    if not settings.calibration:
        raise BadInput("best chooses keep-sets from a calibration pass", "give --calibration FILE (repeatable)")
    for path in (*settings.calibration, *settings.heldout):
        if not Path(path).is_file():
            raise BadInput(f"{path}: no such file", "give an existing text file")
        if not read_text(Path(path).read_bytes()).strip():
            raise BadInput(f"{path}: the text is empty", "give a text file with content")
    if settings.tier is not None and settings.tier not in TIERS:
        raise BadInput(
            f"--tier {settings.tier!r} is not one of {', '.join(TIERS)}",
            "gpu: all on the GPU; gpu+cpu: --n-cpu-moe N; ram: system memory; disk: paging through mmap",
        )
    if settings.tier in ("gpu", "gpu+cpu") and settings.gpu_memory is None:
        raise BadInput(
            f"--tier {settings.tier} places the model on a GPU",
            "give --gpu-memory SIZE (the GPU's memory), or --tier ram",
        )
    model = read_model(source)
    layout = inspect_layout(model)
    spec = load_spec(settings.ladder)
    kept_counts = None
    if settings.keep_file is not None:
        from ggufcarve.moe.keepset import load_keepset

        kept_counts = [load_keepset(settings.keep_file, layout).kept_count, layout.expert_count]
    elif settings.keep_counts is not None:
        from ggufcarve.quant.fit import parse_kept_counts

        kept_counts = sorted(
            {*parse_kept_counts(settings.keep_counts, layout), layout.expert_count}
        )  # the unpruned rungs compete too
    fit = plan_fit(
        model,
        layout,
        spec,
        kept_counts=kept_counts,
        memory=settings.memory,
        context=ContextSettings(settings.ctx, settings.kv_type, settings.kv_type),
        quantizer=make_quantizer(settings.quantizer, settings.llama_cpp_dir),
        measure=run_memory_settings(settings),
        gpu_memory=settings.gpu_memory,
        on_event=on_event,
    )
    from ggufcarve.fileio import format_size

    tier = settings.tier or fit.fastest_tier()
    if tier == "disk" and settings.tier is None:
        tier = "ram"  # nothing runs faster than from disk: the search stops below with the smallest rung's figure
    candidates = choose_candidates(fit, tier)
    if not candidates and settings.tier is not None:
        raise BadInput(
            f"nothing runs in tier {tier} with {format_size(settings.memory)} of memory"
            + (f" and {format_size(settings.gpu_memory)} of GPU memory" if settings.gpu_memory else ""),
            f"the fastest tier any rung runs in is {fit.fastest_tier()}: give --tier {fit.fastest_tier()}",
        )
    if not candidates:
        smallest = min(r.total for r in fit.rows)
        raise BadInput(
            f"nothing fits in {format_size(settings.memory)}: the smallest "
            f"rung takes {format_size(smallest)} as llama.cpp allocates it "
            "(weights, cache, compute and output buffers)",
            "give a larger --memory, a shorter --ctx or --kv-type q8_0",
        )
    kept = sorted({c.kept for c in candidates if c.family == PRUNED})
    order = [r.name for r in spec.rungs]
    quants = sorted({c.quant for c in candidates}, key=order.index)
    n = layout.expert_count
    types = {
        (c.kept, c.quant): types_differ(fit.row(c.kept, c.quant).rung, fit.row(n, c.quant).rung)
        for c in candidates
        if c.family == PRUNED
    }
    return Plan(model, layout, spec, fit, candidates, kept, quants, types, time.perf_counter() - started, tier)


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


def measure_speed(
    source: Path, plan: Plan, settings: BestSettings, work: Path, on_event: Sink = ignore
) -> dict[str, Any]:
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
            request = Request(
                model=str(source),
                threads=threads,
                gpu_layers=settings.gpu_layers,
                n_ctx=settings.eval_ctx,
                result_out=str(work / f"speed-{role}-{number}.json"),
                text=str(path),
                max_chunks=2 if role == "heldout" and number == 0 else 1,
            )
            result = run_child(request, f"measure {path.name}", on_event, work)
            if "bad_input" in result:
                raise BadInput(f"{path}: {result['bad_input']}", "give a longer text or a smaller --chunk-ctx")
            total += int(result["n_tokens"])
            if role == "heldout" and number == 0:
                decode_seconds, decode_tokens = (
                    float(result.get("score_seconds", 0.0)),
                    int(result["n_chunk"]) * int(result["n_ctx"]),
                )
        out[f"{role}_tokens"] = total
    out["decode_tok_s"] = decode_tokens / decode_seconds if decode_seconds > 0 else None
    out["quantize_bytes_s"] = None
    rung = next((r for r in reversed(plan.spec.rungs) if not r.needs_imatrix), None)
    if rung is not None and plan.model.total_bytes <= 2 * 2**30:
        quantizer = make_quantizer(settings.quantizer, settings.llama_cpp_dir)
        target = work / "speed-quantized.gguf"
        job = QuantizeJob(
            source,
            target,
            rung.ftype,
            None,
            True,
            rung.output_tensor_type,
            rung.token_embedding_type,
            rung.tensor_types,
            rung.pure,
            False,
            threads,
        )
        started = time.perf_counter()
        run = quantizer.run(job)
        seconds = time.perf_counter() - started
        target.unlink(missing_ok=True)
        if run.returncode == 0 and seconds > 0:
            out["quantize_bytes_s"] = plan.model.total_bytes / seconds
            out["quantize_rung"] = rung.name
    return out


def estimate(plan: Plan, settings: BestSettings, speed: dict[str, Any]) -> dict[str, Any]:
    """Estimates of each stage's seconds from the measured speed (None where not measured).

    The tournament of C scored candidates over U held-out tokens follows the measurement layer's
    schedule (the first round covers U / 2^(ceil(log2 C) - 1), each next one twice as much),
    assuming half of the candidates leave after each round: the paired test lets more leave when
    they are clearly worse and fewer when they are close, so this is an estimate, not a bound. The
    references score U tokens once; builds are the unpruned rungs, the file-scored pruned rungs (a
    prune and a quantization of the source's size each) and the confirmations (1 + confirm: a
    prune, a quantization and a full scoring each)."""
    from ggufcarve.measure.tournament import schedule

    rate, qrate = speed.get("decode_tok_s"), speed.get("quantize_bytes_s")
    cal_tokens = (
        speed["calibration_tokens"]
        if settings.max_tokens is None
        else min(settings.max_tokens, speed["calibration_tokens"])
    )
    held = speed["heldout_tokens"]
    if settings.chunks:
        held = min(held, settings.chunks * settings.eval_ctx * len(settings.heldout))
    n_methods = len(settings.methods)
    pruned_pairs = [c for c in plan.candidates if c.family == PRUNED]
    masked = sum(n_methods for c in pruned_pairs if not plan.types[(c.kept, c.quant)])
    filed = sum(n_methods for c in pruned_pairs if plan.types[(c.kept, c.quant)])
    scored = masked + filed + sum(1 for c in plan.candidates if c.family == UNPRUNED)
    units = max(1, held // settings.eval_ctx)
    rounds = schedule(scored, units, len(settings.heldout))
    alive, previous, tournament_tokens = scored, 0, 0.0
    for number, n in enumerate(rounds):
        tournament_tokens += alive * (n - previous) / units * held
        alive, previous = (max(1, -(-alive // 2)) if number < len(rounds) - 1 else alive), n
    source_bytes = plan.model.total_bytes
    confirmations = min(1 + settings.confirm, masked)
    stages = {
        "calibration": cal_tokens / rate if rate else None,
        "references": held / rate if rate else None,
        "builds": (len(plan.quants) + 2 * filed + 2 * confirmations) * source_bytes / qrate if qrate else None,
        "tournament": tournament_tokens / rate if rate else None,
        "confirmation": confirmations * held / rate if rate else None,
    }
    known = [v for v in stages.values() if v is not None]
    return {
        "stages": stages,
        "total": sum(known) if len(known) == len(stages) else None,
        "scored_candidates": scored,
        "masked": masked,
        "file_scored": filed,
        "disk_bytes": sum(plan.fit.row(plan.layout.expert_count, q).rung.bytes for q in plan.quants)
        + (filed + confirmations) * source_bytes,
    }


STAGES = ("calibration", "references", "builds", "tournament", "confirmation")
DECODE_STAGES = ("calibration", "references", "tournament", "confirmation")


def project_estimate(plan: Plan, guess: dict[str, Any]) -> dict[str, Any]:
    """The dry run's estimate moved to REFERENCE_MODEL: the same plan of work (texts, candidates, builds),
    decoding at this machine's measured rate scaled by the bytes one token reads there and here,
    builds at the quantizer's measured bytes per second on the reference's file bytes. A rate
    measured on a small file includes fixed costs per process, so the projection is high there."""
    scale = (
        REFERENCE_MODEL["bytes"]
        * REFERENCE_MODEL["active_fraction"]
        / (plan.model.total_bytes * active_fraction(plan.model, plan.layout))
    )
    stages: dict[str, float | None] = {}
    for stage, seconds in guess["stages"].items():
        if seconds is None:
            stages[stage] = None
        elif stage == "builds":
            stages[stage] = seconds * REFERENCE_MODEL["bytes"] / plan.model.total_bytes
        else:
            stages[stage] = seconds * scale
    known = [v for v in stages.values() if v is not None]
    return {
        "model": REFERENCE_MODEL["name"],
        "stages": stages,
        "total": sum(known) if len(known) == len(stages) else None,
        "rule": "decoding x (bytes read per token there / here) at this "
        "machine's measured rate; builds x (file bytes there / here)",
    }


def projection(model: Any, layout: Any, timings: dict[str, float]) -> dict[str, Any]:
    """The measured stage seconds scaled to REFERENCE_MODEL: decoding stages by the bytes one
    token reads (file bytes x active fraction), builds by the file bytes; the same texts, K
    values and candidate count assumed."""
    decode_scale = (
        REFERENCE_MODEL["bytes"]
        * REFERENCE_MODEL["active_fraction"]
        / (model.total_bytes * active_fraction(model, layout))
    )
    build_scale = REFERENCE_MODEL["bytes"] / model.total_bytes
    scaled = {
        stage: timings.get(f"{stage}_seconds", 0.0) * (build_scale if stage == "builds" else decode_scale)
        for stage in STAGES
    }
    return {
        "model": REFERENCE_MODEL["name"],
        "rule": "decoding stages x (bytes read per token there / here); builds x (file bytes there / here)",
        "decode_scale": decode_scale,
        "build_scale": build_scale,
        "stages_seconds": scaled,
        "total_seconds": sum(scaled.values()),
    }


# ---------------------------------------------------------------------------------------------
# How to run a candidate


def offload_arguments(path: Path, settings: BestSettings) -> tuple[list[str], dict[str, Any] | None]:
    """The llama.cpp arguments that place `path` on the GPU of --gpu-memory, and the offload record
    (quant.offload: the file whole, else the smallest --n-cpu-moe N with the compute buffers
    counted, with the equal -ot regex; none when even every expert on the CPU leaves too much for
    the GPU)."""
    if settings.gpu_memory is None:
        return [], None
    offload = measured_memory(path, settings).offload
    record = {**offload.to_json(), "placement": offload.label()}
    if offload.n_cpu_moe is None:
        return [], record
    return ["-ngl", "99", *(["--n-cpu-moe", str(offload.n_cpu_moe)] if offload.n_cpu_moe else [])], record


def run_command(path: Path, settings: BestSettings) -> dict[str, Any]:
    """The llama-server command line of a candidate at the budget's context."""
    argv = ["llama-server", "-m", path.name, "-c", str(settings.ctx)]
    if settings.kv_type != "F16":
        argv += ["-ctk", settings.kv_type.lower(), "-ctv", settings.kv_type.lower(), "-fa", "on"]
    gpu, offload = offload_arguments(path, settings)
    return {"argv": argv + gpu, "gpu": offload}


# ---------------------------------------------------------------------------------------------
# Builds


def _ladder(
    spec_path: Path,
    source: Path,
    out_dir: Path,
    rungs: list[str],
    imatrix: Path | None,
    name: str,
    settings: BestSettings,
    on_event: Sink,
) -> dict[str, Path]:
    from ggufcarve.errors import ToolFailed
    from ggufcarve.quant.ladder_plan import plan_ladder
    from ggufcarve.quant.ladder_run import run_ladder
    from ggufcarve.quant.quantizer import make_quantizer
    from ggufcarve.quant.spec import load_spec

    spec = load_spec(spec_path)
    needs = any(r.needs_imatrix for r in spec.select(rungs))
    ladder_plan = plan_ladder(
        spec,
        source,
        out_dir,
        quantizer=make_quantizer(settings.quantizer, settings.llama_cpp_dir),
        imatrix=imatrix if needs else None,
        only=rungs,
        model_name=name,
        nthreads=settings.threads,
        on_event=on_event,
    )
    result = run_ladder(ladder_plan, on_event=on_event)
    if result.failed:
        failed = result.failed[0]
        raise ToolFailed(
            f"rung {failed.name} failed: {failed.error}",
            "see the quantizer's last lines; run best again (built rungs are kept)",
        )
    return {p.rung.name: p.output for p in ladder_plan.rungs}


def _prune_to(plan: Plan, keep_file: Path, pruned_path: Path, imatrix: Path, on_event: Sink) -> tuple[Path, Path]:
    """The source pruned to the keep-set of `keep_file` at `pruned_path`, and the imatrix remapped to
    it beside it (both kept when the pruned file already records that keep-set)."""
    from ggufcarve.gguf.container import read_model
    from ggufcarve.imatrix.remap import execute_remap, plan_remap, resolve_source_layout
    from ggufcarve.imatrix_format import read_imatrix
    from ggufcarve.moe.keepset import keepset_from_provenance, load_keepset
    from ggufcarve.moe.layout import inspect_layout
    from ggufcarve.prune.execute import execute
    from ggufcarve.prune.plan import plan_prune

    keepset = load_keepset(keep_file, plan.layout)
    remapped = pruned_path.with_suffix(".imatrix.gguf")
    if pruned_path.is_file() and remapped.is_file():
        recorded = keepset_from_provenance(read_model(pruned_path).get, pruned_path.name)
        if recorded is not None and recorded.layers == keepset.layers:
            return pruned_path, remapped
    pruned_path.parent.mkdir(parents=True, exist_ok=True)
    execute(plan_prune(plan.model, plan.layout, keepset, pruned_path), plan.model, force=True, on_event=on_event)
    source_imatrix = read_imatrix(imatrix)
    pruned = read_model(pruned_path)
    layout = resolve_source_layout(source_imatrix, pruned, inspect_layout(pruned), plan.layout)
    remap_plan = plan_remap(
        source_imatrix, keepset, layout, remapped, output_format="gguf", pruned=pruned, source=plan.model
    )
    execute_remap(remap_plan, force=True, sources=[*pruned.paths, *plan.model.paths], on_event=on_event)
    return pruned_path, remapped


def _build_pruned(
    plan: Plan,
    settings: BestSettings,
    keep_file: Path,
    kept: int,
    quant: str,
    method: str,
    work: Path,
    models_dir: Path,
    imatrix: Path,
    base: str,
    on_event: Sink,
) -> Path:
    """One pruned rung: the source pruned to `keep_file`, its imatrix remapped, the rung quantized."""
    pruned, remapped = _prune_to(plan, keep_file, work / "pruned" / f"K{kept}-{method}.gguf", imatrix, on_event)
    return _ladder(
        settings.ladder,
        pruned,
        models_dir / f"K{kept}-{method}",
        [quant],
        remapped,
        f"{base}-{kept}e",
        settings,
        on_event,
    )[quant]


def _content_key(doc: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def keep_sets(
    source: Path, plan: Plan, settings: BestSettings, work: Path, imatrix: Path, on_event: Sink
) -> tuple[dict[int, dict[str, Any]], float, bool]:
    """Every method's keep-set at every candidate K (K -> method -> {"file", "identical_to"}) from
    one calibration pass that also writes `imatrix`. The pass's scores are kept beside them and
    reused when the key of their inputs (the sha256 of the source and of the calibration texts,
    the methods and the pass settings) matches the one recorded: a re-run at other K values
    chooses its keep-sets from them without a pass. Returns the keep-sets, the pass's seconds and
    whether the pass was reused."""
    from ggufcarve.fileio import sha256_file_cached, write_text_atomic
    from ggufcarve.select.keep import choose
    from ggufcarve.select.scores import read_scores
    from ggufcarve.tune.run import TuneSettings, calibration_scores

    key = _content_key(
        {
            "source": [sha256_file_cached(p) for p in plan.model.paths],
            "calibration": [sha256_file_cached(p) for p in settings.calibration],
            "methods": list(settings.methods),
            "ctx": settings.eval_ctx,
            "max_tokens": settings.max_tokens,
        }
    )
    directory = work / "keep-sets"
    record = directory / "scores.json"
    started = time.perf_counter()
    scores: dict[str, Any] | None = None
    try:
        previous = json.loads(record.read_text())
        if previous["key"] == key and imatrix.is_file():
            scores = {m: read_scores(directory / name) for m, name in previous["scores"].items()}
    except (OSError, ValueError, KeyError, TypeError, CarveError):
        scores = None
    reused = scores is not None
    if scores is None:
        directory.mkdir(parents=True, exist_ok=True)
        tune_settings = TuneSettings(
            keeps=tuple(plan.kept_counts),
            methods=settings.methods,
            calibration=settings.calibration,
            ctx=settings.eval_ctx,
            max_tokens=settings.max_tokens,
            threads=settings.threads,
            gpu_layers=settings.gpu_layers,
            imatrix_out=imatrix,
        )
        scores = calibration_scores(plan.model, plan.layout, tune_settings, work, on_event)[0]
        for method, method_scores in scores.items():
            write_text_atomic(directory / f"{method}.scores.json", method_scores.dumps())
        write_text_atomic(
            record,
            json.dumps({"key": key, "scores": {m: f"{m}.scores.json" for m in scores}}, indent=1, sort_keys=True)
            + "\n",
        )
    out: dict[int, dict[str, Any]] = {}
    for k in plan.kept_counts:
        seen: dict[tuple, str] = {}
        out[k] = {}
        for method, method_scores in scores.items():
            selection = choose(method_scores, k)
            path = directory / f"{method}-{k}.json"
            write_text_atomic(path, json.dumps(selection.record({}), indent=1, sort_keys=True, allow_nan=False) + "\n")
            layers = tuple(sorted(selection.keepset.layers.items()))
            out[k][method] = {"file": path, "identical_to": seen.get(layers)}
            seen.setdefault(layers, method)
        if settings.keep_file is not None:
            from ggufcarve.moe.keepset import load_keepset

            given = load_keepset(settings.keep_file, plan.layout)
            if given.kept_count == k:
                path = directory / f"keep-file-{k}.json"
                write_text_atomic(path, json.dumps(given.to_json(), indent=1, sort_keys=True) + "\n")
                layers = tuple(sorted(given.layers.items()))
                out[k]["keep-file"] = {"file": path, "identical_to": seen.get(layers)}
    return out, 0.0 if reused else time.perf_counter() - started, reused


def tensor_types(path: Path) -> dict[str, str]:
    from ggufcarve.gguf.container import read_model
    from ggufcarve.quant.fit import type_name

    return {t.name: type_name(t.type_id) for t in read_model(path).tensors}


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


def best(
    source: Path, settings: BestSettings, out_dir: Path, *, plan: Plan | None = None, on_event: Sink = ignore
) -> BestResult:
    """Search the candidates; write best.json, best.md, best-pareto.png and plan.toml under `out_dir`, the models
    under out_dir/models."""
    from ggufcarve.best.render import chart, markdown, plan_document, publish_command, write_plan
    from ggufcarve.fileio import write_text_atomic
    from ggufcarve.llama.masking import required_nodes
    from ggufcarve.llama.tools import physical_cores
    from ggufcarve.measure import tournament as mt
    from ggufcarve.measure.statistics import metric_column, paired_difference
    from ggufcarve.moe.keepset import load_keepset
    from ggufcarve.quant.ladder_plan import model_name_from
    from ggufcarve.reports import envelope

    started = time.perf_counter()
    plan = plan or plan_best(source, settings, on_event=on_event)
    ids = {c.id for c in plan.candidates if c.family == UNPRUNED} | {
        f"{c.id}-{m}" for c in plan.candidates if c.family == PRUNED for m in settings.methods
    }
    wanted = set(settings.only) if settings.only else None
    if wanted is not None and (unknown := wanted - ids):  # before anything is written
        raise BadInput(f"--only {', '.join(sorted(unknown))}: not a candidate", f"candidates: {', '.join(sorted(ids))}")
    previous_timings = _previous_timings(out_dir)
    timings: dict[str, float] = {"fit_seconds": plan.seconds}
    out_dir.mkdir(parents=True, exist_ok=True)
    work = out_dir / "work"
    work.mkdir(exist_ok=True)
    models_dir = out_dir / "models"
    imatrix = work / "calibration.imatrix.gguf"
    threads = settings.threads or physical_cores()
    gate = None
    if settings.gate is not None:
        from ggufcarve.evaluate.gate import load_gate

        gate = load_gate(settings.gate)

    sets: dict[int, dict[str, Any]] = {}
    reused = False
    if plan.kept_counts:
        sets, timings["calibration_seconds"], reused = keep_sets(source, plan, settings, work, imatrix, on_event)
    base = model_name_from(source)
    layout = plan.layout

    t0 = time.perf_counter()
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
    rungs = (
        _ladder(
            settings.ladder,
            source,
            models_dir / UNPRUNED,
            quants,
            imatrix if imatrix.is_file() else None,
            base,
            settings,
            on_event,
        )
        if quants
        else {}
    )
    records: dict[str, dict[str, Any]] = {}
    pool: list[mt.Candidate] = []
    fraction = active_fraction(plan.model, layout)  # of a file's bytes one token reads: prefer = "faster"
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
                mt.Candidate(
                    c.id, path, None, fits=records[c.id]["fits"], file_bytes=size, read_bytes=int(size * fraction)
                )
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
                        read_bytes=int(c.file_bytes * fraction),
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
                path = _build_pruned(
                    plan, settings, entry["file"], c.kept, c.quant, method, work, models_dir, imatrix, base, on_event
                )
                size = path.stat().st_size
                record.update(
                    built=True,
                    path=path,
                    file_bytes=size,
                    **built_record(path, settings, plan.tier),
                    memory_estimated_total=c.estimated_total,
                )
                pool.append(
                    mt.Candidate(cid, path, None, fits=record["fits"], file_bytes=size, read_bytes=int(size * fraction))
                )
    timings["builds_seconds"] = time.perf_counter() - t0

    measured = None
    confirmations: list[str] = []
    if wanted is None:
        t0 = time.perf_counter()
        segments = mt.prepare_segments(
            source,
            settings.heldout,
            chunk_ctx=settings.eval_ctx,
            chunks=settings.chunks,
            threads=threads,
            work=work,
            gpu_layers=settings.gpu_layers,
            on_event=on_event,
        )
        timings["references_seconds"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        measure_settings = mt.MeasureSettings(
            threads=threads,
            gpu_layers=settings.gpu_layers,
            z=settings.z,
            metric=settings.metric,
            prefer=settings.prefer,
            gate=(lambda stats: _judge(gate, stats)) if gate is not None else None,
            tables=mt.measure_tables(),
        )
        measured = mt.measure(pool, segments, measure_settings, work, on_event=on_event)
        timings["tournament_seconds"] = time.perf_counter() - t0
        for cid, r in measured.records.items():
            records[cid].update(
                {k: v for k, v in r.items() if k not in ("id", "group", "fits", "finalist")}, finalist=r["finalist"]
            )
        for r in records.values():  # identical keep-sets: the figures of the one scored
            if r.get("identical_to") and r["identical_to"] in measured.records:
                twin = records[r["identical_to"]]
                r.update(
                    {
                        k: twin.get(k)
                        for k in (
                            "kld_mean",
                            "kld_mean_stderr",
                            "kld_p999",
                            "same_top_p",
                            "ppl",
                            "tokens",
                            "chunks_scored",
                            "segments",
                        )
                    },
                    stopped_early=True,
                    stopped_reason="identical",
                    lost_by=None,
                )
        decision = measured.groups[""]
        t0 = time.perf_counter()
        finalists = sorted(
            (cid for cid in decision["finalists"]),
            key=lambda cid: (mt.metric_value(records[cid], settings.metric), cid),
        )
        if decision["winner"] is not None:
            runners = [cid for cid in finalists if cid != decision["winner"] and records[cid]["scored_by"] == "mask"][
                : settings.confirm
            ]
            confirmations = [cid for cid in (decision["winner"], *runners) if records[cid]["scored_by"] == "mask"]
        column = metric_column("kld_mean")
        confirm_builds = 0.0
        for cid in confirmations:
            r = records[cid]
            keep_file = out_dir / r["keep_set"]
            built_at = time.perf_counter()
            path = _build_pruned(
                plan,
                settings,
                keep_file,
                r["kept_experts"],
                r["quant"],
                r["selection"],
                work,
                models_dir,
                imatrix,
                base,
                on_event,
            )
            confirm_builds += time.perf_counter() - built_at
            unpruned_types = tensor_types(rungs[r["quant"]])
            mismatched = sorted(n for n, t in tensor_types(path).items() if unpruned_types.get(n) != t)
            confirm = mt.measure(
                [mt.Candidate(f"{cid}@file", path, None)], segments, measure_settings, work, on_event=on_event
            )
            file_record = confirm.records[f"{cid}@file"]
            masked_table, file_table = measured.table(cid), confirm.table(f"{cid}@file")
            pair = (
                paired_difference(file_table[:, column], masked_table[:, column])
                if len(masked_table) == len(file_table)
                else None
            )
            size = path.stat().st_size
            estimated_total = r["memory"][0]["total"] if r.get("memory") else None
            r.update(
                built=True,
                path=path,
                file_bytes=size,
                **built_record(path, settings, plan.tier),
                memory_estimated_total=estimated_total,
                confirmed={
                    "masked_kld_mean": r["kld_mean"],
                    "file_kld_mean": file_record["kld_mean"],
                    "file_kld_mean_stderr": file_record["kld_mean_stderr"],
                    "paired_difference": pair.to_json() if pair else None,
                    "types_mismatched": mismatched[:8],
                    "file_segments": file_record.get("segments"),
                    "chunks": file_record["chunks_scored"],
                },
            )
            tolerance = max(2 * file_record["kld_mean_stderr"], CONFIRM_RELATIVE * r["kld_mean"])
            if abs(file_record["kld_mean"] - r["kld_mean"]) > tolerance:
                raise ToolFailed(
                    f"{cid}: masked mean KLD {r['kld_mean']:.6f} but its built "
                    f"file {path.name} measures {file_record['kld_mean']:.6f} "
                    f"(more than {tolerance:.6f} apart)"
                    + (
                        f"; tensors of another type than the unpruned rung's: {', '.join(mismatched[:4])}"
                        if mismatched
                        else ""
                    ),
                    "score this candidate by its file: a masked score stands for "
                    "the pruned file only where llama-quantize chose the same types",
                )
        timings["confirmation_seconds"] = (
            time.perf_counter() - t0 - confirm_builds
        )  # scoring the files; their builds count as builds
        timings["builds_seconds"] += confirm_builds
    for stage in STAGES:
        timings.setdefault(f"{stage}_seconds", 0.0)

    winner = None
    if measured is not None and measured.groups[""]["winner"] is not None:
        winner = records[measured.groups[""]["winner"]]
    for r in records.values():
        if r["built"]:
            r["run_command"] = run_command(Path(r["path"]), settings)
        r.setdefault("chunks_scored", 0)
        r.setdefault("stopped_early", False)
        r.setdefault("stopped_reason", None)
        for key in ("kld_mean", "kld_mean_stderr", "kld_p999", "same_top_p", "ppl"):
            r.setdefault(key, None)
    timings["total_seconds"] = time.perf_counter() - started

    def public(r: dict[str, Any]) -> dict[str, Any]:
        doc = {k: v for k, v in r.items() if k != "path"}
        doc["path"] = str(Path(r["path"]).relative_to(out_dir)) if r["path"] else None
        return doc

    candidates = [public(r) for r in sorted(records.values(), key=lambda r: (r["file_bytes"], r["id"]))]
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
        "winner": public(winner) if winner else None,
        "kept_counts": plan.kept_counts,
        "halving": measured.groups[""] if measured is not None else None,
        "units": [list(u) for u in measured.units] if measured is not None else [],
        "selection_rule": SELECTION_RULE,
        "projection": projection(plan.model, layout, timings),
        "only": sorted(wanted) if wanted else None,
        "keep_sets_reused": reused,
        "chunks_decoded": measured.decoded_chunks if measured is not None else 0,
        "chunks_cached": measured.cached_chunks if measured is not None else 0,
        "previous_run_timings": previous_timings,
    }
    if winner is not None and winner["family"] == UNPRUNED:  # published by the ladder alone: no prune stage
        results["publish"] = {"command": publish_command({"winner": winner}, source, settings, out_dir, imatrix)}
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
        "gpu_memory_bytes": settings.gpu_memory,
        "tier": plan.tier,
        "tier_asked": settings.tier,
        "ladder": plan.spec.name,
        "confirm": settings.confirm,
        "prefer": settings.prefer,
        "z": settings.z,
    }
    report = envelope(
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
    outputs: list[Path] = []
    if wanted is None:
        write_text_atomic(out_dir / "best.json", json.dumps(report, indent=1, sort_keys=True, allow_nan=False) + "\n")
        write_text_atomic(out_dir / "best.md", markdown(report))
        chart(report, out_dir / CHART)
        outputs = [out_dir / "best.json", out_dir / "best.md", out_dir / CHART]
        (out_dir / "plan.toml").unlink(missing_ok=True)  # a plan of an earlier answer would publish another model
        if winner is not None and winner["family"] == PRUNED:
            outputs.append(write_plan(plan_document(report, source, settings, out_dir, imatrix), out_dir))
    return BestResult(report, outputs)


def _previous_timings(out_dir: Path) -> dict[str, float] | None:
    """The timings of the run that wrote out_dir/best.json before this one (reported apart from this run's)."""
    try:
        return json.loads((out_dir / "best.json").read_text())["timings"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
