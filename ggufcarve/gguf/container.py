"""The GGUF container: header, raw key/value records and tensor infos, for single files and split sets.

Knows nothing about experts. Reads any tensor type, including ids gguf-py does not know: their
byte size is derived from the exactly-cumulative offsets llama.cpp requires.

GGUF v2/v3 layout (little endian):
    "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x  (string key | u32 value_type | value)
    n_tensors x (string name | u32 n_dims | u64 ne[n_dims] | u32 ggml_type | u64 offset)
    zero padding to `general.alignment` (default 32)
    tensor data; each tensor starts at data_start + offset, offsets are cumulative and every
    tensor is followed by zero padding to the alignment.
A string is u64 length + UTF-8 bytes; an array is u32 item_type | u64 count | items.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import stat
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGUF_DEFAULT_ALIGNMENT, GGUFValueType, Keys
from gguf.gguf_writer import SHARD_NAME_FORMAT

from ggufcarve.errors import BadInput
from ggufcarve.gguf.types import ggml_type_name, ggml_type_row_bytes

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = GGUF_DEFAULT_ALIGNMENT
SPLIT_NO = Keys.Split.LLM_KV_SPLIT_NO
SPLIT_COUNT = Keys.Split.LLM_KV_SPLIT_COUNT
SPLIT_TENSORS_COUNT = Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT
SPLIT_KEYS = (SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS_COUNT)


def _shard_name_pattern(form: str) -> re.Pattern[str]:
    """The regex of a shard name written by `form` ("{:s}-{:05d}-of-{:05d}.gguf", gguf-py's
    SHARD_NAME_FORMAT, llama_split_path's "%s-%05d-of-%05d.gguf"): groups prefix, no and count."""
    lead, between, of, tail = re.split(r"\{[^}]*\}", form)
    return re.compile(
        f"^{re.escape(lead)}(?P<prefix>.*){re.escape(between)}(?P<no>\\d{{5}}){re.escape(of)}(?P<count>\\d{{5}}){re.escape(tail)}$"
    )


SHARD_NAME = _shard_name_pattern(SHARD_NAME_FORMAT)

# Fixed-size scalar encodings, by GGUF value type.
SCALAR_FORMATS: dict[int, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
NUMPY_DTYPES: dict[int, str] = {
    GGUFValueType.UINT8: "<u1",
    GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4",
    GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.BOOL: "<u1",
    GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8",
}
MAX_DIMS = 4


def pad_to(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class KeyValue:
    """One metadata record, kept as its exact bytes so it can be copied verbatim."""

    key: str
    value_type: int
    raw: bytes  # the whole record: key string, u32 type, value

    @cached_property
    def value(self) -> Any:
        """Scalars as Python values, strings as str, arrays as a list (strings) or a numpy array."""
        key_len = struct.unpack_from("<Q", self.raw, 0)[0]
        value, _ = decode_value(self.raw, 8 + key_len + 4, self.value_type)
        return value

    @property
    def item_type(self) -> int | None:
        if self.value_type != GGUFValueType.ARRAY:
            return None
        key_len = struct.unpack_from("<Q", self.raw, 0)[0]
        return struct.unpack_from("<I", self.raw, 8 + key_len + 4)[0]


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: ne[0] is the row width, ne[-1] the outermost axis
    type_id: int
    offset: int  # from the start of the file's data section
    nbytes: int  # without padding

    @property
    def type_name(self) -> str:
        return ggml_type_name(self.type_id)

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


@dataclass
class GGUFFile:
    """One physical GGUF file: its header, parsed; tensor data stays on disk."""

    path: Path
    version: int
    kvs: list[KeyValue]
    tensors: list[TensorInfo]
    alignment: int
    data_start: int  # absolute offset of the data section
    size: int  # file size in bytes
    header_bytes: bytes = field(repr=False, default=b"")  # everything before data_start

    @cached_property
    def kv_index(self) -> dict[str, KeyValue]:
        return {kv.key: kv for kv in self.kvs}

    def get(self, key: str, default: Any = None) -> Any:
        kv = self.kv_index.get(key)
        return default if kv is None else kv.value

    def data_range(self, tensor: TensorInfo) -> tuple[int, int]:
        """Absolute [start, end) of a tensor's bytes in this file."""
        start = self.data_start + tensor.offset
        return start, start + tensor.nbytes


class _Cursor:
    """Bounds-checked little-endian reads from a buffer, raising BadInput naming the byte offset."""

    def __init__(self, buf: Any, path: Path, size: int) -> None:
        self.buf = buf
        self.path = path
        self.size = size
        self.pos = 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise BadInput(
                f"{self.path}: truncated or corrupt GGUF header: {what} at byte "
                f"{self.pos} runs past the end of the file ({self.size} bytes)",
                "re-download or re-copy the file; compare its size and sha256 with the source",
            )

    def unpack(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value[0] if len(value) == 1 else value

    def string(self, what: str) -> str:
        n = self.unpack("<Q", f"length of {what}")
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise BadInput(
                f"{self.path}: {what} at byte {self.pos - n} is not valid UTF-8", "the file is corrupt"
            ) from None

    def skip_value(self, value_type: int, what: str) -> None:
        if value_type in SCALAR_FORMATS:
            self.need(struct.calcsize(SCALAR_FORMATS[value_type]), what)
            self.pos += struct.calcsize(SCALAR_FORMATS[value_type])
        elif value_type == GGUFValueType.STRING:
            n = self.unpack("<Q", f"length of {what}")
            self.need(n, what)
            self.pos += n
        elif value_type == GGUFValueType.ARRAY:
            item_type, count = self.unpack("<IQ", f"array header of {what}")
            if item_type in SCALAR_FORMATS:
                n = struct.calcsize(SCALAR_FORMATS[item_type]) * count
                self.need(n, what)
                self.pos += n
            elif item_type == GGUFValueType.STRING:
                for _ in range(count):
                    n = self.unpack("<Q", f"string length in {what}")
                    self.need(n, what)
                    self.pos += n
            elif item_type == GGUFValueType.ARRAY:
                raise BadInput(
                    f"{self.path}: {what} is an array of arrays (byte "
                    f"{self.pos}), which llama.cpp's GGUF reader refuses",
                    "the file is corrupt or was not written for llama.cpp",
                )
            else:
                raise BadInput(
                    f"{self.path}: {what} has unknown array item type {item_type} at byte {self.pos}",
                    "the file is corrupt",
                )
        else:
            raise BadInput(
                f"{self.path}: {what} has unknown value type {value_type} at byte {self.pos}", "the file is corrupt"
            )


def decode_value(buf: bytes, pos: int, value_type: int) -> tuple[Any, int]:
    """Decode one value at `pos`; returns (value, position after it)."""
    if value_type in SCALAR_FORMATS:
        fmt = SCALAR_FORMATS[value_type]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if value_type == GGUFValueType.STRING:
        n = struct.unpack_from("<Q", buf, pos)[0]
        pos += 8
        return bytes(buf[pos : pos + n]).decode("utf-8", errors="replace"), pos + n
    if value_type == GGUFValueType.ARRAY:
        item_type, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item_type in NUMPY_DTYPES:
            dtype = np.dtype(NUMPY_DTYPES[item_type])
            arr = np.frombuffer(buf, dtype=dtype, count=count, offset=pos).copy()
            return (arr.astype(bool) if item_type == GGUFValueType.BOOL else arr), pos + count * dtype.itemsize
        items = []
        for _ in range(count):
            item, pos = decode_value(buf, pos, item_type)
            items.append(item)
        return items, pos
    raise ValueError(f"unknown GGUF value type {value_type}")


def _directory_given(path: Path) -> BadInput:
    models = sorted(
        p.name for p in path.glob("*.gguf") if (shard := SHARD_NAME.match(p.name)) is None or shard["no"] == "00001"
    )
    if not models:
        return BadInput(f"{path}: is a directory and holds no .gguf file", "give the path of a .gguf file")
    return BadInput(
        f"{path}: is a directory, not a GGUF file (it holds {len(models)} .gguf file{'s' if len(models) > 1 else ''})",
        f"give one of them, e.g. {path / models[0]}",
    )


def read_file(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse one GGUF file's header. Raises BadInput with the file and byte offset on any defect."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise BadInput(f"{path}: no such file", "check the path") from None
    except IsADirectoryError:
        raise _directory_given(path) from None
    except PermissionError:
        raise BadInput(f"{path}: permission denied", "check the file's permissions") from None
    try:
        status = os.fstat(fd)
        if stat.S_ISDIR(status.st_mode):  # O_RDONLY opens a directory on Linux
            raise _directory_given(path)
        if not stat.S_ISREG(status.st_mode):
            raise BadInput(f"{path}: not a regular file", "give the path of a .gguf file")
        size = status.st_size
        if size < 24:
            raise BadInput(f"{path}: {size} bytes is too short to be a GGUF file", "the file is truncated or not GGUF")
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mm:
            return _parse(mm, path, size)
    finally:
        os.close(fd)


def _parse(buf: Any, path: Path, size: int) -> GGUFFile:
    cur = _Cursor(buf, path, size)
    magic = bytes(buf[0:4])
    if magic != GGUF_MAGIC:
        raise BadInput(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')", "give a .gguf model file")
    cur.pos = 4
    version = cur.unpack("<I", "version")
    if version not in (2, 3):
        raise BadInput(
            f"{path}: GGUF version {version} is not supported (only 2 and 3)",
            "convert the file with a current llama.cpp",
        )
    n_tensors, n_kv = cur.unpack("<QQ", "tensor and key counts")
    if n_kv > size or n_tensors > size:
        raise BadInput(
            f"{path}: header claims {n_tensors} tensors and {n_kv} keys, more than the file can hold",
            "the file is corrupt",
        )

    kvs: list[KeyValue] = []
    for i in range(n_kv):
        start = cur.pos
        key = cur.string(f"key #{i}")
        value_type = cur.unpack("<I", f"type of key {key!r}")
        cur.skip_value(value_type, f"value of key {key!r}")
        kvs.append(KeyValue(key, value_type, bytes(buf[start : cur.pos])))
    keys = [kv.key for kv in kvs]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise BadInput(f"{path}: key {dup!r} appears twice", "the file is corrupt")

    infos: list[tuple[str, tuple[int, ...], int, int]] = []
    for i in range(n_tensors):
        name = cur.string(f"name of tensor #{i}")
        n_dims = cur.unpack("<I", f"dimension count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise BadInput(
                f"{path}: tensor {name!r} has {n_dims} dimensions (1..{MAX_DIMS} allowed)", "the file is corrupt"
            )
        shape = tuple(
            cur.unpack(f"<{n_dims}Q", f"shape of tensor {name!r}")
            if n_dims > 1
            else (cur.unpack("<Q", f"shape of tensor {name!r}"),)
        )
        type_id, offset = cur.unpack("<IQ", f"type and offset of tensor {name!r}")
        infos.append((name, shape, type_id, offset))

    alignment_kv = next((kv for kv in kvs if kv.key == Keys.General.ALIGNMENT), None)
    alignment = DEFAULT_ALIGNMENT
    if alignment_kv is not None:
        if (
            alignment_kv.value_type != GGUFValueType.UINT32
            or alignment_kv.value <= 0
            or alignment_kv.value & (alignment_kv.value - 1)
        ):
            raise BadInput(f"{path}: general.alignment must be a u32 power of two", "the file is corrupt")
        alignment = alignment_kv.value
    data_start = pad_to(cur.pos, alignment)
    if data_start > size:
        raise BadInput(
            f"{path}: truncated: header ends at byte {cur.pos} but the file has {size} bytes",
            "re-download or re-copy the file",
        )
    header_bytes = bytes(buf[:data_start])

    tensors = _size_tensors(infos, path, alignment, size - data_start)
    return GGUFFile(path, version, kvs, tensors, alignment, data_start, size, header_bytes)


def _size_tensors(
    infos: list[tuple[str, tuple[int, ...], int, int]], path: Path, alignment: int, data_size: int
) -> list[TensorInfo]:
    """Byte sizes from the types; for unknown types from the gap to the next offset.

    llama.cpp requires offset[i] == sum of padded sizes of tensors 0..i-1, so the gap before the
    next tensor (or the end of the data section) is the size rounded up to the alignment; the
    size is the one multiple of the row count in (gap - alignment, gap].
    """
    tensors: list[TensorInfo] = []
    expected = 0
    for i, (name, shape, type_id, offset) in enumerate(infos):
        if offset != expected:
            raise BadInput(
                f"{path}: tensor {name!r} has data offset {offset}, expected {expected}",
                "the file is corrupt or not written by a GGUF writer",
            )
        row_bytes = ggml_type_row_bytes(type_id, shape[0])
        rows = math.prod(shape[1:])
        if row_bytes is not None:
            nbytes = row_bytes * rows
        else:
            gap_end = infos[i + 1][3] if i + 1 < len(infos) else data_size
            gap = gap_end - offset
            candidates = [n for n in range(max(gap - alignment + 1, 0), gap + 1) if rows and n % rows == 0 and n > 0]
            if len(candidates) != 1:
                raise BadInput(
                    f"{path}: cannot determine the size of tensor {name!r} of unknown ggml type {type_id}",
                    "upgrade the gguf package to a version that knows this type",
                )
            nbytes = candidates[0]
        if offset + nbytes > data_size:
            raise BadInput(
                f"{path}: truncated: tensor {name!r} needs bytes up to "
                f"{offset + nbytes} of the data section, the file has {data_size}",
                "re-download or re-copy the file; compare its size and sha256 with the source",
            )
        tensors.append(TensorInfo(name, shape, type_id, offset, nbytes))
        expected = offset + pad_to(nbytes, alignment)
    return tensors


@dataclass
class GGUFModel:
    """A model as llama.cpp loads it: one file, or the shards of a split set in order."""

    shards: list[GGUFFile]

    @property
    def path(self) -> Path:
        return self.shards[0].path

    @property
    def metadata(self) -> GGUFFile:
        """The shard holding the model's metadata (the first)."""
        return self.shards[0]

    def get(self, key: str, default: Any = None) -> Any:
        return self.shards[0].get(key, default)

    @cached_property
    def tensor_index(self) -> dict[str, tuple[int, TensorInfo]]:
        return {t.name: (i, t) for i, shard in enumerate(self.shards) for t in shard.tensors}

    @property
    def tensors(self) -> Iterable[TensorInfo]:
        for shard in self.shards:
            yield from shard.tensors

    @property
    def is_split(self) -> bool:
        return len(self.shards) > 1

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.shards)

    @property
    def paths(self) -> list[Path]:
        return [s.path for s in self.shards]


def shard_paths(prefix: str | os.PathLike[str], count: int) -> list[Path]:
    """llama.cpp's split naming: PREFIX-00001-of-0000N.gguf."""
    return [Path(SHARD_NAME_FORMAT.format(os.fspath(prefix), i + 1, count)) for i in range(count)]


def read_model(path: str | os.PathLike[str]) -> GGUFModel:
    """Read a single GGUF file, or a whole split set given its first shard."""
    first = read_file(path)
    count = first.get(SPLIT_COUNT, 0)
    if not count or count == 1 and first.get(SPLIT_NO, 0) == 0:
        return GGUFModel([first])
    if first.get(SPLIT_NO, 0) != 0:
        raise BadInput(
            f"{first.path}: this is shard {first.get(SPLIT_NO) + 1} of {count} of a split model",
            "give the first shard (-00001-of-...)",
        )
    match = SHARD_NAME.match(str(first.path))
    if not match:
        raise BadInput(
            f"{first.path}: split model ({SPLIT_COUNT}={count}) but the name is not {shard_paths('PREFIX', count)[0]}",
            "rename the shards the way llama-gguf-split names them",
        )
    shards = [first]
    for i, shard_path in enumerate(shard_paths(match["prefix"], count)[1:], start=1):
        if not shard_path.exists():
            raise BadInput(
                f"{first.path}: shard {i + 1} of {count} is missing ({shard_path})",
                "download every shard of the split model",
            )
        shard = read_file(shard_path)
        if shard.get(SPLIT_NO) != i or shard.get(SPLIT_COUNT) != count:
            raise BadInput(
                f"{shard_path}: {SPLIT_NO}/{SPLIT_COUNT} say "
                f"{shard.get(SPLIT_NO)}/{shard.get(SPLIT_COUNT)}, expected {i}/{count}",
                "the shards come from different split sets",
            )
        shards.append(shard)
    model = GGUFModel(shards)
    expected_tensors = first.get(SPLIT_TENSORS_COUNT)
    n_tensors = sum(len(s.tensors) for s in shards)
    if expected_tensors is not None and expected_tensors != n_tensors:
        raise BadInput(
            f"{first.path}: {SPLIT_TENSORS_COUNT} is {expected_tensors} but the shards hold {n_tensors} tensors",
            "the split set is incomplete or mixed",
        )
    if len(model.tensor_index) != n_tensors:
        raise BadInput(f"{first.path}: a tensor name appears in more than one shard", "the split set is corrupt")
    return model


# ---------------------------------------------------------------------------------------------
# Encoding


def encode_string(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def encode_value(value_type: int, value: Any, item_type: int | None = None) -> bytes:
    if value_type in SCALAR_FORMATS:
        return struct.pack(SCALAR_FORMATS[value_type], value)
    if value_type == GGUFValueType.STRING:
        return encode_string(value)
    if value_type == GGUFValueType.ARRAY:
        if item_type is None:
            raise ValueError("an array needs an item type")
        items = list(value)
        if item_type in NUMPY_DTYPES:
            body = np.asarray(items, dtype=NUMPY_DTYPES[item_type]).tobytes()
        else:
            body = b"".join(encode_value(item_type, v) for v in items)
        return struct.pack("<IQ", item_type, len(items)) + body
    raise ValueError(f"unknown GGUF value type {value_type}")


def make_kv(key: str, value_type: int, value: Any, item_type: int | None = None) -> KeyValue:
    raw = encode_string(key) + struct.pack("<I", value_type) + encode_value(value_type, value, item_type)
    return KeyValue(key, int(value_type), raw)


@dataclass(frozen=True)
class TensorHeader:
    """What the header says of one output tensor; its offset follows from the order."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    nbytes: int


def encode_header(
    version: int, kvs: Sequence[KeyValue], tensors: Sequence[TensorHeader], alignment: int
) -> tuple[bytes, list[int]]:
    """The bytes before the data section, and each tensor's offset within the data section."""
    parts = [GGUF_MAGIC, struct.pack("<IQQ", version, len(tensors), len(kvs))]
    parts.extend(kv.raw for kv in kvs)
    offsets = []
    offset = 0
    for t in tensors:
        offsets.append(offset)
        parts.append(encode_string(t.name))
        parts.append(struct.pack(f"<I{len(t.shape)}QIQ", len(t.shape), *t.shape, t.type_id, offset))
        offset += pad_to(t.nbytes, alignment)
    header = b"".join(parts)
    return header + bytes(pad_to(len(header), alignment) - len(header)), offsets


def replace_kvs(kvs: Sequence[KeyValue], changes: dict[str, KeyValue | None]) -> list[KeyValue]:
    """Records in their original order with `changes` applied in place (None deletes); new keys appended."""
    out = []
    for kv in kvs:
        if kv.key in changes:
            new = changes[kv.key]
            if new is not None:
                out.append(new)
        else:
            out.append(kv)
    present = {kv.key for kv in kvs}
    out.extend(new for key, new in changes.items() if key not in present and new is not None)
    return out
