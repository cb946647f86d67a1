"""Where llama.cpp computes: the devices it sees, and `Compute`, the one object that says where every
child runs.

    compute = Compute(gpu_layers=99, rpc=("127.0.0.1:50052",))
    compute.tool_args()                 # ["-ngl", "99", "--rpc", "127.0.0.1:50052"] for llama.cpp's tools
    set_model_params(llama_cpp, params, compute)    # in a libllama child: llama_model_params

Devices (ggml/include/ggml-backend.h of the llama.cpp in llama-cpp-python 0.3.36): every backend
registers its devices, each with a name (`CUDA0`, `Vulkan0`, `CPU`), a description, a type (enum
ggml_backend_dev_type: CPU, GPU, IGPU, ACCEL, META) and its free and total memory. An RPC server
(`ggml-rpc-server -H HOST -p PORT`, ggml/src/ggml-rpc) exports the devices of another process
over a socket: `ggml_backend_rpc_add_server(endpoint)` (looked up through the "RPC" registry's
proc address, as common/arg.cpp's `--rpc` does) answers a registry of its devices, named `RPC0`,
`RPC1`, ... in the order they were added, of type GPU, whose buffers are not host memory; it
answers NULL when the server does not answer. `ggml_backend_register` then lists them with the
others.

Which devices a model offloads to: llama_model_load_from_file (src/llama.cpp) takes
`llama_model_params.devices` (a NULL-terminated array) when set, else RPC devices first, then the
GPUs, then integrated GPUs when there is no GPU. `offload_devices` makes that list and
`set_model_params` sets it explicitly, so that a device registered after the backend was
initialised is used, as llama.cpp's tools use theirs. `tensor_split` is the share of each of those
devices (llama.cpp's -ts); `gpu_layers` the layers offloaded (-ngl), the last ones first;
`n_cpu_moe` keeps the routed experts of blocks 0..N-1 in system memory (--n-cpu-moe: common/arg.cpp
adds one tensor_buft_override per block, `blk\\.{i}` + LLM_FFN_EXPS_REGEX to the CPU buffer type).

`kv_overrides` replaces header values at load (llama.cpp's --override-kv KEY=int:VALUE):
llama_model_params.kv_overrides is an array of llama_model_kv_override {tag, char key[128], value}
ended by an entry whose key is empty; the loader (src/llama-model-loader.cpp, GGUFMeta) takes an
override before the file's value, and also where the file has no such key.
"""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

from ggufcarve.errors import BadInput

DEVICE_TYPES = ("CPU", "GPU", "IGPU", "ACCEL", "META")  # enum ggml_backend_dev_type, in its order
RPC_REGISTRY = "RPC"
HOST = "host"  # system memory, as a row beside the devices
FIT_MARGIN = 2**30  # common/fit.cpp's fit_params_target: the memory llama.cpp's --fit leaves free per device, 1024 MiB
ENDPOINT = re.compile(r"^(?P<host>[A-Za-z0-9_.\-]+|\[[0-9A-Fa-f:]+\]):(?P<port>\d{1,5})$")
KEEPALIVE: list[object] = []  # arrays handed to llama.cpp through llama_model_params
LLM_FFN_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"  # common/common.h
KV_KEY_BYTES = 128  # llama_model_kv_override.key: char[128], NUL included
KV_OVERRIDE_INT = 0  # enum llama_model_kv_override_type: LLAMA_KV_OVERRIDE_TYPE_INT
AUTO = -1  # gpu_layers: placed on the devices present by the placement search (llama.cpp's -ngl auto, --fit on)


def block_regex(block: int) -> str:
    """llm_ffn_block_regex(block, LLM_FFN_EXPS_REGEX): the override --n-cpu-moe adds for one block."""
    return rf"blk\.{block}{LLM_FFN_EXPS_REGEX}"


def parse_endpoints(text: str, flag: str = "--rpc") -> tuple[str, ...]:
    """ "HOST:PORT[,HOST:PORT...]" -> the endpoints, each checked."""
    endpoints = tuple(part.strip() for part in text.split(",") if part.strip())
    if not endpoints:
        raise BadInput(f"{flag} {text!r} names no server", "write it like 127.0.0.1:50052 (comma-separate several)")
    for endpoint in endpoints:
        m = ENDPOINT.match(endpoint)
        if m is None or not 0 < int(m["port"]) < 65536:
            raise BadInput(
                f"{flag} {endpoint!r} is not HOST:PORT", "write it like 127.0.0.1:50052 (comma-separate several)"
            )
    if len(set(endpoints)) != len(endpoints):
        raise BadInput(f"{flag} {text!r} names a server twice", "name every ggml-rpc-server once")
    return endpoints


