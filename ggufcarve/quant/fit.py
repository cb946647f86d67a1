"""Which kept-expert count K and which ladder rung fit in a memory budget, from the model's header alone.

    model = read_model("Model-Q8_0.gguf")
    report = plan_fit(model, load_spec("ladders/q8-to-iq1.toml"), memory=parse_memory("24GiB"),
                      context=ContextSettings(16384), quantizer=make_quantizer("auto"))

For every K the pruned model's header is written as a sparse file (the prune plan's header; the
data a hole of the planned size) and llama.cpp's quantizer is asked for a dry run of every rung on
it, so each tensor's target type is llama.cpp's own choice for that K (its rules depend on
n_expert, layer position, row widths and names). A rung's size is then the header llama-quantize
writes (the source's keys plus general.file_type and general.quantization_version) and every
tensor's rows at its target type, padded to the file's alignment. Tensors the ladder would give
`imatrix_fallback_type` (target type needs an imatrix, entry missing: by default the MTP blocks,
which llama-imatrix never runs, or what `imatrix_entries` lacks) are dry-run again with the
ladder's own override. The KV cache and recurrent state come from kvcache.context_memory; the
total is file + cache (compute buffers and the OS are not counted). With a GPU budget each row
also says whether the rung fits the GPU whole or with which `--n-cpu-moe N` (placement/offload.py),
from the per-block expert bytes of the planned tensors.

K values: every K the pruner accepts (moe/kept.py: at least expert_used_count, and with grouped
routing the same count from every group) among powers of two, multiples of `kept_step` and the
original count (kept_step), unless `kept_counts` names them.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf.constants import GGML_QUANT_VERSION, GGUFValueType, Keys

from ggufcarve.errors import BadInput
from ggufcarve.events import Event, Sink, ignore
from ggufcarve.gguf.container import SPLIT_KEYS, GGUFModel, TensorHeader, encode_header, make_kv, pad_to, replace_kvs
from ggufcarve.gguf.types import FILE_TYPES, ggml_type_row_bytes, tensor_type
from ggufcarve.llama.devices import Compute
from ggufcarve.llama.memory import HOST, DeviceMemory, DryLoad, MemorySettings
from ggufcarve.moe.keepset import keep_per_block
from ggufcarve.moe.kept import kept_count_problems
from ggufcarve.moe.layout import MoeLayout
from ggufcarve.placement.kvcache import ContextMemory, ContextSettings, context_memory
from ggufcarve.placement.offload import (
    DEFAULT_MARGIN,
    GPU_TIERS,
    TIERS,
    Offload,
    WeightPlacement,
    gpu_compute,
    placement_of,
    plan_offload,
    split_devices,
    tiers_of,
)
from ggufcarve.placement.search import placed_offload
from ggufcarve.prune.plan import PlannedFile, plan_prune
from ggufcarve.quant.quantizer import DryRun, QuantizeJob, Quantizer
from ggufcarve.quant.spec import LadderSpec, Rung

# ---------------------------------------------------------------------------------------------
# Memory sizes

# ---------------------------------------------------------------------------------------------
# Kept-expert counts


def kept_count_problem(layout: MoeLayout, kept: int) -> str | None:
    """Why the pruner refuses K kept experts per block, or None when it accepts them."""
    problems = kept_count_problems(layout, kept)
    return problems[0] if problems else None


def kept_step(expert_count: int) -> int:
    """The spacing of the listed K values: the power of two nearest below expert_count / 8, so
    about eight multiples (each K costs one dry run per rung)."""
    step = 1
    while step * 2 <= expert_count // 8:
        step *= 2
    return step


def listed_kept_counts(layout: MoeLayout) -> list[int]:
    """Powers of two, multiples of kept_step and the original count, that the pruner accepts."""
    n = layout.expert_count
    step = kept_step(n)
    candidates = {k for k in range(step, n + 1, step)} | {1 << i for i in range(n.bit_length()) if 1 << i <= n} | {n}
    return sorted(k for k in candidates if kept_count_problem(layout, k) is None)


def parse_kept_counts(text: str, layout: MoeLayout) -> list[int]:
    """'--keep 96,128,200-256/8' style lists ('A-B' every count, 'A-B/S' every S-th), each accepted by the pruner."""
    counts: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        match = re.fullmatch(r"(\d+)(?:-(\d+)(?:/(\d+))?)?", part)
        if not match:
            raise BadInput(f"--keep {part!r} is not a count or a range", "write counts like 64,96,128 or 64-128/16")
        lo = int(match[1])
        hi = int(match[2]) if match[2] else lo
        step = int(match[3]) if match[3] else 1
        if hi < lo or step < 1:
            raise BadInput(f"--keep {part!r} is an empty range", "write ranges low-high, e.g. 64-128/16")
        counts.update(range(lo, hi + 1, step))
    if not counts:
        raise BadInput("--keep lists no count", "write counts like 64,96,128")
    for k in sorted(counts):
        problem = kept_count_problem(layout, k)
        if problem:
            raise BadInput(
                f"--keep {k}: {problem}", f"valid counts include {', '.join(map(str, listed_kept_counts(layout)[:12]))}"
            )
    return sorted(counts)


# ---------------------------------------------------------------------------------------------
# Rung sizes


@dataclass(frozen=True)
class RungSize:
    rung: str
    ftype: str
    bytes: int
    fallback: tuple[str, ...]  # tensors the ladder gives imatrix_fallback_type
    needs_imatrix: bool  # llama.cpp's verdict: some tensor's target type needs an imatrix
    placement: WeightPlacement | None = None  # the rung's tensors as llama.cpp places them on a GPU
    types: tuple[
        tuple[str, str], ...
    ] = ()  # every tensor's type in the rung (name, ggml type name), llama.cpp's choice for this K
    # the rung's tensor data as the file holds it (each tensor padded to the alignment): the weights llama.cpp maps
    tensor_bytes: int = 0


@dataclass(frozen=True)
class FitRow:
    kept: int
    rung: RungSize
    memory: int  # the budget
    cache_bytes: int
    gpu_memory: int | None = None
    gpu_margin: int = DEFAULT_MARGIN
    load: DryLoad | None = (
        None  # llama.cpp's dry load of the K's header run on the CPU: cache, compute and output buffers
    )
    placed: Any = None  # placement.search.PlacedMemory: the placement chosen (over several GPU budgets; on one
    # GPU where it is present, measured) and each device's memory in it
    speed: dict[str, Any] | None = None  # --measure-speed: decode_tok_s, prompt_tok_s, speed_placement, speed_of
    faster: Any = None  # placement.search.Placement: --measure-speed's faster variant of the placement found by bytes
    faster_memory: Any = None  # placement.search.PlacedMemory: `faster` loaded on the devices present

    @property
    def memory_measured(self) -> DeviceMemory | None:
        """Host memory of the CPU run: the rung's weights and the K's measured buffers."""
        if self.load is None:
            return None
        return DeviceMemory(
            HOST,
            self.rung.tensor_bytes,
            self.load.cache,
            self.load.on(HOST, self.load.compute),
            self.load.on(HOST, self.load.output),
        )

    @property
    def total(self) -> int:
        """Host bytes of the CPU run: llama.cpp's measured total when measured, else the file and the cache."""
        return self.memory_measured.total if self.memory_measured is not None else self.rung.bytes + self.cache_bytes

    @property
    def offload(self) -> Offload | None:
        """With a GPU budget: whether the rung fits the GPU whole, else the --n-cpu-moe N that makes it
        fit, the GPU's compute buffers counted when measured (placement/offload.py); with the GPU
        present, the placement llama.cpp's dry loads found (`placed`)."""
        if self.gpu_memory is None or self.rung.placement is None:
            return None
        if self.placed is not None:
            return placed_offload(self.placed, self.rung.placement, self.gpu_memory, self.gpu_margin)
        if self.load is None:
            return plan_offload(
                self.rung.placement, gpu_memory=self.gpu_memory, cache_bytes=self.cache_bytes, margin=self.gpu_margin
            )
        compute = gpu_compute(self.rung.placement, self.load.on(HOST, self.load.compute))
        return plan_offload(
            self.rung.placement,
            gpu_memory=self.gpu_memory,
            cache_bytes=self.load.cache,
            margin=self.gpu_margin,
            compute=compute,
        )

    @property
    def gpu_devices(self) -> list[DeviceMemory]:
        """The GPU's and the host's memory at the offload's N (empty without a GPU placement or a measurement)."""
        offload = self.offload
        if offload is None or offload.n_cpu_moe is None or self.load is None or self.rung.placement is None:
            return []
        if self.placed is not None:
            return self.placed.devices
        return split_devices(self.rung.placement, offload, self.load)

    @property
    def tiers(self) -> tuple[str, ...]:
        """The tiers the rung runs in (placement/offload.TIERS), fastest first; "disk" always."""
        if self.placed is not None:
            gpu = (
                ()
                if not self.placed.fits
                else ("gpu", "gpu+cpu")
                if not self.placed.placement.n_cpu_moe
                else ("gpu+cpu",)
            )
            return (*gpu, *(("ram",) if self.total <= self.memory else ()), "disk")
        return tiers_of(self.total, self.memory, self.offload, self.gpu_devices)

    @property
    def tier(self) -> str:
        return self.tiers[0]

    def devices_in(self, tier: str) -> list[DeviceMemory]:
        """Per device, the memory running in `tier` (the CPU run's host memory for ram and disk)."""
        if tier in GPU_TIERS and self.faster_memory is not None:
            return self.faster_memory.devices
        if tier in GPU_TIERS and self.placed is not None:
            return self.placed.devices
        if tier in GPU_TIERS and self.gpu_devices:
            return self.gpu_devices
        return [self.memory_measured] if self.memory_measured is not None else []

    @property
    def devices(self) -> list[DeviceMemory]:
        """Per device, the memory of the fastest tier the rung runs in."""
        return self.devices_in(self.tier)

    @property
    def fits(self) -> bool:
        """Every device's total within its budget in some tier but disk."""
        return self.tier != "disk"


