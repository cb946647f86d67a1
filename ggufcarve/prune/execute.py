"""Executing a prune plan.

One sequential read of each source file feeds everything the prune needs from it: the file's
sha256 (for the provenance keys; skipped when cached for this exact file state, and then only the
kept ranges are read), the writes into temp files beside the outputs, and the xxh3-128 of every
output tensor as its bytes stream by (of each of its pieces instead, for a tensor whose kept
slices are not in file order; a piece is a contiguous source range and the output range it is
copied to). A second thread re-reads each output tensor from its temp file as soon as it is
complete and hashes it the same way. Nothing is renamed into place until every tensor read back
matches the source bytes it was copied from and every key checks out. Memory is a fixed ring of
buffers, passed from the reader thread to the writer (the calling thread) to the sha256 thread
and back to the reader.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash
from gguf.constants import GGUFValueType

from ggufcarve.errors import BadInput
from ggufcarve.events import Counter, Sink, ignore
from ggufcarve.fileio import (
    CHUNK,
    BackgroundFlush,
    atomic_outputs,
    cached_sha256,
    check_outputs,
    dead_temps,
    read_ranges,
    remember_sha256,
    same_file,
    write_at,
    write_text_atomic,
    xxh3_of_ranges,
)
from ggufcarve.gguf.container import GGUFModel, make_kv, read_file, read_model
from ggufcarve.prune.check import OutputHashes, Verification, verify_prune
from ggufcarve.prune.plan import KEY_SOURCE_SHA256, PlannedFile, PrunePlan
from ggufcarve.prune.report import default_report_path, pruning_report
from ggufcarve.reports import dumps

RING_BUFFERS = 64
RING_CHUNK = 512 << 10  # bytes per source read; the ring holds RING_BUFFERS x RING_CHUNK (32 MiB)
VERIFY_READ = 256 << 10  # bytes per read of the output's read-back
# Reads, writes and hashes in pieces that stay in the CPU caches between the kernel's copy and the
# next use: on 1.28 GiB -> 0.68 GiB a warm prune took 0.5 s with 512 KiB reads against 1.5-1.8 s
# with 8 MiB ones, a first (hashing) prune 1.3 s against 2.4-2.6 s (bench/prune_bench.py).
SPAN_GAP = 1 << 16  # kept ranges this close are read as one span (the gap is padding or a small tensor)
POLL_SECONDS = 0.2  # how often a waiting pipeline thread looks whether another one failed


@dataclass
class PruneResult:
    plan: PrunePlan
    source_sha256: list[str]
    verification: Verification
    timings: dict[str, float]
    report_path: Path


@dataclass(frozen=True)
class Piece:
    """A contiguous source byte range and the output byte range it is copied to."""

    tensor: str
    index: int  # among the tensor's pieces, in output order
    shard: int  # source file
    offset: int  # absolute offset in the source file
    length: int
    output: int  # index into the plan's files
    position: int  # absolute offset in that output file


def plan_pieces(plan: PrunePlan) -> list[Piece]:
    """Every piece of every output tensor, in output order."""
    pieces = []
    for out_index, planned in enumerate(plan.files):
        header, offsets = planned.encoded_header
        for tensor, offset in zip(planned.tensors, offsets):
            position = len(header) + offset
            for k, r in enumerate(tensor.ranges):
                pieces.append(Piece(tensor.name, k, r.shard, r.offset, r.length, out_index, position))
                position += r.length
    return pieces


def read_spans(pieces: Sequence[Piece], size: int, whole: bool) -> list[tuple[int, int]]:
    """(offset, length) spans to read from one source file, in file order: the whole file, or the
    pieces (sorted by offset) with gaps of at most SPAN_GAP bytes read through."""
    if whole:
        return [(0, size)]
    spans: list[tuple[int, int]] = []
    for p in pieces:
        if spans and p.offset - (spans[-1][0] + spans[-1][1]) <= SPAN_GAP:
            start = spans[-1][0]
            spans[-1] = (start, max(spans[-1][1], p.offset + p.length - start))
        elif p.length:
            spans.append((p.offset, p.length))
    return spans


class _Stopped(Exception):
    """Raised in a pipeline thread that waits while another one has failed."""


class _Pipeline:
    """The threads of one pass share a failure flag: the first error stops every stage."""

    def __init__(self) -> None:
        self.failed = threading.Event()
        self.errors: list[BaseException] = []
        self.lock = threading.Lock()

    def fail(self, err: BaseException) -> None:
        with self.lock:
            if not isinstance(err, _Stopped):
                self.errors.append(err)
        self.failed.set()

    def get(self, q: queue.Queue[Any]) -> Any:
        while True:
            try:
                return q.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if self.failed.is_set():
                    raise _Stopped from None

    def check(self) -> None:
        if self.failed.is_set():
            raise _Stopped

    def raise_first(self) -> None:
        if self.errors:
            raise self.errors[0]
        if self.failed.is_set():
            raise _Stopped("a pipeline thread stopped without an error")


class _OutputHasher:
    """Re-reads each output tensor on its own thread once it is written: the xxh3-128 of each of
    its hash units (see `_CopyPass`) and, when it has several, of the whole tensor."""

    def __init__(self, pipeline: _Pipeline, progress: Callable[[int], None]) -> None:
        self.pipeline = pipeline
        self.progress = progress
        self.queue: queue.Queue[tuple[Path, str, int, tuple[int, ...]] | None] = queue.Queue()
        self.result: OutputHashes = {}
        self.units: dict[tuple[str, int], str] = {}
        self.thread = threading.Thread(target=self._run, name="ggufcarve-verify-output", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        buffer = bytearray(VERIFY_READ)
        fds: dict[Path, int] = {}
        try:
            while (item := self.pipeline.get(self.queue)) is not None:
                path, name, start, lengths = item
                if path not in fds:
                    fds[path] = os.open(path, os.O_RDONLY)
                whole = xxhash.xxh3_128() if len(lengths) > 1 else None
                position = start
                for k, length in enumerate(lengths):
                    unit = xxhash.xxh3_128()
                    for chunk in read_ranges(fds[path], [(position, length)], buffer, self.progress):
                        unit.update(chunk)
                        if whole is not None:
                            whole.update(chunk)
                    self.units[(name, k)] = unit.hexdigest()
                    position += length
                self.result[name] = (start, position - start, (whole or unit).hexdigest())
        except BaseException as err:  # re-raised by the caller
            self.pipeline.fail(err)
        finally:
            for fd in fds.values():
                os.close(fd)

    def submit(self, path: Path, name: str, start: int, lengths: tuple[int, ...]) -> None:
        self.queue.put((path, name, start, lengths))

    def finish(self) -> None:
        self.queue.put(None)
        self.thread.join()


def _fill_source_sha256(planned: PlannedFile, fd: int, digests: list[str]) -> None:
    """Overwrite the placeholder digests in the written header; the record keeps its length."""
    real = make_kv(KEY_SOURCE_SHA256, GGUFValueType.ARRAY, digests, GGUFValueType.STRING)
    placeholder = next(kv for kv in planned.kvs if kv.key == KEY_SOURCE_SHA256)
    if len(real.raw) != len(placeholder.raw):
        raise RuntimeError(
            f"{KEY_SOURCE_SHA256}: the digests take {len(real.raw)} bytes, the placeholder {len(placeholder.raw)}"
        )
    write_at(fd, real.raw, planned.kv_position(KEY_SOURCE_SHA256))


def _ascending(pieces: Sequence[Piece]) -> bool:
    """A tensor's slices in file order: a read in file order meets its bytes in output order."""
    return all(a.offset + a.length <= b.offset for a, b in zip(pieces, pieces[1:]))