def parse_split(text: str, flag: str = "--tensor-split") -> tuple[float, ...]:
    """ "3,1" -> the share of each device (llama.cpp's -ts: proportions, not necessarily summing to 1)."""
    try:
        shares = tuple(float(part) for part in text.split(","))
    except ValueError:
        shares = ()
    if not shares or any(not share >= 0 for share in shares) or sum(shares) <= 0:
        raise BadInput(f"{flag} {text!r} is not a list of shares", "write it like 1,1 or 3,1 (one per device)")
    return shares


@cache
def rpc_device_key(rpc: tuple[str, ...]) -> tuple[tuple[tuple[str, Any], ...], ...]:
    """The devices of the RPC servers `rpc` as a cache key names them: each one's name, description,
    backend and total memory (not its free memory, which changes), in llama.cpp's order. Listed by a
    child (device_list.libllama_devices) once per process and tuple of servers. The endpoints'
    addresses are left out: ggml-rpc names a server's registry and describes its devices by the
    address (ggml_backend_rpc_add_server), which says where a server listens, not what computes."""
    import importlib

    # looked up when a key is made, not imported: the listing runs through llama.child, which
    # imports this module (an import here would close the cycle devices -> device_list -> child)
    libllama_devices = importlib.import_module("ggufcarve.llama.device_list").libllama_devices

    def without_address(text: str) -> str:
        for endpoint in rpc:
            text = text.replace(endpoint, "")
        return text

    return tuple(
        (
            ("name", without_address(device.name)),
            ("description", without_address(device.description)),
            ("backend", device.backend),
            ("total", device.total),
        )
        for device in libllama_devices(rpc)
        if device.type == "RPC" or device.backend == RPC_REGISTRY
    )


