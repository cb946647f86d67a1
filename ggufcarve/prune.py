"""Pruning as a plan (pure data: each output tensor is a list of source byte ranges) and one executor.

The executor streams the ranges into temp files beside the output, hashes the source in a second
thread meanwhile, re-reads the output and checks every tensor (xxh3-128) and every key against
the source before renaming anything into place.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import xxhash
from gguf.constants import GGUFValueType
from gguf.utility import model_weight_count_rounded_notation

from ggufcarve import __version__
from ggufcarve.container import (
    SHARD_NAME,
    SPLIT_COUNT,
    SPLIT_KEYS,
    SPLIT_NO,
    SPLIT_TENSORS_COUNT,
    GGUFFile,
    GGUFModel,
    KeyValue,
    TensorHeader,
    encode_header,
    make_kv,
    pad_to,
    read_file,
    replace_kvs,
    shard_paths,
)
from ggufcarve.errors import BadInput, VerificationFailed
from ggufcarve.fileio import CHUNK, BackgroundFlush, atomic_outputs, cached_sha256, check_outputs, check_report_slot, copy_range, read_ranges, remember_sha256, write_text_atomic, xxh3_of_ranges
from ggufcarve.keepset import KeepSet, check_keepset, provenance_kvs
from ggufcarve.moe import MoeLayout

REPORT_SCHEMA_VERSION = 1
PROVENANCE = "ggufcarve."
KEY_SOURCE_SHA256 = "ggufcarve.source.sha256"  # one entry per source file, filled in after hashing
SHA256_PLACEHOLDER = "0" * 64


@dataclass(frozen=True)
class SourceRange:
    shard: int  # index into the source shards
    offset: int  # absolute offset in that file
    length: int


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    type_id: int
    ranges: tuple[SourceRange, ...]
    source_shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(r.length for r in self.ranges)

    @property
    def pruned(self) -> bool:
        return self.shape != self.source_shape

    @property
    def header(self) -> TensorHeader:
        return TensorHeader(self.name, self.shape, self.type_id, self.nbytes)


@dataclass(frozen=True)
class PlannedFile:
    path: Path
    version: int
    alignment: int
    kvs: tuple[KeyValue, ...]
    tensors: tuple[PlannedTensor, ...]

    @cached_property
    def encoded_header(self) -> tuple[bytes, list[int]]:
        return encode_header(self.version, self.kvs, [t.header for t in self.tensors], self.alignment)

    @property
    def size(self) -> int:
        header, offsets = self.encoded_header
        if not self.tensors:
            return len(header)
        return len(header) + offsets[-1] + pad_to(self.tensors[-1].nbytes, self.alignment)

    def kv_position(self, key: str) -> int:
        """Byte offset of a key's record in the header."""
        position = 24  # magic, version, n_tensors, n_kv
        for kv in self.kvs:
            if kv.key == key:
                return position
            position += len(kv.raw)
        raise KeyError(key)


