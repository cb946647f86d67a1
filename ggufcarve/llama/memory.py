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
same way. The child runs on the CPU only (n_gpu_layers 0, no extra buffer types): every figure is
host memory.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

CHILD_MODULE = "ggufcarve.llama.memory"
MIB = 2**20
KV_TYPES = {"F16": 1, "Q8_0": 8}  # enum ggml_type of the cache types ggufcarve offers
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # enum llama_flash_attn_type
CACHE_LINE = re.compile(r"^(?:llama_kv_cache|llama_memory_recurrent): size = +(?P<mib>[\d.]+) MiB")
COMPUTE_LINE = re.compile(r"compute buffer size = +(?P<mib>[\d.]+) MiB")
OUTPUT_LINE = re.compile(r"output buffer size = +(?P<mib>[\d.]+) MiB")


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


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes one device would hold (`device` "host": system memory)."""

    device: str
    weights: int
    cache: int
    compute: int
    output: int

    @property
    def total(self) -> int:
        return self.weights + self.cache + self.compute + self.output

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "weights": self.weights, "cache": self.cache, "compute": self.compute, "output": self.output, "total": self.total}


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
        return cls(doc["model"], doc["result_out"], MemorySettings(**doc["settings"]))


def parse_log(lines: list[str]) -> dict[str, float]:
    """The MiB figures of llama.cpp's log lines of a dry load (module docstring); a figure whose line
    is missing is absent from the result."""
    out: dict[str, float] = {}
    for line in lines:
        for key, pattern in (("cache", CACHE_LINE), ("compute", COMPUTE_LINE), ("output", OUTPUT_LINE)):
            match = pattern.search(line.strip())
            if match:
                out[key] = out.get(key, 0.0) + float(match["mib"])
    return out


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
        raise BadInput(f"cache type {settings.kv_type!r} / flash attention {settings.flash_attn!r}", "give f16 or q8_0, and auto, on or off")
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = 0
    params.use_extra_bufts = False
    params.no_alloc = True
    params.load_mode = 0  # LLAMA_LOAD_MODE_NONE: nothing mapped, as common/fit.cpp
    model = llama_cpp.llama_model_load_from_file(request.model.encode(), params)
    if not model:
        raise ToolFailed(f"{Path(request.model).name}: llama.cpp could not read the model for a dry load", " | ".join(s.strip() for s in lines[-3:]))
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = settings.n_ctx
    cparams.n_batch = settings.n_batch
    cparams.n_ubatch = settings.n_ubatch
    cparams.n_seq_max = settings.n_seq
    cparams.type_k = cparams.type_v = KV_TYPES[settings.kv_type.upper()]
    cparams.flash_attn_type = FLASH_ATTN[settings.flash_attn]
    cparams.swa_full = settings.swa_full  # llama.cpp's tools' default is False (common_params.swa_full), libllama's own True
    cparams.kv_unified = False
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        raise BadInput(f"{Path(request.model).name}: llama.cpp refuses a context of {settings.n_ctx} tokens with a {settings.kv_type} cache "
                       f"(flash attention {settings.flash_attn})", " | ".join(s.strip() for s in lines[-2:] if s.strip()) or "a quantized V cache needs flash attention")
    figures = parse_log(lines)
    missing = [key for key in ("compute", "output") if key not in figures]
    if missing:
        raise ToolFailed(f"{Path(request.model).name}: llama.cpp's dry load logged no {' and no '.join(missing)} buffer size", "a llama.cpp whose log lines ggufcarve does not know")
    temp = out.with_name(out.name + f".{os.getpid()}.tmp")
    temp.write_text(json.dumps(figures))
    os.replace(temp, out)


def measure_memory(path: Path, settings: MemorySettings, *, weights: int | None = None) -> DeviceMemory:
    """The host memory llama.cpp allocates for `path` with `settings`, from its own dry load;
    `weights`: the bytes of the weights as placed when they differ from the file's (a rung not yet
    written: fit's size of its tensors)."""
    from ggufcarve.llama import child

    with tempfile.TemporaryDirectory(prefix="ggufcarve-memory-") as tmp:
        result = Path(tmp) / "memory.json"
        request = Request(str(path), str(result), settings)
        figures = child.run(CHILD_MODULE, request, result, lambda p: json.loads(p.read_text()), what=f"measuring the memory of {path.name}",
                            hint="the last lines are llama.cpp's own; check that the model loads (ggufcarve inspect MODEL)", timeout=600)
    return DeviceMemory("host", weight_bytes(path) if weights is None else weights, round(figures.get("cache", 0.0) * MIB),
                        round(figures["compute"] * MIB), round(figures["output"] * MIB))


def main(argv: list[str] | None = None) -> int:
    from ggufcarve.llama import child

    return child.serve(Request, _dry_load, argv)


if __name__ == "__main__":
    from ggufcarve.llama import child as _child

    _child.exit_now(main(sys.argv[1:]))
