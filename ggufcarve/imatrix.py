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

import dataclasses
import json
import os
import re
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from gguf.constants import GGMLQuantizationType, GGUFValueType

from ggufcarve import __version__
from ggufcarve.container import (
    GGUF_MAGIC,
    GGUFModel,
    KeyValue,
    TensorHeader,
    encode_header,
    make_kv,
    pad_to,
    read_file,
    replace_kvs,
)
from ggufcarve.errors import BadInput, CarveError
from ggufcarve.fileio import (
    atomic_outputs,
    check_report_slot,
    check_outputs,
    sha256_file,
    write_text_atomic,
)
from ggufcarve.keepset import KEY_KEPT_COUNT, KEY_KEPT_EXPERTS, KEY_SOURCE_EXPERT_COUNT, KeepSet, check_keepset, keepset_from_provenance, provenance_kvs
from ggufcarve.moe import MoeLayout

FORMATS = ("gguf", "dat")
KEY_TYPE = "general.type"
KEY_DATASETS = "imatrix.datasets"
KEY_CHUNK_COUNT = "imatrix.chunk_count"
KEY_CHUNK_SIZE = "imatrix.chunk_size"
IMATRIX_KEYS = (KEY_DATASETS, KEY_CHUNK_COUNT, KEY_CHUNK_SIZE)
# A remapped GGUF imatrix carries keepset.provenance_kvs (spelled as in a pruned model, so
# keepset_from_provenance reads either file) and the sha256 of the imatrix it was remapped from.
KEY_REMAP_SOURCE_SHA256 = "ggufcarve.imatrix.source_sha256"
DEFAULT_CHUNK_SIZE = 512  # llama-imatrix's default: -c 512 (and -b 2048 -> 4 sequences of 512)
REPORT_NAME = "imatrix-remap-report.json"
REPORT_SCHEMA_VERSION = 1
SUFFIXES = {"in_sum2": ".in_sum2", "counts": ".counts", "in_sum": ".in_sum"}
F32 = int(GGMLQuantizationType.F32)
# An expert weight as llama-imatrix names its entry (MUL_MAT_ID src0).
EXPERT_ENTRY = re.compile(r"^blk\.(?P<block>\d+)\.ffn_(?:gate|up|down|gate_up)_exps\.weight$")
MAX_NAME_BYTES = 1 << 16


def _ignore(_: int) -> None:
    pass


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
        return EXPERT_ENTRY.match(self.name) is not None

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
    arch = gf.get("general.architecture")
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
            raw.append(RawTensor(t.name, t.shape, t.type_id, (lambda s=start, n=t.nbytes: bytes(mm[s : s + n])), t.nbytes))
            order.append((t.name, "raw"))

    if not parts:
        if kind not in (None, "imatrix") or arch is not None:
            raise BadInput(
                f"{path}: a GGUF {kind or 'model'} file{f' ({arch})' if arch else ''}, not an imatrix (no <weight>.in_sum2 tensors)",
                "give the imatrix file llama-imatrix wrote, not the model",
            )
        raise BadInput(f"{path}: GGUF imatrix has no entries (no <weight>.in_sum2 / .counts tensors)", "llama-quantize rejects it too ('no data in file'); recompute the imatrix")
    if kind is not None and kind != "imatrix":
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
                f"{path}: entry {name} has {name}{SUFFIXES[have]} but no {name}{SUFFIXES['counts' if 'counts' not in found else 'in_sum2']}",
                "llama-quantize rejects it ('mismatched sums and counts'); the file is corrupt",
            )
        sums_t, counts_t, in_sum_t = found["in_sum2"], found["counts"], found.get("in_sum")
        for t in (sums_t, counts_t, in_sum_t):
            if t is not None and t.type_id != F32:
                raise BadInput(f"{path}: {t.name} is {t.type_name}, not F32", "llama-quantize reads only F32 imatrix tensors; the file is corrupt")
        n_mat = counts_t.n_elements
        nval = sums_t.n_elements
        if n_mat < 1 or nval < 1 or nval % n_mat:
            raise BadInput(
                f"{path}: {sums_t.name} has {nval} values, not a whole number of rows for its {n_mat} counts",
                "the file is corrupt",
            )
        if in_sum_t is not None and in_sum_t.n_elements != nval:
            raise BadInput(f"{path}: {in_sum_t.name} has {in_sum_t.n_elements} values, {sums_t.name} has {nval}", "the file is corrupt")
        row_len = nval // n_mat
        counts = np.array(_f32_view(mm, gf.data_start + counts_t.offset, n_mat), dtype=np.float32)
        s_off = gf.data_start + sums_t.offset
        load_sums = lambda o=s_off, n=n_mat, r=row_len: _f32_view(mm, o, n * r).reshape(n, r)
        load_in_sum = None
        if in_sum_t is not None:
            i_off = gf.data_start + in_sum_t.offset
            load_in_sum = lambda o=i_off, n=n_mat, r=row_len: _f32_view(mm, o, n * r).reshape(n, r)
        entries.append(ImatrixEntry(name, n_mat, row_len, counts, None, load_sums, load_in_sum, sums_t.shape, counts_t.shape))

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
        want = GGUFValueType(value_type).name.lower() + (f" of {GGUFValueType(item_type).name.lower()}" if item_type is not None else "")
        raise BadInput(f"{path}: key {kv.key} is not a {want}", "llama.cpp type-checks these keys (and aborts on a mismatch); the file is corrupt")


