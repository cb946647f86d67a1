"""Where llama.cpp really computed: the devices each child's loader assigned the layers to, as its own
"load_tensors: layer N assigned to device D" lines (src/llama-model.cpp, debug level) say, per stage of a
command.

    with recording() as computed:
        with stage("tournament"):
            ...                                   # children started here report their layers
    computed.to_json()    # {"tournament": [{"layers": {"RPC0": 5}, "children": 3}]}

llama.cpp names one layer per block and one for the output layer (n_layer + 1 in all); a layer
"assigned to device CPU" computes on the CPU. A libllama child reports its load through the child
protocol (`llama.child`), a llama.cpp tool through its log lines (`layers_of`); the parent records
each under the stage open when the child ran (the child's task name where none is open).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

DRY_LOAD = "dry-load"  # a memory measurement's load (no_alloc): its own stage wherever it runs
LAYER_LINE = re.compile(r"load_tensors: layer +(?P<layer>\d+) assigned to device (?P<device>[^,\s]+)")


def layers_of(lines: Iterable[str]) -> dict[str, int]:
    """Device -> the number of layers llama.cpp's loader assigned it, from its log lines (the last
    load's when the lines hold several)."""
    assigned: dict[int, str] = {}
    for line in lines:
        m = LAYER_LINE.search(line)
        if m:
            if int(m["layer"]) == 0:
                assigned = {}
            assigned[int(m["layer"])] = m["device"]
    counts: dict[str, int] = {}
    for device in assigned.values():
        counts[device] = counts.get(device, 0) + 1
    return dict(sorted(counts.items()))


@dataclass
class Computed:
    """Per stage, each distinct assignment of layers to devices and how many children had it."""

    stages: dict[str, dict[tuple[tuple[str, int], ...], int]] = field(default_factory=dict)

    def add(self, stage_name: str, layers: dict[str, int]) -> None:
        if not layers:
            return
        seen = self.stages.setdefault(stage_name, {})
        key = tuple(sorted(layers.items()))
        seen[key] = seen.get(key, 0) + 1

    def devices(self, stage_name: str) -> set[str]:
        """The devices that computed a layer of `stage_name`."""
        return {device for key in self.stages.get(stage_name, {}) for device, _ in key}

    def to_json(self) -> dict[str, list[dict[str, Any]]]:
        return {
            name: [{"layers": dict(key), "children": count} for key, count in sorted(seen.items())]
            for name, seen in sorted(self.stages.items())
        }


def in_words(seen: list[dict[str, Any]] | None) -> str:
    """A stage's `Computed.to_json()` entries in words: "RPC0 5/5 layers", "CUDA0 30/41 layers + CPU
    11/41 layers (2 children)", "not recorded" for a stage no child reported."""
    if not seen:
        return "not recorded"
    parts = []
    for entry in seen:
        layers = entry["layers"]
        total = sum(layers.values())
        text = " + ".join(f"{device} {count}/{total} layers" for device, count in layers.items())
        parts.append(text + (f" ({entry['children']} children)" if entry.get("children", 1) > 1 else ""))
    return "; ".join(parts)


_lock = threading.Lock()
_recorders: list[Computed] = []
_stages: list[str] = []


@contextmanager
def recording() -> Iterator[Computed]:
    """Record where every child started inside the block computed."""
    computed = Computed()
    with _lock:
        _recorders.append(computed)
    try:
        yield computed
    finally:
        with _lock:
            _recorders.remove(computed)


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Children started inside the block are recorded as `name`'s."""
    with _lock:
        _stages.append(name)
    try:
        yield
    finally:
        with _lock:
            _stages.remove(name)


def record(layers: dict[str, int], task: str = "") -> None:
    """A child's layers, under the innermost open stage (else `task`; a dry load's always under
    DRY_LOAD), for every recording open."""
    with _lock:
        name = DRY_LOAD if task == DRY_LOAD else _stages[-1] if _stages else task or "other"
        for computed in _recorders:
            computed.add(name, layers)
