"""What `best` weighs before anything is built: its settings, the candidates from fit's exact sizes and
llama.cpp's measured memory per tier (`plan_best`), and where a built file runs (`measured_memory`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ggufcarve import settings as S
from ggufcarve.best.candidates import PRUNED, Candidate
from ggufcarve.errors import BadInput
from ggufcarve.events import Sink, ignore
from ggufcarve.llama.devices import FIT_MARGIN, Compute
from ggufcarve.measure.statistics import DEFAULT_Z, METRICS, PREFERENCES, check_z
from ggufcarve.select.criteria import BEST_DEFAULT
from ggufcarve.settings import key, required


@dataclass(frozen=True)
class BestSettings:
    memory: int = required(S.MEMORY)
    ladder: Path = required(S.LADDER)
    heldout: tuple[Path, ...] = required(S.HELDOUT)
    calibration: tuple[Path, ...] = key(S.CALIBRATION, ())
    methods: tuple[str, ...] = key(S.METHODS, BEST_DEFAULT)
    ctx: int = key(S.CTX, 16384)  # the context whose cache counts against the budget
    kv_type: str = key(S.KV_TYPE, "F16")
    eval_ctx: int = key(S.CHUNK_CTX, 512)  # tokens per chunk of the calibration pass and the scoring
    chunks: int | None = key(S.CHUNKS, None)
    max_tokens: int | None = key(S.MAX_TOKENS, None)
    compute: Compute = S.compute_key()  # where every llama.cpp child runs (not what the budget counts)
    metric: str = "kld_mean"
    gate: Path | None = key(S.GATE, None)
    gpu_memory: tuple[int, ...] = key(S.GPU_MEMORY, ())  # one budget per GPU, in device order (several: a split)
    # the K values weighed, as written (quant.fit.parse_kept_counts); None: fit's grid
    keep_counts: str | None = key(S.KEEP, None)
    keep_file: Path | None = None  # a keep-set weighed at its K beside the criteria's (selection "keep-file")
    tier: str | None = (
        None  # placement.offload.TIERS: where the answer must run; None: the fastest tier any candidate runs in
    )
    quantizer: str = key(S.QUANTIZER, "auto")
    llama_cpp_dir: Path | None = key(S.LLAMA_CPP, None)
    only: tuple[str, ...] = key(S.ONLY, ())  # build only these candidate ids, score nothing (a job of several hosts)
    confirm: int = 1  # runners-up built and scored as files besides the winner
    prefer: str = "smaller"  # among candidates tied with the leader: smaller | faster | metric
    min_decode: float | None = None  # tok/s the answer must decode at, measured in its placement
    search: bool = key(S.SEARCH, False)  # then the local search from the winner (best.search)
    search_passes: int | None = key(S.SEARCH_PASSES, None)
    z: float = key(S.Z, DEFAULT_Z)
    bench_depth: int | None = key(S.BENCH_DEPTH, None)  # llama-bench -d of the finalists' timing; None: ctx / 2
    gpu_margin: int = key(S.GPU_MARGIN, FIT_MARGIN)  # kept free on each budgeted device
    # experts per token weighed beside the trained count: "auto" (trained - 1 down to half of it) or counts; None:
    # the trained count alone
    topk: tuple[int, ...] | str | None = key(S.TOPK, None)


def run_context(settings: BestSettings) -> Any:
    """The run line's context (placement.run_line.RunContext): the budget's context and cache type,
    flash attention on with a quantized cache, timed at `bench_depth` (half the context by default)."""
    from ggufcarve.placement.run_line import RunContext

    return RunContext(n_ctx=settings.ctx, kv_type=settings.kv_type, depth=settings.bench_depth)


def placed_settings(settings: BestSettings, source: Path) -> BestSettings:
    """`settings` with the scoring's placement resolved (placement.auto) for `source` at the scoring's
    context, on the budgeted devices alone where --gpu-memory gives budgets."""
    from dataclasses import replace

    from ggufcarve.placement import auto

    if settings.gpu_memory and not settings.compute.devices:
        settings = replace(settings, compute=replace(settings.compute, devices=budgeted_devices(settings)))
    return auto.placed_settings(settings, source, settings.eval_ctx, settings.gpu_margin)


def budgeted_devices(settings: BestSettings) -> tuple[str, ...]:
    """The devices the --gpu-memory budgets are for (placement.auto.budget_devices)."""
    from ggufcarve.placement.auto import budget_devices

    return budget_devices(settings.gpu_memory, settings.compute.rpc)


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
    tier: str = "ram"  # the tier the candidates are ranked in (placement.offload.TIERS)
    used_counts: tuple[int, ...] = ()  # experts per token weighed below the trained count, largest first


def gpu_words(budgets: tuple[int, ...]) -> str:
    """ "8 GiB of GPU memory", or "8 GiB + 10 GiB of GPU memory" for several devices."""
    from ggufcarve.fileio import format_size

    return " + ".join(format_size(b) for b in budgets) + " of GPU memory"


def run_memory_settings(settings: BestSettings) -> Any:
    """The run whose memory counts against the budget: llama-server's defaults at --ctx and --kv-type
    (a quantized V cache needs flash attention: on with q8_0, llama.cpp's auto otherwise)."""
    from ggufcarve.llama.memory import MemorySettings

    return MemorySettings(
        settings.ctx,
        settings.kv_type,
        flash_attn="on" if settings.kv_type.upper() != "F16" else "auto",
        # the budgeted devices present; the placement is the budget's
        compute=Compute(rpc=settings.compute.rpc, devices=budgeted_devices(settings)),
    )


MEASURED: dict[tuple[str, int, int, BestSettings], Any] = {}  # measured_memory's, by file and settings


def measured_memory(path: Path, settings: BestSettings) -> Any:
    """Where a built file runs (placement.offload.Placed): llama.cpp's dry load of it at the run's
    settings, per device in the fastest tier it runs in, its placement and its tiers.

    One GPU budget: the one-GPU rule (placement.offload); with the GPU present (a GPU build, or
    --rpc's devices) llama.cpp loads --n-cpu-moe N on it from the estimate's N
    (placement.search.place_on_devices: the next N while over the budget, the smaller ones while they
    fit), the GPU tiers then hold the measured rows, and with no N that fits they are lost. Several
    budgets: placement.search places the file over the devices (`-ts` by the budgets), loaded on
    them when present.
    A file's answer is kept for the process (by path, size and modification time)."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, settings)
    if key not in MEASURED:
        MEASURED[key] = _measured_memory(path, settings)
    return MEASURED[key]


def _measured_memory(path: Path, settings: BestSettings) -> Any:
    from dataclasses import replace

    from ggufcarve.gguf.container import read_model
    from ggufcarve.llama.memory import dry_load, weight_bytes
    from ggufcarve.placement.offload import place, tiers_of, weight_placement
    from ggufcarve.placement.search import Placement, place_on_devices, placed_offload, present_devices

    load = dry_load(path, run_memory_settings(settings))
    model = read_model(path)
    weights = weight_placement(model)
    budgets = settings.gpu_memory

    def on_device(placement: Placement) -> Any:
        return placed_load(path, settings, placement, len(weights.expert_bytes))

    if len(budgets) > 1:
        placed = place(weights, weight_bytes(path), load, memory=settings.memory, gpu_memory=None)
        several = place_on_devices(
            weights,
            load,
            budgets=budgets,
            memory=settings.memory,
            present=present_devices(load, budgets),
            load=on_device,
            margin=settings.gpu_margin,
        )
        tiers = several_tiers(placed, several)
        return replace(placed, split=several.devices if several else [], several=several, tiers=tiers)
    budget = budgets[0] if budgets else None
    placed = place(
        weights, weight_bytes(path), load, memory=settings.memory, gpu_memory=budget, margin=settings.gpu_margin
    )
    present = present_devices(load, budgets) if budgets else []
    if placed.offload is None or not present:
        return placed
    on_gpu = place_on_devices(
        weights,
        load,
        budgets=budgets,
        memory=settings.memory,
        present=present,
        load=on_device,
        from_last=False,
        margin=settings.gpu_margin,
    )
    if on_gpu is None:
        offload = replace(placed.offload, n_cpu_moe=None)
        return replace(placed, split=[], offload=offload, tiers=tiers_of(placed.host.total, settings.memory, None, []))
    offload = placed_offload(on_gpu, weights, budgets[0], settings.gpu_margin)
    tiers = tiers_of(placed.host.total, settings.memory, offload, on_gpu.devices)
    return replace(placed, split=on_gpu.devices, offload=offload, tiers=tiers)


def placed_load(path: Path, settings: BestSettings, placement: Any, main_blocks: int) -> Any:
    """llama.cpp's dry load of `path` at the run's settings in `placement` (placement.search.Placement)
    on the devices present."""
    from ggufcarve.llama.memory import dry_load

    return dry_load(path, placement.loaded_with(run_memory_settings(settings), main_blocks))


def placement_memory(path: Path, settings: BestSettings, placement: Any) -> Any:
    """What each device holds when the built file `path` runs in `placement` (a
    placement.search.PlacedMemory against the budgets and --memory, measured by llama.cpp's dry load
    of it), or None when fewer devices than GPU budgets are present (nothing to measure on)."""
    from ggufcarve.gguf.container import read_model
    from ggufcarve.llama.memory import HOST
    from ggufcarve.placement.memory import device_memory
    from ggufcarve.placement.search import PlacedMemory, present_devices

    placed = measured_memory(path, settings)
    devices = present_devices(placed.load, settings.gpu_memory) if settings.gpu_memory else []
    if not devices:
        return None
    load = placed_load(path, settings, placement, len(placed.weights.expert_bytes))
    limits = {**dict(zip(devices, settings.gpu_memory)), HOST: settings.memory}
    return PlacedMemory(placement, device_memory(read_model(path), load), True, limits, settings.gpu_margin)


def several_tiers(placed: Any, several: Any) -> tuple[str, ...]:
    """The tiers of a file placed over several devices (placement.search.PlacedMemory, None when it
    fits none): gpu with no experts in system memory, gpu+cpu with or without; then ram and disk as
    its CPU run allows."""
    from ggufcarve.placement.offload import GPU_TIERS

    gpu: tuple[str, ...] = ()
    if several is not None:
        gpu = GPU_TIERS if not several.placement.n_cpu_moe else ("gpu+cpu",)
    return (*gpu, *(t for t in placed.tiers if t not in GPU_TIERS))


def built_placement(placed: Any, tier: str) -> Any:
    """How a built file runs in `tier` (placement.search.Placement): over the devices of several
    budgets, every layer on the GPU with its --n-cpu-moe N for one, 0 GPU layers in system memory."""
    from ggufcarve.placement.offload import GPU_TIERS
    from ggufcarve.placement.search import Placement

    if tier not in GPU_TIERS:
        return Placement(gpu_layers=0)
    if placed.several is not None:
        return placed.several.placement
    offload = placed.offload
    if offload is None or offload.n_cpu_moe is None:
        return Placement(gpu_layers=0)
    return Placement(n_cpu_moe=offload.n_cpu_moe)  # every layer and the output offloaded


def built_record(path: Path, settings: BestSettings, tier: str) -> dict[str, Any]:
    """The memory keys of a built file's record: `memory` per device running in `tier`, its
    fastest `tier`, its `tiers`, `fits` (it runs in `tier`), `n_cpu_moe` (the experts of that
    many blocks in system memory on the GPU; None without a GPU placement) and `placement` (how it
    runs in `tier`: placement.search.Placement's keys; 0 GPU layers in system memory)."""
    placed = measured_memory(path, settings)
    placement = built_placement(placed, tier)
    main_blocks = len(placed.weights.expert_bytes)
    if placed.several is not None:
        n_cpu_moe = placed.several.placement.n_cpu_moe
    else:
        n_cpu_moe = placed.offload.n_cpu_moe if placed.offload is not None else None
    return {
        "n_cpu_moe": n_cpu_moe,
        "placement": placement.to_json(main_blocks),
        "memory": [d.to_json() for d in placed.devices(tier)],
        "memory_source": "measured: llama.cpp's dry load of the built file"
        + ("" if placed.several is None or placed.several.measured else "; the GPUs' rows estimated from it"),
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
    from ggufcarve.placement.kvcache import ContextSettings
    from ggufcarve.placement.offload import TIERS
    from ggufcarve.quant.fit import plan_fit, types_differ
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
    check_z(settings.z)
    if settings.search:
        from ggufcarve.tune.search import check_search

        check_search(settings.calibration)
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
    if settings.tier in ("gpu", "gpu+cpu") and not settings.gpu_memory:
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
        context=ContextSettings(n_ctx=settings.ctx, type_k=settings.kv_type, type_v=settings.kv_type),
        quantizer=make_quantizer(settings.quantizer, settings.llama_cpp_dir),
        measure=run_memory_settings(settings),
        gpu_memory=settings.gpu_memory or None,
        gpu_margin=settings.gpu_margin,
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
            + (f" and {gpu_words(settings.gpu_memory)}" if settings.gpu_memory else ""),
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
    used_counts = weighed_used_counts(model, layout, settings.topk)
    return Plan(
        model, layout, spec, fit, candidates, kept, quants, types, time.perf_counter() - started, tier, used_counts
    )


def weighed_used_counts(model: Any, layout: Any, topk: tuple[int, ...] | str | None) -> tuple[int, ...]:
    """The experts per token `--topk` weighs besides the trained count, largest first: with "auto", every count
    from the trained one less down to half of it (never below 1, never above grouped routing's limit); else the
    counts given, each checked against llama.cpp's rules (moe/experts_used.py), the trained one left out. Each
    is applied at load (`--override-kv`), so the file's count must be one value."""
    import math

    from ggufcarve.moe.experts_used import experts_used_overrides, grouped_limit

    if topk is None:
        return ()
    trained = layout.expert_used_count
    if topk == S.TOPK_AUTO:
        counts = [n for n in range(trained - 1, max(1, math.ceil(trained / 2)) - 1, -1) if n <= grouped_limit(layout)]
    else:
        counts = sorted({n for n in topk if n != trained}, reverse=True)
    for n in counts:
        experts_used_overrides(model, layout, n)  # refused here, before anything is built
    return tuple(counts)