@dataclass(frozen=True)
class PrunePlan:
    sources: tuple[Path, ...]
    source_sizes: tuple[int, ...]
    layout: MoeLayout
    keepset: KeepSet
    files: tuple[PlannedFile, ...]
    changed_keys: dict[str, tuple[Any, Any]]  # key -> (before, after), provenance excluded
    provenance: bool
    warnings: tuple[str, ...]

    @property
    def kept_count(self) -> int:
        return self.keepset.kept_count

    @property
    def bytes_in(self) -> int:
        return sum(self.source_sizes)

    @property
    def bytes_out(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def tensors(self) -> dict[str, PlannedTensor]:
        return {t.name: t for f in self.files for t in f.tensors}

    @property
    def outputs(self) -> list[Path]:
        return [f.path for f in self.files]

    def to_json(self) -> dict[str, Any]:
        pruned = [t for t in self.tensors.values() if t.pruned]
        return {
            "sources": [{"path": str(p), "bytes": s} for p, s in zip(self.sources, self.source_sizes)],
            "outputs": [{"path": str(f.path), "bytes": f.size, "tensors": len(f.tensors)} for f in self.files],
            "expert_count": {"before": self.layout.expert_count, "after": self.kept_count},
            "moe_blocks": list(self.layout.blocks),
            "tensors_total": len(self.tensors),
            "tensors_pruned": sorted(t.name for t in pruned),
            "changed_keys": {k: {"before": _jsonable(a), "after": _jsonable(b)} for k, (a, b) in sorted(self.changed_keys.items())},
            "provenance_keys": self.provenance,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "warnings": list(self.warnings),
        }


def tensor_ranges(model: GGUFModel, layout: MoeLayout, keepset: KeepSet) -> dict[str, tuple[tuple[int, ...], tuple[SourceRange, ...]]]:
    """For every source tensor: its output shape and the source byte ranges that make its data."""
    experts = layout.expert_tensors
    result = {}
    for shard_index, shard in enumerate(model.shards):
        for tensor in shard.tensors:
            start, _ = shard.data_range(tensor)
            expert = experts.get(tensor.name)
            if expert is None:
                result[tensor.name] = (tensor.shape, (SourceRange(shard_index, start, tensor.nbytes),))
                continue
            slab = expert.bytes_per_expert
            kept = keepset.layers[expert.block]
            result[tensor.name] = (
                (*tensor.shape[:-1], len(kept)),
                tuple(_merge_adjacent([SourceRange(shard_index, start + e * slab, slab) for e in kept])),
            )
    return result


def _merge_adjacent(ranges: list[SourceRange]) -> list[SourceRange]:
    merged: list[SourceRange] = []
    for r in ranges:
        last = merged[-1] if merged else None
        if last and last.shard == r.shard and last.offset + last.length == r.offset:
            merged[-1] = SourceRange(r.shard, last.offset, last.length + r.length)
        else:
            merged.append(r)
    return merged


def parse_size(text: str) -> int:
    """'512M' / '50G' (decimal, as llama-gguf-split) or a byte count."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)B?\s*", text.upper())
    if not match or int(match[1]) <= 0:
        raise BadInput(f"split size {text!r} is not a positive size", "write it like 512M or 50G")
    return int(match[1]) * {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}[match[2]]


def relabel_size(label: str, total_params: int, kept: int, expert_count: int) -> str | None:
    """The general.size_label after pruning; None when the label's form is not recognised.

    Forms: "<N>x<size>" (gguf-py's MoE label) -> "<K>x<size>"; "<total>-A<active>" and "<total>"
    -> total recomputed from the pruned tensor shapes.
    """
    if kept == expert_count:
        return label
    if m := re.fullmatch(r"(\d+)x(.+)", label):
        return f"{kept}x{m[2]}"
    if m := re.fullmatch(r"[\d.]+[KMBT](?P<rest>-A[\d.]+[KMBT].*)?", label):
        return model_weight_count_rounded_notation(total_params, min_digits=2) + (m["rest"] or "")
    return None


def plan_prune(
    model: GGUFModel,
    layout: MoeLayout,
    keepset: KeepSet,
    output: str | os.PathLike[str],
    *,
    provenance: bool = True,
    split_max_size: int | None = None,
    merge: bool = False,
) -> PrunePlan:
    """Everything the executor will do, decided before a byte is written."""
    warnings = list(check_keepset(keepset, layout))
    kept = keepset.kept_count
    ranges = tensor_ranges(model, layout, keepset)
    source_tensors = [(i, t) for i, shard in enumerate(model.shards) for t in shard.tensors]
    planned = {
        t.name: PlannedTensor(t.name, ranges[t.name][0], t.type_id, ranges[t.name][1], t.shape)
        for _, t in source_tensors
    }

    meta = model.metadata
    arch = layout.architecture
    changes: dict[str, KeyValue | None] = {f"{arch}.expert_count": make_kv(f"{arch}.expert_count", GGUFValueType.UINT32, kept)}
    changed_keys: dict[str, tuple[Any, Any]] = {}
    if layout.expert_count != kept:
        changed_keys[f"{arch}.expert_count"] = (layout.expert_count, kept)
    label = meta.get("general.size_label")
    if isinstance(label, str) and kept != layout.expert_count:
        total_params = sum(
            t.n_elements * (kept if t.name in layout.expert_tensors else t.shape[-1]) // t.shape[-1] for t in model.tensors
        )
        new_label = relabel_size(label, total_params, kept, layout.expert_count)
        if new_label is None:
            warnings.append(f"general.size_label {label!r} has a form ggufcarve does not know; left unchanged")
        elif new_label != label:
            changes["general.size_label"] = make_kv("general.size_label", GGUFValueType.STRING, new_label)
            changed_keys["general.size_label"] = (label, new_label)
    if provenance:
        source_sha256 = make_kv(KEY_SOURCE_SHA256, GGUFValueType.ARRAY, [SHA256_PLACEHOLDER] * len(model.shards), GGUFValueType.STRING)
        for kv in (source_sha256, *provenance_kvs(keepset, layout.expert_count)):
            changes[kv.key] = kv

    output = Path(output)
    same_sharding = model.is_split and split_max_size is None and not merge
    if same_sharding:
        groups = [[t.name for t in shard.tensors] for shard in model.shards]
    elif split_max_size is not None:
        groups = _split_by_size([planned[t.name] for _, t in source_tensors], split_max_size, meta.alignment)
    else:
        groups = [[t.name for _, t in source_tensors]]

    n_out = len(groups)
    paths = [output] if n_out == 1 else shard_paths(_shard_prefix(output), n_out)
    n_tensors = len(source_tensors)
    files = []
    for i, (path, names) in enumerate(zip(paths, groups)):
        if same_sharding:
            base = model.shards[i].kvs  # shards keep their own split.* records
        elif i == 0:
            base = meta.kvs
        else:
            base = []
        file_changes: dict[str, KeyValue | None] = dict(changes) if i == 0 else {}
        if not same_sharding:
            if n_out == 1:
                file_changes.update({key: None for key in SPLIT_KEYS})
            else:
                file_changes[SPLIT_NO] = make_kv(SPLIT_NO, GGUFValueType.UINT16, i)
                file_changes[SPLIT_COUNT] = make_kv(SPLIT_COUNT, GGUFValueType.UINT16, n_out)
                file_changes[SPLIT_TENSORS_COUNT] = make_kv(SPLIT_TENSORS_COUNT, GGUFValueType.INT32, n_tensors)
        kvs = tuple(replace_kvs(base, file_changes))
        files.append(PlannedFile(path, meta.version, meta.alignment, kvs, tuple(planned[n] for n in names)))

    return PrunePlan(
        sources=tuple(model.paths),
        source_sizes=tuple(s.size for s in model.shards),
        layout=layout,
        keepset=keepset,
        files=tuple(files),
        changed_keys=changed_keys,
        provenance=provenance,
        warnings=tuple(warnings),
    )


def _split_by_size(tensors: list[PlannedTensor], max_size: int, alignment: int) -> list[list[str]]:
    """llama-gguf-split's rule: start a new shard when the padded tensor bytes would exceed max_size."""
    groups: list[list[str]] = [[]]
    current = 0
    for t in tensors:
        size = pad_to(t.nbytes, alignment)
        if groups[-1] and current + size > max_size:
            groups.append([])
            current = 0
        groups[-1].append(t.name)
        current += size
    return groups


def _shard_prefix(output: Path) -> str:
    match = SHARD_NAME.match(str(output))
    if match:
        return match["prefix"]
    return str(output)[: -len(".gguf")] if output.suffix == ".gguf" else str(output)


# ---------------------------------------------------------------------------------------------
# Execution


@dataclass(frozen=True)
class ProgressEvent:
    stage: str  # "copy", "hash source", "verify"
    advance: int  # bytes just processed
    total: int  # bytes this stage will process


EventSink = Callable[[ProgressEvent], None]


def _ignore(_: ProgressEvent) -> None:
    pass


@dataclass
class TensorCheck:
    name: str
    pruned: bool
    source_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    type_name: str
    source_bytes: int
    output_bytes: int
    expected_xxh3: str
    output_xxh3: str

    @property
    def ok(self) -> bool:
        return self.expected_xxh3 == self.output_xxh3


@dataclass
class Verification:
    tensors: list[TensorCheck]
    keys_checked: int
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and all(t.ok for t in self.tensors)

    def raise_if_failed(self, where: str) -> None:
        bad = [t.name for t in self.tensors if not t.ok]
        problems = self.problems + ([f"tensor data differs from the source slices: {', '.join(bad[:5])}" + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else "")] if bad else [])
        if problems:
            raise VerificationFailed(f"{where}: " + "; ".join(problems[:3]) + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""), "check that the keep-set is the one the output was made with (see its method/pruning-report.json); otherwise re-run the prune")


