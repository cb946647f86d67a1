"""KeepSet: per MoE block, the original expert ids kept, in the order they will be stored.

Our file format (JSON): {"layers": {"<blk index>": [ids...]}, ...free metadata}. Also read:
- kept_expert_indices.json: {"main_<i>": [ids] | {"keep": [ids]}, "mtp_<j>": ...}; mtp_j is block n_layer + j
- carve_manifest.json / expert-selection.json: per-layer retained/kept ids, keyed by block or as a
  list of {"layer": i, "retained": [...]} records.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf.constants import GGUFValueType

from ggufcarve import __version__
from ggufcarve.errors import BadInput
from ggufcarve.gguf.container import KeyValue, make_kv
from ggufcarve.listing import shortened
from ggufcarve.moe.kept import KEPT_COUNT_HINT, check_kept_count, groups_of, kept_count_problems
from ggufcarve.moe.layout import MoeLayout
from ggufcarve.reports import read_json_bytes

# Field names published manifests use for the kept ids of one layer.
KEPT_ID_FIELDS = (
    "keep",
    "kept",
    "retained",
    "kept_ids",
    "retained_ids",
    "kept_experts",
    "retained_experts",
    "kept_expert_indices",
    "indices",
    "experts",
)
# Field names under which a manifest nests its per-layer mapping.
LAYER_MAP_FIELDS = (
    "layers",
    "kept_expert_indices",
    "kept_experts",
    "retained_experts",
    "kept",
    "retained",
    "selection",
    "experts",
)
LAYER_NUMBER_FIELDS = ("layer", "block", "layer_index", "block_index", "blk")
LAYER_KEY = re.compile(r"^(?:(?P<kind>main|mtp|layer|blk|block|model\.layers)[._-]?)?(?P<index>\d+)$")
# pick(block, the ids of one routing group, how many to keep) -> the kept ids of that group
Pick = Callable[[int, range, int], Sequence[int]]


@dataclass(frozen=True)
class KeepSet:
    layers: dict[int, tuple[int, ...]]
    metadata: dict[str, Any] = field(default_factory=dict)
    file: dict[str, Any] | None = field(
        default=None, compare=False
    )  # the file it was read from: name (no directory), sha256, bytes

    @property
    def kept_count(self) -> int:
        counts = {len(ids) for ids in self.layers.values()}
        return counts.pop() if len(counts) == 1 else -1

    def to_json(self) -> dict[str, Any]:
        return {**self.metadata, "layers": {str(b): list(ids) for b, ids in sorted(self.layers.items())}}

    @classmethod
    def as_written(cls, keepset: KeepSet, doc: Any, raw: bytes, name: str) -> KeepSet:
        """The keep-set `load_keepset` reads from a file named `name` holding `raw` (the JSON
        document `doc`, whose kept ids are `keepset`'s): its metadata and file record."""
        metadata = {k: v for k, v in doc.items() if k != "layers"} if isinstance(doc, dict) and "layers" in doc else {}
        return cls(
            dict(keepset.layers),
            {**metadata, "source_file": name},
            {"name": name, "sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)},
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        from ggufcarve.fileio import write_text_atomic

        write_text_atomic(Path(path), json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n")


def _first(block: int, members: range, quota: int) -> Sequence[int]:
    return members[:quota]


def keep_per_block(layout: MoeLayout, kept: int, pick: Pick = _first, selection: str | None = None) -> KeepSet:
    """K experts in every MoE block, K/groups from every routing group, stored group by group in
    ascending id order (the order llama.cpp's grouped top-k needs). `pick` chooses a group's kept
    ids (default: its first ones). Raises BadInput when K breaks the load rules of moe/kept.py."""
    check_kept_count(layout, kept)
    groups = groups_of(layout)
    size = layout.expert_count // groups
    quota = kept // groups
    layers = {}
    for block in layout.blocks:
        chosen: list[int] = []
        for g in range(groups):
            members = range(g * size, (g + 1) * size)
            ids = sorted(pick(block, members, quota))
            if len(ids) != quota or len(set(ids)) != quota or not all(i in members for i in ids):
                raise ValueError(
                    f"blk.{block}: pick gave {ids} for group {g}, not {quota} "
                    f"distinct ids of {members.start}..{members.stop - 1}"
                )
            chosen.extend(ids)
        layers[block] = tuple(chosen)
    label = f"first {kept}" if groups == 1 else f"first {quota} of each of the {groups} groups"
    return KeepSet(layers, {"selection": selection or label})


def keep_first(layout: MoeLayout, count: int) -> KeepSet:
    """The first `count` experts of every MoE block; with grouped routing the first count/groups of every group."""
    return keep_per_block(layout, count)


def keep_ids(layout: MoeLayout, ids: Iterable[int]) -> KeepSet:
    """The same ids, in the given order, in every MoE block."""
    ids = tuple(ids)
    return KeepSet({b: ids for b in layout.blocks}, {"selection": "ids given on the command line"})


# Keys a ggufcarve output (pruned model or remapped imatrix) carries to say what it kept.
KEY_VERSION = "ggufcarve.version"
KEY_SOURCE_EXPERT_COUNT = "ggufcarve.source.expert_count"
KEY_KEPT_COUNT = "ggufcarve.kept_expert_count"
KEY_KEPT_BLOCKS = "ggufcarve.kept_blocks"
KEY_KEPT_EXPERTS = "ggufcarve.kept_experts"  # blocks x K ids, row-major in KEY_KEPT_BLOCKS order


def provenance_kvs(keepset: KeepSet, source_expert_count: int) -> list[KeyValue]:
    """The ggufcarve.* records describing a keep-set: version, expert counts, kept ids per block."""
    blocks = sorted(keepset.layers)
    return [
        make_kv(KEY_VERSION, GGUFValueType.STRING, __version__),
        make_kv(KEY_SOURCE_EXPERT_COUNT, GGUFValueType.UINT32, source_expert_count),
        make_kv(KEY_KEPT_COUNT, GGUFValueType.UINT32, keepset.kept_count),
        make_kv(KEY_KEPT_BLOCKS, GGUFValueType.ARRAY, blocks, GGUFValueType.UINT32),
        make_kv(
            KEY_KEPT_EXPERTS, GGUFValueType.ARRAY, [e for b in blocks for e in keepset.layers[b]], GGUFValueType.UINT32
        ),
    ]


def keepset_from_provenance(get: Callable[[str], Any], name: str) -> KeepSet | None:
    """The keep-set recorded by provenance_kvs in a file whose keys `get` reads, if it has one."""
    blocks, experts, kept = get(KEY_KEPT_BLOCKS), get(KEY_KEPT_EXPERTS), get(KEY_KEPT_COUNT)
    if blocks is None or experts is None or not kept or len(experts) != len(blocks) * kept:
        return None
    ids = [int(e) for e in experts]
    layers = {int(b): tuple(ids[i * kept : (i + 1) * kept]) for i, b in enumerate(blocks)}
    return KeepSet(layers, {"selection": f"read from {name} ({KEY_KEPT_EXPERTS})"})


def parse_id_list(text: str) -> list[int]:
    """'0,1,4-7' -> [0, 1, 4, 5, 6, 7]."""
    ids: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = part.split("-", 1)
                ids.extend(range(int(lo), int(hi) + 1))
            else:
                ids.append(int(part))
        except ValueError:
            raise BadInput(f"--keep-ids: {part!r} is not an id or a range", "write ids like 0,1,4-7") from None
    return ids


def load_keepset(path: str | os.PathLike[str], layout: MoeLayout) -> KeepSet:
    """Read our format or a published manifest; layer keys resolve to GGUF block indices."""
    path = Path(path)
    doc, raw = read_json_bytes(path, "keep-set file", 'a keep-set is a JSON file such as {"layers": {"0": [0, 1]}}')
    return KeepSet.as_written(KeepSet(_find_layers(doc, path, layout)), doc, raw, path.name)


def _find_layers(doc: Any, path: Path, layout: MoeLayout) -> dict[int, tuple[int, ...]]:
    if isinstance(doc, list):
        return _layers_from_records(doc, path, "top level", layout)
    if not isinstance(doc, dict):
        raise BadInput(
            f"{path}: top level is a {type(doc).__name__}, expected an object",
            "see `ggufcarve prune --help` for the keep-set format",
        )
    for name in LAYER_MAP_FIELDS:
        if name in doc and isinstance(doc[name], (dict, list)):
            value = doc[name]
            if isinstance(value, list):
                return _layers_from_records(value, path, name, layout)
            if value and all(_layer_key(k, layout) is not None for k in value):
                return _layers_from_mapping(value, path, name, layout)
    layer_keys = [k for k in doc if _layer_key(k, layout) is not None]
    if layer_keys:
        return _layers_from_mapping({k: doc[k] for k in layer_keys}, path, "top level", layout)
    raise BadInput(
        f"{path}: no per-layer expert lists found (looked for fields "
        f"{', '.join(LAYER_MAP_FIELDS)} and keys like main_0, mtp_0, 12)",
        'write {"layers": {"<block>": [kept ids]}}',
    )


def _layer_key(key: Any, layout: MoeLayout) -> int | None:
    match = LAYER_KEY.match(str(key))
    if not match:
        return None
    index = int(match["index"])
    if match["kind"] == "mtp" and layout.described_by != "model":
        raise BadInput(
            f"keep-set key {key!r} counts MTP blocks after the main layers, and "
            f"the {layout.described_by} does not say how many main layers there are",
            "give --model PRUNED.gguf or --source-model SOURCE.gguf, or write the keep-set with block indices",
        )
    return layout.main_layer_count + index if match["kind"] == "mtp" else index


def _ids(value: Any, path: Path, where: str) -> tuple[int, ...]:
    if isinstance(value, dict):
        name = next((f for f in KEPT_ID_FIELDS if f in value), None)
        if name is None:
            raise BadInput(
                f"{path}: {where} has no kept-id field (expected one of {', '.join(KEPT_ID_FIELDS)})",
                "give the kept ids as a list",
            )
        value, where = value[name], f"{where}.{name}"
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise BadInput(
            f"{path}: {where} is not a list of integer expert ids", "give the kept ids as a list such as [0, 3, 5]"
        )
    return tuple(value)


def _layers_from_mapping(
    mapping: dict[str, Any], path: Path, where: str, layout: MoeLayout
) -> dict[int, tuple[int, ...]]:
    layers: dict[int, tuple[int, ...]] = {}
    for key, value in mapping.items():
        block = _layer_key(key, layout)
        if block is None:
            raise BadInput(
                f"{path}: {where}: key {key!r} is not a layer (expected a block index, main_<i> or mtp_<j>)",
                "fix the key",
            )
        if block in layers:
            raise BadInput(f"{path}: {where}: block {block} is listed twice (key {key!r})", "list every MoE block once")
        layers[block] = _ids(value, path, f"{where}[{key!r}]")
    return layers


def _layers_from_records(records: list[Any], path: Path, where: str, layout: MoeLayout) -> dict[int, tuple[int, ...]]:
    layers: dict[int, tuple[int, ...]] = {}
    for i, record in enumerate(records):
        at = f"{where}[{i}]"
        if not isinstance(record, dict):
            raise BadInput(
                f"{path}: {at} is not an object with a layer number and kept ids", 'use {"layer": 3, "retained": [...]}'
            )
        number_field = next((f for f in LAYER_NUMBER_FIELDS if f in record), None)
        if number_field is None:
            raise BadInput(
                f"{path}: {at} has no layer number (expected one of {', '.join(LAYER_NUMBER_FIELDS)})",
                "add the block index",
            )
        block = _layer_key(record[number_field], layout)
        if record.get("mtp") is True and block is not None and block < layout.main_layer_count:
            block += layout.main_layer_count
        if block is None:
            raise BadInput(
                f"{path}: {at}.{number_field} = {record[number_field]!r} is not a layer index",
                "use the GGUF block index",
            )
        if block in layers:
            raise BadInput(f"{path}: {at}: block {block} is listed twice", "list every MoE block once")
        layers[block] = _ids(record, path, at)
    return layers


def check_keepset(keepset: KeepSet, layout: MoeLayout) -> list[str]:
    """Check llama.cpp's load rules before a byte is written. Raises BadInput listing every
    problem; returns warnings (routing effects that load but cost speed or quality)."""
    problems: list[str] = []
    expected = set(layout.blocks)
    missing = sorted(expected - set(keepset.layers))
    extra = sorted(set(keepset.layers) - expected)
    if missing:
        problems.append(f"MoE block(s) {_fmt(missing)} not listed")
    if extra:
        problems.append(f"block(s) {_fmt(extra)} listed but have no experts")
    n = layout.expert_count
    for block in sorted(set(keepset.layers) & expected):
        ids = keepset.layers[block]
        bad = sorted({i for i in ids if not 0 <= i < n})
        if bad:
            problems.append(f"blk.{block}: id(s) {_fmt(bad)} out of range 0..{n - 1}")
        dups = sorted({i for i in ids if ids.count(i) > 1})
        if dups:
            problems.append(f"blk.{block}: duplicate id(s) {_fmt(dups)}")
    counts = sorted({len(ids) for ids in keepset.layers.values()})
    if len(counts) > 1:
        problems.append(
            f"blocks keep different expert counts {counts}; "
            f"{layout.architecture}.expert_count is one number for all blocks"
        )
    if problems:
        raise BadInput(
            "keep-set does not fit the model: " + shortened(problems, 4),
            "list every MoE block once, with the same number of unique ids in range",
        )

    k = counts[0]
    problems = kept_count_problems(layout, k)
    if groups_of(layout) > 1 and not problems:
        problems.extend(_check_groups(keepset, layout, k))
    if problems:
        raise BadInput("keep-set breaks llama.cpp's load rules: " + shortened(problems, 4), KEPT_COUNT_HINT)

    warnings = []
    if k & (k - 1):
        warnings.append(
            f"K={k} is not a power of two: llama.cpp's fused CUDA top-k path needs one (the unfused path is slower)"
        )
    if layout.described_by == "model" and not layout.routing.keeps_outputs and k < n:
        warnings.append(f"{layout.architecture} routing is {layout.routing.describe()}")
    return warnings


def _check_groups(keepset: KeepSet, layout: MoeLayout, k: int) -> list[str]:
    """Per block: the same count from every group, ordered group by group (K itself is checked by
    kept_count_problems)."""
    groups = groups_of(layout)
    size, per_group = layout.expert_count // groups, k // groups
    problems = []
    for block, ids in sorted(keepset.layers.items()):
        group_of = [i // size for i in ids]
        if group_of != sorted(group_of):
            problems.append(
                f"blk.{block}: kept ids must be ordered group by group (groups are contiguous ranges of {size})"
            )
            continue
        per = [group_of.count(g) for g in range(groups)]
        if any(c != per_group for c in per):
            problems.append(
                f"blk.{block}: keeps {per} experts from the {groups} groups; every group must keep {per_group}"
            )
    return problems


def _fmt(ids: list[int]) -> str:
    shown = ", ".join(map(str, ids[:8]))
    return shown + (f", ... ({len(ids)} in all)" if len(ids) > 8 else "")
