"""Importance matrices (imatrix) in llama.cpp's two formats: read, write, convert, remap, check.

GGUF imatrix (llama-imatrix's default output; `tools/imatrix/imatrix.cpp`, `save_imatrix`):
    KV  general.type = "imatrix", imatrix.datasets (string array), imatrix.chunk_count (u32),
        imatrix.chunk_size (u32). llama-quantize refuses a GGUF imatrix lacking any imatrix.* key.
    per weight W (names sorted): W.in_sum2 F32 ne=[ne0, n_mat] (raw sums of x^2 per input column,
        one row per matrix: per expert for MUL_MAT_ID weights) and W.counts F32 ne=[1, n_mat]
        (tokens seen; for expert weights the (token, slot) pairs routed to each expert).
    Some builds also write W.in_sum (plain sums, same shape as in_sum2); llama.cpp ignores it.
    llama-imatrix's own .dat -> GGUF merge (`--in-file X.dat -o Y.gguf`) writes every entry with
    n_mat = 1 (in_sum2 [n_expert*ne0, 1], one count): per-expert counts do not exist in a .dat.

Legacy .dat (`save_imatrix_legacy`; the only format ik_llama.cpp's quantizer reads):
    i32 n_entries; per entry: i32 len, name, i32 ncall, i32 nval, f32 values[nval];
    optional trailer: i32 chunk_count, i32 len, dataset name.
    values = (sum / count_e) * ncall, expert-major (n_expert x ne0), where
    ncall = ceil(max(count) / chunk_size) and a never-routed expert stores 1 * ncall; entries with
    no data at all are not written.

llama-quantize normalises GGUF data as sum/count (1.0 where count is 0) and .dat data as
value/ncall, rejects non-finite values, and throws `imatrix size X is different from tensor size
Y for W` unless an entry has exactly ne0 * ne2 values of its weight W (token_embd only logs).

Remapping for a pruned model takes, per expert weight, the kept experts' rows in keep-set order
(and their counts); every other entry is carried over byte for byte.

Arrays are memory-mapped views and every derived entry computes its values only when written, so
memory stays at one entry whatever the size of the file.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGMLQuantizationType, GGUFType, GGUFValueType, Keys

from ggufcarve.errors import BadInput, CarveError
from ggufcarve.events import Counter, Sink, ignore
from ggufcarve.fileio import (
    atomic_outputs,
    check_outputs,
)
from ggufcarve.gguf.container import (
    GGUF_MAGIC,
    KeyValue,
    TensorHeader,
    encode_header,
    pad_to,
    read_file,
)
from ggufcarve.listing import shortened
from ggufcarve.moe.keepset import (
    KeepSet,
    keepset_from_provenance,
)
from ggufcarve.moe.layout import expert_weight_block

FORMATS = ("gguf", "dat")
KEY_TYPE = Keys.General.TYPE  # GGUFType.IMATRIX in an imatrix
KEY_DATASETS = Keys.IMatrix.DATASETS
KEY_CHUNK_COUNT = Keys.IMatrix.CHUNK_COUNT
KEY_CHUNK_SIZE = Keys.IMatrix.CHUNK_SIZE
IMATRIX_KEYS = (KEY_DATASETS, KEY_CHUNK_COUNT, KEY_CHUNK_SIZE)
# A remapped GGUF imatrix carries keepset.provenance_kvs (spelled as in a pruned model, so
# keepset_from_provenance reads either file) and the sha256 of the imatrix it was remapped from.
KEY_REMAP_SOURCE_SHA256 = "ggufcarve.imatrix.source_sha256"
DEFAULT_CHUNK_SIZE = 512  # llama-imatrix's default: -c 512 (and -b 2048 -> 4 sequences of 512)
SUFFIXES = {"in_sum2": ".in_sum2", "counts": ".counts", "in_sum": ".in_sum"}
F32 = int(GGMLQuantizationType.F32)
MAX_NAME_BYTES = 1 << 16


def counts_of(e: ImatrixEntry) -> np.ndarray:
    """The stored counts of a GGUF entry (a .dat entry stores ncall instead)."""
    if e.counts is None:
        raise BadInput(
            f"{e.name}: the imatrix entry has no counts (a .dat imatrix stores ncall instead)",
            "convert the imatrix to GGUF first (ggufcarve imatrix convert)",
        )
    return e.counts


def lround(counts: np.ndarray) -> np.ndarray:
    """Counts as llama.cpp reads them from a GGUF imatrix: std::lround of the stored floats."""
    x = np.asarray(counts, dtype=np.float64)
    return (np.sign(x) * np.floor(np.abs(x) + 0.5)).astype(np.int64)


# ---------------------------------------------------------------------------------------------
# Values


@dataclass(frozen=True, eq=False)
class ImatrixEntry:
    """The statistics of one weight: `n_mat` rows of `row_len` values, one row per matrix.

    GGUF: `sums` are the raw in_sum2 rows, `counts` the per-row counts (float32, as stored).
    .dat: one row of nval values ((sum/count)*ncall, expert-major), `ncall` the entry's call count.
    """

    name: str
    n_mat: int
    row_len: int
    counts: np.ndarray | None  # float32 [n_mat] (GGUF); None for .dat
    ncall: int | None  # .dat only
    load_sums: Callable[[], np.ndarray] = field(repr=False)  # -> float32 [n_mat, row_len]
    load_in_sum: Callable[[], np.ndarray] | None = field(default=None, repr=False)
    # GGUF shapes (ggml ne) as stored, so an untouched entry is written back unchanged.
    sums_ne: tuple[int, ...] | None = None
    counts_ne: tuple[int, ...] | None = None

    @property
    def nval(self) -> int:
        return self.n_mat * self.row_len

    @property
    def has_in_sum(self) -> bool:
        return self.load_in_sum is not None

    @property
    def block(self) -> int | None:
        match = re.match(r"^blk\.(\d+)\.", self.name)
        return int(match[1]) if match else None

    @property
    def is_expert_weight(self) -> bool:
        """Named like an expert weight (llama-imatrix collects these through MUL_MAT_ID)."""
        return expert_weight_block(self.name) is not None

    @property
    def per_expert_counts(self) -> bool:
        return self.counts is not None and self.n_mat > 1

    def sums(self) -> np.ndarray:
        return self.load_sums()

    def normalized(self) -> np.ndarray:
        """The values llama-quantize uses (flat float32): sum/count (1 where count is 0) or value/ncall."""
        sums = self.sums()
        if self.counts is None:
            ncall = self.ncall or 0
            return (sums / np.float32(ncall)).reshape(-1) if ncall > 0 else sums.reshape(-1).copy()
        counts = lround(self.counts).astype(np.float32)
        safe = np.where(counts > 0, counts, np.float32(1))
        out = sums / safe[:, None]
        out[counts <= 0] = np.float32(1)
        return out.reshape(-1).astype(np.float32)


@dataclass(frozen=True)
class RawTensor:
    """A GGUF tensor that is not part of any entry; carried over as bytes."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    load: Callable[[], bytes] = field(repr=False)
    nbytes: int = 0