@dataclass
class FitReport:
    model: GGUFModel
    layout: MoeLayout
    spec: LadderSpec
    memory: int
    cache: ContextMemory
    kept_counts: list[int]
    rows: list[FitRow]
    quantizer: dict[str, Any]
    seconds: float
    imatrix_assumption: str
    gpu_memory: int | None = None
    gpu_margin: int = DEFAULT_MARGIN
    rpc: tuple[str, ...] = ()  # the RPC servers the devices measured on are on: the run lines' --rpc

    def row(self, kept: int, rung: str) -> FitRow:
        return next(r for r in self.rows if r.kept == kept and r.rung.rung == rung)

    def fastest_tier(self) -> str:
        """The fastest tier any row runs in."""
        return min((r.tier for r in self.rows), key=TIERS.index, default="disk")

    def best(self, tier: str | None = None) -> FitRow | None:
        """The row with the most experts, then the largest file, among those running in `tier`
        (default: the fastest tier any row runs in; None when that is disk)."""
        tier = tier or self.fastest_tier()
        if tier == "disk" and tier == self.fastest_tier():
            return None
        fitting = [r for r in self.rows if tier in r.tiers]
        return max(fitting, key=lambda r: (r.kept, r.rung.bytes)) if fitting else None

    def _placement_json(self, row: FitRow) -> dict[str, Any]:
        """With GPU budgets: the placement a user runs the row with and its llama-server line."""

        main = self.layout.main_layer_count
        placement = row_placement(row)
        if placement is None:
            return {}
        from ggufcarve.quant.ladder_plan import model_name_from

        base = model_name_from(self.model.path)
        name = base if row.kept == self.layout.expert_count else f"{base}-{row.kept}e"
        rung = next(r for r in self.spec.rungs if r.name == row.rung.rung)
        from ggufcarve.placement.run_line import RunContext, server_argv

        context = self.cache.settings
        placed = row.faster_memory or row.placed
        devices = tuple(d.device for d in placed.devices if d.device != HOST) if placed and placed.measured else ()
        server = server_argv(
            rung.file_name(name),
            placement,
            main,
            RunContext(n_ctx=context.n_ctx, kv_type=context.type_k),
            rpc=self.rpc,
            devices=devices,
        )
        return {
            "placement": {
                **placement.to_json(main),
                "label": placement.label(),
                **({"walk": row.placed.walk} if row.placed is not None and row.placed.walk else {}),
            },
            **({"placement_chosen_by": "measured speed (llama-bench)"} if row.faster is not None else {}),
            "placement_measured": placed is not None and placed.measured,
            "server": server,
        }

    def to_json(self) -> dict[str, Any]:
        best = self.best()
        return {
            "model": {
                "architecture": self.layout.architecture,
                "expert_count": self.layout.expert_count,
                "expert_used_count": self.layout.expert_used_count,
                "expert_group_count": self.layout.group_count,
                "expert_group_used_count": self.layout.group_used_count,
                "bytes": self.model.total_bytes,
            },
            "ladder": {"name": self.spec.name, "rungs": [r.name for r in self.spec.rungs]},
            "memory_bytes": self.memory,
            **(
                {"gpu_memory_bytes": self.gpu_memory, "gpu_margin_bytes": self.gpu_margin}
                if self.gpu_memory is not None
                else {}
            ),
            "cache": self.cache.to_json(),
            "kept_counts": self.kept_counts,
            "sizes_from": {
                "method": "llama.cpp quantizer dry run on a sparse pruned header per K",
                "quantizer": self.quantizer,
                "imatrix": self.imatrix_assumption,
            },
            "rows": [
                {
                    "kept": r.kept,
                    "power_of_two": r.kept & (r.kept - 1) == 0,
                    "rung": r.rung.rung,
                    "ftype": r.rung.ftype,
                    "file_bytes": r.rung.bytes,
                    "cache_bytes": r.cache_bytes,
                    "total_bytes": r.total,
                    "fits": r.fits,
                    "imatrix_fallback": list(r.rung.fallback),
                    "needs_imatrix": r.rung.needs_imatrix,
                    "tier": r.tier,
                    "tiers": list(r.tiers),
                    **({"memory": [d.to_json() for d in r.devices]} if r.devices else {}),
                    **({"gpu": offload.to_json()} if (offload := r.offload) else {}),
                    **self._placement_json(r),
                    **(r.speed or {}),
                }
                for r in self.rows
            ],
            "best": {"kept": best.kept, "rung": best.rung.rung, "total_bytes": best.total, "tier": best.tier}
            if best
            else None,
        }