@dataclass
class PruneResult:
    plan: PrunePlan
    source_sha256: list[str]
    verification: Verification
    timings: dict[str, float]
    report_path: Path


Ranges = dict[str, tuple[tuple[int, ...], tuple[SourceRange, ...]]]
OutputHashes = dict[str, tuple[int, int, str]]  # tensor name -> (absolute start, length, xxh3-128) in its output file


class _Cancelled(Exception):
    """Stops a hashing thread when the write failed."""


def _ascending(ranges: tuple[SourceRange, ...]) -> bool:
    """Slices in file order, so one sequential read of the source can hash them."""
    return all(a.offset + a.length <= b.offset for a, b in zip(ranges, ranges[1:]))


def hash_source(model: GGUFModel, ranges: Ranges, progress: Callable[[int], None]) -> tuple[list[str], dict[str, str]]:
    """Each source file's sha256 and each output tensor's expected xxh3-128 (of its source slices).

    One sequential read per source file feeds both, for every tensor whose slices are in ascending
    order; other tensors, and files whose sha256 is cached, are hashed by positioned reads.
    """
    hashers = {name: xxhash.xxh3_128() for name in ranges}
    folded: list[list[tuple[int, int, str]]] = [[] for _ in model.shards]
    positioned: list[str] = []
    for name, (_, rs) in ranges.items():
        if _ascending(rs):
            folded[rs[0].shard].extend((r.offset, r.offset + r.length, name) for r in rs)
        else:
            positioned.append(name)
    digests = [cached_sha256(p) for p in model.paths]
    for shard, digest in enumerate(digests):
        if digest is not None:
            positioned.extend(dict.fromkeys(name for _, _, name in folded[shard]))
            folded[shard] = []
    buffer = bytearray(CHUNK)
    for shard, path in enumerate(model.paths):
        if digests[shard] is not None:
            continue
        segments = sorted(folded[shard])
        sha = hashlib.sha256()
        fd = os.open(path, os.O_RDONLY)
        try:
            position, i = 0, 0
            for chunk in read_ranges(fd, [(0, model.shards[shard].size)], buffer, progress):
                sha.update(chunk)
                end = position + len(chunk)
                while i < len(segments) and segments[i][0] < end:
                    lo, hi, name = segments[i]
                    if max(lo, position) < min(hi, end):
                        hashers[name].update(chunk[max(lo, position) - position : min(hi, end) - position])
                    if hi > end:
                        break
                    i += 1
                position = end
        finally:
            os.close(fd)
        digests[shard] = sha.hexdigest()
        remember_sha256(path, digests[shard])
    fds = [os.open(p, os.O_RDONLY) for p in model.paths]
    try:
        for name in positioned:
            for r in ranges[name][1]:
                for chunk in read_ranges(fds[r.shard], [(r.offset, r.length)], buffer, progress):
                    hashers[name].update(chunk)
    finally:
        for fd in fds:
            os.close(fd)
    return [d for d in digests if d is not None], {name: h.hexdigest() for name, h in hashers.items()}


