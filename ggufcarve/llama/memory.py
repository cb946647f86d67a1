"""Memory as llama.cpp allocates it: a dry load of a model and a context with the run's settings.

    figures = measure_memory(Path("model.gguf"), MemorySettings(n_ctx=16384, kv_type="q8_0"))
    figures.total  # bytes on the host: weights + KV/recurrent state + compute buffers + output buffer

The child (`python -m ggufcarve.llama.memory`, through the one launcher) loads the model with
llama_model_params.no_alloc (only the metadata is read; allocations are simulated) and
load_mode NONE, as common/fit.cpp's common_get_device_memory_data does for llama-fit-params, then
creates a context with the settings. llama.cpp logs what it would allocate, and those lines are
the figures (src/llama-kv-cache.cpp, src/llama-memory-recurrent.cpp, src/llama-context.cpp of the
llama.cpp in llama-cpp-python 0.3.36):
    llama_kv_cache: size = X MiB (...)                 the KV cache
    llama_memory_recurrent: size = X MiB (...)         the recurrent state (hybrid models)
    sched_reserve: <buffer> compute buffer size = X MiB  the compute buffers, per backend buffer
    llama_context: <buffer> output buffer size = X MiB   the logits/embeddings buffer (n_seq_max outputs)
With no_alloc the model's buffers log 0 MiB, so the weights are the bytes of the file's tensor
data (what the CPU buffer maps; llama-fit-params' "model" figure on the host). A no-alloc load
never reads tensor data, so a sparse header (fit's pruned headers: data a hole) is measured the
same way. No extra buffer types are used (ggufcarve's children's setting).

Devices. With `gpu_layers` and `cpu_tensors` (the patterns llama.cpp's -ot PATTERN=CPU keeps in
system memory, --n-cpu-moe's among them) the dry load places the model as a run with those flags
would. A compute or output buffer whose name starts with "CPU" or ends with "_Host" (pinned host
memory: "CUDA_Host") is system memory; any other is its device's ("CUDA0", "Vulkan0", ...). A
llama.cpp built without a GPU backend (this machine's) has no such device: every buffer is the
CPU's, and `split_devices` gives the GPU's share by llama.cpp's placement rule (placement/offload.py),
the compute buffers marked as estimated. The weights are never logged by a dry load (its model
buffers log 0 MiB); they are the file's tensor bytes as placed.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ggufcarve.llama.devices import CPU, HOST, Compute, cpu_overrides, set_model_params

CHILD_MODULE = "ggufcarve.llama.memory"
MIB = 2**20
KV_TYPES = {"F16": 1, "Q8_0": 8}  # enum ggml_type of the cache types ggufcarve offers
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # enum llama_flash_attn_type
CACHE_LINE = re.compile(r"^(?P<kind>llama_kv_cache|llama_memory_recurrent): size = +(?P<mib>[\d.]+) MiB")
CACHE_LAYER_LINE = re.compile(
    r"^(?P<kind>llama_kv_cache|llama_memory_recurrent)[:,] layer +(?P<layer>\d+): dev = (?P<device>\S+)"
)  # debug level: the device of each layer's cache (src/llama-kv-cache.cpp, src/llama-memory-recurrent.cpp)
COMPUTE_LINE = re.compile(r"(?P<buffer>\S+) compute buffer size = +(?P<mib>[\d.]+) MiB")
OUTPUT_LINE = re.compile(r"(?P<buffer>\S+) +output buffer size = +(?P<mib>[\d.]+) MiB")
OVERRIDE_LINE = re.compile(
    r"^tensor (?P<tensor>\S+) \(.*\) buffer type overridden to (?P<buffer>\S+)"
)  # src/llama-model-loader.cpp, debug level
LAYER_LINE = re.compile(r"load_tensors: layer +(?P<layer>\d+) assigned to device (?P<device>\S+?),")  # debug level


@dataclass(frozen=True)
class MemorySettings:
    """The run settings memory depends on (llama-server's and llama-fit-params' defaults)."""

    n_ctx: int
    kv_type: str = "F16"
    n_batch: int = 2048
    n_ubatch: int = 512
    n_seq: int = 1
    flash_attn: str = "auto"
    swa_full: bool = False
    compute: Compute = CPU  # the placement loaded: offloaded layers (-ngl), RPC devices (--rpc), split (-ts)
    cpu_tensors: tuple[str, ...] = ()  # regexes of the tensors kept in system memory (-ot PATTERN=CPU)


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes one device would hold (`device` "host": system memory)."""

    device: str
    weights: int
    cache: int
    compute: int
    output: int
    estimated: tuple[
        str, ...
    ] = ()  # the figures not measured by llama.cpp here (with the reason in the caller's memory_source)

    @property
    def total(self) -> int:
        return self.weights + self.cache + self.compute + self.output

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "weights": self.weights,
            "cache": self.cache,
            "compute": self.compute,
            "output": self.output,
            "total": self.total,
            **({"estimated": list(self.estimated)} if self.estimated else {}),
        }


