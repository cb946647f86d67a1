"""What `best` builds: the unpruned rungs (the ladder, resumed by content), the pruned rungs of the pairs
whose types differ, the keep-sets of every criterion at every K from one calibration pass, and how to run a
built candidate (`run_command`)."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from ggufcarve.best.plan import BestSettings, Plan, measured_memory
from ggufcarve.errors import CarveError, ToolFailed
from ggufcarve.events import Sink
from ggufcarve.placement.search import Placement


def budget_placement(path: Path, settings: BestSettings) -> tuple[Placement | None, dict[str, Any] | None]:
    """How `path` runs on the GPU(s) of --gpu-memory, and the offload record. One GPU:
    placement.offload's (the file whole, else the smallest --n-cpu-moe N with the compute buffers
    counted; none when even every expert on the CPU leaves too much for the GPU). Several:
    placement.search's placement over the devices."""
    if not settings.gpu_memory:
        return None, None
    placed = measured_memory(path, settings)
    main = len(placed.weights.expert_bytes)
    if len(settings.gpu_memory) > 1:
        several = placed.several
        if several is None:
            return None, {"placement": "none: even every expert in system memory leaves too much for the GPUs"}
        placement = several.placement
        return placement, {**placement.to_json(main), "placement": placement.label(), "measured": several.measured}
    offload = placed.offload
    record = {**offload.to_json(), "placement": offload.label()}
    return (None if offload.n_cpu_moe is None else Placement(n_cpu_moe=offload.n_cpu_moe)), record


def run_command(path: Path, settings: BestSettings, placement: dict[str, Any] | None = None) -> dict[str, Any]:
    """The llama-server command line of a candidate as it is measured (placement.run_line): `placement`
    (a record's, placement.search.Placement's keys; else the budget's) on the budgeted devices with
    their --rpc servers, at the budget's context and cache type."""
    from ggufcarve.best.plan import budgeted_devices, run_context
    from ggufcarve.placement.run_line import server_argv

    derived, offload = budget_placement(path, settings)
    placed = Placement.from_json(placement) if placement else derived
    if placement and placement.get("override_tensor"):
        offload = {**(offload or {}), **placement, "placement": "the last blocks' experts on the CPU (-ot)"}
    main = len(measured_memory(path, settings).weights.expert_bytes)
    on_devices = placed is not None and placed.gpu_layers > 0
    argv = server_argv(
        path.name,
        placed,
        main,
        run_context(settings),
        rpc=settings.compute.rpc if on_devices else (),
        devices=budgeted_devices(settings) if on_devices else (),
    )
    return {"argv": argv, "gpu": offload}


def override_command(
    trained: Path, experts_used: int, settings: BestSettings, placement: dict[str, Any] | None = None
) -> dict[str, Any]:
    """`run_command` of the file at its trained top-k (`trained`) routed to N at load: the same line with
    --override-kv {arch}.expert_used_count=int:N (and the expert width where the file lacks it)."""
    from ggufcarve.gguf.container import read_model
    from ggufcarve.llama.devices import Compute
    from ggufcarve.moe.experts_used import experts_used_overrides
    from ggufcarve.moe.layout import inspect_layout

    model = read_model(trained)
    command = run_command(trained, settings, placement)
    overrides = Compute(kv_overrides=experts_used_overrides(model, inspect_layout(model), experts_used))
    return {**command, "argv": [*command["argv"], *overrides.override_args()]}


