"""Matrix products of quantized weights by ggml's own CPU kernels, from Python (llama-cpp-python's
libggml), without dequantizing the weights.

    products = MatrixProducts(threads=2)
    outs = products.run([Product(address, type_id, cols, rows, x), ...])   # x: float32 [T, cols]
    outs[i]                      # float32 [T, rows]: x @ W.T, W the rows x cols matrix at `address`

Each product is `ggml_mul_mat(W, X)` (ggml/include/ggml.h): W a 2-D tensor of ggml type `type_id`
(a GGUF tensor's type id is its ggml type) whose data is the weights' bytes where they lie (a
memory map of the model file: nothing is copied or dequantized), X the float32 rows of `x`; the
result is [T, rows] float32, row t = W x_t. ggml computes it as llama.cpp's mul_mat does: X is
quantized to the weight type's dot-product type (Q8_0 for Q8_0 and most k-quants) and the dot
products run on the quantized rows, so a product costs what llama.cpp's own costs, and an expert's
output equals llama.cpp's ffn_moe_down up to the order of its sums.

All products of one `run` are one graph, computed by `ggml_graph_compute_with_ctx` (ggml-cpu.h) on
`threads` threads. The context's memory is a numpy buffer kept across runs (tensor headers, the
graph, the results and the work buffer where ggml quantizes X), so repeated runs fault in no new
pages. ggml aborts the process when its context runs out of memory: the buffer is sized from the
bound `context_bytes` gives, which covers ggml_graph_plan's work size for MUL_MAT (the
dot-product-type rows of X, at most 4 bytes an element, plus a cache line per thread).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from ggufcarve.llama.ggml import GgmlTensor, libggml

GGML_TYPE_F32 = 0
ALIGNMENT = 64  # GGML_MEM_ALIGN is 16; each object padded further for safety
SLACK = 1 << 16


class GgmlInitParams(ctypes.Structure):
    """`struct ggml_init_params` (ggml.h): memory pool size, its buffer, whether tensor data is allocated."""

    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


@dataclass(frozen=True)
class Product:
    """x @ W.T for the `rows` x `cols` matrix W of ggml type `type_id` whose bytes start at `address`
    (kept alive by the caller for the run); `x` float32 [T, cols], C-contiguous."""

    address: int
    type_id: int
    cols: int
    rows: int
    x: np.ndarray


@lru_cache(maxsize=1)
def _typed() -> Any:
    lib = libggml()
    pointer = ctypes.c_void_p
    signatures = {
        "ggml_init": ([GgmlInitParams], pointer),
        "ggml_free": ([pointer], None),
        "ggml_set_no_alloc": ([pointer, ctypes.c_bool], None),
        "ggml_new_tensor_2d": ([pointer, ctypes.c_int, ctypes.c_int64, ctypes.c_int64], pointer),
        "ggml_mul_mat": ([pointer, pointer, pointer], pointer),
        "ggml_new_graph_custom": ([pointer, ctypes.c_size_t, ctypes.c_bool], pointer),
        "ggml_build_forward_expand": ([pointer, pointer], None),
        "ggml_graph_compute_with_ctx": ([pointer, pointer, ctypes.c_int], ctypes.c_int),
        "ggml_tensor_overhead": ([], ctypes.c_size_t),
        "ggml_graph_overhead_custom": ([ctypes.c_size_t, ctypes.c_bool], ctypes.c_size_t),
        "ggml_row_size": ([ctypes.c_int, ctypes.c_int64], ctypes.c_size_t),
    }
    for name, (argtypes, restype) in signatures.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    return lib


def context_bytes(products: Sequence[Product], threads: int) -> int:
    """A bound on the ggml context memory one run of `products` needs: per product three tensor
    headers and its float32 result; the graph; the work buffer (the largest X in its dot-product
    type, at most 4 bytes an element, and a cache line per thread); alignment slack."""
    lib = _typed()
    headers = 3 * len(products) * (lib.ggml_tensor_overhead() + ALIGNMENT)
    results = sum(len(p.x) * p.rows * 4 + ALIGNMENT for p in products)
    graph = lib.ggml_graph_overhead_custom(_graph_size(len(products)), False)
    work = max((len(p.x) * p.cols * 4 for p in products), default=0) + 64 * (threads + 1)
    return headers + results + graph + work + SLACK


def _graph_size(n_products: int) -> int:
    return max(16, 2 * n_products + 8)  # leafs (W and X of each product) and nodes each fit


class MatrixProducts:
    """Runs of ggml matrix products on `threads` threads (see the module docstring)."""

    def __init__(self, threads: int = 1) -> None:
        self.threads = max(1, threads)
        self._memory = np.empty(0, np.uint8)

    def run(self, products: Sequence[Product]) -> list[np.ndarray]:
        """x @ W.T of every product, float32 [T, rows] each (see `Product`)."""
        if not products:
            return []
        lib = _typed()
        for p in products:
            if p.x.dtype != np.float32 or not p.x.flags.c_contiguous or p.x.ndim != 2 or p.x.shape[1] != p.cols:
                raise ValueError(f"x must be C-contiguous float32 [T, {p.cols}], not {p.x.dtype} {p.x.shape}")
        needed = context_bytes(products, self.threads)
        if self._memory.nbytes < needed:
            self._memory = np.empty(needed, np.uint8)
        ctx = lib.ggml_init(GgmlInitParams(self._memory.nbytes, self._memory.ctypes.data, True))
        if not ctx:
            raise MemoryError("ggml_init failed")
        try:
            results = []
            for p in products:
                weights = lib.ggml_new_tensor_2d(ctx, p.type_id, p.cols, p.rows)
                GgmlTensor.from_address(weights).data = p.address
                x = lib.ggml_new_tensor_2d(ctx, GGML_TYPE_F32, p.cols, len(p.x))
                GgmlTensor.from_address(x).data = p.x.ctypes.data
                lib.ggml_set_no_alloc(ctx, False)
                results.append(lib.ggml_mul_mat(ctx, weights, x))
                lib.ggml_set_no_alloc(ctx, True)
            graph = lib.ggml_new_graph_custom(ctx, _graph_size(len(products)), False)
            for result in results:
                lib.ggml_build_forward_expand(graph, result)
            status = lib.ggml_graph_compute_with_ctx(ctx, graph, self.threads)
            if status != 0:
                raise RuntimeError(f"ggml_graph_compute_with_ctx returned {status}")
            outs = []
            for p, result in zip(products, results):
                data = GgmlTensor.from_address(result).data
                outs.append(np.ctypeslib.as_array((ctypes.c_float * (len(p.x) * p.rows)).from_address(data)).reshape(len(p.x), p.rows).copy())
            return outs
        finally:
            lib.ggml_free(ctx)