@dataclass(frozen=True)
class Imatrix:
    """An imatrix file, parsed; values stay on disk until written."""

    format: str  # "gguf" | "dat"
    path: Path | None
    entries: tuple[ImatrixEntry, ...]
    datasets: tuple[str, ...]
    chunk_count: int | None
    chunk_size: int | None  # GGUF only; a .dat does not record it
    # GGUF container details (for byte-exact rewriting)
    version: int = 3
    alignment: int = 32
    kvs: tuple[KeyValue, ...] = ()
    tensor_order: tuple[tuple[str, str], ...] = ()  # (entry or tensor name, "in_sum2"|"counts"|"in_sum"|"raw")
    raw_tensors: tuple[RawTensor, ...] = ()
    # .dat trailer: None (absent), (chunk_count, None) or (chunk_count, dataset bytes)
    dat_trailer: tuple[int, bytes | None] | None = None
    size: int = 0  # bytes on disk, when read from a file

    @property
    def entry_index(self) -> dict[str, ImatrixEntry]:
        return {e.name: e for e in self.entries}

    def get(self, key: str, default: Any = None) -> Any:
        for kv in self.kvs:
            if kv.key == key:
                return kv.value
        return default

    @property
    def remap_keepset(self) -> KeepSet | None:
        """The keep-set a ggufcarve-remapped GGUF imatrix records, if any."""
        if self.format != "gguf":
            return None
        return keepset_from_provenance(self.get, self.path.name if self.path else "the imatrix")