@dataclass(frozen=True)
class Compute:
    """Where and with what a llama.cpp child computes: the layers it offloads (`gpu_layers`, -ngl; AUTO
    until `placement.auto.resolve` places it on the devices present), the RPC servers whose devices
    it adds (`rpc`, --rpc), the share of each offload device (`tensor_split`, -ts), the CPU threads
    (`threads`, -t; 0: the child's default), the MoE blocks whose routed experts stay in system
    memory (`n_cpu_moe`, --n-cpu-moe) and the devices offloaded to (`devices`, -dev: their names;
    none: every offload device, in the order llama.cpp takes them)."""

    gpu_layers: int = 0
    rpc: tuple[str, ...] = ()
    tensor_split: tuple[float, ...] = ()
    threads: int = 0
    n_cpu_moe: int = 0
    devices: tuple[str, ...] = ()
    kv_overrides: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.gpu_layers < AUTO or self.threads < 0 or self.n_cpu_moe < 0:
            raise BadInput(
                f"gpu layers {self.gpu_layers}, threads {self.threads} and n-cpu-moe {self.n_cpu_moe} must be >= 0",
                "for example --gpu-layers 99",
            )
        for key, _ in self.kv_overrides:
            if not key or len(key.encode()) >= KV_KEY_BYTES:
                raise BadInput(
                    f"--override-kv key {key!r} is empty or longer than {KV_KEY_BYTES - 1} bytes",
                    "name a header key of the model (ggufcarve inspect MODEL)",
                )

    def with_overrides(self, overrides: tuple[tuple[str, int], ...]) -> Compute:
        """The same placement with these header values replaced at load (none: the file's own)."""
        return replace(self, kv_overrides=tuple(overrides))

    def override_args(self) -> list[str]:
        """--override-kv KEY=int:VALUE for each replaced header value (llama-perplexity, llama-cli, llama-server)."""
        return [arg for key, value in self.kv_overrides for arg in ("--override-kv", f"{key}=int:{value}")]

    def cpu_tensors(self) -> tuple[str, ...]:
        """The -ot patterns of the tensors it keeps in system memory: one per block, as --n-cpu-moe."""
        return tuple(block_regex(i) for i in range(self.n_cpu_moe))

    @property
    def offloads(self) -> bool:
        """Whether any layer is offloaded (to a GPU or an RPC device)."""
        return self.gpu_layers > 0

    @property
    def auto(self) -> bool:
        """Whether the layers are still to be placed on the devices present."""
        return self.gpu_layers == AUTO

    def with_threads(self, threads: int) -> Compute:
        return replace(self, threads=threads)

    def tool_args(self, bench: bool = False) -> list[str]:
        """The same placement as llama.cpp tools' options (llama-perplexity, llama-fit-params; with
        `bench`, llama-bench's, whose -ts separates the shares of one split by "/")."""
        if self.auto:
            raise ValueError("an automatic placement is resolved (placement.auto.resolve) before a tool runs")
        if bench and self.kv_overrides:
            raise ValueError("llama-bench takes no --override-kv: time a file that carries the values")
        args = ["-ngl", str(self.gpu_layers)]
        if self.rpc:
            args += ["--rpc", ",".join(self.rpc)]
        if self.devices and self.offloads:
            args += ["-dev", ("/" if bench else ",").join(self.devices)]
        if self.tensor_split:
            args += ["-ts", ("/" if bench else ",").join(f"{share:g}" for share in self.tensor_split)]
        if self.threads:
            args += ["-t", str(self.threads)]
        if self.n_cpu_moe:
            args += ["-ncmoe" if bench else "--n-cpu-moe", str(self.n_cpu_moe)]
        return args + self.override_args()

    def key(self) -> dict[str, Any]:
        """What of it changes computed numbers (a cache's key): the libllama's backend (always: a
        CUDA build offloads large matmuls to its GPUs even at -ngl 0), the layers offloaded ("auto"
        while unplaced), the threads; where layers are offloaded, the split, the experts kept in
        system memory, the devices named, and each RPC server's devices as they describe
        themselves (name, description, backend, total memory: `rpc_device_key`). The endpoints'
        addresses do not change a number and are not in it."""
        from ggufcarve.llama.tools import libllama_backend

        key: dict[str, Any] = {
            "backend": libllama_backend(),
            "gpu_layers": "auto" if self.auto else self.gpu_layers,
            "threads": self.threads,
        }
        if self.kv_overrides:
            key["kv_overrides"] = [list(pair) for pair in self.kv_overrides]
        if not (self.offloads or self.auto):
            return key  # every layer on the CPU: an RPC device added then computes nothing (ggml-rpc offloads no op)
        key["tensor_split"] = list(self.tensor_split)
        if self.n_cpu_moe:
            key["n_cpu_moe"] = self.n_cpu_moe
        if self.devices:
            key["devices"] = list(self.devices)
        if self.rpc:
            key["rpc_devices"] = [dict(device) for device in rpc_device_key(self.rpc)]
        return key

    def to_json(self) -> dict[str, Any]:
        return {
            "gpu_layers": "auto" if self.auto else self.gpu_layers,
            "rpc": list(self.rpc),
            "tensor_split": list(self.tensor_split),
            "threads": self.threads,
            "n_cpu_moe": self.n_cpu_moe,
            "devices": list(self.devices),
            **({"kv_overrides": [list(pair) for pair in self.kv_overrides]} if self.kv_overrides else {}),
        }

    def record(self) -> dict[str, Any]:
        """What a report publishes of it: the JSON form with the RPC servers counted, not addressed."""
        return {**{k: v for k, v in self.to_json().items() if k != "rpc"}, "rpc_servers": len(self.rpc)}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Compute:
        layers = doc.get("gpu_layers", 0)
        return cls(
            AUTO if layers == "auto" else int(layers),
            tuple(str(e) for e in doc.get("rpc", ())),
            tuple(float(s) for s in doc.get("tensor_split", ())),
            int(doc.get("threads", 0)),
            int(doc.get("n_cpu_moe", 0)),
            tuple(str(d) for d in doc.get("devices", ())),
            tuple((str(key), int(value)) for key, value in doc.get("kv_overrides", ())),
        )


CPU = Compute()


@dataclass(frozen=True)
class Device:
    """One device llama.cpp sees: its name (`CUDA0`, `RPC0`, `CPU`; `host` for system memory), what
    it is (`description`), its `type` (GPU, IGPU, CPU, ACCEL, or RPC for a GPU-type device of an RPC
    server) and its memory in bytes."""

    name: str
    description: str
    type: str
    free: int
    total: int
    backend: str = ""  # the registry's name: "CUDA", "RPC", "CPU", ...

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "type": self.type,
            "free": self.free,
            "total": self.total,
            "backend": self.backend,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Device:
        return cls(
            str(doc["name"]),
            str(doc["description"]),
            str(doc["type"]),
            int(doc["free"]),
            int(doc["total"]),
            str(doc.get("backend", "")),
        )


def host_memory() -> Device:
    """System memory as a row beside the devices: MemAvailable and MemTotal of /proc/meminfo."""
    values: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    values[name] = int(parts[0]) * 1024
    except OSError:
        pass
    total = values.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Device(HOST, "system memory", "CPU", values.get("MemAvailable", total), total)


