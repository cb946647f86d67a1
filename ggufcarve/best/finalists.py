"""best's finalists once the tournament has ranked them: the masked ones confirmed as built files
(`confirm`), their speed in their placement (`measure_speeds`), and the winner re-checked once built
(`rechecked`: its measured memory per device and decode speed)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ggufcarve.best.builds import tensor_types
from ggufcarve.best.plan import BestSettings, built_record
from ggufcarve.errors import BadInput, ToolFailed

if TYPE_CHECKING:
    from ggufcarve.llama.devices import Compute
    from ggufcarve.measure import tournament as mt

CONFIRM_RELATIVE = 0.01
# how a candidate scored without a file of its own stands in for that file: routing masked on its quant's
# unpruned rung, or another file with the used count overridden at load
STANDINS = ("mask", "override")


def built_file(search: Any, records: dict[str, dict[str, Any]], cid: str) -> Path:
    """The file a candidate scored without one stands for, built: a masked keep-set pruned and quantized
    (best.builds.build_pruned); a used-count variant (`topk_of`) its trained candidate's file routed to N
    (best.builds.build_routed), its record given `routed_from`, that file's path under the output directory."""
    from ggufcarve.best.builds import build_routed

    r = records[cid]
    if not r.get("topk_of"):
        return search.pruned_rung(search.out_dir / r["keep_set"], r["kept_experts"], r["quant"], r["selection"])
    parent = records[r["topk_of"]]
    trained = Path(parent["path"]) if parent.get("built") else built_file(search, records, parent["id"])
    r["routed_from"] = str(trained.relative_to(search.out_dir))
    return build_routed(trained, r["experts_used"], search.on_event)


def route_built_finalists(search: Any, records: dict[str, dict[str, Any]], decision: dict[str, Any]) -> float:
    """Every finalist at another used count whose trained candidate's file is built: that file routed to N (a
    copy) and recorded as built, so that its speed is measured on a file that carries N. Returns the seconds."""
    plan, settings = search.plan, search.settings
    t0 = time.perf_counter()
    for cid in decision["finalists"]:
        r = records[cid]
        if r.get("built") or not r.get("topk_of") or not records[r["topk_of"]].get("built"):
            continue
        path = built_file(search, records, cid)
        estimated_total = r["memory"][0]["total"] if r.get("memory") else None
        r.update(
            built=True,
            path=path,
            file_bytes=path.stat().st_size,
            **built_record(path, settings, plan.tier),
            memory_estimated_total=estimated_total,
        )
    return time.perf_counter() - t0


