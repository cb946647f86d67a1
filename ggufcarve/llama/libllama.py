"""What every libllama child task does first: llama.cpp's log filtered, and the model loaded on the CPU.

Child tasks (tracing, calibration, evaluation) run llama-cpp-python's low-level API in a process of
their own, started through the one launcher, since llama.cpp aborts the whole process on a failed
assert. Two settings are shared by all of them:
  * the log: llama.cpp calls one global callback with a ggml_log_level (DEBUG 1, INFO 2, WARN 3,
    ERROR 4, CONT 5: continues the previous message); warnings and errors reach stderr, where the
    launcher keeps the tail for the error message (all levels with `verbose`);
  * the model: placed by a `Compute` (`llama.devices`: its last `gpu_layers` layers on the offload
    devices, RPC servers' devices added, split by `tensor_split`; 0 layers, the default, keeps every
    layer on the CPU; a llama.cpp without a GPU or RPC device keeps them there), without extra
    buffer types (`use_extra_bufts = False`): on CPUs with AMX, llama.cpp 0.3.36 crashes in
    `ggml_backend_amx_mul_mat` for small models otherwise.
ctypes callbacks handed to llama.cpp must outlive every call into it, exit included: they are kept
in `KEEPALIVE`. A child that needs only the low-level API imports it with `bindings()`.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from ggufcarve.llama.devices import CPU, Compute, set_model_params

LOG_WARN, LOG_ERROR, LOG_CONT = 3, 4, 5
KEEPALIVE: list[object] = []
_assigned: list[str] = []  # the loader's "layer N assigned to device D" lines since the last load began
_logging: list[bool] = []  # whether forward_warnings installed its callback


def bindings() -> ModuleType:
    """llama-cpp-python's ctypes bindings (`llama_cpp.llama_cpp`: every llama_* function, struct and
    constant of libllama), imported without running the package's `__init__`, which also imports its
    high-level API (`llama_cpp.llama`: jinja2 and the chat formats, about 30 ms of a child's start).

    The package then sits in sys.modules holding the bindings' names (as its `__init__` starts with
    `from .llama_cpp import *`), with a module `__getattr__` (PEP 562): a submodule it is asked for
    is imported, and any other name runs the package's `__init__` first, so `import llama_cpp` and
    `from llama_cpp import Llama` elsewhere in the process still work."""
    if "llama_cpp" not in sys.modules:
        spec = importlib.util.find_spec("llama_cpp")
        if spec is None or spec.loader is None:
            raise ModuleNotFoundError("No module named 'llama_cpp'", name="llama_cpp")
        package = importlib.util.module_from_spec(spec)
        loader = spec.loader

        def complete(name: str) -> Any:
            submodule = f"{package.__name__}.{name}"
            try:
                return importlib.import_module(submodule)
            except ModuleNotFoundError as err:
                if err.name != submodule:
                    raise
            del package.__getattr__
            loader.exec_module(package)
            return getattr(package, name)

        package.__getattr__ = complete  # type: ignore[attr-defined]
        sys.modules["llama_cpp"] = package
        low = importlib.import_module("llama_cpp.llama_cpp")
        # the first line of the package's __init__: `from .llama_cpp import *`
        public = getattr(low, "__all__", None) or [name for name in vars(low) if not name.startswith("_")]
        vars(package).update({name: getattr(low, name) for name in public})
    return importlib.import_module("llama_cpp.llama_cpp")


def forward_warnings(llama_cpp: Any, verbose: bool = False) -> None:
    """Install the log callback: warnings and errors (everything with `verbose`) to stderr."""
    forwarding = [False]

    def log(level: int, text: bytes, _user_data: object) -> None:
        if text and b"assigned to device" in text:
            _assigned.append(text.decode("utf-8", errors="replace"))
        forward = verbose or level in (LOG_WARN, LOG_ERROR) or (level == LOG_CONT and forwarding[0])
        if level != LOG_CONT:
            forwarding[0] = forward
        if forward and text:
            sys.stderr.write(text.decode("utf-8", errors="replace"))

    callback = llama_cpp.llama_log_callback(log)
    KEEPALIVE.append(callback)
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    _logging.append(True)


def load_model(llama_cpp: Any, path: str, compute: Compute = CPU, task: str = "") -> Any:
    """The llama_model pointer of `path` placed by `compute`, without extra buffer types; None when
    it fails. In a child task (`task` its name), the devices llama.cpp's loader assigned the layers
    to are told to the parent (`child.computed`)."""
    from ggufcarve.llama.computed import layers_of

    if not _logging:
        forward_warnings(llama_cpp)
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    set_model_params(llama_cpp, params, compute)
    params.use_extra_bufts = False
    _assigned.clear()
    model = llama_cpp.llama_model_load_from_file(path.encode(), params)
    if model and task:
        from ggufcarve.llama import child

        child.computed(task, layers_of(_assigned))
    return model


def traced_context(
    llama_cpp: Any,
    model: Any,
    *,
    n_ctx: int,
    n_batch: int,
    n_ubatch: int,
    threads: int,
    eval_callback: Any,
    sequences: int = 1,
    swa_full: bool = True,
) -> Any:
    """A context of `model` whose graph scheduler calls `eval_callback`
    (ggml_backend_sched_eval_callback: (tensor, ask, user data) -> bool); warm-up off, since a
    warm-up decode routes every token to every expert. `n_ctx` KV cells in all for `sequences`
    sequences (one KV stream each: kv_unified off). `swa_full` False is llama.cpp's common tools'
    setting (common_params.swa_full), True llama_context_default_params'. None when llama.cpp
    cannot create it."""
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = n_ctx
    params.n_batch = n_batch
    params.n_ubatch = n_ubatch
    params.n_seq_max = sequences
    params.kv_unified = False
    params.swa_full = swa_full
    params.n_threads = params.n_threads_batch = threads
    callback = llama_cpp.ggml_backend_sched_eval_callback(eval_callback)
    KEEPALIVE.append(callback)
    params.cb_eval = callback
    params.cb_eval_user_data = None
    ctx = llama_cpp.llama_init_from_model(model, params)
    if ctx:
        llama_cpp.llama_set_warmup(ctx, False)
    return ctx


def fill_batch(batch: Any, entries: Any) -> int:
    """Put (token, position, sequence) entries into a `llama_batch`, logits requested for every
    token (the last block computes only tokens whose logits are requested); returns the count."""
    count = 0
    for token, pos, seq in entries:
        batch.token[count] = token
        batch.pos[count] = pos
        batch.n_seq_id[count] = 1
        batch.seq_id[count][0] = seq
        batch.logits[count] = 1
        count += 1
    batch.n_tokens = count
    return count


def write_results(out: Path, arrays: dict[str, Any]) -> None:
    """A child task's results as one .npz, written under the temp-name scheme and renamed into
    place; not fsynced: the parent reads it as soon as the child has exited, then deletes it."""
    import numpy as np

    from ggufcarve.fileio import atomic_file

    with atomic_file(out, sync=False) as partial, open(partial, "wb") as f:
        np.savez(f, **arrays)