# ---------------------------------------------------------------------------------------------
# in a libllama child


def _libggml() -> Any:
    from llama_cpp import _ggml

    lib = _ggml.libggml
    void, size, text = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
    for name, args, result in (
        ("ggml_backend_load_all", [], None),
        ("ggml_backend_dev_count", [], size),
        ("ggml_backend_dev_get", [size], void),
        ("ggml_backend_dev_name", [void], text),
        ("ggml_backend_dev_description", [void], text),
        ("ggml_backend_dev_type", [void], ctypes.c_int),
        ("ggml_backend_dev_memory", [void, ctypes.POINTER(size), ctypes.POINTER(size)], None),
        ("ggml_backend_dev_backend_reg", [void], void),
        ("ggml_backend_reg_name", [void], text),
        ("ggml_backend_reg_by_name", [text], void),
        ("ggml_backend_reg_get_proc_address", [void, text], void),
        ("ggml_backend_register", [void], None),
        ("ggml_backend_dev_by_type", [ctypes.c_int], void),
        ("ggml_backend_dev_buffer_type", [void], void),
    ):
        function = getattr(lib, name)
        function.argtypes = args
        function.restype = result
    return lib


_added: set[str] = set()
CONNECT_TIMEOUT = 5.0


def answers(endpoint: str) -> None:
    """BadInput unless a TCP connection to the RPC server at `endpoint` opens."""
    import socket

    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT):
            pass
    except OSError as err:
        raise BadInput(
            f"--rpc {endpoint}: the RPC server does not answer ({err.strerror or err})",
            f"start it (ggml-rpc-server -H {host} -p {port}) or correct the address",
        ) from None


def add_rpc_servers(endpoints: tuple[str, ...]) -> None:
    """Register the devices of each RPC server in this process (common/arg.cpp's add_rpc_devices);
    a server already added is not added again. BadInput when llama.cpp has no RPC backend or a
    server does not answer."""
    if not endpoints:
        return
    lib = _libggml()
    lib.ggml_backend_load_all()
    registry = lib.ggml_backend_reg_by_name(RPC_REGISTRY.encode())
    if not registry:
        raise BadInput(
            "--rpc: this llama-cpp-python was built without the RPC backend",
            'reinstall it with CMAKE_ARGS="-DGGML_RPC=on" pip install --no-cache-dir --force-reinstall '
            "llama-cpp-python==0.3.36 (see docs/gpus.md)",
        )
    address = lib.ggml_backend_reg_get_proc_address(registry, b"ggml_backend_rpc_add_server")
    add_server = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(address)
    for endpoint in endpoints:
        if endpoint in _added:
            continue
        answers(endpoint)  # ggml-rpc aborts the process on a server it cannot connect to
        server = add_server(endpoint.encode())
        if not server:
            raise BadInput(
                f"--rpc {endpoint}: the RPC server does not answer",
                f"start it (ggml-rpc-server -H {endpoint.rpartition(':')[0]} -p {endpoint.rpartition(':')[2]}) "
                "or correct the address",
            )
        lib.ggml_backend_register(server)
        _added.add(endpoint)


def _devices(lib: Any) -> list[tuple[int, Device]]:
    found = []
    for index in range(lib.ggml_backend_dev_count()):
        handle = lib.ggml_backend_dev_get(index)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(handle, ctypes.byref(free), ctypes.byref(total))
        kind = int(lib.ggml_backend_dev_type(handle))
        backend = (lib.ggml_backend_reg_name(lib.ggml_backend_dev_backend_reg(handle)) or b"").decode()
        type_name = DEVICE_TYPES[kind] if kind < len(DEVICE_TYPES) else str(kind)
        if backend == RPC_REGISTRY and type_name == "GPU":
            type_name = "RPC"
        found.append(
            (
                handle,
                Device(
                    (lib.ggml_backend_dev_name(handle) or b"").decode(),
                    (lib.ggml_backend_dev_description(handle) or b"").decode(),
                    type_name,
                    free.value,
                    total.value,
                    backend,
                ),
            )
        )
    return found


def registered_devices(rpc: tuple[str, ...] = ()) -> list[Device]:
    """Every device this process's llama.cpp sees, after the RPC servers' devices are added."""
    add_rpc_servers(rpc)
    return [device for _, device in _devices(_libggml())]


