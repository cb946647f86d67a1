"""How a user runs a model on their devices: the placements tried, fastest first, and the first that fits.

    placement = Placement(n_cpu_moe=12, tensor_split=(8, 8, 10))
    placement_args(placement, blocks)   # placement.run_line: ["-ngl", "999", "-ts", "8,8,10", "--n-cpu-moe", "12"]
    choice = choose(weight_placement(model), host_load, budgets=(8 * GiB, 8 * GiB, 10 * GiB), memory=64 * GiB)

The placements, fastest first (every one offloads every layer; `-ngl` below the layer count is
slower than keeping experts in system memory and is not tried):
  * whole: every tensor but the input layer on the devices;
  * --n-cpu-moe N: the routed experts of blocks 0..N-1 in system memory (N = 1, 2, ...);
  * the last-N variant (-ot of blocks n-N..n-1), tried before --n-cpu-moe N where it moves more
    expert bytes (a model whose first blocks are dense holds no experts there), after it over
    several devices (it relieves the last device, which holds the output layer);
several devices share the layers by their budgets (`-ts` in proportion, llama.cpp's split rule),
and where one is over its budget the split moves whole layers to a device with room (`relieved`:
-ts as layer counts, llama-fit-params' form).

A placement fits when every device's weights + cache + compute buffers + `margin` (llama.cpp's
--fit target margin, 1 GiB) are within its budget and the host's total within `memory`. The
figures of a device that is not on this machine are estimated: the weights and the cache by
llama.cpp's own layer assignment (src/llama-model.cpp, load_tensors: layer il goes to the device
whose cumulative share first exceeds il / (n_layer + 1), the output layer as layer n_layer), the
compute buffers from the CPU run's graph (`offload.gpu_compute` for one device; each device of a
split the whole graph's, plus the copies of the graph's inputs llama.cpp's pipeline parallelism
keeps: `pipelined`, `graph_inputs`; estimated). With the
devices present (`--rpc`, or a GPU build), fit loads the placement for real and `measured_rows` reads it.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ggufcarve.llama.devices import LLM_FFN_EXPS_REGEX, Compute
from ggufcarve.llama.memory import HOST, DeviceMemory, DryLoad, MemorySettings
from ggufcarve.placement.offload import DEFAULT_MARGIN, Offload, WeightPlacement, override_regex

ALL_LAYERS = 999  # n_gpu_layers above the layer count offloads every layer and the output (llama-server: -ngl all)


@dataclass(frozen=True)
class Placement:
    """Where the layers and experts go: every layer offloaded (`gpu_layers`), the routed experts of
    `n_cpu_moe` blocks in system memory (the first ones, or the last ones with `from_last`), shared
    between the devices by `tensor_split`."""

    gpu_layers: int = ALL_LAYERS
    n_cpu_moe: int = 0
    from_last: bool = False
    tensor_split: tuple[float, ...] = ()

    def cpu_blocks(self, main_blocks: int) -> range:
        n = min(self.n_cpu_moe, main_blocks)
        return range(main_blocks - n, main_blocks) if self.from_last else range(n)

    def cpu_tensors(self, main_blocks: int) -> tuple[str, ...]:
        """The patterns of the tensors kept in system memory (what -ot PATTERN=CPU or --n-cpu-moe adds)."""
        if not self.n_cpu_moe:
            return ()
        if not self.from_last:
            return (override_regex(self.n_cpu_moe),)
        blocks = "|".join(str(i) for i in self.cpu_blocks(main_blocks))
        return (rf"blk\.({blocks}){LLM_FFN_EXPS_REGEX}",)

    def compute(self, rpc: tuple[str, ...] = (), devices: tuple[str, ...] = ()) -> Compute:
        """The `Compute` that loads this placement on the devices present (`rpc`'s among them; the
        `devices` named, else every offload device)."""
        return Compute(self.gpu_layers, rpc, self.tensor_split, devices=devices)

    def override_tensor(self, main_blocks: int) -> str | None:
        patterns = self.cpu_tensors(main_blocks)
        return f"{patterns[0]}=CPU" if patterns else None

    def loaded_with(self, settings: MemorySettings, main_blocks: int) -> MemorySettings:
        """`settings` (a dry load's) with this placement's layers, split and CPU tensors, on the devices
        its `compute` names (`rpc`'s among them)."""
        placed = self.compute(settings.compute.rpc, settings.compute.devices)
        return replace(settings, compute=placed, cpu_tensors=self.cpu_tensors(main_blocks))

    def label(self) -> str:
        where = (
            "whole"
            if not self.n_cpu_moe
            else f"n-cpu-moe {self.n_cpu_moe}"
            if not self.from_last
            else f"last {self.n_cpu_moe} blocks' experts on the CPU"
        )
        return where + (
            f", split {':'.join(f'{s:g}' for s in self.tensor_split)}" if len(self.tensor_split) > 1 else ""
        )

    def to_json(self, main_blocks: int) -> dict[str, Any]:
        """Its keys (`from_json` reads them back): llama.cpp's -ngl, --n-cpu-moe N (None for the last
        N blocks'), the -ot pattern of the last N blocks' experts, -ts; `blocks_on_cpu` N either way."""
        return {
            "gpu_layers": self.gpu_layers,
            "n_cpu_moe": None if self.from_last else self.n_cpu_moe,
            "override_tensor": self.override_tensor(main_blocks) if self.from_last else None,
            "tensor_split": list(self.tensor_split),
            "blocks_on_cpu": self.n_cpu_moe,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Placement:
        from_last = bool(doc.get("override_tensor"))
        blocks = doc.get("blocks_on_cpu")
        if blocks is None:
            blocks = doc.get("n_cpu_moe") or 0
        return cls(int(doc.get("gpu_layers", ALL_LAYERS)), int(blocks), from_last, tuple(doc.get("tensor_split") or ()))


def assign_layers(layer_count: int, gpu_layers: int, shares: tuple[float, ...], devices: list[str]) -> dict[int, str]:
    """Layer -> device by llama.cpp's rule (module docstring) for layers 0..layer_count (the last
    one the output layer), in float32 as llama.cpp computes the split points."""
    if not devices:
        return dict.fromkeys(range(layer_count + 1), "CPU")
    weights = np.asarray(shares if shares else [1.0] * len(devices), dtype=np.float32)
    points = list(np.cumsum(weights, dtype=np.float32) / np.float32(weights.sum()))
    start = max(layer_count + 1 - gpu_layers, 0)
    active = min(gpu_layers, layer_count + 1)
    out = {}
    for il in range(layer_count + 1):
        if il < start or il - start >= active:
            out[il] = "CPU"
            continue
        index = bisect_right(points, float(np.float32(il - start) / np.float32(active)))
        out[il] = devices[min(index, len(devices) - 1)]
    return out


@dataclass(frozen=True)
class PlacedMemory:
    """A placement and what each device then holds (the devices in order, then the host)."""

    placement: Placement
    devices: list[DeviceMemory]
    measured: bool  # loaded by llama.cpp on the devices present; else estimated
    budgets: dict[str, int] = field(default_factory=dict)  # device -> its budget (the host's: --memory)
    margin: int = DEFAULT_MARGIN
    walk: str = ""  # how place_on_devices reached it over N (loaded placements only)

    def over(self) -> list[str]:
        """The devices over their budget (a GPU's with the margin kept free), and any device holding
        bytes that has no budget (it is not the user's to fill)."""
        out = []
        for row in self.devices:
            budget = self.budgets.get(row.device)
            if budget is None and row.device != HOST and row.total > 0:
                out.append(row.device)
            elif budget is not None and row.total + (0 if row.device == HOST else self.margin) > budget:
                out.append(row.device)
        return out

    @property
    def fits(self) -> bool:
        return not self.over()

    def kept_because(self) -> str:
        """Why a faster placement measured over a budget (this one) is not taken."""
        return f"{self.placement.label()} decodes faster but, loaded, {', '.join(self.over())} is over its budget"


def _rows(
    weights: WeightPlacement,
    placement: Placement,
    layers: dict[int, str],
    devices: list[str],
    cache: dict[str, int],
    buffers: dict[str, tuple[int, int]],
    estimated: tuple[str, ...],
) -> list[DeviceMemory]:
    """Rows of `devices` and the host: the weights by `layers` (layer -> device, HOST for the CPU;
    the output layer at index n_layer_all), the cache and the (compute, output) buffers given."""
    main = len(weights.expert_bytes)
    blocks = main + weights.nextn_blocks
    on_cpu = set(placement.cpu_blocks(main))
    held = dict.fromkeys([*devices, HOST], 0)
    held[HOST] += weights.input_bytes
    for block in range(main):
        held[layers.get(block, HOST)] += weights.block_other[block] if weights.block_other else 0
        held[HOST if block in on_cpu else layers.get(block, HOST)] += weights.expert_bytes[block]
    held[layers.get(blocks, HOST)] += weights.output_bytes
    return [
        DeviceMemory(
            d,
            held.get(d, 0),
            cache.get(d, 0),
            *buffers.get(d, (0, 0)),
            () if d == HOST and not estimated else estimated,
        )
        for d in [*devices, HOST]
    ]


def estimate(
    weights: WeightPlacement, host_load: DryLoad, placement: Placement, devices: list[str]
) -> list[DeviceMemory]:
    """Each device's memory for `placement` on devices not present here: the weights and the cache
    by llama.cpp's layer assignment, the compute buffers from the CPU run's (module docstring)."""
    from ggufcarve.placement.offload import gpu_compute

    main = len(weights.expert_bytes)
    assigned = assign_layers(main + weights.nextn_blocks, placement.gpu_layers, placement.tensor_split, devices)
    layers = {il: HOST if d == "CPU" else d for il, d in assigned.items()}
    cache = dict.fromkeys([*devices, HOST], 0)
    for total, held_by in host_load.cache_kinds.values() or [(host_load.cache, tuple(range(main)))]:
        for block in held_by:
            cache[layers.get(block, HOST)] += total / max(len(held_by), 1)
    cache = {d: round(v) for d, v in cache.items()}
    graph = host_load.on(HOST, host_load.compute)
    one = len(devices) == 1 and not placement.from_last
    buffers = {d: (gpu_compute(weights, graph)(placement.n_cpu_moe) if one else graph, 0) for d in devices}
    buffers[HOST] = (graph, host_load.on(HOST, host_load.output))
    if pipelined(placement, devices, main + weights.nextn_blocks):
        inputs = graph_inputs(host_load)
        buffers = {d: (graph + (SCHED_MAX_COPIES - 1) * inputs, 0) for d in devices}
        buffers[HOST] = (max(graph, SCHED_MAX_COPIES * inputs), host_load.on(HOST, host_load.output))
    return _rows(weights, placement, layers, devices, cache, buffers, ("compute",))


SCHED_MAX_COPIES = 4  # ggml-backend.cpp's GGML_SCHED_MAX_COPIES: input copies with pipeline parallelism


def pipelined(placement: Placement, devices: list[str], layer_count: int) -> bool:
    """Whether llama.cpp runs `placement` with pipeline parallelism (llama_context: more than one
    device, every layer offloaded, the layer split, no tensor override; every device able to run
    asynchronously with events, as CUDA's and RPC's are): then the scheduler keeps
    SCHED_MAX_COPIES copies of every split's inputs."""
    return len(devices) > 1 and placement.gpu_layers > layer_count and not placement.n_cpu_moe


def graph_inputs(load: DryLoad) -> int:
    """The bytes of a micro-batch's graph inputs, what the host's compute buffer holds with every layer
    offloaded: the attention masks (n_ctx x n_ubatch, F16 with flash attention, else F32; a second
    one with a sliding window) and the input embeddings (n_embd x n_ubatch, F32). Measured on two RPC
    devices, a split's devices each hold (copies - 1) of these beyond one device's compute buffer
    and the host `copies` of them: within about 1 MiB on the demo model; the Qwen3.6-35B-A3B
    replica's recurrent blocks add inputs not counted here (its last device 3.7% low,
    tests/test_placement.py)."""
    settings = load.settings
    if settings is None:
        return 0
    ubatch = min(settings.n_ubatch, settings.n_ctx)
    mask = settings.n_ctx * ubatch * (4 if settings.flash_attn == "off" else 2) * (2 if load.n_swa else 1)
    return mask + load.n_embd * ubatch * 4


def measured_rows(weights: WeightPlacement, placement: Placement, load: DryLoad) -> list[DeviceMemory]:
    """Each device's memory for `placement` from llama.cpp's dry load of it on the devices present:
    the weights of `weights` (a rung's tensor bytes) by the layers llama.cpp assigned, the cache and
    the buffers as it logged them."""
    devices = [name for name, _ in load.offload_devices]
    layers = {il: HOST if d == "CPU" else d for il, d in load.layers.items()}
    buffers = {d: (load.on(d, load.compute), load.on(d, load.output)) for d in [*devices, HOST]}
    return _rows(weights, placement, layers, devices, load.cache_by_device, buffers, ())


def shares_of(budgets: tuple[int, ...]) -> tuple[float, ...]:
    """-ts shares in proportion to the budgets, in GiB to two decimals (8GiB,8GiB,10GiB: 8,8,10)."""
    return tuple(round(b / 2**30, 2) or 0.01 for b in budgets)


def candidates(weights: WeightPlacement, shares: tuple[float, ...], from_last: bool = True) -> list[Placement]:
    """The placements tried, fastest first (module docstring); without `from_last`, --n-cpu-moe's alone."""
    return [placement for group in _by_blocks_on_cpu(weights, shares, from_last) for placement in group]


def _by_blocks_on_cpu(weights: WeightPlacement, shares: tuple[float, ...], from_last: bool) -> list[list[Placement]]:
    """`candidates` grouped by N, the blocks whose experts are in system memory (index N): within a
    group the first-N and the last-N variant, the one moving more expert bytes first; over several
    devices the last-N variant is tried on uniform models too (it relieves the last device, which
    holds the output layer)."""
    main = len(weights.expert_bytes)
    split = shares if len(shares) > 1 else ()
    groups = [[Placement(tensor_split=split)]]
    for n in range(1, main + 1):
        first = Placement(n_cpu_moe=n, tensor_split=split)
        last = Placement(n_cpu_moe=n, from_last=True, tensor_split=split)
        moved_first = sum(weights.expert_bytes[:n])
        moved_last = sum(weights.expert_bytes[main - n :])
        if not from_last or n == main:
            groups.append([first])
        elif moved_last > moved_first:
            groups.append([last, first])
        else:
            groups.append([first, last] if split else [first])
    return groups


def layer_counts(placement: Placement, layer_count: int, devices: list[str]) -> list[int]:
    """The layers llama.cpp gives each of `devices` under `placement` (assign_layers; the output layer
    at index `layer_count` included)."""
    assigned = assign_layers(layer_count, placement.gpu_layers, placement.tensor_split, devices)
    return [sum(1 for d in assigned.values() if d == device) for device in devices]


def relieved(
    placed: PlacedMemory,
    rows_of: Callable[[Placement], list[DeviceMemory]],
    layer_count: int,
    steps: int | None = None,
) -> PlacedMemory:
    """`placed`, or where a device is over its budget and another has room, the split that moves
    whole layers from the device most over to the one with the most room, one layer at a time
    (`-ts` as layer counts, as llama-fit-params writes it; `rows_of`: each device's memory for a
    placement, estimated or measured), until every device fits: the first split that fits, else
    `placed`. Stops where no device has room, where the host is over (a split moves no bytes off the
    host), at a split seen before, or after `steps` moves (default: one per layer and device)."""
    names = [row.device for row in placed.devices if row.device != HOST]
    if len(names) < 2 or placed.fits:
        return placed
    counts = layer_counts(placed.placement, layer_count, names)
    seen = {tuple(counts)}
    current = placed
    for _ in range(steps if steps is not None else (layer_count + 1) * len(names)):
        over = current.over()
        if not over:
            return current
        if HOST in over:
            break
        room = {
            row.device: current.budgets[row.device] - row.total - current.margin
            for row in current.devices
            if row.device in current.budgets and row.device != HOST
        }
        giver = min((d for d in over if counts[names.index(d)] > 0), key=lambda d: room.get(d, 0), default=None)
        takers = sorted((d for d in names if room.get(d, -1) > 0), key=lambda d: -room[d])
        if giver is None or not takers:
            break
        counts[names.index(giver)] -= 1
        counts[names.index(takers[0])] += 1
        if tuple(counts) in seen:
            break
        seen.add(tuple(counts))
        placement = replace(current.placement, tensor_split=tuple(float(c) for c in counts))
        current = PlacedMemory(placement, rows_of(placement), placed.measured, placed.budgets, placed.margin)
    return current if current.fits else placed


def choose(
    weights: WeightPlacement,
    host_load: DryLoad,
    *,
    budgets: tuple[int, ...],
    memory: int,
    devices: list[str] | None = None,
    margin: int = DEFAULT_MARGIN,
    from_last: bool = True,
    shares: tuple[float, ...] | None = None,
) -> PlacedMemory | None:
    """The fastest placement whose estimated memory fits every device's budget and the host's
    `memory`, its split relieved where a device is over (`relieved`); None when even every expert in
    system memory does not fit."""
    names = devices or [f"GPU{i}" for i in range(len(budgets))]
    limits = {**dict(zip(names, budgets)), HOST: memory}
    layer_count = len(weights.expert_bytes) + weights.nextn_blocks

    def rows_of(placement: Placement) -> list[DeviceMemory]:
        return estimate(weights, host_load, placement, names)

    for placement in candidates(weights, shares or shares_of(budgets), from_last):
        placed = relieved(PlacedMemory(placement, rows_of(placement), False, limits, margin), rows_of, layer_count)
        if placed.fits:
            return placed
    return None


def place_on_devices(
    weights: WeightPlacement,
    host_load: DryLoad,
    *,
    budgets: tuple[int, ...],
    memory: int,
    present: list[str],
    load: Callable[[Placement], DryLoad],
    margin: int = DEFAULT_MARGIN,
    from_last: bool = True,
    shares: tuple[float, ...] | None = None,
) -> PlacedMemory | None:
    """The fastest placement that fits the budgets: `choose`'s by the estimate; with the devices
    `present` (their names, one per budget), llama.cpp loads the placements (`load`: its dry load of
    one). The walk over N (the blocks whose experts are in system memory) is a bisection: from N = 1
    on, no device's memory grows with N (block N's experts leave the devices; the compute buffer of
    a device grows by at most that block, as ggml copies a system-memory expert block to the device
    for a large batch), while N = 0 to 1 adds that copy: N = 0 is tried by itself. The bisection
    starts at the estimate's N; at each N the split is the estimate's, relieved by measured rows
    (`relieved`) where a loaded device is over. Where the loads contradict the monotone order (N fits,
    a larger N does not), the walk goes through every N upward and `PlacedMemory.walk` says so. None
    when none fits. Without `from_last`, --n-cpu-moe's placements alone (the ones a ggufcarve command
    takes). `shares`: the split tried (-ts), else by the budgets."""
    names = present or [f"GPU{i}" for i in range(len(budgets))]
    placed = choose(
        weights,
        host_load,
        budgets=budgets,
        memory=memory,
        devices=names,
        margin=margin,
        from_last=from_last,
        shares=shares,
    )
    if not present:
        return placed
    limits = {**dict(zip(names, budgets)), HOST: memory}
    layer_count = len(weights.expert_bytes) + weights.nextn_blocks
    groups = _by_blocks_on_cpu(weights, shares or shares_of(budgets), from_last)
    loads = 0

    def measured_rows_of(placement: Placement) -> list[DeviceMemory]:
        nonlocal loads
        loads += 1
        return measured_rows(weights, placement, load(placement))

    def estimated_rows_of(placement: Placement) -> list[DeviceMemory]:
        return estimate(weights, host_load, placement, names)

    def estimated(placement: Placement) -> Placement:
        """The placement with the split the estimate relieves it to (itself where none fits)."""
        placed = PlacedMemory(placement, estimated_rows_of(placement), False, limits, margin)
        return relieved(placed, estimated_rows_of, layer_count).placement

    found: dict[int, PlacedMemory | None] = {}

    def fits_at(n: int) -> PlacedMemory | None:
        if n not in found:
            found[n] = None
            for placement in groups[n]:
                start = estimated(placement)
                again = relieved(
                    PlacedMemory(start, measured_rows_of(start), True, limits, margin),
                    measured_rows_of,
                    layer_count,
                    steps=2 * len(names),
                )
                if again.fits:
                    found[n] = again
                    break
        return found[n]

    last = len(groups) - 1
    start = placed.placement.n_cpu_moe if placed is not None else last
    if fits_at(start) is not None:
        low, high = (1, start) if start > 0 and fits_at(0) is None else (0, 0)
    elif start < last and fits_at(last) is not None:
        low, high = start + 1, last
    else:
        return None
    while low < high:
        mid = (low + high) // 2
        if fits_at(mid) is not None:
            high = mid
        else:
            low = mid + 1
    walk = f"bisection over N, {loads} dry loads"
    contradicted = [(a, b) for a in found for b in found if 1 <= a < b and found[a] and not found[b]]
    if high > 0 and contradicted:
        a, b = contradicted[0]
        high = next(n for n in range(1, last + 1) if fits_at(n) is not None)
        walk = f"every N upward ({loads} dry loads): N = {a} fits and N = {b} does not, memory is not monotone in N"
    return replace(found[high], walk=walk)


def placed_offload(placed: PlacedMemory, weights: WeightPlacement, gpu_memory: int, margin: int) -> Offload:
    """The one-GPU answer (placement.offload.Offload) of --n-cpu-moe N placed on that GPU: N (None
    when it is over a budget), the GPU's total with the margin, its cache and compute buffers."""
    gpu = next((row for row in placed.devices if row.device != HOST), None)
    if gpu is None:
        raise ValueError(f"{placed.placement.label()}: no device row to place on (the host's alone)")
    main = len(weights.expert_bytes)
    n = placed.placement.n_cpu_moe or 0
    moved = sum(weights.expert_bytes[:n])
    return Offload(
        gpu_memory, gpu.cache, margin, n if placed.fits else None, gpu.total + margin, moved, main, gpu.compute
    )


def present_devices(load: DryLoad, budgets: tuple[int, ...]) -> list[str]:
    """The offload devices of `load` that the budgets are for: those they name (settings.Budgets'
    `names`), else the first ones in device order; none when they are not all present (then the
    placement is estimated)."""
    devices = list(load.gpu_devices)
    names = list(getattr(budgets, "names", ()))
    if names:
        return names if all(name in devices for name in names) else []
    return devices[: len(budgets)] if len(devices) >= len(budgets) else []


def other_variant(
    weights: WeightPlacement, host_load: DryLoad, placement: Placement, devices: list[str]
) -> Placement | None:
    """The same N of experts in system memory from the other end (the last N blocks for --n-cpu-moe N,
    the first N for the last-N -ot), where it needs no more memory than `placement` on any device
    (the estimate, device by device: it fits wherever `placement` does); None otherwise or for a
    placement with every expert on the devices. ik_llama measured the last-N variant ~10% faster at
    prompt processing; which is faster here is for a measurement to say."""
    if not placement.n_cpu_moe or placement.n_cpu_moe >= len(weights.expert_bytes):
        return None
    other = Placement(placement.gpu_layers, placement.n_cpu_moe, not placement.from_last, placement.tensor_split)
    names = devices or ["GPU0"]
    ours = {row.device: row.total for row in estimate(weights, host_load, placement, names)}
    theirs = {row.device: row.total for row in estimate(weights, host_load, other, names)}
    return other if all(theirs[d] <= ours[d] for d in names) else None


def faster_beyond_noise(runs: list[float], other: list[float], z: float = 2.0) -> bool:
    """Whether the runs of `runs` (tok/s) are faster than `other`'s beyond noise: the difference of
    their means exceeds z standard errors (Welch's, each run one sample; with fewer than two runs on
    a side, never)."""
    if len(runs) < 2 or len(other) < 2:
        return False
    a, b = np.asarray(runs, dtype=np.float64), np.asarray(other, dtype=np.float64)
    stderr = float(np.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b)))
    return float(a.mean() - b.mean()) > z * stderr
