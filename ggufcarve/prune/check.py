"""Checking a pruned output against its source: every tensor's xxh3-128 and every key."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from gguf.constants import Keys

from ggufcarve.errors import VerificationFailed
from ggufcarve.events import Counter, Sink, ignore
from ggufcarve.fileio import (
    CHUNK,
    xxh3_of_ranges,
)
from ggufcarve.gguf.container import (
    SPLIT_KEYS,
    GGUFFile,
    GGUFModel,
)
from ggufcarve.listing import shortened
from ggufcarve.moe.experts_used import check_experts_used, used_count_key, with_experts_used
from ggufcarve.moe.keepset import KeepSet, check_keepset
from ggufcarve.moe.layout import MoeLayout
from ggufcarve.prune.plan import PROVENANCE, expert_records, jsonable, tensor_ranges


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
        problems = self.problems + (
            [f"tensor data differs from the source slices: {shortened(bad, 5, ', ')}"] if bad else []
        )
        if problems:
            raise VerificationFailed(
                f"{where}: " + shortened(problems, 3),
                "check that the keep-set is the one the output was made with (see its "
                "method/<output stem>.pruning-report.json); otherwise re-run the prune",
            )


OutputHashes = dict[str, tuple[int, int, str]]  # tensor name -> (absolute start, length, xxh3-128) in its output file


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


def verify_prune(
    source: GGUFModel,
    layout: MoeLayout,
    keepset: KeepSet,
    output_files: list[GGUFFile],
    *,
    expected: dict[str, str] | None = None,
    output_hashes: OutputHashes | None = None,
    experts_used: int | None = None,
    on_event: Sink = ignore,
) -> Verification:
    """Check an output against its source: every tensor is the concatenation of its source slices
    (xxh3-128), every source key is byte-identical except the ones pruning changes (prune/plan.py
    `expert_records`: the expert count, and the used count `experts_used` with its expert width).

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

    records = expert_records(source, layout, kept, experts_used)
    allowed_changes = {*records, Keys.General.SIZE_LABEL}
    out_meta = output_files[0]
    for key, record in records.items():
        out_kv = out_meta.kv_index.get(key)
        if out_kv is None or out_kv.raw != record.raw:
            found = None if out_kv is None else jsonable(out_kv.value)
            problems.append(f"{key} is {found!r}, expected {jsonable(record.value)!r}")
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
            new_key = (
                kv.key not in source_keys
                and not kv.key.startswith(PROVENANCE)
                and kv.key not in SPLIT_KEYS
                and kv.key not in records
            )
            if (f_index == 0 and new_key) or (f_index > 0 and kv.key not in SPLIT_KEYS):
                problems.append(f"{f.path.name}: unexpected key {kv.key}")

    if output_hashes is None:
        verify_total = sum(t.nbytes for _, t in out_tensors)
        output_hashes = hash_output(output_files, Counter(on_event, "verify", verify_total))
    if expected is None:
        expected_total = sum(r.length for _, rs in ranges.values() for r in rs)
        buffer = bytearray(CHUNK)
        progress = Counter(on_event, "hash source", expected_total)
        fds = [os.open(p, os.O_RDONLY) for p in source.paths]
        try:
            expected = {
                name: xxh3_of_ranges(fds[rs[0].shard], [(r.offset, r.length) for r in rs], buffer, progress)
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
            problems.append(
                f"{t.name}: shape {list(t.shape)} type {t.type_name}, expected {list(shape)} {src.type_name}"
            )
        start, end = f.data_range(t)
        hashed_start, hashed_length, digest = output_hashes[t.name]
        if (hashed_start, hashed_length) != (start, end - start):
            problems.append(
                f"{t.name}: header places it at bytes {start}..{end}, but it "
                f"was written at {hashed_start}..{hashed_start + hashed_length}"
            )
        checks.append(
            TensorCheck(
                t.name,
                shape != src.shape,
                src.shape,
                t.shape,
                t.type_name,
                src.nbytes,
                t.nbytes,
                expected[t.name],
                digest,
            )
        )
    return Verification(checks, keys_checked, problems)


def check_prune(
    source: GGUFModel, layout: MoeLayout, keepset: KeepSet, output: GGUFModel, on_event: Sink = ignore
) -> Verification:
    """`ggufcarve check-prune`: re-run the verification of an existing output (a used count it was
    rewritten to, `prune --topk` or `topk`, is read from it)."""
    key = used_count_key(layout)
    written = output.metadata.kv_index.get(key)
    source_record = source.metadata.kv_index.get(key)
    experts_used = None
    if written is not None and (source_record is None or written.raw != source_record.raw):
        value = written.value
        experts_used = int(value[0] if hasattr(value, "__len__") else value)
        check_experts_used(source, layout, experts_used)
    check_keepset(keepset, layout if experts_used is None else with_experts_used(layout, experts_used))
    return verify_prune(source, layout, keepset, list(output.shards), experts_used=experts_used, on_event=on_event)