def place_rows(
    model: GGUFModel,
    layout: MoeLayout,
    rows: list[FitRow],
    budgets: tuple[int, ...],
    margin: int,
    settings: MemorySettings,
    directory: Path,
    on_event: Sink = ignore,
) -> list[FitRow]:
    """Each row placed on the devices of `budgets` (placement.search.place_on_devices); where the
    devices are present, the placements are loaded by llama.cpp (one dry load per K and placement)
    from the estimate's until the fastest that fits. One budget is placed here only with its device
    present (else by placement.offload's rule, FitRow.offload), by --n-cpu-moe's placements alone;
    measured to fit with none of them, the row holds the last one's measured memory."""
    from dataclasses import replace

    from ggufcarve.llama.memory import dry_load
    from ggufcarve.placement.search import PlacedMemory, Placement, measured_rows, place_on_devices, present_devices

    out = []
    headers: dict[int, Path] = {}
    loads: dict[tuple[int, Placement], DryLoad] = {}
    for done, row in enumerate(rows, 1):
        weights, load = row.rung.placement, row.load
        if weights is None or load is None:
            out.append(row)
            continue

        def load_placement(placement: Placement, kept: int = row.kept, main: int = len(weights.expert_bytes)) -> Any:
            if kept not in headers:
                headers[kept] = sparse_pruned_header(model, layout, kept, directory, vocabulary=True).path
            if (kept, placement) not in loads:
                loads[(kept, placement)] = dry_load(headers[kept], placement.loaded_with(settings, main))
            return loads[(kept, placement)]

        present = present_devices(load, budgets)
        if len(budgets) == 1 and not present:
            out.append(row)
            continue
        placed = place_on_devices(
            weights,
            load,
            budgets=budgets,
            memory=row.memory,
            present=present,
            load=load_placement,
            margin=margin,
            from_last=len(budgets) > 1,
        )
        if placed is None and len(budgets) == 1:
            slowest = Placement(n_cpu_moe=len(weights.expert_bytes))
            rows_at = measured_rows(weights, slowest, load_placement(slowest))
            placed = PlacedMemory(slowest, rows_at, True, {present[0]: budgets[0], HOST: row.memory}, margin)
        out.append(replace(row, placed=placed))
        on_event(Event("memory", done, len(rows), "rows", f"K={row.kept} {row.rung.rung}"))
    return out


