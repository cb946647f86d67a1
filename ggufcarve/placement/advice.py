"""The answer to a load that ran a device out of memory: the placement that fits the devices' free
memory (llama.cpp's own figures for them), found by the placement search over the model's dry loads.

    error = DeviceOutOfMemory(...)           # raised by a child (llama.child.out_of_memory)
    fitting_answer(error).hint               # "it fits with --gpu-layers 999 --n-cpu-moe 12: ..."

Only the placements a ggufcarve command takes are answered: every layer offloaded with the routed
experts of the first N blocks in system memory (--n-cpu-moe N), split over several devices by their
free memory (--tensor-split), on the devices the run named (`Compute.devices`) or else every offload
device present (placement.auto.present_devices). The margin kept free on each device is the command's
--gpu-margin, by default llama.cpp's --fit margin; each dry load is a progress event ("placing").
"""

from __future__ import annotations

from pathlib import Path

from ggufcarve.errors import CarveError, DeviceOutOfMemory
from ggufcarve.events import Event, Sink, ignore
from ggufcarve.fileio import format_size
from ggufcarve.llama.devices import FIT_MARGIN, Compute
from ggufcarve.llama.memory import DryLoad
from ggufcarve.placement.search import ALL_LAYERS, PlacedMemory, Placement, place_on_devices, present_devices

DEFAULT_CTX = 512  # the context of a dry load for a request that names none
HOST_UNBOUNDED = 2**62  # the host's share is mapped from the file (mmap): it pages, it does not fail to load


def fitting_placement(
    model: Path, compute: Compute, n_ctx: int | None, margin: int = FIT_MARGIN, on_event: Sink = ignore
) -> tuple[PlacedMemory | None, list[str]]:
    """The fastest --n-cpu-moe placement of `model` that fits the free memory of the offload devices
    `compute` names or sees (its RPC servers' among them), `margin` left free on each, measured by
    llama.cpp's dry loads on them, and their names; (None, names) when even every expert in system
    memory does not fit."""
    from ggufcarve.gguf.container import read_model
    from ggufcarve.llama.memory import MemorySettings, dry_load
    from ggufcarve.placement import auto
    from ggufcarve.placement.offload import weight_placement

    devices = auto.present_devices(compute.rpc)
    if compute.devices:
        devices = [d for d in devices if d.name in compute.devices]
    if not devices:
        return None, []
    names = [d.name for d in devices]
    run = MemorySettings(n_ctx or DEFAULT_CTX, compute=Compute(rpc=compute.rpc, devices=tuple(names)))
    loads = 0

    def load(placement: Placement) -> DryLoad:
        nonlocal loads
        loads += 1
        on_event(Event("placing", loads, 0, "loads", placement.label()))
        return dry_load(model, placement.loaded_with(run, len(weights.expert_bytes)))

    on_event(Event("placing", 0, 0, "loads", f"{model.name} on {', '.join(names)}"))
    host_load = dry_load(model, run)
    weights = weight_placement(read_model(model))
    budgets = tuple(d.free for d in devices)
    placed = place_on_devices(
        weights,
        host_load,
        budgets=budgets,
        memory=HOST_UNBOUNDED,
        present=present_devices(host_load, budgets),
        load=load,
        from_last=False,
        margin=margin,
    )
    return placed, names


def placement_flags(placed: PlacedMemory) -> list[str]:
    """The ggufcarve options of a placement (the --gpu-layers, --n-cpu-moe and --tensor-split that load it)."""
    placement = placed.placement
    flags = ["--gpu-layers", str(ALL_LAYERS)]
    if placement.n_cpu_moe:
        flags += ["--n-cpu-moe", str(placement.n_cpu_moe)]
    if len(placement.tensor_split) > 1:
        flags += ["--tensor-split", ",".join(f"{s:g}" for s in placement.tensor_split)]
    return flags


def fitting_answer(error: DeviceOutOfMemory, margin: int = FIT_MARGIN, on_event: Sink = ignore) -> CarveError:
    """`error` with the placement that fits as its hint (`margin` free on each device, each dry load an
    event to `on_event`); the error as it was when the model or the devices cannot be read again."""
    model = Path(error.model)
    if not model.is_file() or not isinstance(error.compute, Compute):
        return error
    try:
        placed, names = fitting_placement(model, error.compute, error.n_ctx, margin, on_event)
    except CarveError:
        return error
    if not names:
        return error
    if placed is None:
        return DeviceOutOfMemory(
            error.message,
            f"{model.name} does not fit the free memory of {', '.join(names)} even with every routed expert in "
            "system memory: give --gpu-layers 0 (the CPU), or a shorter context",
            model=error.model,
            compute=error.compute,
            n_ctx=error.n_ctx,
        )
    rows = "; ".join(
        f"{row.device} {format_size(row.total)} of {format_size(placed.budgets[row.device])} free"
        for row in placed.devices
        if row.device in placed.budgets and row.device in names
    )
    how = "llama.cpp's dry load on the devices" if placed.measured else "estimated from the CPU's dry load"
    return DeviceOutOfMemory(
        error.message,
        f"it fits with {' '.join(placement_flags(placed))} ({rows}, with {format_size(placed.margin)} kept free each; "
        f"{how}); finished builds and cached measurements are kept",
        model=error.model,
        compute=error.compute,
        n_ctx=error.n_ctx,
    )