def source_hash_bytes(model: GGUFModel, ranges: Ranges) -> int:
    """The bytes hash_source will read (for progress totals)."""
    uncached = {i for i, p in enumerate(model.paths) if cached_sha256(p) is None}
    total = sum(model.shards[i].size for i in uncached)
    for _, rs in ranges.values():
        if not _ascending(rs) or rs[0].shard not in uncached:
            total += sum(r.length for r in rs)
    return total


def hash_output(files: list[GGUFFile], progress: Callable[[int], None]) -> OutputHashes:
    """xxh3-128 of every tensor of the given files, read back from disk."""
    buffer = bytearray(CHUNK)
    result: OutputHashes = {}
    for f in files:
        fd = os.open(f.path, os.O_RDONLY)
        try:
            for t in f.tensors:
                start, end = f.data_range(t)
                result[t.name] = (start, end - start, xxh3_of_ranges(fd, [(start, end - start)], buffer, progress))
        finally:
            os.close(fd)
    return result


class _OutputHasher:
    """Reads back and hashes each output tensor on a second thread as soon as it is written."""

    def __init__(self, progress: Callable[[int], None]) -> None:
        self.progress = progress
        self.queue: queue.Queue[tuple[Path, str, int, int] | None] = queue.Queue(maxsize=256)
        self.result: OutputHashes = {}
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="ggufcarve-verify-output", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        buffer = bytearray(CHUNK)
        fds: dict[Path, int] = {}
        try:
            while (item := self.queue.get()) is not None:
                path, name, start, length = item
                if path not in fds:
                    fds[path] = os.open(path, os.O_RDONLY)
                self.result[name] = (start, length, xxh3_of_ranges(fds[path], [(start, length)], buffer, self.progress))
        except BaseException as err:  # re-raised by finish()
            self.error = err
            while self.queue.get() is not None:
                pass
        finally:
            for fd in fds.values():
                os.close(fd)

    def submit(self, path: Path, name: str, start: int, length: int) -> None:
        self.queue.put((path, name, start, length))

    def finish(self) -> OutputHashes:
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.result