def pruned_plan(model: GGUFModel, layout: MoeLayout, kept: int, path: Path) -> PlannedFile:
    """The one file `ggufcarve prune` plans for K experts per block (the first of each), at `path`."""
    return plan_prune(model, layout, keep_per_block(layout, kept), path, merge=True).files[0]


def sparse_pruned_header(
    model: GGUFModel, layout: MoeLayout, kept: int, directory: Path, *, vocabulary: bool = False
) -> PlannedFile:
    """The pruned model of K experts as `ggufcarve prune` plans it (one file, provenance keys
    included), written as a header and a hole of the planned data size for the quantizer's dry run.

    The written header leaves out the tokenizer's string arrays (llama-quantize never reads the
    vocabulary, and parsing 250k strings costs most of a dry run's time) and states their count
    as `{arch}.vocab_size`, which load_hparams reads where it needs the vocabulary size. The
    returned plan is the full one: output sizes are computed from it. With `vocabulary` the
    header keeps every key (llama.cpp's loader reads the vocabulary: the memory dry load)."""
    planned = pruned_plan(model, layout, kept, directory / f"pruned-{kept}{'-vocab' if vocabulary else ''}.gguf")
    kvs = (
        list(planned.kvs)
        if vocabulary
        else [
            kv for kv in planned.kvs if not (kv.key.startswith("tokenizer.") and kv.item_type == GGUFValueType.STRING)
        ]
    )
    vocab_key = Keys.LLM.VOCAB_SIZE.format(arch=layout.architecture)
    tokens = model.get(Keys.Tokenizer.LIST)
    if tokens is not None and model.get(vocab_key) is None and not vocabulary:
        kvs.append(make_kv(vocab_key, GGUFValueType.UINT32, len(tokens)))
    header, _ = encode_header(planned.version, kvs, [t.header for t in planned.tensors], planned.alignment)
    _, data_offsets = planned.encoded_header
    data_size = data_offsets[-1] + pad_to(planned.tensors[-1].nbytes, planned.alignment) if planned.tensors else 0
    with open(planned.path, "wb") as f:
        f.write(header)
        f.truncate(len(header) + data_size)
    return planned


