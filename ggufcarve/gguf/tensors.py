"""Reading tensor data: a whole tensor, or one expert's slab of an expert-axis tensor, and its values.

A tensor's bytes are `[data_start + offset, data_start + offset + nbytes)` of its shard. In ggml
order `ne[0]` is the row width and `ne[-1]` the outermost axis, so the numpy array of a tensor has
the reversed shape, and the expert axis of an expert tensor (`ne[-1]`) is numpy axis 0: expert `e`
is the contiguous byte range `[e * slab, (e + 1) * slab)` with `slab = nbytes / ne[-1]`. Quantized
rows are dequantized by gguf-py (`gguf.quants.dequantize`), which knows every llama.cpp block type;
Q8_0, the type of most source models, by one vectorised numpy pass with the same products.
"""

from __future__ import annotations

import os

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from ggufcarve.errors import BadInput, UnsupportedModel
from ggufcarve.gguf.container import GGUFModel, TensorInfo, ggml_type_name


def _locate(model: GGUFModel, name: str) -> tuple[int, TensorInfo]:
    try:
        return model.tensor_index[name]
    except KeyError:
        raise BadInput(
            f"{model.path.name} has no tensor {name}",
            "check the tensor name (ggufcarve inspect lists the expert tensors)",
        ) from None


def _read(path: os.PathLike[str] | str, offset: int, length: int) -> bytes:
    with open(path, "rb", buffering=0) as f:
        data = os.pread(f.fileno(), length, offset)
    if len(data) != length:
        raise BadInput(
            f"{path}: {length - len(data)} bytes missing at offset {offset + len(data)}", "the file is truncated"
        )
    return data


def tensor_bytes(model: GGUFModel, name: str) -> bytes:
    """The raw bytes of tensor `name`, exactly as stored."""
    shard, info = _locate(model, name)
    start, end = model.shards[shard].data_range(info)
    return _read(model.shards[shard].path, start, end - start)


def expert_slab(model: GGUFModel, name: str, expert: int) -> bytes:
    """The raw bytes of expert `expert` of an expert-axis tensor (its last ggml dimension)."""
    shard, info = _locate(model, name)
    n_expert = info.shape[-1]
    if not 0 <= expert < n_expert:
        raise BadInput(
            f"{name}: expert {expert} out of range 0..{n_expert - 1}", "give an id below the tensor's last dimension"
        )
    slab = info.nbytes // n_expert
    start, _ = model.shards[shard].data_range(info)
    return _read(model.shards[shard].path, start + expert * slab, slab)


def dequantize_q8_0(data: np.ndarray) -> np.ndarray:
    """Q8_0 blocks (uint8, 34 bytes each: f16 d, then 32 int8 q) as float32 q * d, the product
    ggml's dequantize_row_q8_0 computes; one vectorised pass instead of gguf-py's row groups."""
    blocks = data.reshape(-1, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    values = blocks[:, 2:].view(np.int8).astype(np.float32)
    with np.errstate(invalid="ignore"):  # an Inf scale times a zero quant is NaN, as in ggml
        values *= d
    return values.reshape(-1)


def dequantize(raw: bytes, type_id: int, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values of `raw` (a tensor or a slab of type `type_id` and ggml shape `shape`), numpy order."""
    try:
        qtype = GGMLQuantizationType(type_id)
        GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise UnsupportedModel(
            f"ggml type {ggml_type_name(type_id)} has no numpy dequantizer in gguf-py",
            "this tensor type cannot be read by ggufcarve",
        ) from None
    data = np.frombuffer(raw, dtype=np.uint8)
    if qtype == GGMLQuantizationType.Q8_0:
        return dequantize_q8_0(data).reshape(tuple(reversed(shape)))
    rows = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    try:
        values = gguf_dequantize(data.reshape(rows, -1), qtype)
    except NotImplementedError:
        raise UnsupportedModel(
            f"gguf-py cannot dequantize {qtype.name}", "this tensor type cannot be read by ggufcarve"
        ) from None
    return np.ascontiguousarray(values, dtype=np.float32).reshape(tuple(reversed(shape)))


def tensor_values(model: GGUFModel, name: str) -> np.ndarray:
    """The float32 values of tensor `name`, numpy order (ggml shape reversed)."""
    _, info = _locate(model, name)
    return dequantize(tensor_bytes(model, name), info.type_id, info.shape)


def expert_values(model: GGUFModel, name: str, expert: int) -> np.ndarray:
    """The float32 values of one expert of an expert-axis tensor: numpy shape of `ne[:-1]` reversed."""
    _, info = _locate(model, name)
    return dequantize(expert_slab(model, name, expert), info.type_id, info.shape[:-1])