def offload_devices(rpc: tuple[str, ...] = (), names: tuple[str, ...] = ()) -> list[tuple[int, Device]]:
    """The devices a model offloads to, in llama.cpp's default order (RPC devices, GPUs, then
    integrated GPUs where there is no GPU), as (handle, device); with `names`, those devices in
    that order (BadInput for a name llama.cpp does not list)."""
    add_rpc_servers(rpc)
    found = _devices(_libggml())
    if names:
        by_name = {device.name: (handle, device) for handle, device in found}
        missing = [name for name in names if name not in by_name]
        if missing:
            raise BadInput(
                f"no device {', '.join(missing)} here (llama.cpp lists {', '.join(by_name) or 'none'})",
                "name the devices as ggufcarve devices lists them",
            )
        return [by_name[name] for name in names]
    order = offload_order([device for _, device in found])
    return sorted((d for d in found if d[1] in order), key=lambda d: order.index(d[1]))


def offload_order(devices: list[Device]) -> list[Device]:
    """The devices a model offloads to, in llama.cpp's default order: RPC devices, GPUs, then
    integrated GPUs where there is no GPU."""
    gpus = [d for d in devices if d.type == "GPU"]
    igpus = [d for d in devices if d.type == "IGPU"]
    return [d for d in devices if d.type == "RPC"] + gpus + (igpus if not gpus else [])


def device_order(devices: list[Device]) -> list[Device]:
    """Every device in the one order ggufcarve names them (`ggufcarve devices`, budgets, rows, run
    lines): the offload devices in the order a model offloads to them, then the others (the CPU)."""
    first = offload_order(devices)
    return first + [d for d in devices if d not in first]


def set_model_params(llama_cpp: Any, params: Any, compute: Compute) -> list[Device]:
    """Put `compute`'s placement into llama_model_params: n_gpu_layers, the offload devices (set
    explicitly, NULL-terminated), tensor_split and the header values replaced at load. Returns the
    offload devices."""
    if compute.auto:
        raise ValueError("an automatic placement is resolved (placement.auto.resolve) before a model is loaded")
    params.n_gpu_layers = compute.gpu_layers
    if compute.kv_overrides:
        params.kv_overrides = kv_override_array(llama_cpp, compute.kv_overrides)
    add_rpc_servers(compute.rpc)  # listed with the others even when nothing is offloaded
    if not compute.offloads:
        return []
    devices = offload_devices(compute.rpc, compute.devices)
    if compute.tensor_split and len(compute.tensor_split) > len(devices):
        raise BadInput(
            f"--tensor-split gives {len(compute.tensor_split)} shares for {len(devices)} device(s)",
            "give one share per device (ggufcarve devices lists them)",
        )
    if devices:
        array = (ctypes.c_void_p * (len(devices) + 1))(*[handle for handle, _ in devices], None)
        KEEPALIVE.append(array)
        params.devices = ctypes.cast(array, ctypes.c_void_p)
    if compute.tensor_split:
        shares = (ctypes.c_float * max(int(llama_cpp.llama_max_devices()), len(compute.tensor_split)))()
        for i, share in enumerate(compute.tensor_split):
            shares[i] = share
        KEEPALIVE.append(shares)
        params.tensor_split = shares
    if compute.n_cpu_moe:
        params.tensor_buft_overrides = cpu_overrides(compute.cpu_tensors())
    return [device for _, device in devices]


def kv_override_array(llama_cpp: Any, overrides: tuple[tuple[str, int], ...]) -> Any:
    """A llama_model_kv_override array of integer overrides ended by an empty key, kept alive in
    KEEPALIVE: what common/arg.cpp builds for --override-kv KEY=int:VALUE."""
    entry = llama_cpp.llama_model_kv_override
    array = (entry * (len(overrides) + 1))()
    for i, (key, value) in enumerate(overrides):
        array[i].tag = KV_OVERRIDE_INT
        array[i].key = key.encode()
        array[i].value.val_i64 = value
    KEEPALIVE.append(array)
    return ctypes.cast(array, ctypes.POINTER(entry))


def cpu_overrides(patterns: tuple[str, ...]) -> int:
    """A llama_model_tensor_buft_override array ({pattern, CPU buffer type} ..., {NULL, NULL}), kept
    alive in KEEPALIVE: what common/arg.cpp builds for -ot PATTERN=CPU and --n-cpu-moe N."""

    class Override(ctypes.Structure):
        _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]

    lib = _libggml()
    cpu = lib.ggml_backend_dev_buffer_type(lib.ggml_backend_dev_by_type(0))  # GGML_BACKEND_DEVICE_TYPE_CPU
    array = (Override * (len(patterns) + 1))(*[Override(p.encode(), cpu) for p in patterns], Override(None, None))
    KEEPALIVE.append(array)
    return ctypes.addressof(array)