def verify_prune(
    source: GGUFModel,
    layout: MoeLayout,
    keepset: KeepSet,
    output_files: list[GGUFFile],
    *,
    expected: dict[str, str] | None = None,
    output_hashes: OutputHashes | None = None,
    on_event: EventSink = _ignore,
) -> Verification:
    """Check an output against its source: every tensor is the concatenation of its source slices
    (xxh3-128), every source key is byte-identical except the ones pruning changes.

    `expected` and `output_hashes` may come precomputed from the executor's hashing threads;
    output hashes then carry the byte range they were read from, which must be where the
    re-parsed header puts each tensor.
    """
    problems: list[str] = []
    kept = keepset.kept_count
    ranges = tensor_ranges(source, layout, keepset)
    out_tensors = [(f, t) for f in output_files for t in f.tensors]
    out_names = [t.name for _, t in out_tensors]
    source_names = [t.name for t in source.tensors]
    if sorted(out_names) != sorted(source_names):
        missing = sorted(set(source_names) - set(out_names))
        extra = sorted(set(out_names) - set(source_names))
        problems.append(f"tensor set differs from the source (missing {missing[:3]}, extra {extra[:3]})")

    arch = layout.architecture
    allowed_changes = {f"{arch}.expert_count", "general.size_label"}
    out_meta = output_files[0]
    expert_kv = out_meta.kv_index.get(f"{arch}.expert_count")
    if expert_kv is None or expert_kv.value_type != GGUFValueType.UINT32 or expert_kv.value != kept:
        problems.append(f"{arch}.expert_count is {None if expert_kv is None else expert_kv.value!r}, expected u32 {kept}")
    keys_checked = 0
    for kv in source.metadata.kvs:
        if kv.key in SPLIT_KEYS or kv.key in allowed_changes:
            continue
        keys_checked += 1
        out_kv = out_meta.kv_index.get(kv.key)
        if out_kv is None:
            problems.append(f"key {kv.key} is missing from the output")
        elif out_kv.raw != kv.raw:
            problems.append(f"key {kv.key} differs from the source")
    source_keys = set(source.metadata.kv_index)
    for f_index, f in enumerate(output_files):
        for kv in f.kvs:
            new_key = kv.key not in source_keys and not kv.key.startswith(PROVENANCE) and kv.key not in SPLIT_KEYS
            if (f_index == 0 and new_key) or (f_index > 0 and kv.key not in SPLIT_KEYS):
                problems.append(f"{f.path.name}: unexpected key {kv.key}")

    if output_hashes is None:
        verify_total = sum(t.nbytes for _, t in out_tensors)
        output_hashes = hash_output(output_files, lambda n: on_event(ProgressEvent("verify", n, verify_total)))
    if expected is None:
        expected_total = sum(r.length for _, rs in ranges.values() for r in rs)
        buffer = bytearray(CHUNK)
        fds = [os.open(p, os.O_RDONLY) for p in source.paths]
        try:
            expected = {
                name: xxh3_of_ranges(fds[rs[0].shard], [(r.offset, r.length) for r in rs], buffer, lambda n: on_event(ProgressEvent("hash source", n, expected_total)))
                for name, (_, rs) in ranges.items()
            }
        finally:
            for fd in fds:
                os.close(fd)

    source_info = {t.name: t for t in source.tensors}
    checks = []
    for f, t in out_tensors:
        if t.name not in ranges:
            continue
        shape, _ = ranges[t.name]
        src = source_info[t.name]
        if t.shape != shape or t.type_id != src.type_id:
            problems.append(f"{t.name}: shape {list(t.shape)} type {t.type_name}, expected {list(shape)} {src.type_name}")
        start, end = f.data_range(t)
        hashed_start, hashed_length, digest = output_hashes[t.name]
        if (hashed_start, hashed_length) != (start, end - start):
            problems.append(f"{t.name}: header places it at bytes {start}..{end}, but it was written at {hashed_start}..{hashed_start + hashed_length}")
        checks.append(TensorCheck(t.name, shape != src.shape, src.shape, t.shape, t.type_name, src.nbytes, t.nbytes, expected[t.name], digest))
    return Verification(checks, keys_checked, problems)


