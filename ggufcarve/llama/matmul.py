"""Products of routed experts' quantized weights by ggml's own CPU kernels, from Python
(llama-cpp-python's libggml), without dequantizing the weights.

    products = ExpertProducts(threads=2)
    outs = products.run([ExpertProduct(address, type_id, cols, rows, n_expert, x, experts), ...])
    outs[i]       # float32 [T, rows]: row t is W[experts[t]] x[t], W the expert-axis tensor at `address`

Each product is one `ggml_mul_mat_id(as, b, ids)` (ggml/include/ggml.h), the op of llama.cpp's
build_moe_ffn: `as` the 3-D expert-axis tensor of ggml type `type_id` (a GGUF tensor's type id is
its ggml type; ne = [cols, rows, n_expert]) whose data is its bytes where they lie (a memory map of
the model file: nothing is copied or dequantized), `b` the float32 rows of `x` as [cols, 1, T],
`ids` the expert of each row as [1, T] int32. ggml computes it as llama.cpp does: `x` quantized to
the weight type's dot-product type (Q8_0 for Q8_0), the dot products on the quantized rows, so a
product costs what llama.cpp's own costs and an expert's output is llama.cpp's ffn_moe_down.

All products of one `run` are one graph, computed by `ggml_graph_compute_with_ctx` (ggml-cpu.h) on
`threads` threads. The context's memory is a numpy buffer kept across runs (tensor headers, the
graph, the results and the work buffer), so repeated runs fault in no new pages. ggml aborts the
process when its context runs out of memory: `context_bytes` bounds what ggml_graph_plan
(ggml/src/ggml-cpu/ggml-cpu.c) asks for MUL_MAT_ID: the rows of `b` in the dot-product type (at
most 4 bytes an element), the row counts and row mappings per expert, a cache line per expert and
per thread, and the tiled kernels' 512 KiB slot per thread (tiled/tiled-kernel.h TILED_WS_SLOT).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
from gguf.constants import GGMLQuantizationType

from ggufcarve.llama.ggml import GgmlTensor, libggml

GGML_TYPE_F32 = int(GGMLQuantizationType.F32)
GGML_TYPE_I32 = int(GGMLQuantizationType.I32)
CACHE_LINE = 64
TILED_SLOT = 512 * 1024  # ggml-cpu's tiled matmul workspace per thread
OBJECT_SLACK = 256  # ggml_object header and alignment per object
SLACK = 1 << 16


class GgmlInitParams(ctypes.Structure):
    """`struct ggml_init_params` (ggml.h): memory pool size, its buffer, whether tensor data is allocated."""

    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


@dataclass(frozen=True)
class ExpertProduct:
    """Row t of the result is W[experts[t]] x[t], for the expert-axis tensor W (`n_expert` matrices
    of `rows` x `cols`, ggml type `type_id`) whose bytes start at `address` (kept alive by the
    caller for the run); `x` float32 [T, cols] and `experts` int32 [T], both C-contiguous."""

    address: int
    type_id: int
    cols: int
    rows: int
    n_expert: int
    x: np.ndarray
    experts: np.ndarray

    def __post_init__(self) -> None:
        x, ids = self.x, self.experts
        if x.dtype != np.float32 or not x.flags.c_contiguous or x.ndim != 2 or x.shape[1] != self.cols:
            raise ValueError(f"x must be C-contiguous float32 [T, {self.cols}], not {x.dtype} {x.shape}")
        if ids.dtype != np.int32 or not ids.flags.c_contiguous or ids.shape != (len(x),):
            raise ValueError(f"experts must be C-contiguous int32 [{len(x)}], not {ids.dtype} {ids.shape}")
        if len(ids) and not (0 <= int(ids.min()) and int(ids.max()) < self.n_expert):
            raise ValueError(f"experts must lie in 0..{self.n_expert - 1}")


@lru_cache(maxsize=1)
def _typed() -> Any:
    lib = libggml()
    pointer = ctypes.c_void_p
    signatures = {
        "ggml_init": ([GgmlInitParams], pointer),
        "ggml_free": ([pointer], None),
        "ggml_set_no_alloc": ([pointer, ctypes.c_bool], None),
        "ggml_new_tensor_2d": ([pointer, ctypes.c_int, ctypes.c_int64, ctypes.c_int64], pointer),
        "ggml_new_tensor_3d": ([pointer, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64], pointer),
        "ggml_mul_mat_id": ([pointer, pointer, pointer, pointer], pointer),
        "ggml_new_graph_custom": ([pointer, ctypes.c_size_t, ctypes.c_bool], pointer),
        "ggml_build_forward_expand": ([pointer, pointer], None),
        "ggml_graph_compute_with_ctx": ([pointer, pointer, ctypes.c_int], ctypes.c_int),
        "ggml_tensor_overhead": ([], ctypes.c_size_t),
        "ggml_graph_overhead_custom": ([ctypes.c_size_t, ctypes.c_bool], ctypes.c_size_t),
    }
    for name, (argtypes, restype) in signatures.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    return lib


def _graph_size(n_products: int) -> int:
    return 3 * n_products + 8  # leafs (as, b and ids of each product) and nodes each fit


def context_bytes(products: Sequence[ExpertProduct], threads: int) -> int:
    """A bound on the ggml context memory one run of `products` needs (see the module docstring)."""
    lib = _typed()
    headers = 4 * len(products) * (lib.ggml_tensor_overhead() + OBJECT_SLACK)
    results = sum(len(p.x) * p.rows * 4 + OBJECT_SLACK for p in products)
    graph = lib.ggml_graph_overhead_custom(_graph_size(len(products)), False) + OBJECT_SLACK
    work = max((len(p.x) * p.cols * 4 + p.n_expert * (len(p.x) * 8 + 8 + CACHE_LINE) for p in products), default=0)
    work += 4 * CACHE_LINE + threads * (TILED_SLOT + CACHE_LINE) + OBJECT_SLACK
    return headers + results + graph + work + SLACK


class ExpertProducts:
    """Runs of ggml expert products on `threads` threads (see the module docstring)."""

    def __init__(self, threads: int = 1) -> None:
        self.threads = max(1, threads)
        self._memory = np.empty(0, np.uint8)

    def run(self, products: Sequence[ExpertProduct]) -> list[np.ndarray]:
        """Every product's float32 [T, rows] (see `ExpertProduct`)."""
        outs = [np.empty((0, p.rows), np.float32) for p in products]
        live = [p for p in products if len(p.x)]
        if not live:
            return outs
        lib = _typed()
        needed = context_bytes(live, self.threads)
        if self._memory.nbytes < needed:
            self._memory = np.empty(needed + needed // 2, np.uint8)  # room to grow before the next allocation
        ctx = lib.ggml_init(GgmlInitParams(self._memory.nbytes, self._memory.ctypes.data, True))
        if not ctx:
            raise MemoryError("ggml_init failed")
        try:
            results = []
            for p in live:
                weights = lib.ggml_new_tensor_3d(ctx, p.type_id, p.cols, p.rows, p.n_expert)
                GgmlTensor.from_address(weights).data = p.address
                x = lib.ggml_new_tensor_3d(ctx, GGML_TYPE_F32, p.cols, 1, len(p.x))
                GgmlTensor.from_address(x).data = p.x.ctypes.data
                ids = lib.ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 1, len(p.x))
                GgmlTensor.from_address(ids).data = p.experts.ctypes.data
                lib.ggml_set_no_alloc(ctx, False)
                results.append(lib.ggml_mul_mat_id(ctx, weights, x, ids))
                lib.ggml_set_no_alloc(ctx, True)
            graph = lib.ggml_new_graph_custom(ctx, _graph_size(len(live)), False)
            for result in results:
                lib.ggml_build_forward_expand(graph, result)
            status = lib.ggml_graph_compute_with_ctx(ctx, graph, self.threads)
            if status != 0:
                raise RuntimeError(f"ggml_graph_compute_with_ctx returned {status}")
            indexes = [i for i, p in enumerate(products) if len(p.x)]
            for i, p, result in zip(indexes, live, results):
                data = GgmlTensor.from_address(result).data  # [rows, 1, T]: the outputs of row t contiguous
                outs[i] = (
                    np.ctypeslib.as_array((ctypes.c_float * (len(p.x) * p.rows)).from_address(data))
                    .reshape(len(p.x), p.rows)
                    .copy()
                )
            return outs
        finally:
            lib.ggml_free(ctx)