# ---------------------------------------------------------------------------------------------
# Reading


def read_imatrix(path: str | os.PathLike[str]) -> Imatrix:
    """Read a GGUF or legacy .dat imatrix (told apart by the GGUF magic, as llama.cpp does)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        size = path.stat().st_size
    except FileNotFoundError:
        raise BadInput(f"{path}: no such imatrix file", "check the path") from None
    except IsADirectoryError:
        raise BadInput(f"{path}: is a directory, not an imatrix file", "give the .gguf or .dat imatrix") from None
    except PermissionError:
        raise BadInput(f"{path}: permission denied", "check the file's permissions") from None
    if size == 0:
        raise BadInput(f"{path}: empty file, not an imatrix", "give the .gguf or .dat file llama-imatrix wrote")
    imatrix = _read_gguf(path) if magic == GGUF_MAGIC else _read_dat(path, size)
    check_finite(imatrix)
    return imatrix


def _memmap(path: Path) -> np.ndarray:
    return np.memmap(path, dtype=np.uint8, mode="r")


def _f32_view(mm: np.ndarray, offset: int, count: int) -> np.ndarray:
    return np.frombuffer(mm, dtype="<f4", count=count, offset=offset)


def _read_gguf(path: Path) -> Imatrix:
    gf = read_file(path)
    arch = gf.get(Keys.General.ARCHITECTURE)
    kind = gf.get(KEY_TYPE)
    parts: dict[str, dict[str, Any]] = {}
    order: list[tuple[str, str]] = []
    raw: list[RawTensor] = []
    mm = _memmap(path) if gf.tensors else None
    for t in gf.tensors:
        for part, suffix in SUFFIXES.items():
            if t.name.endswith(suffix) and len(t.name) > len(suffix):
                name = t.name[: -len(suffix)]
                parts.setdefault(name, {})[part] = t
                order.append((name, part))
                break
        else:
            start = gf.data_start + t.offset
            raw.append(
                RawTensor(t.name, t.shape, t.type_id, (lambda s=start, n=t.nbytes: bytes(mm[s : s + n])), t.nbytes)
            )
            order.append((t.name, "raw"))

    if not parts:
        if kind not in (None, GGUFType.IMATRIX) or arch is not None:
            raise BadInput(
                f"{path}: a GGUF {kind or 'model'} file{f' ({arch})' if arch else ''}, "
                "not an imatrix (no <weight>.in_sum2 tensors)",
                "give the imatrix file llama-imatrix wrote, not the model",
            )
        raise BadInput(
            f"{path}: GGUF imatrix has no entries (no <weight>.in_sum2 / .counts tensors)",
            "llama-quantize rejects it too ('no data in file'); recompute the imatrix",
        )
    if kind is not None and kind != GGUFType.IMATRIX:
        raise BadInput(f"{path}: general.type is {kind!r}, not 'imatrix'", "give the imatrix file llama-imatrix wrote")
    missing = [k for k in IMATRIX_KEYS if k not in gf.kv_index]
    if missing:
        raise BadInput(
            f"{path}: GGUF imatrix lacks {', '.join(missing)}; llama-quantize rejects it ('missing imatrix metadata')",
            "recompute it with a current llama-imatrix, or convert a .dat with `ggufcarve imatrix convert`",
        )
    _check_kv_type(gf.kv_index[KEY_DATASETS], GGUFValueType.ARRAY, path, GGUFValueType.STRING)
    _check_kv_type(gf.kv_index[KEY_CHUNK_COUNT], GGUFValueType.UINT32, path)
    _check_kv_type(gf.kv_index[KEY_CHUNK_SIZE], GGUFValueType.UINT32, path)

    entries = []
    for name, found in parts.items():
        if "in_sum2" not in found or "counts" not in found:
            have = next(iter(found))
            raise BadInput(
                f"{path}: entry {name} has {name}{SUFFIXES[have]} but no "
                f"{name}{SUFFIXES['counts' if 'counts' not in found else 'in_sum2']}",
                "llama-quantize rejects it ('mismatched sums and counts'); the file is corrupt",
            )
        sums_t, counts_t, in_sum_t = found["in_sum2"], found["counts"], found.get("in_sum")
        for t in (sums_t, counts_t, in_sum_t):
            if t is not None and t.type_id != F32:
                raise BadInput(
                    f"{path}: {t.name} is {t.type_name}, not F32",
                    "llama-quantize reads only F32 imatrix tensors; the file is corrupt",
                )
        n_mat = counts_t.n_elements
        nval = sums_t.n_elements
        if n_mat < 1 or nval < 1 or nval % n_mat:
            raise BadInput(
                f"{path}: {sums_t.name} has {nval} values, not a whole number of rows for its {n_mat} counts",
                "the file is corrupt",
            )
        if in_sum_t is not None and in_sum_t.n_elements != nval:
            raise BadInput(
                f"{path}: {in_sum_t.name} has {in_sum_t.n_elements} values, {sums_t.name} has {nval}",
                "the file is corrupt",
            )
        row_len = nval // n_mat
        counts = np.array(_f32_view(mm, gf.data_start + counts_t.offset, n_mat), dtype=np.float32)
        s_off = gf.data_start + sums_t.offset
        load_sums = lambda o=s_off, n=n_mat, r=row_len: _f32_view(mm, o, n * r).reshape(n, r)
        load_in_sum = None
        if in_sum_t is not None:
            i_off = gf.data_start + in_sum_t.offset
            load_in_sum = lambda o=i_off, n=n_mat, r=row_len: _f32_view(mm, o, n * r).reshape(n, r)
        entries.append(
            ImatrixEntry(name, n_mat, row_len, counts, None, load_sums, load_in_sum, sums_t.shape, counts_t.shape)
        )

    return Imatrix(
        format="gguf",
        path=path,
        entries=tuple(entries),
        datasets=tuple(gf.get(KEY_DATASETS) or ()),
        chunk_count=int(gf.get(KEY_CHUNK_COUNT)),
        chunk_size=int(gf.get(KEY_CHUNK_SIZE)),
        version=gf.version,
        alignment=gf.alignment,
        kvs=tuple(gf.kvs),
        tensor_order=tuple(order),
        raw_tensors=tuple(raw),
        size=gf.size,
    )


def _check_kv_type(kv: KeyValue, value_type: int, path: Path, item_type: int | None = None) -> None:
    if kv.value_type != value_type or (item_type is not None and kv.item_type != item_type):
        want = GGUFValueType(value_type).name.lower() + (
            f" of {GGUFValueType(item_type).name.lower()}" if item_type is not None else ""
        )
        raise BadInput(
            f"{path}: key {kv.key} is not a {want}",
            "llama.cpp type-checks these keys (and aborts on a mismatch); the file is corrupt",
        )


class _DatCursor:
    def __init__(self, mm: np.ndarray, path: Path, size: int) -> None:
        self.mm, self.path, self.size, self.pos = mm, path, size, 0

    def need(self, n: int, what: str) -> None:
        if self.pos + n > self.size:
            raise BadInput(
                f"{self.path}: truncated or corrupt .dat imatrix: {what} at byte "
                f"{self.pos} runs past the end of the file ({self.size} bytes)",
                "re-copy the file, or recompute it with llama-imatrix",
            )

    def i32(self, what: str) -> int:
        self.need(4, what)
        value = struct.unpack_from("<i", self.mm, self.pos)[0]
        self.pos += 4
        return value

    def take(self, n: int, what: str) -> bytes:
        self.need(n, what)
        data = bytes(self.mm[self.pos : self.pos + n])
        self.pos += n
        return data


def _read_dat(path: Path, size: int) -> Imatrix:
    mm = _memmap(path)
    cur = _DatCursor(mm, path, size)
    not_imatrix = "it is neither a GGUF imatrix nor a legacy .dat imatrix"
    n_entries = cur.i32("entry count")
    if n_entries < 1 or n_entries * 12 > size:
        raise BadInput(
            f"{path}: {not_imatrix} (entry count {n_entries} at byte 0)",
            "give the .gguf or .dat file llama-imatrix wrote",
        )
    entries: list[ImatrixEntry] = []
    seen: set[str] = set()
    for i in range(n_entries):
        length = cur.i32(f"name length of entry #{i}")
        if not 0 < length <= MAX_NAME_BYTES:
            raise BadInput(
                f"{path}: entry #{i} at byte {cur.pos - 4} has a name length of {length}; {not_imatrix}",
                "the file is corrupt or not an imatrix",
            )
        raw_name = cur.take(length, f"name of entry #{i}")
        try:
            name = raw_name.decode("utf-8")
        except UnicodeDecodeError:
            raise BadInput(
                f"{path}: name of entry #{i} at byte {cur.pos - length} is not UTF-8; {not_imatrix}",
                "the file is corrupt or not an imatrix",
            ) from None
        if name in seen:
            raise BadInput(f"{path}: entry {name} appears twice", "the file is corrupt")
        seen.add(name)
        ncall = cur.i32(f"ncall of {name}")
        nval = cur.i32(f"value count of {name}")
        if nval < 1:
            raise BadInput(
                f"{path}: entry {name} has {nval} values",
                "llama-quantize rejects it ('failed reading number of values'); the file is corrupt",
            )
        offset = cur.pos
        cur.need(4 * nval, f"{nval} values of {name}")
        cur.pos += 4 * nval
        entries.append(
            ImatrixEntry(name, 1, nval, None, ncall, lambda o=offset, n=nval: _f32_view(mm, o, n).reshape(1, n))
        )

    trailer: tuple[int, bytes | None] | None = None
    if cur.pos < size:
        start = cur.pos
        chunk_count = cur.i32("chunk count (trailer)")
        dataset = None
        if cur.pos < size:
            length = cur.i32("dataset name length (trailer)")
            if length < 0:
                raise BadInput(
                    f"{path}: trailer at byte {start} has a dataset name length of {length}", "the file is corrupt"
                )
            dataset = cur.take(length, "dataset name (trailer)")
        if cur.pos != size:
            raise BadInput(
                f"{path}: {size - cur.pos} unexpected bytes after the trailer at byte {cur.pos}",
                "the file is corrupt or two files were concatenated",
            )
        trailer = (chunk_count, dataset)
    datasets = (trailer[1].decode("utf-8", errors="replace"),) if trailer and trailer[1] else ()
    return Imatrix(
        format="dat",
        path=path,
        entries=tuple(entries),
        datasets=datasets,
        chunk_count=trailer[0] if trailer else None,
        chunk_size=None,
        dat_trailer=trailer,
        size=size,
    )


def check_finite(imatrix: Imatrix) -> None:
    """llama-quantize throws on a non-finite value; so do we, naming every bad entry."""
    bad = []
    for e in imatrix.entries:
        sums = e.sums()
        problems = []
        if not np.isfinite(sums).all():
            index = int(np.flatnonzero(~np.isfinite(sums.reshape(-1)))[0])
            problems.append(f"value {sums.reshape(-1)[index]} at index {index}")
        if e.counts is not None and (not np.isfinite(e.counts).all() or (e.counts < 0).any()):
            problems.append("negative or non-finite counts")
        if e.load_in_sum is not None and not np.isfinite(e.load_in_sum()).all():
            problems.append("non-finite in_sum")
        if problems:
            bad.append(f"{e.name} ({', '.join(problems)})")
    if bad:
        raise BadInput(
            f"{imatrix.path}: non-finite imatrix data in {len(bad)} entr{'y' if len(bad) == 1 else 'ies'}: "
            + shortened(bad, 4),
            "llama-quantize rejects it ('imatrix contains non-finite value'); recompute the imatrix",
        )


# ---------------------------------------------------------------------------------------------
# Writing


def ggml_ne(*dims: int) -> tuple[int, ...]:
    """A shape as gguf writes it: trailing 1-sized dimensions dropped (ggml_n_dims), at least one."""
    dims_list = list(dims)
    while len(dims_list) > 1 and dims_list[-1] == 1:
        dims_list.pop()
    return tuple(dims_list)


def _entry_shapes(e: ImatrixEntry) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """llama-imatrix writes in_sum2 as [ne0, n_mat] and counts as [1, n_mat] (1-D when n_mat is 1)."""
    sums_ne = e.sums_ne if e.sums_ne is not None else ggml_ne(e.row_len, e.n_mat)
    counts_ne = e.counts_ne if e.counts_ne is not None else ggml_ne(1, e.n_mat)
    return sums_ne, counts_ne


def _gguf_tensors(imatrix: Imatrix) -> list[tuple[TensorHeader, Callable[[], bytes]]]:
    entries = imatrix.entry_index
    raws = {t.name: t for t in imatrix.raw_tensors}

    def sums_bytes(e: ImatrixEntry) -> bytes:
        return np.ascontiguousarray(e.sums(), dtype="<f4").tobytes()

    result = []
    for name, part in imatrix.tensor_order:
        if part == "raw":
            t = raws[name]
            result.append((TensorHeader(t.name, t.shape, t.type_id, t.nbytes), t.load))
            continue
        e = entries[name]
        sums_ne, counts_ne = _entry_shapes(e)
        if part == "in_sum2":
            result.append((TensorHeader(name + SUFFIXES[part], sums_ne, F32, 4 * e.nval), lambda e=e: sums_bytes(e)))
        elif part == "in_sum":
            result.append(
                (
                    TensorHeader(name + SUFFIXES[part], sums_ne, F32, 4 * e.nval),
                    lambda e=e: np.ascontiguousarray(e.load_in_sum(), dtype="<f4").tobytes(),
                )
            )  # type: ignore[misc]
        else:
            result.append(
                (
                    TensorHeader(name + SUFFIXES[part], counts_ne, F32, 4 * e.n_mat),
                    lambda e=e: np.ascontiguousarray(counts_of(e), dtype="<f4").tobytes(),
                )
            )
    return result


def encoded_size(imatrix: Imatrix) -> int:
    """Bytes the file will take when written."""
    if imatrix.format == "dat":
        size = 4 + sum(12 + len(e.name.encode()) + 4 * e.nval for e in imatrix.entries)
        if imatrix.dat_trailer is not None:
            size += 4 + (4 + len(imatrix.dat_trailer[1]) if imatrix.dat_trailer[1] is not None else 0)
        return size
    tensors = _gguf_tensors(imatrix)
    header, _ = encode_header(imatrix.version, imatrix.kvs, [h for h, _ in tensors], imatrix.alignment)
    return len(header) + sum(pad_to(h.nbytes, imatrix.alignment) for h, _ in tensors)


def _write_all(fd: int, data: bytes | memoryview, progress: Callable[[int], None]) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
        progress(n)


def write_to_fd(imatrix: Imatrix, fd: int, progress: Callable[[int], None] = lambda n: None) -> int:
    """Write the file sequentially to `fd`, one entry's values in memory at a time; returns bytes written."""
    written = [0]

    def put(data: bytes | memoryview) -> None:
        _write_all(fd, data, progress)
        written[0] += len(data)

    if imatrix.format == "gguf":
        tensors = _gguf_tensors(imatrix)
        header, _ = encode_header(imatrix.version, imatrix.kvs, [h for h, _ in tensors], imatrix.alignment)
        put(header)
        for h, load in tensors:
            data = load()
            if len(data) != h.nbytes:
                raise CarveError(f"internal error: {h.name} produced {len(data)} bytes, expected {h.nbytes}")
            put(data)
            put(bytes(pad_to(h.nbytes, imatrix.alignment) - h.nbytes))
        return written[0]

    put(struct.pack("<i", len(imatrix.entries)))
    for e in imatrix.entries:
        raw_name = e.name.encode("utf-8")
        put(struct.pack("<i", len(raw_name)) + raw_name + struct.pack("<ii", e.ncall or 0, e.nval))
        put(np.ascontiguousarray(e.sums(), dtype="<f4").tobytes())
    if imatrix.dat_trailer is not None:
        chunk_count, dataset = imatrix.dat_trailer
        put(struct.pack("<i", chunk_count))
        if dataset is not None:
            put(struct.pack("<i", len(dataset)) + dataset)
    return written[0]


def write_imatrix(
    imatrix: Imatrix,
    output: str | os.PathLike[str],
    *,
    force: bool = False,
    sources: Sequence[Path] = (),
    on_event: Sink = ignore,
) -> Path:
    """Write under a temp name beside `output`, fsync, rename; refuses to overwrite without force."""
    output = Path(output)
    size = encoded_size(imatrix)
    check_outputs([output], [*([imatrix.path] if imatrix.path else []), *sources], size, force)
    with atomic_outputs([output]) as opened:
        ((_, fd),) = opened
        written = write_to_fd(imatrix, fd, Counter(on_event, "write", size))
        if written != size:
            raise CarveError(f"internal error: wrote {written} bytes, planned {size}")
    return output
