"""Converting an imatrix between GGUF and legacy .dat, as llama-imatrix itself does."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGUFType, GGUFValueType

from ggufcarve.errors import BadInput
from ggufcarve.events import Sink, ignore
from ggufcarve.gguf.container import (
    make_kv,
)
from ggufcarve.imatrix_format import (
    DEFAULT_CHUNK_SIZE,
    FORMATS,
    IMATRIX_KEYS,
    KEY_CHUNK_COUNT,
    KEY_CHUNK_SIZE,
    KEY_DATASETS,
    KEY_TYPE,
    Imatrix,
    ImatrixEntry,
    counts_of,
    lround,
    read_imatrix,
    write_imatrix,
)
from ggufcarve.listing import shortened

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
        raise BadInput(
            f"{imatrix.path}: imatrix.chunk_size is {chunk_size}; the .dat ncall cannot be computed",
            "the file is corrupt",
        )
    entries, skipped = [], []
    for e in imatrix.entries:
        counts = lround(counts_of(e))
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
        losses.append(
            f"imatrix.chunk_size ({imatrix.chunk_size}): give --chunk-size {imatrix.chunk_size} when converting back"
        )
    extra_keys = [kv.key for kv in imatrix.kvs if kv.key not in (KEY_TYPE, *IMATRIX_KEYS)]
    if extra_keys:
        losses.append(f"metadata keys {shortened(extra_keys, 4, ', ')}")
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
        raise BadInput(
            f"chunk size {chunk_size} must be positive",
            "use the -c/--ctx-size the imatrix was computed with (llama-imatrix default 512)",
        )
    entries = []
    for e in imatrix.entries:
        ncall = e.ncall or 0
        count = np.array([np.float32(ncall * chunk_size)], dtype=np.float32)

        def load(e: ImatrixEntry = e) -> np.ndarray:
            return (e.sums() * np.float32(chunk_size)).astype(np.float32)

        entries.append(ImatrixEntry(e.name, 1, e.nval, count, None, load))
    chunk_count = (
        imatrix.chunk_count if imatrix.chunk_count is not None else max((e.ncall or 0) for e in imatrix.entries)
    )
    kvs = (
        make_kv(KEY_TYPE, GGUFValueType.STRING, GGUFType.IMATRIX),
        make_kv(KEY_DATASETS, GGUFValueType.ARRAY, list(imatrix.datasets), GGUFValueType.STRING),
        make_kv(KEY_CHUNK_COUNT, GGUFValueType.UINT32, int(chunk_count)),
        make_kv(KEY_CHUNK_SIZE, GGUFValueType.UINT32, int(chunk_size)),
    )
    order = tuple((e.name, part) for e in entries for part in ("in_sum2", "counts"))
    result = Imatrix(
        "gguf", None, tuple(entries), imatrix.datasets, int(chunk_count), int(chunk_size), kvs=kvs, tensor_order=order
    )
    return Conversion(result, (), ())


def convert(imatrix: Imatrix, fmt: str, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Conversion:
    if fmt not in FORMATS:
        raise BadInput(f"unknown imatrix format {fmt!r}", "use gguf or dat")
    return to_dat(imatrix) if fmt == "dat" else to_gguf(imatrix, chunk_size)


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
    on_event: Sink = ignore,
) -> ConvertResult:
    """`ggufcarve imatrix convert`: write `source` in the other format, then re-read the result."""
    if fmt not in FORMATS:
        raise BadInput(f"unknown imatrix format {fmt!r}", "use --format gguf or --format dat")
    if fmt == source.format:
        raise BadInput(
            f"{source.path} is already a {fmt} imatrix",
            f"nothing to convert; copy the file, or use --format {'dat' if fmt == 'gguf' else 'gguf'}",
        )
    conversion = convert(source, fmt, chunk_size if chunk_size is not None else DEFAULT_CHUNK_SIZE)
    path = write_imatrix(
        conversion.imatrix, output, force=force, sources=[source.path] if source.path else [], on_event=on_event
    )
    read_imatrix(path)
    return ConvertResult(conversion, source, path, path.stat().st_size)