def default_report_path(plan: PrunePlan) -> Path:
    return plan.outputs[0].parent / "method" / "pruning-report.json"


def execute(plan: PrunePlan, model: GGUFModel, *, force: bool = False, on_event: EventSink = _ignore, report_path: Path | None = None) -> PruneResult:
    """Write the plan's outputs (temp names, fsync, rename), verify them, and write the report.

    Three streams run at once: the main thread copies source ranges into the temp files; a
    second thread reads the whole source once (sha256 for the provenance keys and the expected
    xxh3 of every tensor); a third reads each tensor back from the temp file once it is written.
    Nothing is renamed into place until every tensor and key checked out.
    """
    t_start = time.perf_counter()
    report_path = report_path or default_report_path(plan)
    check_outputs(plan.outputs, list(plan.sources), plan.bytes_out, force)
    check_report_slot(report_path, [p.name for p in plan.outputs], lambda doc: [f["name"] for f in doc["output"]["files"]], force)
    ranges = tensor_ranges(model, plan.layout, plan.keepset)
    source_total = source_hash_bytes(model, ranges)
    data_total = sum(t.nbytes for t in plan.tensors.values())

    background: dict[str, Any] = {}
    cancelled = threading.Event()

    def checked(stage: str, total: int) -> Callable[[int], None]:
        def progress(n: int) -> None:
            if cancelled.is_set():
                raise _Cancelled
            on_event(ProgressEvent(stage, n, total))

        return progress

    def run_source_hash() -> None:
        try:
            started = time.perf_counter()
            background["sha256"], background["expected"] = hash_source(model, ranges, checked("hash source", source_total))
            background["seconds"] = time.perf_counter() - started
        except BaseException as err:  # re-raised in the main thread
            background["error"] = err

    source_hasher = threading.Thread(target=run_source_hash, name="ggufcarve-hash-source", daemon=True)
    source_hasher.start()
    timings: dict[str, float] = {}
    output_hasher = _OutputHasher(checked("verify", data_total))
    try:
        with atomic_outputs(plan.outputs) as outputs:
            t_copy = time.perf_counter()
            _write_files(plan, outputs, output_hasher, on_event)
            timings["write_seconds"] = time.perf_counter() - t_copy
            t_verify = time.perf_counter()
            output_hashes = output_hasher.finish()
            source_hasher.join()
            if "error" in background:
                raise background["error"]
            if plan.provenance:
                _fill_source_sha256(plan.files[0], outputs[0][1], background["sha256"])
            written = [read_file(temp) for temp, _ in outputs]
            verification = verify_prune(model, plan.layout, plan.keepset, written, expected=background["expected"], output_hashes=output_hashes)
            verification.raise_if_failed(f"verification of {plan.outputs[0].name}")
            timings["verify_seconds"] = time.perf_counter() - t_verify
    finally:
        cancelled.set()
        source_hasher.join()
        if output_hasher.thread.is_alive():
            output_hasher.queue.put(None)
            output_hasher.thread.join()
    timings["hash_source_seconds"] = background.get("seconds", 0.0)
    timings["total_seconds"] = time.perf_counter() - t_start
    result = PruneResult(plan, background["sha256"], verification, timings, report_path)
    write_text_atomic(report_path, _dumps(pruning_report(result)))
    return result


