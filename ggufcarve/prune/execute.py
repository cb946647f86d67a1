"""Executing a prune plan.

The executor streams the ranges into temp files beside the output, hashes the source in a second
thread meanwhile, re-reads the output and checks every tensor (xxh3-128) and every key against
the source before renaming anything into place.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import xxhash
from gguf.constants import GGUFValueType

from ggufcarve.events import Counter, Sink, ignore
from ggufcarve.fileio import (
    CHUNK,
    BackgroundFlush,
    atomic_outputs,
    cached_sha256,
    check_outputs,
    copy_range,
    read_ranges,
    remember_sha256,
    write_text_atomic,
    xxh3_of_ranges,
)
from ggufcarve.gguf.container import (
    GGUFModel,
    make_kv,
    pad_to,
    read_file,
)
from ggufcarve.prune.check import OutputHashes, Ranges, Verification, verify_prune
from ggufcarve.prune.plan import (
    KEY_SOURCE_SHA256,
    PlannedFile,
    PrunePlan,
    SourceRange,
    tensor_ranges,
)
from ggufcarve.prune.report import default_report_path, pruning_report
from ggufcarve.reports import dumps


@dataclass
class PruneResult:
    plan: PrunePlan
    source_sha256: list[str]
    verification: Verification
    timings: dict[str, float]
    report_path: Path

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

def execute(plan: PrunePlan, model: GGUFModel, *, force: bool = False, on_event: Sink = ignore, report_path: Path | None = None) -> PruneResult:
    """Write the plan's outputs (temp names, fsync, rename), verify them, and write the report.

    Three streams run at once: the main thread copies source ranges into the temp files; a
    second thread reads the whole source once (sha256 for the provenance keys and the expected
    xxh3 of every tensor); a third reads each tensor back from the temp file once it is written.
    Nothing is renamed into place until every tensor and key checked out.
    """
    t_start = time.perf_counter()
    report_path = report_path or default_report_path(plan)
    check_outputs(plan.outputs, list(plan.sources), plan.bytes_out, force)
    ranges = tensor_ranges(model, plan.layout, plan.keepset)
    source_total = source_hash_bytes(model, ranges)
    data_total = sum(t.nbytes for t in plan.tensors.values())

    background: dict[str, Any] = {}
    cancelled = threading.Event()

    def checked(stage: str, total: int) -> Callable[[int], None]:
        counter = Counter(on_event, stage, total)

        def progress(n: int) -> None:
            if cancelled.is_set():
                raise _Cancelled
            counter(n)

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
    write_text_atomic(report_path, dumps(pruning_report(result)))
    return result


def _write_files(plan: PrunePlan, outputs: list[tuple[Path, int]], output_hasher: _OutputHasher, on_event: Sink) -> None:
    copied = Counter(on_event, "copy", plan.bytes_out)
    flush = BackgroundFlush()
    source_fds = [os.open(p, os.O_RDONLY) for p in plan.sources]
    try:
        for planned, (temp, fd) in zip(plan.files, outputs):

            def progress(n: int, fd: int = fd) -> None:
                flush.wrote(fd, n)
                copied(n)

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

