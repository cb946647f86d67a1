"""Tensor types and file types as gguf-py states them (`ggml_type` of ggml.h, `llama_ftype` of llama.h).

Nothing here is a copy of a table: the names and ids come from `gguf.constants`. The spelling of
a file type is llama-quantize's (`Q4_K_M`, `IQ2_XS`, `F32`): llama.h's `LLAMA_FTYPE_MOSTLY_<NAME>`
without the prefix, and `LLAMA_FTYPE_ALL_F32` as `F32`.
"""

from __future__ import annotations

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from ggufcarve.errors import BadInput

# ggml types that hold integers or are only an operand format of dot products (ggml's vec_dot
# partners Q8_1 and Q8_K): ggml_quantize_chunk cannot produce them, so no tensor is stored as one
# by llama-quantize.
_NOT_STORAGE_TYPES = frozenset(
    {
        GGMLQuantizationType.I8,
        GGMLQuantizationType.I16,
        GGMLQuantizationType.I32,
        GGMLQuantizationType.I64,
        GGMLQuantizationType.F64,
        GGMLQuantizationType.Q8_1,
        GGMLQuantizationType.Q8_K,
    }
)

#: ggml type name -> id, every type gguf-py knows.
TENSOR_TYPES: dict[str, int] = {t.name: int(t) for t in GGMLQuantizationType}

#: The tensor types llama-quantize can write (targets of --tensor-type, --output-tensor-type, ...).
QUANTIZE_TARGET_TYPES: frozenset[str] = frozenset(
    t.name for t in GGMLQuantizationType if t not in _NOT_STORAGE_TYPES and t in GGML_QUANT_SIZES
)


def _file_type_name(file_type: LlamaFileType) -> str:
    return "F32" if file_type is LlamaFileType.ALL_F32 else file_type.name.removeprefix("MOSTLY_")


#: llama-quantize file type name -> llama_ftype id; GUESSED (a loader-only marker) is left out.
FILE_TYPES: dict[str, int] = {_file_type_name(ft): int(ft) for ft in LlamaFileType if ft is not LlamaFileType.GUESSED}


def ggml_type_name(type_id: int) -> str:
    """gguf-py's name of ggml type `type_id`; "type<id>" for an id it does not know."""
    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type{type_id}"


def tensor_type(name: str) -> GGMLQuantizationType:
    """The ggml type called `name` (any case)."""
    try:
        return GGMLQuantizationType[name.upper()]
    except KeyError:
        raise BadInput(f"unknown ggml type {name!r}", "use a name such as F32, F16, Q8_0, Q4_K") from None


def ggml_type_row_bytes(type_id: int, ne0: int) -> int | None:
    """Bytes of one row of `ne0` elements, or None for a type gguf-py does not know."""
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        return None
    if ne0 % block:
        raise BadInput(
            f"row width {ne0} is not a multiple of the {ggml_type_name(type_id)} block size {block}",
            "the file is corrupt or was written by an incompatible tool",
        )
    return ne0 // block * type_size


def file_type(name: str) -> LlamaFileType:
    """The llama_ftype llama-quantize calls `name` (any case), e.g. "Q4_K_M" or "F32"."""
    upper = name.upper()
    if upper not in FILE_TYPES:
        raise BadInput(f"unknown llama.cpp file type {name!r}", f"use one of {', '.join(FILE_TYPES)}")
    return LlamaFileType(FILE_TYPES[upper])