class _DatCursor:
    def __init__(self, mm: np.ndarray, path: Path, size: int) -> None:
        self.mm, self.path, self.size, self.pos = mm, path, size, 0

    def need(self, n: int, what: str) -> None:
        if self.pos + n > self.size:
            raise BadInput(
                f"{self.path}: truncated or corrupt .dat imatrix: {what} at byte {self.pos} runs past the end of the file ({self.size} bytes)",
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
        raise BadInput(f"{path}: {not_imatrix} (entry count {n_entries} at byte 0)", "give the .gguf or .dat file llama-imatrix wrote")
    entries: list[ImatrixEntry] = []
    seen: set[str] = set()
    for i in range(n_entries):
        length = cur.i32(f"name length of entry #{i}")
        if not 0 < length <= MAX_NAME_BYTES:
            raise BadInput(f"{path}: entry #{i} at byte {cur.pos - 4} has a name length of {length}; {not_imatrix}", "the file is corrupt or not an imatrix")
        raw_name = cur.take(length, f"name of entry #{i}")
        try:
            name = raw_name.decode("utf-8")
        except UnicodeDecodeError:
            raise BadInput(f"{path}: name of entry #{i} at byte {cur.pos - length} is not UTF-8; {not_imatrix}", "the file is corrupt or not an imatrix") from None
        if name in seen:
            raise BadInput(f"{path}: entry {name} appears twice", "the file is corrupt")
        seen.add(name)
        ncall = cur.i32(f"ncall of {name}")
        nval = cur.i32(f"value count of {name}")
        if nval < 1:
            raise BadInput(f"{path}: entry {name} has {nval} values", "llama-quantize rejects it ('failed reading number of values'); the file is corrupt")
        offset = cur.pos
        cur.need(4 * nval, f"{nval} values of {name}")
        cur.pos += 4 * nval
        entries.append(ImatrixEntry(name, 1, nval, None, ncall, lambda o=offset, n=nval: _f32_view(mm, o, n).reshape(1, n)))

    trailer: tuple[int, bytes | None] | None = None
    if cur.pos < size:
        start = cur.pos
        chunk_count = cur.i32("chunk count (trailer)")
        dataset = None
        if cur.pos < size:
            length = cur.i32("dataset name length (trailer)")
            if length < 0:
                raise BadInput(f"{path}: trailer at byte {start} has a dataset name length of {length}", "the file is corrupt")
            dataset = cur.take(length, "dataset name (trailer)")
        if cur.pos != size:
            raise BadInput(f"{path}: {size - cur.pos} unexpected bytes after the trailer at byte {cur.pos}", "the file is corrupt or two files were concatenated")
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
            f"{imatrix.path}: non-finite imatrix data in {len(bad)} entr{'y' if len(bad) == 1 else 'ies'}: " + "; ".join(bad[:4]) + (f" (+{len(bad) - 4} more)" if len(bad) > 4 else ""),
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
            result.append((TensorHeader(name + SUFFIXES[part], sums_ne, F32, 4 * e.nval), lambda e=e: np.ascontiguousarray(e.load_in_sum(), dtype="<f4").tobytes()))  # type: ignore[misc]
        else:
            assert e.counts is not None
            result.append((TensorHeader(name + SUFFIXES[part], counts_ne, F32, 4 * e.n_mat), lambda e=e: np.ascontiguousarray(e.counts, dtype="<f4").tobytes()))
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


def write_to_fd(imatrix: Imatrix, fd: int, progress: Callable[[int], None] = _ignore) -> int:
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


def write_imatrix(imatrix: Imatrix, output: str | os.PathLike[str], *, force: bool = False, sources: Sequence[Path] = (), progress: Callable[[int], None] = _ignore) -> Path:
    """Write under a temp name beside `output`, fsync, rename; refuses to overwrite without force."""
    output = Path(output)
    size = encoded_size(imatrix)
    check_outputs([output], [*([imatrix.path] if imatrix.path else []), *sources], size, force)
    with atomic_outputs([output]) as opened:
        (_, fd), = opened
        written = write_to_fd(imatrix, fd, progress)
        if written != size:
            raise CarveError(f"internal error: wrote {written} bytes, planned {size}")
    return output


# ---------------------------------------------------------------------------------------------
# Conversion


@dataclass(frozen=True)
class Conversion:
    imatrix: Imatrix
    losses: tuple[str, ...]  # what the target format cannot hold
    skipped: tuple[str, ...]  # entries not written (no data at all), as llama-imatrix skips them


def to_dat(imatrix: Imatrix) -> Conversion:
    """GGUF -> legacy .dat exactly as llama-imatrix's save_imatrix_legacy writes it from the same data."""
    if imatrix.format == "dat":
        return Conversion(imatrix, (), ())
    chunk_size = imatrix.chunk_size or 0
    if chunk_size <= 0:
        raise BadInput(f"{imatrix.path}: imatrix.chunk_size is {chunk_size}; the .dat ncall cannot be computed", "the file is corrupt")
    entries, skipped = [], []
    for e in imatrix.entries:
        assert e.counts is not None
        counts = lround(e.counts)
        if not counts.any():
            skipped.append(e.name)
            continue
        ncall = int((int(counts.max()) + chunk_size - 1) // chunk_size)

        def load(e: ImatrixEntry = e, counts: np.ndarray = counts, ncall: int = ncall) -> np.ndarray:
            sums = np.array(e.sums(), dtype=np.float32)
            c = counts.astype(np.float32)
            zero = c == 0
            sums[zero] = np.float32(1)  # "store 1 for partial data"
            c[zero] = np.float32(1)
            return ((sums / c[:, None]) * np.float32(ncall)).astype(np.float32).reshape(1, -1)

        entries.append(ImatrixEntry(e.name, 1, e.nval, None, ncall, load))
    losses = []
    if any(e.per_expert_counts for e in imatrix.entries):
        losses.append("per-expert counts (routing frequencies): a .dat stores one ncall per entry")
    if any(e.has_in_sum for e in imatrix.entries):
        losses.append("the <weight>.in_sum tensors")
    if len(imatrix.datasets) > 1:
        losses.append(f"datasets other than the last ({len(imatrix.datasets) - 1})")
    if imatrix.chunk_size:
        losses.append(f"imatrix.chunk_size ({imatrix.chunk_size}): give --chunk-size {imatrix.chunk_size} when converting back")
    extra_keys = [kv.key for kv in imatrix.kvs if kv.key not in (KEY_TYPE, *IMATRIX_KEYS)]
    if extra_keys:
        losses.append(f"metadata keys {', '.join(extra_keys[:4])}" + (f" (+{len(extra_keys) - 4} more)" if len(extra_keys) > 4 else ""))
    if imatrix.raw_tensors:
        losses.append(f"{len(imatrix.raw_tensors)} tensors that are not imatrix entries")
    dataset = imatrix.datasets[-1].encode("utf-8") if imatrix.datasets else b""
    result = Imatrix(
        format="dat",
        path=None,
        entries=tuple(entries),
        datasets=imatrix.datasets[-1:],
        chunk_count=imatrix.chunk_count,
        chunk_size=None,
        dat_trailer=(int(imatrix.chunk_count or 0), dataset),
    )
    return Conversion(result, tuple(losses), tuple(skipped))


def to_gguf(imatrix: Imatrix, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Conversion:
    """Legacy .dat -> GGUF as llama-imatrix merges one (`--in-file X.dat -o Y.gguf`): values x chunk_size,
    one count of ncall x chunk_size per entry, so llama-quantize normalises to the same value/ncall."""
    if imatrix.format == "gguf":
        return Conversion(imatrix, (), ())
    if chunk_size <= 0:
        raise BadInput(f"chunk size {chunk_size} must be positive", "use the -c/--ctx-size the imatrix was computed with (llama-imatrix default 512)")
    entries = []
    for e in imatrix.entries:
        ncall = e.ncall or 0
        count = np.array([np.float32(ncall * chunk_size)], dtype=np.float32)

        def load(e: ImatrixEntry = e) -> np.ndarray:
            return (e.sums() * np.float32(chunk_size)).astype(np.float32)

        entries.append(ImatrixEntry(e.name, 1, e.nval, count, None, load))
    chunk_count = imatrix.chunk_count if imatrix.chunk_count is not None else max((e.ncall or 0) for e in imatrix.entries)
    kvs = (
        make_kv(KEY_TYPE, GGUFValueType.STRING, "imatrix"),
        make_kv(KEY_DATASETS, GGUFValueType.ARRAY, list(imatrix.datasets), GGUFValueType.STRING),
        make_kv(KEY_CHUNK_COUNT, GGUFValueType.UINT32, int(chunk_count)),
        make_kv(KEY_CHUNK_SIZE, GGUFValueType.UINT32, int(chunk_size)),
    )
    order = tuple((e.name, part) for e in entries for part in ("in_sum2", "counts"))
    result = Imatrix("gguf", None, tuple(entries), imatrix.datasets, int(chunk_count), int(chunk_size), kvs=kvs, tensor_order=order)
    return Conversion(result, (), ())


def convert(imatrix: Imatrix, fmt: str, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Conversion:
    if fmt not in FORMATS:
        raise BadInput(f"unknown imatrix format {fmt!r}", "use gguf or dat")
    return to_dat(imatrix) if fmt == "dat" else to_gguf(imatrix, chunk_size)


# ---------------------------------------------------------------------------------------------
# Checking against a model


@dataclass(frozen=True)
class ModelCheck:
    problems: tuple[str, ...]  # each would make llama-quantize fail, or shows the wrong model
    warnings: tuple[str, ...]
    missing: tuple[str, ...]  # model weight matrices without an entry


def expected_sizes(model: GGUFModel) -> dict[str, int]:
    """The entry size llama-quantize accepts for each tensor: ne[0] * ne[2]."""
    return {t.name: t.shape[0] * (t.shape[2] if len(t.shape) > 2 else 1) for t in model.tensors}


def check_against_model(imatrix: Imatrix, model: GGUFModel, *, sizes: Mapping[str, int] | None = None) -> ModelCheck:
    """llama-quantize's per-tensor check, for every entry at once: the weight exists and the entry
    has ne0 * ne2 values (`imatrix size X is different from tensor size Y for W`)."""
    sizes = dict(sizes) if sizes is not None else expected_sizes(model)
    problems, warnings = [], []
    for e in imatrix.entries:
        if e.name not in sizes:
            problems.append(f"{e.name} is not a tensor of {model.path.name}")
            continue
        if e.nval != sizes[e.name]:
            message = f"imatrix size {e.nval} is different from tensor size {sizes[e.name]} for {e.name}"
            (warnings if e.name == "token_embd.weight" else problems).append(message)
    # weight matrices of blocks the imatrix has no entry for at all (MTP blocks: never run by llama-imatrix)
    covered = {e.block for e in imatrix.entries}
    missing = tuple(
        t.name for t in model.tensors
        if len(t.shape) >= 2 and t.name.endswith(".weight") and (m := re.match(r"^blk\.(\d+)\.", t.name)) and int(m[1]) not in covered
    )
    if missing:
        blocks = sorted({int(n.split(".")[1]) for n in missing})
        warnings.append(
            f"block(s) {', '.join(map(str, blocks))} of {model.path.name} have no imatrix entries (llama-imatrix never runs MTP blocks); "
            f"IQ1/IQ2/IQ3_XXS targets fail on their {len(missing)} weight matrices ('Missing importance matrix'): give them a --tensor-type override such as blk\\.{blocks[0]}\\.=q4_K"
        )
    recorded = imatrix.remap_keepset
    if recorded is not None:
        pruned_with = keepset_from_provenance(model.get, model.path.name)
        if pruned_with is not None and pruned_with.layers != recorded.layers:
            differ = sorted(b for b in set(recorded.layers) | set(pruned_with.layers) if recorded.layers.get(b) != pruned_with.layers.get(b))
            problems.append(f"the imatrix was remapped with another keep-set than {model.path.name} was pruned with (blocks {', '.join(map(str, differ))} differ)")
    return ModelCheck(tuple(problems), tuple(warnings), missing)


def raise_problems(problems: Sequence[str], where: str, hint: str) -> None:
    if problems:
        shown = "; ".join(problems[:6]) + (f" (+{len(problems) - 6} more)" if len(problems) > 6 else "")
        raise BadInput(f"{where}: {len(problems)} problem{'s' if len(problems) > 1 else ''}: {shown}", hint)


# ---------------------------------------------------------------------------------------------
# Remapping


@dataclass(frozen=True)
class TensorRemap:
    name: str
    block: int
    mtp: bool
    experts_before: int
    kept: tuple[int, ...]
    dropped: tuple[int, ...]
    routed_kept: int | None  # (token, slot) pairs routed to kept experts; None without per-expert counts
    routed_dropped: int | None


@dataclass(frozen=True)
class RemapPlan:
    source: Imatrix
    output: Imatrix  # values computed when written
    output_path: Path
    output_format: str
    keepset: KeepSet
    layout: MoeLayout  # of the source model (expert_count = experts before pruning)
    kept_count: int
    tensors: tuple[TensorRemap, ...]
    unchanged: tuple[str, ...]
    blocks_without_entries: tuple[int, ...]
    losses: tuple[str, ...]
    skipped: tuple[str, ...]
    warnings: tuple[str, ...]
    models: dict[str, dict[str, Any]]  # "pruned" / "source" -> path, architecture, expert_count
    chunk_size: int

    @property
    def routing(self) -> dict[str, Any]:
        """Share of the calibration's (token, slot) routing the kept experts received, over MoE blocks."""
        per_block: dict[int, TensorRemap] = {}
        for t in self.tensors:
            if t.routed_kept is not None:
                per_block.setdefault(t.block, t)
        if not per_block:
            return {"available": False, "reason": "the imatrix has no per-expert counts (a .dat, or converted from one)"}
        kept = sum(t.routed_kept or 0 for t in per_block.values())
        dropped = sum(t.routed_dropped or 0 for t in per_block.values())
        total = kept + dropped
        return {
            "available": True,
            "routed_total": total,
            "routed_kept": kept,
            "routed_dropped": dropped,
            "share_kept": kept / total if total else None,
            "blocks": [
                {"block": b, "mtp": t.mtp, "routed_kept": t.routed_kept, "routed_dropped": t.routed_dropped, "share_kept": (t.routed_kept or 0) / max((t.routed_kept or 0) + (t.routed_dropped or 0), 1)}
                for b, t in sorted(per_block.items())
            ],
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "input": {"path": str(self.source.path), "format": self.source.format, "entries": len(self.source.entries)},
            "output": {"path": str(self.output_path), "format": self.output_format, "entries": len(self.output.entries), "bytes": encoded_size(self.output)},
            "expert_count": {"before": self.layout.expert_count, "after": self.kept_count},
            "tensors_remapped": [t.name for t in self.tensors],
            "entries_unchanged": list(self.unchanged),
            "blocks_without_entries": list(self.blocks_without_entries),
            "routing": self.routing,
            "losses": list(self.losses),
            "entries_skipped": list(self.skipped),
            "warnings": list(self.warnings),
        }


def _select(e: ImatrixEntry, ids: Sequence[int], n_expert: int, ne0: int) -> ImatrixEntry:
    """The entry with only experts `ids` (in that order): rows of a per-expert entry, slices of a flat one."""
    index = np.asarray(ids, dtype=np.int64)
    if e.n_mat == n_expert and e.row_len == ne0:
        counts = None if e.counts is None else e.counts[index].astype(np.float32)
        sums_ne = None if e.sums_ne is None else ggml_ne(ne0, len(ids))
        counts_ne = None if e.counts_ne is None else ggml_ne(1, len(ids))

        def load() -> np.ndarray:
            return np.ascontiguousarray(e.sums()[index])

        load_in_sum = None
        if e.load_in_sum is not None:
            src_in_sum = e.load_in_sum
            load_in_sum = lambda: np.ascontiguousarray(src_in_sum()[index])
        return dataclasses.replace(e, n_mat=len(ids), counts=counts, load_sums=load, load_in_sum=load_in_sum, sums_ne=sums_ne, counts_ne=counts_ne)
    # one row holding all experts (.dat, or a GGUF converted from one): expert-major slices
    assert e.n_mat == 1 and e.row_len == n_expert * ne0

    def load_flat() -> np.ndarray:
        return np.ascontiguousarray(e.sums().reshape(n_expert, ne0)[index].reshape(1, -1))

    load_in_sum = None
    if e.load_in_sum is not None:
        src_in_sum = e.load_in_sum
        load_in_sum = lambda: np.ascontiguousarray(src_in_sum().reshape(n_expert, ne0)[index].reshape(1, -1))
    sums_ne = None if e.sums_ne is None else ggml_ne(len(ids) * ne0, 1)
    return dataclasses.replace(e, row_len=len(ids) * ne0, load_sums=load_flat, load_in_sum=load_in_sum, sums_ne=sums_ne)


def imatrix_expert_count(imatrix: Imatrix, ne0: Mapping[str, int]) -> dict[str, int]:
    """Experts per expert entry as the file holds them: GGUF rows, or .dat values / ne0."""
    result = {}
    for e in imatrix.entries:
        if e.name not in ne0:
            continue
        if e.n_mat > 1:
            result[e.name] = e.n_mat
        elif e.nval % ne0[e.name] == 0:
            result[e.name] = e.nval // ne0[e.name]
    return result


def resolve_source_layout(
    imatrix: Imatrix,
    pruned: GGUFModel | None,
    pruned_layout: MoeLayout | None,
    source_layout: MoeLayout | None,
) -> MoeLayout:
    """The layout of the unpruned model the keep-set selects from.

    From --source-model when given; else the pruned model's layout with expert_count set to the
    source's, read from its ggufcarve.source.expert_count key or, failing that, from the imatrix.
    """
    recorded = pruned.get(KEY_SOURCE_EXPERT_COUNT) if pruned is not None else None
    if source_layout is not None:
        if recorded is not None and int(recorded) != source_layout.expert_count:
            raise BadInput(
                f"{pruned.path if pruned else 'the pruned model'} was pruned from a {int(recorded)}-expert model ({KEY_SOURCE_EXPERT_COUNT}), the source model has {source_layout.expert_count}",
                "give the source model the pruned model was made from",
            )
        return source_layout
    assert pruned is not None and pruned_layout is not None
    if recorded is not None:
        return dataclasses.replace(pruned_layout, expert_count=int(recorded))
    ne0 = {t.name: t.shape[0] for t in pruned_layout.expert_tensors.values() if t.role == "expert weight"}
    found = sorted(set(imatrix_expert_count(imatrix, ne0).values()))
    if len(found) != 1:
        raise BadInput(
            f"{pruned.path} does not record the source expert count (no {KEY_SOURCE_EXPERT_COUNT}) and the imatrix entries give {found or 'none'}",
            "pass --source-model with the unpruned model",
        )
    return dataclasses.replace(pruned_layout, expert_count=found[0])


def plan_remap(
    imatrix: Imatrix,
    keepset: KeepSet,
    layout: MoeLayout,
    output: str | os.PathLike[str],
    *,
    output_format: str | None = None,
    chunk_size: int | None = None,
    pruned: GGUFModel | None = None,
    source: GGUFModel | None = None,
) -> RemapPlan:
    """Validate everything and decide the output; nothing is written.

    `layout` is the source (unpruned) layout: its expert_count is what the keep-set selects from.
    At least one model is needed. The input entries are checked against `source` (else against
    `pruned`, expert entries scaled back to the source's expert count); the output entries against
    `pruned` with llama-quantize's own size check. Problems are reported all at once.
    """
    output = Path(output)
    fmt = output_format or imatrix.format
    if fmt not in FORMATS:
        raise BadInput(f"unknown imatrix format {fmt!r}", "use --format gguf or --format dat")
    warnings = list(check_keepset(keepset, layout))
    k = keepset.kept_count
    n_expert = layout.expert_count
    where = str(imatrix.path)

    recorded = imatrix.remap_keepset
    if recorded is not None:
        raise BadInput(
            f"{where} was already remapped by ggufcarve to {imatrix.get(KEY_KEPT_COUNT)} experts ({KEY_KEPT_EXPERTS})",
            "remap the original imatrix (the one computed on the unpruned model)",
        )
    if pruned is not None:
        arch = pruned.get("general.architecture")
        if arch != layout.architecture:
            raise BadInput(f"{pruned.path} is {arch}, the source model is {layout.architecture}", "give the pruned model made from this source")
        pruned_k = pruned.get(f"{arch}.expert_count")
        if pruned_k != k:
            raise BadInput(
                f"the keep-set keeps {k} experts per block but {pruned.path} has {arch}.expert_count={pruned_k}",
                "use the keep-set the model was pruned with (omit --keep to use the one it records)",
            )

    # Input checks against the unpruned model (or the pruned one, expert sizes scaled back to the
    # source's expert count): every entry names a tensor and has the size that model needs.
    reference = source if source is not None else pruned
    if reference is None:
        raise BadInput("remapping needs the source or the pruned model", "give --source-model and/or --model")
    expert_weights = {t.name: t for t in layout.expert_tensors.values() if t.role == "expert weight"}
    shapes = {t.name: t.shape for t in reference.tensors}
    ne0 = {name: shapes[name][0] for name in expert_weights if name in shapes}
    sizes = expected_sizes(reference)
    sizes.update({name: width * n_expert for name, width in ne0.items()})
    problems: list[str] = []
    expert_entries: dict[str, ImatrixEntry] = {}
    for e in imatrix.entries:
        if e.name in ne0:
            problem = _expert_entry_problem(e, n_expert, k, ne0[e.name])
            if problem:
                problems.append(problem)
            else:
                expert_entries[e.name] = e
        elif e.name not in sizes:
            problems.append(f"{e.name} is not a tensor of {reference.path.name}")
        elif e.nval != sizes[e.name] and e.name != "token_embd.weight":
            problems.append(f"{e.name} has {e.nval} values, but {reference.path.name} needs {sizes[e.name]} (ne0 x ne2); it fits neither the dense nor the expert layout")
    problems = _group_problems(problems)
    raise_problems(problems, f"{where} does not fit the {n_expert}-expert source model", "check that the imatrix was computed on the unpruned model this keep-set selects from")

    # Convert first (when asked), then select: remapping commutes with conversion, so a .dat
    # remapped from the GGUF equals the remap of llama-imatrix's own .dat of the same run.
    size = chunk_size if chunk_size is not None else (imatrix.chunk_size or DEFAULT_CHUNK_SIZE)
    conversion = convert(imatrix, fmt, size)
    converted = conversion.imatrix.entry_index
    tensors, entries, unchanged = [], [], []
    for e in imatrix.entries:
        if e.name not in converted:  # a .dat cannot hold an entry without any data
            continue
        if e.name not in expert_entries:
            entries.append(converted[e.name])
            unchanged.append(e.name)
            continue
        block = expert_weights[e.name].block
        ids = keepset.layers[block]
        dropped = tuple(i for i in range(n_expert) if i not in set(ids))
        routed_kept = routed_dropped = None
        if e.per_expert_counts:
            assert e.counts is not None
            counts = lround(e.counts)
            routed_kept = int(counts[list(ids)].sum())
            routed_dropped = int(counts.sum()) - routed_kept
        tensors.append(TensorRemap(e.name, block, layout.is_mtp(block), n_expert, tuple(ids), dropped, routed_kept, routed_dropped))
        entries.append(_select(converted[e.name], ids, n_expert, ne0[e.name]))

    covered = {t.block for t in tensors}
    without = tuple(b for b in layout.blocks if b not in covered)
    if without:
        mtp = [b for b in without if layout.is_mtp(b)]
        main = [b for b in without if not layout.is_mtp(b)]
        if mtp:
            warnings.append(f"MTP block(s) {', '.join(map(str, mtp))} have no imatrix entries (llama-imatrix never runs MTP blocks); IQ rungs need a --tensor-type override for blk.{mtp[0]}")
        if main:
            warnings.append(f"MoE block(s) {', '.join(map(str, main))} have no expert entries in the imatrix")

    result = dataclasses.replace(conversion.imatrix, entries=tuple(entries))
    if fmt == "gguf":  # a note of the remap, spelled as in the pruned model (a .dat has no metadata)
        source_sha256 = make_kv(KEY_REMAP_SOURCE_SHA256, GGUFValueType.STRING, "0" * 64)  # filled in when written
        provenance = provenance_kvs(keepset, n_expert)
        changes = {kv.key: kv for kv in (provenance[0], source_sha256, *provenance[1:])}
        result = dataclasses.replace(result, kvs=tuple(replace_kvs(result.kvs, changes)))
    for name in conversion.skipped:
        warnings.append(f"{name} has no data at all; a .dat cannot hold it (llama-imatrix skips such entries), so IQ rungs need a --tensor-type override for it")

    if pruned is not None:
        check = check_against_model(result, pruned)
        raise_problems(check.problems, f"remapped imatrix does not fit {pruned.path}", "the pruned model and the keep-set do not match; re-prune or give the matching keep-set")

    models = {}
    for role, m in (("pruned", pruned), ("source", source)):
        if m is not None:
            arch = m.get("general.architecture")
            models[role] = {"path": str(m.path), "architecture": arch, "expert_count": int(m.get(f"{arch}.expert_count") or 0)}
    return RemapPlan(
        source=imatrix,
        output=result,
        output_path=output,
        output_format=fmt,
        keepset=keepset,
        layout=layout,
        kept_count=k,
        tensors=tuple(tensors),
        unchanged=tuple(unchanged),
        blocks_without_entries=without,
        losses=conversion.losses if fmt != imatrix.format else (),
        skipped=conversion.skipped,
        warnings=tuple(warnings),
        models=models,
        chunk_size=size,
    )


def _group_problems(problems: list[str]) -> list[str]:
    """The same expert-count problem of many entries becomes one line naming the first entry."""
    grouped: dict[str, list[str]] = {}
    for p in problems:
        name, _, rest = p.partition(" ")
        if EXPERT_ENTRY.match(name) and "experts" in rest:
            grouped.setdefault(rest, []).append(name)
        else:
            grouped.setdefault(p, [])
    out = []
    for key, names in grouped.items():
        if not names:
            out.append(key)
        elif len(names) == 1:
            out.append(f"{names[0]} {key}")
        else:
            out.append(f"{names[0]} (and {len(names) - 1} more expert entries) {key}")
    return out


def _expert_entry_problem(e: ImatrixEntry, n_expert: int, kept: int, ne0: int) -> str | None:
    if e.nval == n_expert * ne0 and (e.n_mat in (1, n_expert)) and (e.n_mat == 1 or e.row_len == ne0):
        return None
    found = e.n_mat if e.n_mat > 1 else (e.nval // ne0 if e.nval % ne0 == 0 else None)
    if found == kept and kept != n_expert:
        return f"{e.name} already holds {kept} experts (the pruned count), not the source's {n_expert}: it looks remapped already"
    if found is not None and found != n_expert:
        return f"{e.name} holds {found} experts but the keep-set selects from {n_expert} (the source model's expert_count)"
    return f"{e.name} has {e.nval} values ({e.n_mat} x {e.row_len}); it fits neither the dense ({ne0}) nor the expert ({n_expert} x {ne0}) layout"


@dataclass
class RemapResult:
    plan: RemapPlan
    output_path: Path
    report_path: Path
    input_sha256: str
    output_sha256: str
    output_bytes: int
    timings: dict[str, float]


def default_report_path(output: Path) -> Path:
    return output.parent / "method" / REPORT_NAME


def execute_remap(
    plan: RemapPlan,
    *,
    force: bool = False,
    progress: Callable[[int], None] = _ignore,
    report_path: Path | None = None,
    sources: Sequence[Path] = (),
) -> RemapResult:
    """Write the remapped imatrix (temp name, fsync, rename), re-read it, and write the report
    (default OUTPUT_DIR/method/imatrix-remap-report.json)."""
    t0 = time.perf_counter()
    assert plan.source.path is not None
    report_path = report_path or default_report_path(plan.output_path)
    check_report_slot(report_path, [plan.output_path.name], lambda doc: [Path(doc["output"]["path"]).name], force)
    input_sha = sha256_file(plan.source.path)
    output = plan.output
    if output.format == "gguf" and any(kv.key == KEY_REMAP_SOURCE_SHA256 for kv in output.kvs):
        output = dataclasses.replace(output, kvs=tuple(replace_kvs(output.kvs, {KEY_REMAP_SOURCE_SHA256: make_kv(KEY_REMAP_SOURCE_SHA256, GGUFValueType.STRING, input_sha)})))
    path = write_imatrix(output, plan.output_path, force=force, sources=[plan.source.path, *sources], progress=progress)
    t_write = time.perf_counter()
    output_sha = sha256_file(path)
    written = read_imatrix(path)  # re-read: the file parses and every value is finite
    if len(written.entries) != len(output.entries):
        raise CarveError(f"internal error: {path} has {len(written.entries)} entries, planned {len(output.entries)}")
    timings = {"write_seconds": t_write - t0, "total_seconds": time.perf_counter() - t0}
    result = RemapResult(plan, path, report_path, input_sha, output_sha, path.stat().st_size, timings)
    write_text_atomic(report_path, json.dumps(remap_report(result), indent=1, sort_keys=True) + "\n")
    return result


def remap_report(result: RemapResult) -> dict[str, Any]:
    plan = result.plan
    source = plan.source
    return {
        "schema_version": REPORT_SCHEMA_VERSION,
        "tool": {"name": "ggufcarve", "version": __version__},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "input": {
            "path": str(source.path),
            "format": source.format,
            "bytes": source.size,
            "sha256": result.input_sha256,
            "entries": len(source.entries),
            "chunk_count": source.chunk_count,
            "chunk_size": source.chunk_size,
            "datasets": list(source.datasets),
        },
        "output": {
            "path": str(result.output_path),
            "format": plan.output_format,
            "bytes": result.output_bytes,
            "sha256": result.output_sha256,
            "entries": len(plan.output.entries),
        },
        "models": plan.models,
        "parameters": {"format": plan.output_format, "chunk_size": plan.chunk_size if "dat" in (source.format, plan.output_format) else source.chunk_size},
        "expert_count": {"before": plan.layout.expert_count, "after": plan.kept_count},
        "keep_set": plan.keepset.to_json(),
        "tensors": [
            {
                "name": t.name,
                "block": t.block,
                "mtp": t.mtp,
                "experts_before": t.experts_before,
                "kept": list(t.kept),
                "dropped": list(t.dropped),
                "routed_kept": t.routed_kept,
                "routed_dropped": t.routed_dropped,
                "routed_share_kept": None if t.routed_kept is None else t.routed_kept / max(t.routed_kept + (t.routed_dropped or 0), 1),
            }
            for t in plan.tensors
        ],
        "routing": plan.routing,
        "entries_unchanged": list(plan.unchanged),
        "entries_skipped": list(plan.skipped),
        "blocks_without_entries": list(plan.blocks_without_entries),
        "conversion_losses": list(plan.losses),
        "warnings": list(plan.warnings),
        "timings": {k: round(v, 3) for k, v in sorted(result.timings.items())},
    }


# ---------------------------------------------------------------------------------------------
# Inspection


@dataclass(frozen=True)
class BlockRouting:
    block: int
    entries: tuple[str, ...]
    expert_count: int | None  # None: no per-expert counts
    counts: tuple[int, ...] | None
    zero: tuple[int, ...] | None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"block": self.block, "entries": list(self.entries), "expert_count": self.expert_count}
        if self.counts is not None:
            c = np.asarray(self.counts, dtype=np.float64)
            total = float(c.sum())
            top = np.sort(c)[::-1]
            quarter = max(1, len(c) // 4)
            doc.update(
                counts=list(self.counts),
                zero_count_experts=list(self.zero or ()),
                routed_total=int(total),
                min=int(c.min()),
                median=float(np.median(c)),
                max=int(c.max()),
                top_quarter_share=float(top[:quarter].sum() / total) if total else None,
            )
        return doc


@dataclass(frozen=True)
class ImatrixSummary:
    imatrix: Imatrix
    expert_entries: int
    dense_entries: int
    blocks: tuple[BlockRouting, ...]
    remapped: dict[str, Any] | None
    model_check: ModelCheck | None

    def to_json(self) -> dict[str, Any]:
        im = self.imatrix
        return {
            "path": str(im.path),
            "format": im.format,
            "bytes": im.size,
            "entries": len(im.entries),
            "expert_entries": self.expert_entries,
            "dense_entries": self.dense_entries,
            "chunk_count": im.chunk_count,
            "chunk_size": im.chunk_size,
            "datasets": list(im.datasets),
            "per_expert_counts": any(b.counts is not None for b in self.blocks),
            "remapped_by_ggufcarve": self.remapped,
            "moe_blocks": [b.to_json() for b in self.blocks],
            "model_check": None if self.model_check is None else {"problems": list(self.model_check.problems), "warnings": list(self.model_check.warnings), "entries_missing": list(self.model_check.missing)},
            "entry_list": [{"name": e.name, "values": e.nval, "matrices": e.n_mat, **({"ncall": e.ncall} if e.ncall is not None else {})} for e in im.entries],
        }


def summarize(imatrix: Imatrix, model: GGUFModel | None = None) -> ImatrixSummary:
    """Entries, chunks, datasets, and per MoE block the routing counts (zero-count experts)."""
    per_block: dict[int, list[ImatrixEntry]] = {}
    for e in imatrix.entries:
        if e.is_expert_weight and e.block is not None:
            per_block.setdefault(e.block, []).append(e)
    blocks = []
    for block, entries in sorted(per_block.items()):
        with_counts = [e for e in entries if e.per_expert_counts]
        if with_counts:
            first = with_counts[0]
            assert first.counts is not None
            counts = tuple(int(c) for c in lround(first.counts))
            zero = tuple(i for i, c in enumerate(counts) if c == 0)
            blocks.append(BlockRouting(block, tuple(e.name for e in entries), first.n_mat, counts, zero))
        else:
            blocks.append(BlockRouting(block, tuple(e.name for e in entries), None, None, None))
    remapped = None
    if imatrix.get(KEY_KEPT_COUNT) is not None:
        remapped = {"source_expert_count": imatrix.get(KEY_SOURCE_EXPERT_COUNT), "kept_expert_count": imatrix.get(KEY_KEPT_COUNT), "source_sha256": imatrix.get(KEY_REMAP_SOURCE_SHA256)}
    expert_entries = sum(len(v) for v in per_block.values())
    check = check_against_model(imatrix, model) if model is not None else None
    return ImatrixSummary(imatrix, expert_entries, len(imatrix.entries) - expert_entries, tuple(blocks), remapped, check)


def format_from_path(path: Path) -> str | None:
    suffix = path.suffix.lower()
    return {".gguf": "gguf", ".dat": "dat"}.get(suffix)


@dataclass(frozen=True)
class ConvertResult:
    conversion: Conversion
    source: Imatrix
    output_path: Path
    output_bytes: int


def convert_file(
    source: Imatrix,
    output: str | os.PathLike[str],
    fmt: str,
    *,
    chunk_size: int | None = None,
    force: bool = False,
    progress: Callable[[int], None] = _ignore,
) -> ConvertResult:
    """`ggufcarve imatrix convert`: write `source` in the other format, then re-read the result."""
    if fmt not in FORMATS:
        raise BadInput(f"unknown imatrix format {fmt!r}", "use --format gguf or --format dat")
    if fmt == source.format:
        raise BadInput(f"{source.path} is already a {fmt} imatrix", f"nothing to convert; copy the file, or use --format {'dat' if fmt == 'gguf' else 'gguf'}")
    conversion = convert(source, fmt, chunk_size if chunk_size is not None else DEFAULT_CHUNK_SIZE)
    path = write_imatrix(conversion.imatrix, output, force=force, sources=[source.path] if source.path else [], progress=progress)
    read_imatrix(path)
    return ConvertResult(conversion, source, path, path.stat().st_size)