class _CopyPass:
    """One read of the sources, the writes into the outputs, and the hashes of both sides.

    Both sides hash each tensor in hash units: one unit for a tensor whose slices are in file
    order (the sequential read meets its bytes in output order), one unit per piece otherwise.
    """

    def __init__(self, plan: PrunePlan, model: GGUFModel, outputs: list[tuple[Path, int]], on_event: Sink) -> None:
        self.plan, self.model, self.outputs = plan, model, outputs
        self.pipeline = _Pipeline()
        self.pieces = plan_pieces(plan)
        by_tensor: dict[str, list[Piece]] = {}
        for p in self.pieces:
            by_tensor.setdefault(p.tensor, []).append(p)
        self.first_piece = {name: pieces[0] for name, pieces in by_tensor.items()}
        self.unit_lengths = {
            name: (sum(p.length for p in pieces),) if _ascending(pieces) else tuple(p.length for p in pieces)
            for name, pieces in by_tensor.items()
        }
        self.unit_of = {
            (p.tensor, p.index): (p.tensor, p.index if len(self.unit_lengths[p.tensor]) > 1 else 0) for p in self.pieces
        }
        self.source_units: dict[tuple[str, int], Any] = {unit: xxhash.xxh3_128() for unit in self.unit_of.values()}
        self.remaining = {name: sum(lengths) for name, lengths in self.unit_lengths.items()}
        self.cached = [cached_sha256(path) for path in model.paths]
        self.copied = Counter(on_event, "copy", plan.bytes_out)
        hashed_total = sum(s.size for s, digest in zip(model.shards, self.cached) if digest is None)
        self.hashed = Counter(on_event, "hash source", hashed_total)
        self.output_hasher = _OutputHasher(
            self.pipeline, self._checked(Counter(on_event, "verify", sum(self.remaining.values())))
        )
        self.free: queue.Queue[bytearray] = queue.Queue()
        for _ in range(RING_BUFFERS):
            self.free.put(bytearray(RING_CHUNK))
        self.ready: queue.Queue[tuple[int, int, bytearray, int] | None] = queue.Queue()
        self.to_sha: queue.Queue[tuple[int, bytearray, int] | None] = queue.Queue()
        self.sha = [hashlib.sha256() if digest is None else None for digest in self.cached]

    def _checked(self, counter: Callable[[int], None]) -> Callable[[int], None]:
        def progress(n: int) -> None:
            self.pipeline.check()
            counter(n)

        return progress

    def run(self) -> tuple[list[str], OutputHashes, dict[tuple[str, int], str]]:
        """Copy and hash; returns the sources' sha256 and the read-back hashes of tensors and units."""
        by_shard: list[list[Piece]] = [[] for _ in self.model.shards]
        for p in self.pieces:
            by_shard[p.shard].append(p)
        for shard_pieces in by_shard:
            shard_pieces.sort(key=lambda p: p.offset)
        reader = threading.Thread(target=self._read, args=(by_shard,), name="ggufcarve-read-source", daemon=True)
        sha = threading.Thread(target=self._hash_source, name="ggufcarve-hash-source", daemon=True)
        flush = BackgroundFlush()
        try:
            for (_temp, fd), planned in zip(self.outputs, self.plan.files):
                header, _ = planned.encoded_header
                write_at(fd, header, 0)
                self.copied(len(header))
                os.ftruncate(fd, planned.size)  # the gaps between tensors (padding) read as zeros
            for name, length in self.remaining.items():
                if length == 0:
                    self._submit(name)
            reader.start()
            sha.start()
            self._write(by_shard, flush)
            self.to_sha.put(None)
            sha.join()
            self.pipeline.raise_first()
            self.copied(self.plan.bytes_out - self.copied.done)  # the padding, never written
            self.output_hasher.finish()
        except BaseException as err:
            self.pipeline.fail(err)  # every thread stops within POLL_SECONDS
        finally:
            flush.close()
            for thread in (reader, sha, self.output_hasher.thread):
                if thread.ident is not None:
                    thread.join()
        self.pipeline.raise_first()  # the first real error of any thread, not the _Stopped it caused
        digests = []
        for shard, path in enumerate(self.model.paths):
            digest = self.cached[shard]
            if digest is None:
                digest = self.sha[shard].hexdigest()  # type: ignore[union-attr]
                remember_sha256(path, digest)
            digests.append(digest)
        return digests, self.output_hasher.result, self.output_hasher.units

    def _read(self, by_shard: list[list[Piece]]) -> None:
        """The reader thread: every span of every source file, in file order, through the ring."""
        try:
            for shard, path in enumerate(self.model.paths):
                spans = read_spans(by_shard[shard], self.model.shards[shard].size, whole=self.cached[shard] is None)
                fd = os.open(path, os.O_RDONLY)
                try:
                    if hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    for offset, length in spans:
                        done = 0
                        while done < length:
                            buffer = self.pipeline.get(self.free)
                            got = os.preadv(fd, [memoryview(buffer)[: min(RING_CHUNK, length - done)]], offset + done)
                            if got == 0:
                                raise BadInput(
                                    f"{path.name} ended early: {length - done} bytes missing at offset {offset + done}",
                                    "the source file changed or is truncated",
                                )
                            self.ready.put((shard, offset + done, buffer, got))
                            done += got
                finally:
                    os.close(fd)
            self.ready.put(None)
        except BaseException as err:
            self.pipeline.fail(err)

    def _write(self, by_shard: list[list[Piece]], flush: BackgroundFlush) -> None:
        """The calling thread: write each chunk's pieces, hash them, pass the buffer on."""
        fds = [fd for _, fd in self.outputs]
        shard, i = -1, 0
        while (item := self.pipeline.get(self.ready)) is not None:
            self.pipeline.check()
            chunk_shard, offset, buffer, got = item
            if chunk_shard != shard:
                shard, i = chunk_shard, 0
            pieces = by_shard[shard]
            end = offset + got
            view = memoryview(buffer)[:got]
            j = i
            while j < len(pieces) and pieces[j].offset < end:
                p = pieces[j]
                lo, hi = max(p.offset, offset), min(p.offset + p.length, end)
                if lo < hi:
                    data = view[lo - offset : hi - offset]
                    write_at(fds[p.output], data, p.position + lo - p.offset)
                    self.source_units[self.unit_of[(p.tensor, p.index)]].update(data)
                    flush.wrote(fds[p.output], hi - lo)
                    self.copied(hi - lo)
                    self.remaining[p.tensor] -= hi - lo
                    if self.remaining[p.tensor] == 0:
                        self._submit(p.tensor)
                j += 1
            while i < len(pieces) and pieces[i].offset + pieces[i].length <= end:
                i += 1
            if self.sha[shard] is not None:
                self.to_sha.put((shard, buffer, got))
            else:
                self.free.put(buffer)

    def _hash_source(self) -> None:
        """The sha256 thread: hash each chunk of an uncached source, then return its buffer."""
        try:
            while (item := self.pipeline.get(self.to_sha)) is not None:
                shard, buffer, got = item
                self.sha[shard].update(memoryview(buffer)[:got])  # type: ignore[union-attr]
                self.free.put(buffer)
                self.hashed(got)
        except BaseException as err:
            self.pipeline.fail(err)

    def _submit(self, name: str) -> None:
        first = self.first_piece[name]
        self.output_hasher.submit(self.outputs[first.output][0], name, first.position, self.unit_lengths[name])

    def expected_hashes(self, output_hashes: OutputHashes, output_units: dict[tuple[str, int], str]) -> dict[str, str]:
        """Each output tensor's expected xxh3-128 (of its source slices, in output order).

        A tensor whose hash units all read back equal to the source bytes they were copied from
        is, byte for byte, the concatenation of its source slices: its expected hash is the one
        read back. Any other tensor is hashed again from the source, so that a failure shows the
        true hash.
        """
        expected = {}
        fds: dict[int, int] = {}
        buffer: bytearray | None = None
        try:
            for name, tensor in self.plan.tensors.items():
                units = [(name, k) for k in range(len(self.unit_lengths[name]))]
                if name in output_hashes and all(
                    self.source_units[u].hexdigest() == output_units.get(u) for u in units
                ):
                    expected[name] = output_hashes[name][2]
                    continue
                buffer = buffer or bytearray(CHUNK)
                shard = tensor.ranges[0].shard
                if shard not in fds:
                    fds[shard] = os.open(self.model.paths[shard], os.O_RDONLY)
                expected[name] = xxh3_of_ranges(fds[shard], [(r.offset, r.length) for r in tensor.ranges], buffer)
        finally:
            for fd in fds.values():
                os.close(fd)
        return expected