def rung_tensors(planned: PlannedFile, dry: DryRun) -> list[TensorHeader]:
    """The tensors of the file llama-quantize writes for `dry`: each at its target type."""
    tensors = []
    for t in planned.tensors:
        target = dry.targets.get(t.name)
        type_id = int(tensor_type(target)) if target else t.type_id
        row = ggml_type_row_bytes(type_id, t.shape[0]) if type_id != t.type_id else None
        nbytes = t.nbytes if row is None else row * _rows(t.shape)  # unconverted tensors are copied
        tensors.append(TensorHeader(t.name, t.shape, type_id, nbytes))
    return tensors


def rung_file_bytes(
    planned: PlannedFile, dry: DryRun, ftype: str, tensors: Sequence[TensorHeader] | None = None
) -> int:
    """The size of the file llama-quantize writes for `dry`: the input's keys with
    general.quantization_version and general.file_type set and split keys removed, each tensor's
    rows at its target type (`tensors`, rung_tensors's when not given), padded to the alignment."""
    header, data_size = _rung_header(planned, rung_tensors(planned, dry) if tensors is None else tensors, ftype)
    return len(header) + data_size


def _rung_header(planned: PlannedFile, tensors: Sequence[TensorHeader], ftype: str) -> tuple[bytes, int]:
    """The header llama-quantize writes for `planned` at `tensors`' types, and the size of its data."""
    changes: dict[str, Any] = {key: None for key in SPLIT_KEYS}
    changes[Keys.General.QUANTIZATION_VERSION] = make_kv(
        Keys.General.QUANTIZATION_VERSION, GGUFValueType.UINT32, GGML_QUANT_VERSION
    )
    changes[Keys.General.FILE_TYPE] = make_kv(Keys.General.FILE_TYPE, GGUFValueType.UINT32, FILE_TYPES[ftype])
    header, offsets = encode_header(planned.version, replace_kvs(planned.kvs, changes), tensors, planned.alignment)
    return header, (offsets[-1] + pad_to(tensors[-1].nbytes, planned.alignment) if tensors else 0)


def sparse_rung_file(
    model: GGUFModel, layout: MoeLayout, row: FitRow, directory: Path, planned: PlannedFile | None = None
) -> Path:
    """The rung of `row` as a file llama.cpp loads: its header (every key, every tensor at the type the
    quantizer's dry run chose) and a hole of its data size, so every weight is zero (a zero-scale block in
    every quantized type). What it holds is the rung's shapes and types: what a speed depends on.
    `planned`: the K's `pruned_plan`, when the caller has it."""
    from gguf.constants import GGMLQuantizationType

    if planned is None:
        planned = pruned_plan(model, layout, row.kept, directory / f"pruned-{row.kept}.gguf")
    types = dict(row.rung.types)
    tensors = []
    for t in planned.tensors:
        type_id = int(GGMLQuantizationType[types[t.name]]) if t.name in types else t.type_id
        nbytes = t.nbytes if type_id == t.type_id else ggml_type_row_bytes(type_id, t.shape[0]) * _rows(t.shape)
        tensors.append(TensorHeader(t.name, t.shape, type_id, nbytes))
    header, data_size = _rung_header(planned, tensors, row.rung.ftype)
    path = directory / f"speed-{row.kept}-{row.rung.rung}.gguf"
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(len(header) + data_size)
    return path