def build_rungs(
    spec_path: Path,
    source: Path,
    out_dir: Path,
    rungs: list[str],
    imatrix: Path | None,
    name: str,
    settings: BestSettings,
    on_event: Sink,
) -> dict[str, Path]:
    from ggufcarve.quant.ladder_plan import plan_ladder
    from ggufcarve.quant.ladder_run import run_ladder
    from ggufcarve.quant.quantizer import make_quantizer
    from ggufcarve.quant.spec import load_spec

    spec = load_spec(spec_path)
    # the imatrix whether or not a rung needs it: a pruned rung built alone and the unpruned rung of its quant
    # built beside an IQ rung are then quantized alike (llama-quantize weighs every K-quant by an imatrix it is given)
    ladder_plan = plan_ladder(
        spec,
        source,
        out_dir,
        quantizer=make_quantizer(settings.quantizer, settings.llama_cpp_dir),
        imatrix=imatrix,
        only=rungs,
        model_name=name,
        nthreads=settings.compute.threads or None,
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


def build_pruned(
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
    return build_rungs(
        settings.ladder,
        pruned,
        models_dir / f"K{kept}-{method}",
        [quant],
        remapped,
        f"{base}-{kept}e",
        settings,
        on_event,
    )[quant]


def routed_path(path: Path, experts_used: int) -> Path:
    """Where `build_routed` writes `path` routed to N experts: models/<family>-topN/<stem>-topN.gguf."""
    return path.parent.with_name(f"{path.parent.name}-top{experts_used}") / f"{path.stem}-top{experts_used}.gguf"


def build_routed(path: Path, experts_used: int, on_event: Sink) -> Path:
    """The built file `path` routed to N experts per token (prune.execute.write_routed: a verified copy) at
    `routed_path`; a copy written after `path` changed last that says N is kept."""
    from ggufcarve.gguf.container import read_model
    from ggufcarve.moe.experts_used import used_count
    from ggufcarve.prune.execute import write_routed

    routed = routed_path(path, experts_used)
    if routed.is_file() and routed.stat().st_mtime_ns >= path.stat().st_mtime_ns:
        if used_count(read_model(routed)) == experts_used:
            return routed
    routed.parent.mkdir(parents=True, exist_ok=True)
    write_routed(path, routed, experts_used, on_event=on_event)
    return routed


def _content_key(doc: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def keep_sets(
    source: Path, plan: Plan, settings: BestSettings, work: Path, imatrix: Path, on_event: Sink
) -> tuple[dict[int, dict[str, Any]], float, bool]:
    """Every method's keep-set at every candidate K (K -> method -> {"file", "identical_to"}) from
    one calibration pass that also writes `imatrix`. The pass's scores are kept beside them and
    reused when the key of their inputs (the sha256 of the source and of the calibration texts,
    the methods, the pass settings, the llama.cpp version and where the pass computed:
    `Compute.key`) matches the one recorded and `imatrix` is the file that pass wrote (its sha256,
    recorded beside the key): a re-run at other K values chooses its keep-sets from them without a
    pass. Returns the keep-sets, the pass's seconds and whether the pass was reused."""
    from ggufcarve.best.search import PROXY_SCORES
    from ggufcarve.fileio import sha256_file_cached, write_text_atomic
    from ggufcarve.llama.tools import llama_cpp_version
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
            **({"search": True} if settings.search else {}),  # the pass also keeps the search's proxy
            "llama_cpp": llama_cpp_version(),
            "compute": settings.compute.key(),
        }
    )
    directory = work / "keep-sets"
    record = directory / "scores.json"
    started = time.perf_counter()
    scores: dict[str, Any] | None = None
    try:
        previous = json.loads(record.read_text())
        if (
            previous["key"] == key
            and previous["imatrix"] == sha256_file_cached(imatrix)
            and (not settings.search or (directory / PROXY_SCORES).is_file())
        ):
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
            compute=settings.compute,
            imatrix_out=imatrix,
            search=settings.search,
        )
        scores, _, filled = calibration_scores(plan.model, plan.layout, tune_settings, work, on_event)
        for method, method_scores in scores.items():
            write_text_atomic(directory / f"{method}.scores.json", method_scores.dumps())
        if settings.search:
            write_text_atomic(directory / PROXY_SCORES, filled["hope"].dumps())
        write_text_atomic(
            record,
            json.dumps(
                {"key": key, "imatrix": sha256_file_cached(imatrix), "scores": {m: f"{m}.scores.json" for m in scores}},
                indent=1,
                sort_keys=True,
            )
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