@dataclass
class Request:
    TASK: ClassVar[str] = "memory"

    model: str
    result_out: str
    settings: MemorySettings

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Request:
        settings = doc["settings"]
        return cls(
            doc["model"],
            doc["result_out"],
            MemorySettings(
                **{
                    **settings,
                    "compute": Compute.from_json(settings.get("compute", {})),
                    "cpu_tensors": tuple(settings.get("cpu_tensors", ())),
                }
            ),
        )


def parse_log(lines: list[str]) -> dict[str, Any]:
    """The MiB figures of llama.cpp's log lines of a dry load (module docstring): "cache" (all
    devices), "compute" and "output" as {buffer name: MiB}; a figure whose line is missing is absent."""
    out: dict[str, Any] = {}
    for line in lines:
        text = line.strip()
        match = CACHE_LINE.search(text)
        if match:
            out["cache"] = out.get("cache", 0.0) + float(match["mib"])
            out.setdefault("cache_kinds", {})[match["kind"]] = float(match["mib"])
        match = CACHE_LAYER_LINE.search(text)
        if match:
            out.setdefault("cache_layers", {}).setdefault(match["kind"], {})[match["layer"]] = match["device"]
        match = OVERRIDE_LINE.search(text)
        if match:
            out.setdefault("overridden", {})[match["tensor"]] = match["buffer"]
        for key, pattern in (("compute", COMPUTE_LINE), ("output", OUTPUT_LINE)):
            match = pattern.search(text)
            if match:
                buffers = out.setdefault(key, {})
                buffers[match["buffer"]] = buffers.get(match["buffer"], 0.0) + float(match["mib"])
    return out


def device_name(name: str) -> str:
    """A device's name as llama.cpp's tools print it: an RPC buffer's "RPC0[127.0.0.1:50052]" is RPC0."""
    return name.partition("[")[0]


def buffer_device(name: str) -> str:
    """The device a llama.cpp buffer's memory is on: HOST for the CPU's and pinned host buffers."""
    return HOST if name.startswith("CPU") or name.endswith("_Host") else device_name(name)


def weight_bytes(path: Path) -> int:
    """The bytes of the tensor data of a model (every shard)."""
    from ggufcarve.gguf.container import read_model

    return sum(t.nbytes for t in read_model(path).tensors)