def _write_files(plan: PrunePlan, outputs: list[tuple[Path, int]], output_hasher: _OutputHasher, on_event: EventSink) -> None:
    total = plan.bytes_out
    flush = BackgroundFlush()
    source_fds = [os.open(p, os.O_RDONLY) for p in plan.sources]
    try:
        for planned, (temp, fd) in zip(plan.files, outputs):

            def progress(n: int, fd: int = fd) -> None:
                flush.wrote(fd, n)
                on_event(ProgressEvent("copy", n, total))

            header, offsets = planned.encoded_header
            os.pwrite(fd, header, 0)
            progress(len(header))
            for tensor, offset in zip(planned.tensors, offsets):
                start = position = len(header) + offset
                for r in tensor.ranges:
                    copy_range(source_fds[r.shard], fd, r.offset, position, r.length, progress)
                    position += r.length
                output_hasher.submit(temp, tensor.name, start, tensor.nbytes)
                padding = pad_to(tensor.nbytes, planned.alignment) - tensor.nbytes
                if padding:
                    os.pwrite(fd, bytes(padding), position)
                    progress(padding)
            os.ftruncate(fd, planned.size)
    finally:
        flush.close()
        for fd in source_fds:
            os.close(fd)


def _fill_source_sha256(planned: PlannedFile, fd: int, digests: list[str]) -> None:
    """Overwrite the placeholder digests in the written header; the record keeps its length."""
    real = make_kv(KEY_SOURCE_SHA256, GGUFValueType.ARRAY, digests, GGUFValueType.STRING)
    placeholder = next(kv for kv in planned.kvs if kv.key == KEY_SOURCE_SHA256)
    assert len(real.raw) == len(placeholder.raw)
    os.pwrite(fd, real.raw, planned.kv_position(KEY_SOURCE_SHA256))


def pruning_report(result: PruneResult) -> dict[str, Any]:
    plan, verification = result.plan, result.verification
    return {
        "schema_version": REPORT_SCHEMA_VERSION,
        "tool": {"name": "ggufcarve", "version": __version__},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": {
            "files": [{"path": str(p), "bytes": s, "sha256": h} for p, s, h in zip(plan.sources, plan.source_sizes, result.source_sha256)],
            "architecture": plan.layout.architecture,
            "expert_count": plan.layout.expert_count,
            "expert_used_count": plan.layout.expert_used_count,
            "moe_blocks": list(plan.layout.blocks),
            "mtp_blocks": [b for b in plan.layout.blocks if plan.layout.is_mtp(b)],
        },
        "output": {
            "files": [{"name": f.path.name, "bytes": f.size, "tensors": len(f.tensors)} for f in plan.files],
            "expert_count": plan.kept_count,
        },
        "keep_set": plan.keepset.to_json(),
        "changed_keys": {k: {"before": _jsonable(a), "after": _jsonable(b)} for k, (a, b) in sorted(plan.changed_keys.items())},
        "provenance_keys": plan.provenance,
        "tensors": [
            {
                "name": t.name,
                "pruned": t.pruned,
                "type": t.type_name,
                "source_shape": list(t.source_shape),
                "output_shape": list(t.output_shape),
                "source_bytes": t.source_bytes,
                "output_bytes": t.output_bytes,
                "expected_xxh3_128": t.expected_xxh3,
                "output_xxh3_128": t.output_xxh3,
            }
            for t in verification.tensors
        ],
        "bytes_in": plan.bytes_in,
        "bytes_out": plan.bytes_out,
        "verification": {"ok": verification.ok, "tensors_checked": len(verification.tensors), "keys_checked": verification.keys_checked, "hash": "xxh3_128"},
        "warnings": list(plan.warnings),
        "timings": {k: round(v, 3) for k, v in sorted(result.timings.items())},
    }


def _jsonable(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else value


def _dumps(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def check_prune(source: GGUFModel, layout: MoeLayout, keepset: KeepSet, output: GGUFModel, on_event: EventSink = _ignore) -> Verification:
    """`ggufcarve check-prune`: re-run the verification of an existing output."""
    check_keepset(keepset, layout)
    return verify_prune(source, layout, keepset, list(output.shards), on_event=on_event)

