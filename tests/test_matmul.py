"""ggml's expert products (llama/matmul.py) against numpy's products of gguf-py's dequantized weights."""

from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from ggufcarve.llama.libllama import bindings
from ggufcarve.llama.matmul import ExpertProduct, ExpertProducts, context_bytes


def random_weights(
    qtype: GGMLQuantizationType, cols: int, rows: int, n_expert: int, rng: np.random.Generator
) -> np.ndarray:
    """Random bytes of an expert-axis tensor of `qtype`, every block's f16 scales set to small finite values."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_expert * rows * cols // block, size), dtype=np.uint8)
    scales = 2 if qtype == GGMLQuantizationType.Q8_0 else 4  # d; d and dmin (Q4_K)
    raw[:, :scales] = np.full(scales // 2, 0.01, np.float16).view(np.uint8)
    return raw.reshape(-1)


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.F16])
def test_expert_products_equal_numpy_products_of_the_dequantized_weights(qtype):
    """Row t is W[experts[t]] x[t] for every row, expert and type, in one graph of several products
    on 2 threads (k-quants use ggml's tiled kernels and their per-thread workspace); the difference
    from float32 numpy is the inputs' quantization to the dot-product type (Q8_0, Q8_K)."""
    bindings()
    rng = np.random.default_rng(11)
    cols, rows, n_expert, tokens = 512, 48, 6, 37
    if qtype == GGMLQuantizationType.F16:
        raw = rng.standard_normal(n_expert * rows * cols).astype(np.float16).view(np.uint8)
    else:
        raw = random_weights(qtype, cols, rows, n_expert, rng)
    weights = dequantize(raw.reshape(n_expert * rows, -1), qtype).reshape(n_expert, rows, cols).astype(np.float32)
    products = []
    for _ in range(3):
        x = rng.standard_normal((tokens, cols)).astype(np.float32)
        experts = rng.integers(0, n_expert, tokens).astype(np.int32)
        products.append(ExpertProduct(raw.ctypes.data, int(qtype), cols, rows, n_expert, x, experts))
    empty = ExpertProduct(
        raw.ctypes.data, int(qtype), cols, rows, n_expert, np.empty((0, cols), np.float32), np.empty(0, np.int32)
    )
    engine = ExpertProducts(threads=2)
    outs = engine.run([*products, empty])
    assert outs[-1].shape == (0, rows)
    tolerance = 1e-3 if qtype == GGMLQuantizationType.F16 else 2e-2
    for p, out in zip(products, outs):
        expected = np.einsum("tc,trc->tr", p.x, weights[p.experts])
        assert out.shape == (tokens, rows) and out.dtype == np.float32
        assert np.abs(out - expected).max() <= tolerance * np.abs(expected).max(), qtype.name
    memory = engine._memory
    again = engine.run(products[:1])  # the context memory is reused
    np.testing.assert_array_equal(again[0], outs[0])
    assert engine._memory is memory and memory.nbytes >= context_bytes(products, 2)


def test_bad_products_are_refused_before_ggml_sees_them():
    x = np.zeros((3, 64), np.float32)
    with pytest.raises(ValueError, match="int32"):
        ExpertProduct(0, int(GGMLQuantizationType.F32), 64, 8, 2, x, np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="0..1"):
        ExpertProduct(0, int(GGMLQuantizationType.F32), 64, 8, 2, x, np.array([0, 2, 1], np.int32))
    with pytest.raises(ValueError, match="float32"):
        ExpertProduct(0, int(GGMLQuantizationType.F32), 64, 8, 2, x.astype(np.float64), np.zeros(3, np.int32))