def _dry_load(request: Request, out: Path) -> None:
    import ctypes

    from ggufcarve.errors import BadInput, ToolFailed
    from ggufcarve.llama.libllama import KEEPALIVE, LOG_CONT, bindings

    llama_cpp = bindings()
    lines: list[str] = []

    def log(level: int, text: bytes, _user_data: object) -> None:
        piece = text.decode("utf-8", errors="replace") if text else ""
        if level == LOG_CONT and lines:
            lines[-1] += piece
        else:
            lines.append(piece)

    callback = llama_cpp.llama_log_callback(log)
    KEEPALIVE.append(callback)
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    settings = request.settings
    if settings.kv_type.upper() not in KV_TYPES or settings.flash_attn not in FLASH_ATTN:
        raise BadInput(
            f"cache type {settings.kv_type!r} / flash attention {settings.flash_attn!r}",
            "give f16 or q8_0, and auto, on or off",
        )
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    offload = set_model_params(llama_cpp, params, settings.compute)
    params.use_extra_bufts = False
    params.no_alloc = True
    if settings.cpu_tensors:
        params.tensor_buft_overrides = cpu_overrides(settings.compute.cpu_tensors() + settings.cpu_tensors)
    params.load_mode = 0  # LLAMA_LOAD_MODE_NONE: nothing mapped, as common/fit.cpp
    model = llama_cpp.llama_model_load_from_file(request.model.encode(), params)
    if not model:
        raise ToolFailed(
            f"{Path(request.model).name}: llama.cpp could not read the model for a dry load",
            " | ".join(s.strip() for s in lines[-3:]),
        )
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = settings.n_ctx
    cparams.n_batch = settings.n_batch
    cparams.n_ubatch = settings.n_ubatch
    cparams.n_seq_max = settings.n_seq
    cparams.type_k = cparams.type_v = KV_TYPES[settings.kv_type.upper()]
    cparams.flash_attn_type = FLASH_ATTN[settings.flash_attn]
    cparams.swa_full = (
        settings.swa_full
    )  # llama.cpp's tools' default is False (common_params.swa_full), libllama's own True
    cparams.kv_unified = False
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        raise BadInput(
            f"{Path(request.model).name}: llama.cpp refuses a context of "
            f"{settings.n_ctx} tokens with a {settings.kv_type} cache "
            f"(flash attention {settings.flash_attn})",
            " | ".join(s.strip() for s in lines[-2:] if s.strip()) or "a quantized V cache needs flash attention",
        )
    figures = parse_log(lines)
    missing = [key for key in ("compute", "output") if key not in figures]
    if missing:
        raise ToolFailed(
            f"{Path(request.model).name}: llama.cpp's dry load logged no {' and no '.join(missing)} buffer size",
            "a llama.cpp whose log lines ggufcarve does not know",
        )
    figures["gpu_devices"] = gpu_devices()
    figures["n_embd"] = int(llama_cpp.llama_model_n_embd(model))
    figures["n_swa"] = int(llama_cpp.llama_model_n_swa(model))
    figures["offload_devices"] = [device.to_json() for device in offload]
    figures["layers"] = {m["layer"]: device_name(m["device"]) for m in map(LAYER_LINE.search, lines) if m}
    from ggufcarve.llama import child
    from ggufcarve.llama.computed import DRY_LOAD, layers_of

    child.computed(DRY_LOAD, layers_of(lines))
    temp = out.with_name(out.name + f".{os.getpid()}.tmp")
    temp.write_text(json.dumps(figures))
    os.replace(temp, out)


def gpu_devices() -> list[str]:
    """The names of the offload devices of this llama.cpp (after llama_backend_init), in the one
    device order (llama.devices.offload_order: RPC devices, GPUs, integrated GPUs where no GPU)."""
    from ggufcarve.llama.devices import offload_order, registered_devices

    return [device.name for device in offload_order(registered_devices())]


@dataclass(frozen=True)
class DryLoad:
    """What llama.cpp's dry load logged, in bytes: the KV cache and recurrent state (all devices),
    the compute and output buffers by buffer name, the GPU devices this llama.cpp has, and the
    tensors the `cpu_tensors` patterns moved."""

    cache: int
    compute: dict[str, int]
    output: dict[str, int]
    gpu_devices: tuple[str, ...]
    overridden: dict[str, str]  # tensor -> the buffer type a -ot pattern gave it, as the loader logged it
    layers: dict[int, str] = field(default_factory=dict)  # layer -> the device llama.cpp assigned it (CPU, RPC0, ..)
    offload_devices: tuple[tuple[str, str], ...] = ()  # (name, description) of the devices offloaded to, in order
    cache_by_device: dict[str, int] = field(default_factory=dict)  # the cache's bytes per device, by its layers
    cache_kinds: dict[str, tuple[int, tuple[int, ...]]] = field(
        default_factory=dict
    )  # kind (llama_kv_cache, llama_memory_recurrent) -> (bytes, the layers holding it)
    n_embd: int = 0  # the model's embedding length (llama_model_n_embd)
    n_swa: int = 0  # its sliding window (llama_model_n_swa; 0: none)
    settings: MemorySettings | None = None  # the settings it was loaded with

    def device_of(self, buffer: str) -> str:
        """The device of a buffer: HOST for system memory; an RPC buffer "RPCk[HOST:PORT]" names the
        k-th device of that server, whose global name (RPC0, RPC1, ...) the offload list holds."""
        device = buffer_device(buffer)
        if device == HOST or "[" not in buffer:
            return device
        stem, _, rest = buffer.partition("[")
        endpoint = rest.rstrip("]")
        served = [name for name, description in self.offload_devices if description == endpoint]
        index = stem.removeprefix("RPC")
        return served[int(index)] if index.isdigit() and int(index) < len(served) else device

    def on(self, device: str, buffers: dict[str, int]) -> int:
        return sum(size for name, size in buffers.items() if self.device_of(name) == device)

    @property
    def devices(self) -> list[str]:
        """The devices holding a buffer, the host first."""
        names = {self.device_of(n) for n in (*self.compute, *self.output)}
        return [HOST, *sorted(names - {HOST})]