# what a --measure-speed figure is of (the zero weights route every token to the same experts)
SPEED_OF = (
    "llama-bench on a file of the rung's tensor shapes and types with zero weights (the same experts every token)"
)


def row_placement(row: FitRow) -> Any:
    """How a row runs on the GPUs (placement.search.Placement; None without a GPU placement): the faster
    variant measured by --measure-speed, else the one the placement search found by bytes."""
    from ggufcarve.placement.search import Placement

    if row.faster is not None:
        return row.faster
    if row.placed is not None:
        return row.placed.placement
    if row.offload is not None and row.offload.n_cpu_moe is not None:
        return Placement(n_cpu_moe=row.offload.n_cpu_moe)
    return None


def measure_speeds(
    report: FitReport,
    bench: Callable[[Path, Compute, tuple[str, ...]], Any],
    compute: Compute,
    on_device: bool,
    on_event: Sink = ignore,
    measure: MemorySettings | None = None,
    method: Any = None,
) -> FitReport:
    """Every row that fits, timed in its placement by `bench(file, compute, llama-bench's placement and
    context flags)` (an evaluate.speed.Speed; `method`: its SpeedSettings, whose description each row
    records) on `sparse_rung_file`: in a GPU tier with the devices here (`on_device`),
    every layer on them with the row's --n-cpu-moe N (or its last-N -ot) and split; else on the CPU
    with `compute`. A row with experts in system memory is timed in the other variant too (the same
    N from the other end, placement.search.other_variant), which takes its place when it decodes
    faster beyond noise (`faster`); `speed_placements` lists both. With `measure` (the run's memory
    settings) and the devices present, the variant's memory is llama.cpp's dry load of that file in
    it (`faster_memory`), and a variant over a budget is not taken (`placement_kept_because`)."""
    from dataclasses import replace

    from ggufcarve.gguf.container import read_model
    from ggufcarve.llama.memory import dry_load
    from ggufcarve.placement.memory import device_memory
    from ggufcarve.placement.search import PlacedMemory, Placement, faster_beyond_noise, other_variant

    main = report.layout.main_layer_count
    wanted = [r for r in report.rows if r.fits]
    rows = list(report.rows)
    plans: dict[int, PlannedFile] = {}  # per K: the pruned file's plan, shared by its rungs

    def variant_memory(path: Path, row: FitRow, variant: Placement) -> PlacedMemory | None:
        if measure is None or row.placed is None or not row.placed.measured:  # no device here to load it on
            return None
        rows = device_memory(read_model(path), dry_load(path, variant.loaded_with(measure, main)))
        return PlacedMemory(variant, rows, True, row.placed.budgets, row.gpu_margin)

    from ggufcarve.placement.run_line import RunContext, bench_args

    cache = report.cache.settings
    context = RunContext(
        n_ctx=cache.n_ctx,
        kv_type=cache.type_k,
        **(
            {"flash_attn": measure.flash_attn, "n_batch": measure.n_batch, "n_ubatch": measure.n_ubatch}
            if measure
            else {}
        ),
    )

    def timed(path: Path, placement: Placement | None, row: FitRow) -> tuple[Any, dict[str, Any]]:
        """llama-bench's speed of the row's run line (placement.run_line: its placement on the devices
        measured, its context at half --ctx's depth), and the placement timed."""
        if placement is None:
            flags = bench_args(Placement(gpu_layers=0), main, context)
            return bench(path, Compute(0, (), (), compute.threads), tuple(flags)), {"gpu_layers": 0, "label": "CPU"}
        placed = row.faster_memory or row.placed
        devices = tuple(d.device for d in placed.devices if d.device != HOST) if placed and placed.measured else ()
        flags = bench_args(placement, main, context, rpc=compute.rpc, devices=devices)
        return bench(path, compute, tuple(flags)), {**placement.to_json(main), "label": placement.label()}

    with tempfile.TemporaryDirectory(prefix="ggufcarve-speed-") as tmp:
        for done, row in enumerate(wanted, 1):
            placement = row_placement(row) if row.tier in GPU_TIERS and on_device else None
            other = None
            if placement is not None and row.rung.placement is not None and row.load is not None:
                devices = [d.device for d in row.devices_in(row.tier) if d.device != HOST]
                other = other_variant(row.rung.placement, row.load, placement, devices)
            if row.kept not in plans:
                plans[row.kept] = pruned_plan(report.model, report.layout, row.kept, Path(tmp) / "pruned.gguf")
            path = sparse_rung_file(report.model, report.layout, row, Path(tmp), plans[row.kept])
            loaded, kept_because = None, None
            try:
                speed, where = timed(path, placement, row)
                variants = [(speed, where)]
                faster = None
                if other is not None:
                    variants.append(timed(path, other, row))
                    if faster_beyond_noise(variants[1][0].tg_runs, speed.tg_runs):
                        loaded = variant_memory(path, row, other)
                        if loaded is not None and not loaded.fits:
                            kept_because = loaded.kept_because()
                        else:
                            faster, (speed, where) = other, variants[1]
            finally:
                path.unlink(missing_ok=True)
            record = {
                "decode_tok_s": speed.tg_tok_s,
                "prompt_tok_s": speed.pp_tok_s,
                "speed_placement": where,
                "speed_of": SPEED_OF,
                **({"speed_method": method.method(context.bench_depth)} if method is not None else {}),
                "speed_computed_on": speed.computed_on,
                **({"placement_kept_because": kept_because} if kept_because else {}),
            }
            if len(variants) > 1:
                record["speed_placements"] = [
                    {"label": w["label"], "decode_tok_s": s.tg_tok_s, "prompt_tok_s": s.pp_tok_s} for s, w in variants
                ]
            rows[rows.index(row)] = replace(row, speed=record, faster=faster, faster_memory=loaded if faster else None)
            on_event(Event("speed", done, len(wanted), "rows", f"K={row.kept} {row.rung.rung}"))
    return replace(report, rows=rows)


