"""A prune as a plan (pure data): each output tensor is a list of source byte ranges, plus the new header."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from gguf.constants import GGUFValueType, Keys
from gguf.utility import model_weight_count_rounded_notation

from ggufcarve.errors import BadInput
from ggufcarve.gguf.container import (
    SHARD_NAME,
    SPLIT_COUNT,
    SPLIT_KEYS,
    SPLIT_NO,
    SPLIT_TENSORS_COUNT,
    GGUFModel,
    KeyValue,
    TensorHeader,
    encode_header,
    make_kv,
    pad_to,
    replace_kvs,
    shard_paths,
)
from ggufcarve.moe.experts_used import (
    TRAINED_KEY,
    check_experts_used,
    experts_used_records,
    used_count_key,
    with_experts_used,
)
from ggufcarve.moe.keepset import KeepSet, check_keepset, provenance_kvs
from ggufcarve.moe.layout import MoeLayout

PROVENANCE = "ggufcarve."
KEY_SOURCE_SHA256 = "ggufcarve.source.sha256"  # one entry per source file, filled in after hashing
SHA256_PLACEHOLDER = "0" * 64


def jsonable(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else value


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
    split_max_size: int | None = None  # bytes of tensor data per output shard, as llama-gguf-split
    merge: bool = False  # a split source written as one file
    experts_used: int | None = None  # the {arch}.expert_used_count written; None: the source's kept

    @property
    def kept_count(self) -> int:
        return self.keepset.kept_count

    @property
    def pruned(self) -> bool:
        return self.kept_count != self.layout.expert_count

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

    def is_output_name(self, name: str) -> bool:
        """Whether a file name in the output directory is a form of this output: a planned file,
        PREFIX.gguf, or a shard PREFIX-NNNNN-of-MMMMM.gguf of any count (PREFIX: the output name
        without .gguf and shard suffix). A new output replaces all of them."""
        first = self.outputs[0]
        prefix = Path(_shard_prefix(first)).name
        if name in {p.name for p in self.outputs} or (first.suffix == ".gguf" and name == f"{prefix}.gguf"):
            return True
        match = SHARD_NAME.match(name)
        return match is not None and match["prefix"] == prefix

    def to_json(self) -> dict[str, Any]:
        pruned = [t for t in self.tensors.values() if t.pruned]
        return {
            "sources": [{"path": str(p), "bytes": s} for p, s in zip(self.sources, self.source_sizes)],
            "outputs": [{"path": str(f.path), "bytes": f.size, "tensors": len(f.tensors)} for f in self.files],
            "expert_count": {"before": self.layout.expert_count, "after": self.kept_count},
            "expert_used_count": {
                "before": self.layout.expert_used_count,
                "after": self.layout.expert_used_count if self.experts_used is None else self.experts_used,
            },
            "moe_blocks": list(self.layout.blocks),
            "tensors_total": len(self.tensors),
            "tensors_pruned": sorted(t.name for t in pruned),
            "changed_keys": {
                k: {"before": jsonable(a), "after": jsonable(b)} for k, (a, b) in sorted(self.changed_keys.items())
            },
            "provenance_keys": self.provenance,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "warnings": list(self.warnings),
        }


def expert_records(model: GGUFModel, layout: MoeLayout, kept: int, experts_used: int | None) -> dict[str, KeyValue]:
    """The expert keys an output of K kept experts routed to N writes, where they differ from the
    source's records: `{arch}.expert_count` (u32 K), and the used count with the expert width a
    changed N needs (moe/experts_used.py)."""
    key = Keys.LLM.EXPERT_COUNT.format(arch=layout.architecture)
    records = {} if kept == layout.expert_count else {key: make_kv(key, GGUFValueType.UINT32, kept)}
    if experts_used is not None:
        records.update(experts_used_records(model, layout, experts_used))
    source = model.metadata.kv_index
    return {k: r for k, r in records.items() if k not in source or source[k].raw != r.raw}


def tensor_ranges(
    model: GGUFModel, layout: MoeLayout, keepset: KeepSet
) -> dict[str, tuple[tuple[int, ...], tuple[SourceRange, ...]]]:
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

    Forms: "<N>x<size>" (gguf.utility.size_label of a MoE: size counts the shared parameters and
    one expert's, which pruning keeps) -> "<K>x<size>"; "<total>-A<active>" and "<total>" -> total
    recomputed from the pruned tensor shapes (gguf.utility.model_weight_count_rounded_notation).
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
    experts_used: int | None = None,
) -> PrunePlan:
    """Everything the executor will do, decided before a byte is written. `experts_used` rewrites
    the experts each token is routed to (moe/experts_used.py); the keep-set must then hold K >= it."""
    if experts_used is not None:
        check_experts_used(model, layout, experts_used)
    used_layout = layout if experts_used is None else with_experts_used(layout, experts_used)
    warnings = list(check_keepset(keepset, used_layout))
    kept = keepset.kept_count
    ranges = tensor_ranges(model, layout, keepset)
    source_tensors = [(i, t) for i, shard in enumerate(model.shards) for t in shard.tensors]
    planned = {
        t.name: PlannedTensor(t.name, ranges[t.name][0], t.type_id, ranges[t.name][1], t.shape)
        for _, t in source_tensors
    }

    meta = model.metadata
    changes: dict[str, KeyValue | None] = {}
    changed_keys: dict[str, tuple[Any, Any]] = {}
    for key, record in expert_records(model, layout, kept, experts_used).items():
        changes[key] = record
        changed_keys[key] = (jsonable(meta.get(key)), jsonable(record.value))
    label = meta.get(Keys.General.SIZE_LABEL)
    if isinstance(label, str) and kept != layout.expert_count:
        total_params = sum(
            t.n_elements * (kept if t.name in layout.expert_tensors else t.shape[-1]) // t.shape[-1]
            for t in model.tensors
        )
        new_label = relabel_size(label, total_params, kept, layout.expert_count)
        if new_label is None:
            warnings.append(f"{Keys.General.SIZE_LABEL} {label!r} has a form ggufcarve does not know; left unchanged")
        elif new_label != label:
            changes[Keys.General.SIZE_LABEL] = make_kv(Keys.General.SIZE_LABEL, GGUFValueType.STRING, new_label)
            changed_keys[Keys.General.SIZE_LABEL] = (label, new_label)
    if provenance:
        source_sha256 = make_kv(
            KEY_SOURCE_SHA256, GGUFValueType.ARRAY, [SHA256_PLACEHOLDER] * len(model.shards), GGUFValueType.STRING
        )
        for kv in (source_sha256, *provenance_kvs(keepset, layout.expert_count)):
            changes[kv.key] = kv
        if used_count_key(layout) in changed_keys:
            changes[TRAINED_KEY] = make_kv(TRAINED_KEY, GGUFValueType.UINT32, layout.expert_used_count)

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
        split_max_size=split_max_size,
        merge=merge,
        experts_used=experts_used,
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
