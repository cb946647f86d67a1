"""Reading ggml tensors of a running llama.cpp graph from Python (llama-cpp-python's libggml).

`GgmlTensor` mirrors `struct ggml_tensor` of ggml/include/ggml.h (the llama.cpp vendored in
llama-cpp-python 0.3.36, GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64, GGML_MAX_SRC 10,
GGML_MAX_NAME 64):
    enum ggml_type type; ggml_backend_buffer * buffer; int64_t ne[4]; size_t nb[4];
    enum ggml_op op; int32_t op_params[16]; int32_t flags; ggml_tensor * src[10];
    ggml_tensor * view_src; size_t view_offs; void * data; char name[64]; void * extra; char padding[8]
`ne[i]` counts elements along dimension i (0 is the innermost), `nb[i]` is its stride in bytes;
a view (e.g. `ffn_moe_topk`, the first k rows of an argsort) has strides of its source.
`op_name` gives ggml's own name of an op id (ggml_op_name), so no copy of `enum ggml_op` is kept.
A tensor in a host buffer is read through `data`; one in a device buffer is copied out with
`ggml_backend_tensor_get` and written back with `ggml_backend_tensor_set` (`in_host_memory`).
With GGUFCARVE_TENSOR_COPY=1 every tensor takes the copy path, so that the path a GPU build takes
is run, and compared with the in-place one, on the CPU.
"""

from __future__ import annotations

import ctypes
from functools import cache, lru_cache
from typing import Any

import numpy as np
from gguf.constants import GGMLQuantizationType

GGML_MAX_DIMS = 4
GGML_MAX_OP_PARAMS = 64
GGML_MAX_SRC = 10
GGML_MAX_NAME = 64

# ggml types whose elements are plain numbers numpy can view.
NUMPY_TYPES: dict[int, Any] = {
    int(GGMLQuantizationType.F32): np.float32,
    int(GGMLQuantizationType.F16): np.float16,
    int(GGMLQuantizationType.I32): np.int32,
    int(GGMLQuantizationType.I16): np.int16,
    int(GGMLQuantizationType.I8): np.int8,
    int(GGMLQuantizationType.F64): np.float64,
    int(GGMLQuantizationType.I64): np.int64,
}


class GgmlTensor(ctypes.Structure):
    """`struct ggml_tensor` (see the module docstring)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]

    @property
    def label(self) -> str:
        return self.name.decode("utf-8", errors="replace")


@lru_cache(maxsize=1)
def libggml() -> Any:
    """llama-cpp-python's libggml, with the two functions tensor reading needs typed."""
    from llama_cpp import _ggml

    lib = _ggml.libggml
    lib.ggml_backend_buffer_is_host.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_buffer_is_host.restype = ctypes.c_bool
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    lib.ggml_backend_tensor_get.restype = None
    lib.ggml_backend_tensor_set.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    lib.ggml_backend_tensor_set.restype = None
    lib.ggml_op_name.argtypes = [ctypes.c_int]
    lib.ggml_op_name.restype = ctypes.c_char_p
    return lib


@cache
def op_name(op: int) -> str:
    """ggml's name of an operation (`enum ggml_op`): "MUL_MAT", "MUL_MAT_ID", ..."""
    return (libggml().ggml_op_name(op) or b"").decode()


def tensor_at(address: int) -> GgmlTensor:
    return GgmlTensor.from_address(address)


FORCE_COPY_ENV = "GGUFCARVE_TENSOR_COPY"


@cache
def _force_copy() -> bool:
    import os

    return os.environ.get(FORCE_COPY_ENV) == "1"


def in_host_memory(t: GgmlTensor) -> bool:
    """Whether a graph tensor can be read and written in place (a host buffer), unless GGUFCARVE_TENSOR_COPY=1."""
    return (
        bool(t.buffer) and not _force_copy() and bool(libggml().ggml_backend_buffer_is_host(ctypes.c_void_p(t.buffer)))
    )


def copy_out(address: int, span: int) -> ctypes.Array:
    """The first `span` bytes of a tensor's data, copied out by its backend."""
    raw = ctypes.create_string_buffer(span)
    libggml().ggml_backend_tensor_get(ctypes.c_void_p(address), raw, ctypes.c_size_t(0), ctypes.c_size_t(span))
    return raw


def copy_in(address: int, raw: ctypes.Array, span: int) -> None:
    """Write `span` bytes back into a tensor's data through its backend."""
    libggml().ggml_backend_tensor_set(ctypes.c_void_p(address), raw, ctypes.c_size_t(0), ctypes.c_size_t(span))


def read_tensor(address: int) -> np.ndarray:
    """A copy of the tensor at `address` as a numpy array of shape (ne[3], ne[2], ne[1], ne[0]).

    F16 becomes float32; quantized types are refused (TypeError): graph nodes of interest are F32/I32.
    """
    t = tensor_at(address)
    dtype = NUMPY_TYPES.get(int(t.type))
    if dtype is None:
        raise TypeError(f"{t.label!r} has ggml type {t.type}, which is not a plain number type")
    shape = tuple(int(n) for n in reversed(t.ne))
    strides = tuple(int(s) for s in reversed(t.nb))
    if 0 in shape:
        return np.zeros(shape, dtype=np.float32 if dtype is np.float16 else dtype)
    span = sum((n - 1) * s for n, s in zip(shape, strides)) + np.dtype(dtype).itemsize  # ggml_nbytes of a view
    if in_host_memory(t):
        raw: Any = (ctypes.c_char * span).from_address(t.data)  # the node's memory itself: copied once, below
    else:
        raw = copy_out(address, span)
    view = np.ndarray(shape, dtype=dtype, buffer=raw, strides=strides)
    return view.astype(np.float32) if dtype is np.float16 else np.array(view)