def replaced_files(plan: PrunePlan) -> list[Path]:
    """Existing files of an earlier output under the same name that the new one does not contain
    (old shards of another split count, or the single file a split output replaces); never a source."""
    directory = plan.outputs[0].parent
    try:
        names = sorted(os.listdir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
    planned = {p.name for p in plan.outputs}
    found = []
    for name in names:
        path = directory / name
        if name in planned or not plan.is_output_name(name) or not path.is_file():
            continue
        if any(same_file(path, source) for source in plan.sources):
            continue
        found.append(path)
    return found


def interrupted_swap(plan: PrunePlan) -> bool:
    """Whether the output directory holds what a run killed while renaming a split output into
    place leaves (see `atomic_outputs`): the first output missing, a dead run's temp file of it,
    and other files of the output present. Finishing that run's replacement needs no --force."""
    first = plan.outputs[0]
    if len(plan.outputs) < 2 or first.exists():
        return False
    others = [p for p in plan.outputs[1:] if p.exists()]
    return bool(others) and bool(dead_temps(first.parent, first.name.__eq__))


def execute(
    plan: PrunePlan,
    model: GGUFModel,
    *,
    force: bool = False,
    on_event: Sink = ignore,
    report_path: Path | None = None,
    write_report: bool = True,
) -> PruneResult:
    """Write the plan's outputs (temp names, fsync, rename), verify them, and write the report
    (unless `write_report` is False: a step of a larger run that records the outputs itself).

    A split output is replaced as a set: every shard is written and verified under its temp name
    first; shards of an earlier output of the same name that the new set does not contain are
    removed. Temp files of dead runs of this output are removed before the free-space check, and
    a replacement a dead run left half done (`interrupted_swap`) is finished without `force`.
    The outputs are durable (fsync) before the report is written, and renamed after it.
    """
    t_start = time.perf_counter()
    report_path = report_path or default_report_path(plan)
    replaces = replaced_files(plan)
    force = force or interrupted_swap(plan)
    check_outputs(
        plan.outputs, list(plan.sources), plan.bytes_out, force, replaces=replaces, belongs=plan.is_output_name
    )
    timings: dict[str, float] = {}
    with atomic_outputs(plan.outputs, replaces) as outputs:
        t_copy = time.perf_counter()
        copy_pass = _CopyPass(plan, model, outputs, on_event)
        source_sha256, output_hashes, output_units = copy_pass.run()
        timings["write_seconds"] = time.perf_counter() - t_copy
        t_verify = time.perf_counter()
        if plan.provenance:
            _fill_source_sha256(plan.files[0], outputs[0][1], source_sha256)
        expected = copy_pass.expected_hashes(output_hashes, output_units)
        written = [read_file(temp) for temp, _ in outputs]
        verification = verify_prune(
            model,
            plan.layout,
            plan.keepset,
            written,
            expected=expected,
            output_hashes=output_hashes,
            experts_used=plan.experts_used,
        )
        verification.raise_if_failed(f"verification of {plan.outputs[0].name}")
        timings["verify_seconds"] = time.perf_counter() - t_verify
        for _, fd in outputs:
            os.fsync(fd)
        timings["total_seconds"] = time.perf_counter() - t_start
        result = PruneResult(plan, source_sha256, verification, timings, report_path)
        # The report is written before the outputs are renamed into place: a crash between the
        # two leaves a report of missing outputs, which a re-run to the same names replaces,
        # never outputs that a re-run refuses to replace without --force.
        if write_report:
            write_text_atomic(report_path, dumps(pruning_report(plan, source_sha256, verification, timings)))
    return result


def write_routed(source: Path, output: Path, experts_used: int, *, on_event: Sink = ignore) -> PruneResult:
    """`source` copied to `output` routed to N experts per token (`ggufcarve topk`): every expert kept, the used
    count rewritten (and the expert width added where the file derives it from N: moe/experts_used.py), every
    tensor and every other key byte for byte, verified by per-tensor hashes; no report. `output` is replaced."""
    from ggufcarve.moe.keepset import keep_first
    from ggufcarve.moe.layout import inspect_layout
    from ggufcarve.prune.plan import plan_prune

    model = read_model(source)
    layout = inspect_layout(model)
    plan = plan_prune(
        model, layout, keep_first(layout, layout.expert_count), output, provenance=False, experts_used=experts_used
    )
    return execute(plan, model, force=True, on_event=on_event, write_report=False)