def dry_load(path: Path, settings: MemorySettings) -> DryLoad:
    """llama.cpp's own figures for `path` with `settings`, from a no-alloc load in a child."""
    from ggufcarve.llama import child

    with tempfile.TemporaryDirectory(prefix="ggufcarve-memory-") as tmp:
        result = Path(tmp) / "memory.json"
        request = Request(str(path), str(result), settings)
        figures = child.run(
            CHILD_MODULE,
            request,
            result,
            lambda p: json.loads(p.read_text()),
            what=f"measuring the memory of {path.name}",
            hint="the last lines are llama.cpp's own; check that the model loads (ggufcarve inspect MODEL)",
            timeout=600,
        )
    return DryLoad(
        round(figures.get("cache", 0.0) * MIB),
        {k: round(v * MIB) for k, v in figures["compute"].items()},
        {k: round(v * MIB) for k, v in figures["output"].items()},
        tuple(figures.get("gpu_devices", ())),
        dict(figures.get("overridden", {})),
        {int(k): v for k, v in figures.get("layers", {}).items()},
        tuple((d["name"], d["description"]) for d in figures.get("offload_devices", ())),
        _cache_by_device(figures),
        {
            kind: (round(mib * MIB), tuple(sorted(int(il) for il in figures.get("cache_layers", {}).get(kind, {}))))
            for kind, mib in figures.get("cache_kinds", {}).items()
        },
        int(figures.get("n_embd", 0)),
        int(figures.get("n_swa", 0)),
        settings,
    )


def _cache_by_device(figures: dict[str, Any]) -> dict[str, int]:
    """Each kind of cache (KV, recurrent state) split over the devices of its layers, in bytes (every
    layer of a kind holds the same share: the per-layer buffer lines of a dry load log 0 MiB)."""
    out: dict[str, int] = {}
    for kind, mib in figures.get("cache_kinds", {}).items():
        layers = figures.get("cache_layers", {}).get(kind, {})
        if not layers:
            out[HOST] = out.get(HOST, 0) + round(mib * MIB)
            continue
        for device in set(layers.values()):
            share = sum(1 for d in layers.values() if d == device) / len(layers)
            name = HOST if device == "CPU" else device
            out[name] = out.get(name, 0) + round(mib * MIB * share)
    return out


def measure_memory(path: Path, settings: MemorySettings, *, weights: int | None = None) -> DeviceMemory:
    """The host memory llama.cpp allocates for `path` with `settings` run on the CPU (with
    `gpu_layers` on a GPU backend: the host's buffers, while weights and cache count whole), from
    its own dry load; `weights`: the bytes of the weights as placed when they differ from the file's (a rung
    not yet written: fit's size of its tensors)."""
    load = dry_load(path, settings)
    return DeviceMemory(
        HOST,
        weight_bytes(path) if weights is None else weights,
        load.cache,
        load.on(HOST, load.compute),
        load.on(HOST, load.output),
    )


def main(argv: list[str] | None = None) -> int:
    from ggufcarve.llama import child

    return child.serve(Request, _dry_load, argv)


if __name__ == "__main__":
    from ggufcarve.llama import child as _child

    _child.exit_now(main(sys.argv[1:]))
