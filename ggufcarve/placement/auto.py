"""`--gpu-layers auto`: a run's `Compute` placed on the devices present, as llama.cpp's `--fit on`
(its default, `-ngl auto`) places a model.

    compute = resolve(S.compute(rpc=("127.0.0.1:50052",)), Path("model.gguf"), n_ctx=512)
    compute.gpu_layers, compute.n_cpu_moe      # 999, 0 on a device that holds it whole

The devices are the offload devices llama.cpp sees (the GPUs of the installed backend, the `--rpc` servers' devices,
in `llama.devices.offload_order`, the order `ggufcarve devices` lists them); a llama-cpp-python without a GPU
backend and no `--rpc` has none, and the answer is the CPU without a child started. With devices, the budget of each
is its **free** memory, the margin llama.cpp's fit keeps free (`FIT_MARGIN`, 1 GiB) left over, and the placement is
the measured search every budget uses (`search.place_on_devices`: whole, then the routed experts of the first N
blocks in system memory, loaded by llama.cpp's dry loads until every device fits), so a model larger than the
devices runs with experts on the CPU; where not even every expert in system memory fits, on the CPU. `--n-cpu-moe N`
given with `auto` is kept as given (every layer offloaded, N blocks' experts in system memory), `--tensor-split` as
the split searched with.

A run is placed once, for the largest model it loads (the unpruned source), and that `Compute`
goes to every child: a smaller file (a rung, a pruned file) placed the same way fits as well.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from ggufcarve.errors import BadInput
from ggufcarve.llama.devices import FIT_MARGIN, Compute, Device, host_memory
from ggufcarve.placement.search import ALL_LAYERS

_placed: dict[tuple[object, ...], Compute] = {}
Settings = TypeVar("Settings")


def present_devices(rpc: tuple[str, ...]) -> list[Device]:
    """The offload devices llama.cpp sees with `rpc` added, in the order it offloads to them; none
    without a child where the installed llama.cpp has no GPU backend and no RPC server is named."""
    from ggufcarve.llama.tools import libllama_backend

    if not rpc and libllama_backend() in ("cpu", "rpc"):
        return []
    from ggufcarve.llama.device_list import libllama_devices
    from ggufcarve.llama.devices import offload_order

    return offload_order(libllama_devices(rpc))


def budget_devices(budgets: Sequence[int], rpc: tuple[str, ...]) -> tuple[str, ...]:
    """The devices `budgets` (settings.Budgets: sizes, and the devices they name) are for, in the one
    device order: the names given (each one a device here, where there are devices), else the first
    offload devices present, one per budget; none without budgets, or with fewer devices here than
    budgets given in order (the placement is then estimated)."""
    if not budgets:
        return ()
    present = [device.name for device in present_devices(rpc)]
    names = tuple(getattr(budgets, "names", ()))
    if names:
        missing = [name for name in names if present and name not in present]
        if missing:
            raise BadInput(
                f"--gpu-memory names {', '.join(missing)}, not a device here (llama.cpp lists {', '.join(present)})",
                "name the devices as ggufcarve devices lists them, or give the sizes in device order",
            )
        return names
    return tuple(present[: len(budgets)]) if len(present) >= len(budgets) else ()


def resolve(compute: Compute, model: Path, n_ctx: int, margin: int = FIT_MARGIN) -> Compute:
    """`compute` with an automatic placement made concrete for `model` at `n_ctx` (module docstring);
    a concrete one as it is."""
    if not compute.auto:
        return compute
    present = {device.name: device for device in present_devices(compute.rpc)}
    named = [present[name] for name in compute.devices if name in present]
    devices = named if compute.devices else list(present.values())
    if not devices:
        return replace(compute, gpu_layers=0, tensor_split=())
    if compute.n_cpu_moe:
        return replace(compute, gpu_layers=ALL_LAYERS)
    path = Path(model)
    try:
        stat = path.stat()
    except OSError:
        raise BadInput(f"{path}: no such model", "check the path") from None
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, n_ctx, compute, margin)
    if key not in _placed:
        _placed[key] = _search(compute, path, n_ctx, devices, margin)
    return _placed[key]


def _search(compute: Compute, model: Path, n_ctx: int, devices: list[Device], margin: int) -> Compute:
    from ggufcarve.gguf.container import read_model
    from ggufcarve.llama.memory import MemorySettings, dry_load
    from ggufcarve.placement.offload import weight_placement
    from ggufcarve.placement.search import place_on_devices

    weights = weight_placement(read_model(model))
    on_cpu = MemorySettings(n_ctx, compute=Compute(0, compute.rpc, threads=compute.threads))
    host_load = dry_load(model, on_cpu)
    on_devices = replace(on_cpu, compute=Compute(ALL_LAYERS, compute.rpc, compute.tensor_split, compute.threads))
    budgets = tuple(device.free for device in devices)
    main = len(weights.expert_bytes)
    placed = place_on_devices(
        weights,
        host_load,
        budgets=budgets,
        memory=host_memory().free,
        present=[device.name for device in devices],
        load=lambda placement: dry_load(model, placement.loaded_with(on_devices, main)),
        margin=margin,
        from_last=False,
        shares=compute.tensor_split or None,
    )
    if placed is None:
        return replace(compute, gpu_layers=0, tensor_split=())
    return replace(
        compute,
        gpu_layers=ALL_LAYERS,
        tensor_split=placed.placement.tensor_split,
        n_cpu_moe=placed.placement.n_cpu_moe,
    )


def placed_settings(settings: Settings, model: Path, n_ctx: int, margin: int = FIT_MARGIN) -> Settings:
    """A settings dataclass (tune's, best's, select's, eval's) with its `compute` resolved for `model`,
    `margin` kept free on each device."""
    compute = settings.compute  # type: ignore[attr-defined]
    if not compute.auto:
        return settings
    return replace(settings, compute=resolve(compute, model, n_ctx, margin))  # type: ignore[type-var]
