"""Tensor and expert-slab reading, checked against gguf-py's own reader and dequantizer."""

from __future__ import annotations

import factory
import numpy as np
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from ggufcarve.errors import BadInput
from ggufcarve.gguf.container import read_model
from ggufcarve.gguf.tensors import (
    expert_slab,
    expert_values,
    tensor_bytes,
    tensor_values,
)


def reference(path, name):
    """(raw bytes, float32 values in numpy order) of a tensor as gguf-py reads them."""
    t = next(t for t in GGUFReader(path).tensors if t.name == name)
    raw = np.asarray(t.data).view(np.uint8).tobytes()
    values = gguf_dequantize(np.asarray(t.data), t.tensor_type).reshape(tuple(reversed([int(x) for x in t.shape])))
    return raw, values.astype(np.float32)


@pytest.mark.parametrize("dtype", ["F16", "Q8_0"])
def test_tensors_and_slabs_match_gguf_py(make_model, dtype):
    path = make_model("qwen3moe", dtype, n_embd=256, n_ff_exp=256)
    model = read_model(path)
    for name in ("blk.0.ffn_down_exps.weight", "blk.1.ffn_gate_inp.weight", "blk.0.attn_q.weight"):
        raw, values = reference(path, name)
        assert tensor_bytes(model, name) == raw
        np.testing.assert_array_equal(tensor_values(model, name), values)
    raw, values = reference(path, "blk.1.ffn_up_exps.weight")
    for e in (0, 5, 7):
        slab = len(raw) // 8
        assert expert_slab(model, "blk.1.ffn_up_exps.weight", e) == raw[e * slab : (e + 1) * slab]
        np.testing.assert_array_equal(expert_values(model, "blk.1.ffn_up_exps.weight", e), values[e])


@pytest.mark.slow
def test_k_quant_written_by_llama_quantize(make_model, tmp_path):
    src = make_model("qwen3moe", "F16", n_embd=256, n_ff_exp=256)
    out = tmp_path / "q4km.gguf"
    factory.quantize_with_llama(src, out, "Q4_K_M")
    model = read_model(out)
    name = "blk.0.ffn_gate_exps.weight"
    raw, values = reference(out, name)
    assert model.tensor_index[name][1].type_name in ("Q4_K", "Q5_K", "Q6_K")
    np.testing.assert_array_equal(expert_values(model, name, 3), values[3])
    assert expert_slab(model, name, 3) == raw[3 * len(raw) // 8 : 4 * len(raw) // 8]


def test_bad_names_and_ids(make_model):
    model = read_model(make_model("qwen3moe", "F16"))
    with pytest.raises(BadInput, match="has no tensor"):
        tensor_bytes(model, "blk.9.nothing.weight")
    with pytest.raises(BadInput, match="out of range"):
        expert_slab(model, "blk.0.ffn_up_exps.weight", 8)


def test_q8_0_dequantization_equals_gguf_py_bit_for_bit():
    """The vectorised Q8_0 path gives gguf-py's values, bit for bit, for every f16 scale pattern."""
    import numpy as np
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    from ggufcarve.gguf.tensors import dequantize

    rng = np.random.default_rng(8)
    blocks = rng.integers(0, 256, (1 << 16, 34), dtype=np.uint8)
    blocks[:, :2] = (
        np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(-1, 2)
    )  # every f16 d, NaN and Inf included
    raw = blocks.reshape(256, -1)
    ours = dequantize(raw.tobytes(), int(GGMLQuantizationType.Q8_0), (raw.shape[1] // 34 * 32, 256))
    with np.errstate(invalid="ignore"):
        theirs = gguf_dequantize(raw, GGMLQuantizationType.Q8_0)
    assert ours.shape == theirs.shape and ours.dtype == np.float32
    assert np.array_equal(ours.view(np.uint32), theirs.astype(np.float32).view(np.uint32))