def _rows(shape: Sequence[int]) -> int:
    rows = 1
    for n in shape[1:]:
        rows *= n
    return rows


def _job(path: Path, rung: Rung, overrides: tuple[tuple[str, str], ...] = ()) -> QuantizeJob:
    return QuantizeJob(
        path,
        None,
        rung.ftype,
        None,
        rung.allow_requantize,
        rung.output_tensor_type,
        rung.token_embedding_type,
        overrides + rung.tensor_types,
        rung.pure,
        True,
        1,
    )


def size_rung(
    quantizer: Quantizer, planned: PlannedFile, rung: Rung, missing_imatrix: Any, layout: MoeLayout | None = None
) -> RungSize:
    """One rung of one pruned header: dry run, the ladder's imatrix fallback, the file size, and
    with `layout` the tensors' placement on a GPU."""
    dry = quantizer.dry_run(_job(planned.path, rung))
    fallback = tuple(n for n in dry.refused_without_imatrix() if missing_imatrix(n))
    if fallback:
        overrides = tuple((f"^{re.escape(n)}$", rung.imatrix_fallback_type) for n in fallback)
        dry = quantizer.dry_run(_job(planned.path, rung, overrides))
    tensors = rung_tensors(planned, dry)
    placement = (
        placement_of(((t.name, t.nbytes) for t in tensors), layout.block_count, layout.nextn_layers) if layout else None
    )
    types = tuple((t.name, type_name(t.type_id)) for t in tensors)
    tensor_bytes = sum(pad_to(t.nbytes, planned.alignment) for t in tensors)
    return RungSize(
        rung.name,
        rung.ftype,
        rung_file_bytes(planned, dry, rung.ftype, tensors),
        fallback,
        bool(dry.refused_without_imatrix()),
        placement,
        types,
        tensor_bytes,
    )


def measure_per_kept(
    model: GGUFModel,
    layout: MoeLayout,
    counts: Sequence[int],
    settings: MemorySettings,
    directory: Path,
    on_event: Sink = ignore,
) -> dict[int, DryLoad]:
    """Per K, llama.cpp's dry load (llama.memory) of the pruned model's sparse header with its
    vocabulary: the KV cache, compute and output buffers at `settings` (the weights are each rung's own)."""
    from ggufcarve.llama.memory import dry_load

    out = {}
    for done, k in enumerate(counts, 1):
        header = sparse_pruned_header(model, layout, k, directory, vocabulary=True)
        out[k] = dry_load(header.path, settings)
        header.path.unlink(missing_ok=True)
        on_event(Event("memory", done, len(counts), "K", f"K={k}"))
    return out


def type_name(type_id: int) -> str:
    from gguf.constants import GGMLQuantizationType

    return GGMLQuantizationType(type_id).name