def confirm(
    search: Any,
    records: dict[str, dict[str, Any]],
    rungs: dict[str, Path],
    measured: mt.Measurement,
    segments: list[mt.Segment],
    measure_settings: mt.MeasureSettings,
    ids: list[str] | None = None,
) -> tuple[float, float]:
    """The winner and the first `confirm` other finalists by metric (or the finalists `ids` names), those scored by
    mask: each built as a file and scored on every chunk, its record given the file and `confirmed`. A file whose
    mean KLD lies further than max(2 of its standard errors, CONFIRM_RELATIVE of the masked mean) from the masked
    one is a ToolFailed. Returns the seconds of scoring the files and the seconds of building them."""
    from ggufcarve.measure import tournament as mt
    from ggufcarve.measure.statistics import metric_column, paired_difference

    plan, settings = search.plan, search.settings
    confirmations: list[str] = []
    decision = measured.groups[""]
    t0 = time.perf_counter()
    finalists = sorted(
        (cid for cid in decision["finalists"]),
        key=lambda cid: (mt.metric_value(records[cid], settings.metric), cid),
    )
    if ids is not None:
        confirmations = [
            cid for cid in ids if records[cid]["scored_by"] in STANDINS and not records[cid].get("confirmed")
        ]
    elif decision["winner"] is not None:
        runners = [cid for cid in finalists if cid != decision["winner"] and records[cid]["scored_by"] in STANDINS][
            : settings.confirm
        ]
        confirmations = [cid for cid in (decision["winner"], *runners) if records[cid]["scored_by"] in STANDINS]
    column = metric_column("kld_mean")
    confirm_builds = 0.0
    for cid in confirmations:
        r = records[cid]
        built_at = time.perf_counter()
        path = built_file(search, records, cid)
        confirm_builds += time.perf_counter() - built_at
        unpruned_types = tensor_types(rungs[r["quant"]])
        mismatched = sorted(n for n, t in tensor_types(path).items() if unpruned_types.get(n) != t)
        confirm = mt.measure(
            [mt.Candidate(f"{cid}@file", path, None)], segments, measure_settings, search.work, on_event=search.on_event
        )
        file_record = confirm.records[f"{cid}@file"]
        masked_table, file_table = measured.table(cid), confirm.table(f"{cid}@file")
        pair = (
            paired_difference(file_table[:, column], masked_table[:, column], measured.per_chunk)
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
    return time.perf_counter() - t0 - confirm_builds, confirm_builds


def measure_speeds(
    search: Any,
    records: dict[str, dict[str, Any]],
    decision: dict[str, Any],
    compute: Compute,
    ids: list[str] | None = None,
) -> None:
    """Decode and prompt tok/s of every built finalist in its own placement (`placement`: its layers,
    --n-cpu-moe N or -ot and split on the budgeted devices in a GPU tier, -ngl 0 in system memory)
    and the run line's context (-fa, -ctk/-ctv, -b/-ub, at depth `-d`), measured by llama-bench (its
    own method: `speed_method`), as `decode_tok_s` and `prompt_tok_s`; `speed_placement` is the
    placement timed, `placement` itself. A finalist placed on devices (layers offloaded) whose devices
    are not here is not timed (`speed_note`): a CPU figure would stand under the GPU's placement. A finalist with the
    experts of N blocks in system memory is timed in the other variant too
    (placement.search.other_variant), which takes its place (`placement`, the speeds,
    `placement_chosen_by`) when it decodes faster beyond noise; `speed_placements` lists both; with
    the devices present its `memory` is then the variant's, measured by a dry load of it, and a
    variant measured over a budget is not taken (`placement_kept_because`). Without llama-bench, or
    with layers offloaded where llama-bench sees no device, the figures are None and `speed_note`
    says why. `ids` names the finalists to time (default: all of them)."""
    from ggufcarve.best.plan import budgeted_devices, measured_memory, placement_memory, run_context
    from ggufcarve.evaluate.speed import BENCH_METHOD, bench_speed
    from ggufcarve.llama.devices import HOST
    from ggufcarve.llama.tools import find_tool
    from ggufcarve.placement.run_line import bench_args
    from ggufcarve.placement.search import Placement, faster_beyond_noise, other_variant

    settings = search.settings
    tool = find_tool("llama-bench", settings.llama_cpp_dir)
    main = search.plan.layout.main_layer_count
    context = run_context(settings)
    devices = budgeted_devices(settings)

    def timed(path: Path, placement: dict[str, Any], on_device: bool) -> tuple[Any, dict[str, Any]]:
        placed = Placement.from_json(placement)
        rpc = settings.compute.rpc if placed.gpu_layers > 0 else ()
        flags = bench_args(placed, main, context, rpc=rpc, devices=devices if placed.gpu_layers > 0 else ())
        return bench_speed(tool, path, BENCH_METHOD, compute, flags=flags), dict(placement)

    for cid in decision["finalists"] if ids is None else ids:
        r = records[cid]
        r.setdefault("decode_tok_s", None)
        r.setdefault("prompt_tok_s", None)
        if not r.get("built") or not r.get("path"):
            continue
        if tool is None:
            r["speed_note"] = "not measured: llama-bench is not built (ggufcarve toolchain build)"
            continue
        path = Path(r["path"])
        placement = r.get("placement") or {}
        on_device = bool(placement) and Placement.from_json(placement).gpu_layers != 0
        if on_device and not devices:
            r["speed_note"] = "not measured: the budgeted devices are not on this machine"
            continue
        try:
            speed, where = timed(path, placement, on_device)
        except BadInput as refused:  # layers offloaded but no device seen: no CPU figure under a GPU's name
            r["speed_note"] = f"not measured: {refused}"
            continue
        r["decode_tok_s"], r["prompt_tok_s"], r["speed_placement"] = speed.tg_tok_s, speed.pp_tok_s, where
        r["speed_method"] = BENCH_METHOD.method(context.bench_depth)
        r["speed_computed_on"] = speed.computed_on
        if not on_device or not placement.get("n_cpu_moe"):
            continue
        placed = measured_memory(path, settings)
        if placed.weights is None or placed.load is None:
            continue
        ours = Placement.from_json(placement)
        devices = [m["device"] for m in r.get("memory", []) if m["device"] != HOST]
        other = other_variant(placed.weights, placed.load, ours, devices)
        if other is None:
            continue
        alternative = other.to_json(main)
        other_speed, other_where = timed(path, alternative, on_device)
        r["speed_placements"] = [
            {"label": ours.label(), "decode_tok_s": speed.tg_tok_s, "prompt_tok_s": speed.pp_tok_s},
            {"label": other.label(), "decode_tok_s": other_speed.tg_tok_s, "prompt_tok_s": other_speed.pp_tok_s},
        ]
        if not faster_beyond_noise(other_speed.tg_runs, speed.tg_runs):
            continue
        memory = placement_memory(path, settings, other)
        if memory is not None and not memory.fits:
            r["placement_kept_because"] = memory.kept_because()
            continue
        if memory is not None:
            r["memory"] = [d.to_json() for d in memory.devices]
            r["memory_source"] = "measured: llama.cpp's dry load of the built file in this placement"
        r["placement"] = alternative
        r["placement_chosen_by"] = "measured speed (llama-bench)"
        r["decode_tok_s"], r["prompt_tok_s"] = other_speed.tg_tok_s, other_speed.pp_tok_s
        r["speed_placement"] = other_where
        r["speed_computed_on"] = other_speed.computed_on


def rechecked(
    records: dict[str, dict[str, Any]],
    decision: dict[str, Any],
    settings: BestSettings,
    build: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The winner, re-checked once built: its measured memory per device (`fits` of its built record)
    is the budget check, its measured decode speed the --min-decode one. Failing one, the finalists
    are taken in turn by metric: one not built yet is built first by `build` (its file, confirmation
    and speed; without `build` it is passed over), and the first that passes both takes the winner's
    place; both records say why. With --prefer faster, a finalist tied with the winner within noise
    that decodes faster (measured) is taken."""
    from ggufcarve.measure import tournament as mt

    first = records[decision["winner"]]
    finalists = sorted(decision["finalists"], key=lambda cid: (mt.metric_value(records[cid], settings.metric), cid))

    def failing(r: dict[str, Any]) -> str | None:
        if r.get("built") and not r.get("fits", True):
            over = ", ".join(f"{m['device']} {m['total']} B" for m in r.get("memory", [])) or "its measured memory"
            return f"built, it does not fit in the tier ranked in: {over} (llama.cpp's dry load of the file)"
        speed = r.get("decode_tok_s")
        if settings.min_decode is not None and (speed is None or speed < settings.min_decode):
            measured = "not measured" if speed is None else f"{speed:.1f} tok/s"
            return f"it decodes at {measured}, below --min-decode {settings.min_decode:g}"
        return None

    def passing(cid: str) -> bool:
        r = records[cid]
        if not r.get("built") and build is not None:
            build(cid)
        return bool(r.get("built")) and failing(r) is None

    why = failing(first)
    chosen = first
    if why is not None:
        chosen = next((records[c] for c in finalists if c != first["id"] and passing(c)), first)
    elif settings.prefer == "faster" and first.get("decode_tok_s") is not None:
        tied = [records[c] for c in first.get("tie_with") or [] if c in records]
        faster = [r for r in tied if (r.get("decode_tok_s") or 0) > first["decode_tok_s"] and failing(r) is None]
        if faster:
            chosen = max(faster, key=lambda r: r["decode_tok_s"])
            why = f"tied within noise, {chosen['id']} decodes faster ({chosen['decode_tok_s']:.1f} tok/s, measured)"
    if chosen is not first:
        first["winner"] = False
        first["replaced_because"] = why
        chosen["winner"] = True
        chosen["replaces"] = {"id": first["id"], "because": why}
    elif why is not None:
        first["answer_note"] = f"no finalist passes once built: {why}"
        timed = [records[c] for c in finalists if records[c].get("decode_tok_s")]
        if settings.min_decode is not None and timed:
            fastest = max(timed, key=lambda r: r["decode_tok_s"])
            first["answer_note"] = (
                f"no finalist reaches --min-decode {settings.min_decode:g} tok/s: the fastest of the "
                f"{len(timed)} timed, {fastest['id']}, decodes at {fastest['decode_tok_s']:.1f} tok/s"
            )
    return chosen
