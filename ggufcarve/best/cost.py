"""What `best` costs: this machine's measured speed on the model, the estimate of a run's stages from it,
and their projection to the reference release (REFERENCE_MODEL)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ggufcarve.best.candidates import PRUNED, UNPRUNED
from ggufcarve.best.plan import BestSettings, Plan
from ggufcarve.errors import BadInput
from ggufcarve.events import Sink, ignore

# The reference release the costs are projected to: Qwen3.6-35B-A3B at Q8_0 (256 routed experts,
# top-8, 40 layers, 34 GiB; 3B of its 35B parameters active per token).
REFERENCE_MODEL = {"name": "35B-A3B Q8_0 (256 experts x 40 layers)", "bytes": 34 * 2**30, "active_fraction": 3 / 35}


def expert_bytes(model: Any) -> int:
    """Bytes of the routed experts' tensors (the `_exps` tensors of llama.cpp's names)."""
    return sum(t.nbytes for t in model.tensors if "_exps." in t.name)


def active_fraction(model: Any, layout: Any, experts_used: int | None = None) -> float:
    """The share of the file's bytes one token reads: every tensor but the routed experts, and top-k of n of those
    (k: `experts_used`, default the file's)."""
    total = model.total_bytes
    experts = expert_bytes(model)
    used = experts_used or layout.expert_used_count
    return (total - experts + experts * used / layout.expert_count) / total


def token_read_bytes(path: Path, experts_used: int | None = None) -> int:
    """The bytes of `path` one token reads: every tensor but the routed experts, and top-k of the file's own
    experts (a pruned file reads k of its K, the unpruned rung k of its E; k: `experts_used`, default the file's)."""
    from ggufcarve.gguf.container import read_model
    from ggufcarve.moe.layout import inspect_layout

    model = read_model(path)
    return round(model.total_bytes * active_fraction(model, inspect_layout(model), experts_used))


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

    compute = settings.compute.with_threads(settings.compute.threads or physical_cores())
    threads = compute.threads
    out: dict[str, Any] = {"threads": threads}
    decode_seconds, decode_tokens = 0.0, 0
    for role, paths in (("heldout", settings.heldout), ("calibration", settings.calibration)):
        total = 0
        for number, path in enumerate(paths):
            request = Request(
                model=str(source),
                compute=compute,
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
    prune, a quantization and a full scoring each). With --topk, each survivor of the first round
    adds one candidate per used count weighed, scored from the first unit up."""
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
        if number == 0 and plan.used_counts:  # each survivor's used-count variants, scored from the first unit
            variants = alive * len(plan.used_counts)
            tournament_tokens += variants * n / units * held
            alive += variants
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
        * (1 + len(plan.used_counts))  # a finalist at N used is timed on its rung's copy routed to N
        + (filed + confirmations) * source_bytes,
    }


STAGES = ("calibration", "references", "builds", "tournament", "confirmation")


DECODE_STAGES = ("calibration", "references", "tournament", "confirmation")


SMALLEST_PROJECTED = 256 * 2**20  # below it a stage's time is mostly fixed per-process costs (start, load)
TOO_SMALL = (
    "not projected: the model is {size}, too small to project from (its stages' time is mostly fixed "
    "per-process costs, which do not grow with the model); run the dry run on a model of at least 256 MiB"
)


def _too_small(model: Any) -> str | None:
    from ggufcarve.fileio import format_size

    return TOO_SMALL.format(size=format_size(model.total_bytes)) if model.total_bytes < SMALLEST_PROJECTED else None


def device_words(compute: Any) -> str:
    """Where a run's children compute (llama.devices.Compute), in words: the device a projection assumes."""
    if not compute.offloads:
        return f"this machine's CPU ({compute.threads or 'all physical'} threads)"
    where = f"{len(compute.rpc)} RPC device(s)" if compute.rpc else "this machine's GPU(s)"
    return f"{compute.gpu_layers} layers offloaded to {where}"


def project_estimate(plan: Plan, guess: dict[str, Any], device: str = "this machine") -> dict[str, Any]:
    """The dry run's estimate moved to REFERENCE_MODEL: the same plan of work (texts, candidates, builds),
    decoding at this machine's measured rate scaled by the bytes one token reads there and here,
    builds at the quantizer's measured bytes per second on the reference's file bytes. A rate
    measured on a small file includes fixed costs per process: below SMALLEST_PROJECTED nothing is
    projected."""
    note = _too_small(plan.model)
    if note is not None:
        return {
            "model": REFERENCE_MODEL["name"],
            "device": device,
            "stages": dict.fromkeys(guess["stages"]),
            "total": None,
            "rule": note,
        }
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
        "device": device,
        "stages": stages,
        "total": sum(known) if len(known) == len(stages) else None,
        "rule": "decoding x (bytes read per token there / here) at this "
        "machine's measured rate; builds x (file bytes there / here)",
    }


def projection(model: Any, layout: Any, timings: dict[str, float], device: str = "this machine") -> dict[str, Any]:
    """The measured stage seconds scaled to REFERENCE_MODEL on `device` (where this run computed):
    decoding stages by the bytes one token reads (file bytes x active fraction), builds by the file
    bytes; the same texts, K values and candidate count assumed. Below SMALLEST_PROJECTED nothing
    is projected (`stages_seconds` and `total_seconds` None, `rule` says why)."""
    note = _too_small(model)
    if note is not None:
        return {
            "model": REFERENCE_MODEL["name"],
            "device": device,
            "rule": note,
            "decode_scale": None,
            "build_scale": None,
            "stages_seconds": dict.fromkeys(STAGES),
            "total_seconds": None,
        }
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
        "device": device,
        "rule": "decoding stages x (bytes read per token there / here); builds x (file bytes there / here)",
        "decode_scale": decode_scale,
        "build_scale": build_scale,
        "stages_seconds": scaled,
        "total_seconds": sum(scaled.values()),
    }