def types_differ(pruned: RungSize, unpruned: RungSize) -> list[tuple[str, str, str]]:
    """The tensors llama-quantize gives another type in the pruned rung than in the unpruned rung of
    the same quant (name, pruned type, unpruned type); empty when every tensor's type agrees, which
    makes the pruned rung's computation that of the unpruned rung with the dropped experts masked out
    (quantizing an expert tensor is row by row: the kept experts' slabs are the same bytes)."""
    unpruned_types = dict(unpruned.types)
    return [
        (name, kind, unpruned_types.get(name, "absent"))
        for name, kind in pruned.types
        if unpruned_types.get(name) != kind
    ]


def plan_fit(
    model: GGUFModel,
    layout: MoeLayout,
    spec: LadderSpec,
    *,
    memory: int,
    context: ContextSettings,
    quantizer: Quantizer,
    kept_counts: Sequence[int] | None = None,
    only: Sequence[str] | None = None,
    imatrix_entries: set[str] | None = None,
    workers: int | None = None,
    gpu_memory: int | tuple[int, ...] | None = None,
    gpu_margin: int = DEFAULT_MARGIN,
    measure: MemorySettings | None = None,
    on_event: Sink = ignore,
) -> FitReport:
    """Every (K, rung) pair's file size, the cache at `context`, and whether file + cache fit in `memory`;
    with `gpu_memory`, each row's offload (placement/offload.py: whole, or the smallest --n-cpu-moe N).

    `imatrix_entries`: the tensor names the ladder's imatrix holds; None assumes llama-imatrix's
    coverage (every tensor but those of the MTP blocks).

    Several GPU budgets (one per device, in device order) are placed by placement.search: the
    fastest placement whose estimated memory fits every device, measured again by llama.cpp's dry
    load on the devices when they are present (`measure.compute.rpc`, or a GPU build) and replaced
    by the next one while a measured device is over its budget."""
    started = time.monotonic()
    budgets = (gpu_memory,) if isinstance(gpu_memory, int) else (gpu_memory or ())  # settings.Budgets keeps its names
    if len(budgets) > 1 and measure is None:
        raise BadInput(
            f"{len(budgets)} GPU budgets are placed from llama.cpp's dry load",
            "leave --file-and-cache out, or give one --gpu-memory",
        )
    gpu_memory = budgets[0] if len(budgets) == 1 else None
    rungs = spec.select(only)
    counts = sorted(kept_counts) if kept_counts else listed_kept_counts(layout)
    cache = context_memory(model.get, context)
    mtp_prefixes = tuple(f"blk.{b}." for b in range(layout.main_layer_count, layout.block_count))
    if imatrix_entries is None:
        assumption = (
            "llama-imatrix's: every tensor but the MTP blocks'" if mtp_prefixes else "llama-imatrix's: every tensor"
        )

        def missing_imatrix(name: str) -> bool:
            return name.startswith(mtp_prefixes) if mtp_prefixes else False
    else:
        assumption = f"the given imatrix's {len(imatrix_entries)} entries"

        def missing_imatrix(name: str) -> bool:
            return name not in imatrix_entries

    sizes: dict[tuple[int, str], RungSize] = {}
    total = len(counts) * len(rungs)
    with tempfile.TemporaryDirectory(prefix="ggufcarve-fit-") as tmp:
        headers = {k: sparse_pruned_header(model, layout, k, Path(tmp)) for k in counts}
        with ThreadPoolExecutor(max_workers=workers or max(1, min(4, os.cpu_count() or 1))) as pool:
            futures = {
                (k, r.name): pool.submit(size_rung, quantizer, headers[k], r, missing_imatrix, layout)
                for k in counts
                for r in rungs
            }
            for done, (key, future) in enumerate(futures.items(), 1):
                sizes[key] = future.result()
                on_event(Event("fit", done, total, "rungs", f"K={key[0]} {key[1]}"))
        measured = measure_per_kept(model, layout, counts, measure, Path(tmp), on_event) if measure is not None else {}
        rows = [
            FitRow(k, sizes[(k, r.name)], memory, cache.total_bytes, gpu_memory, gpu_margin, measured.get(k))
            for k in counts
            for r in rungs
        ]
        if budgets and measure is not None:
            rows = place_rows(model, layout, rows, budgets, gpu_margin, measure, Path(tmp), on_event)
    return FitReport(
        model,
        layout,
        spec,
        memory,
        cache,
        counts,
        rows,
        quantizer.describe(),
        time.monotonic() - started,
        assumption,
        gpu_memory,
        gpu_margin,
        measure.compute.rpc if measure is not None else (),
    )
