"""What a run has already done: per stage, the digest of its inputs and parameters and the files it
wrote, in WORK/run-state.json.

A stage is skipped when its digest is the recorded one and every recorded output still exists
with its recorded size and sha256 (sha256s come from the stat-keyed cache, so an untouched file
is not re-read). The state is rewritten atomically after each finished stage: a run killed in the
middle of a stage re-runs that stage and none before it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ggufcarve.errors import BadInput
from ggufcarve.events import Counter, Sink, ignore
from ggufcarve.fileio import sha256_file_cached, write_text_atomic

STATE_NAME = "run-state.json"
STATE_VERSION = 1


def file_digest(path: Path, on_event: Sink = ignore) -> str:
    """sha256 of a file (every shard of a split set is a separate input), with hashing progress."""
    counter = Counter(on_event, "hash", path.stat().st_size)
    return sha256_file_cached(path, counter)


def stage_digest(stage: str, parameters: Mapping[str, Any], inputs: Sequence[tuple[str, str]]) -> str:
    """The digest of a stage's parameters and its input files (name, sha256), order-independent in the inputs."""
    doc = {"stage": stage, "parameters": parameters, "inputs": sorted(inputs)}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


class RunState:
    def __init__(self, work: Path) -> None:
        self.path = work / STATE_NAME
        self.stages: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            try:
                doc = json.loads(self.path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
                raise BadInput(
                    f"{self.path}: unreadable run state ({err})", f"remove {self.path.name} to run every stage again"
                ) from None
            if isinstance(doc, dict) and doc.get("version") == STATE_VERSION and isinstance(doc.get("stages"), dict):
                self.stages = doc["stages"]

    def done(self, stage: str, digest: str, base: Path) -> bool:
        """True when `stage` ran with this digest and its outputs are unchanged."""
        record = self.stages.get(stage)
        if not isinstance(record, dict) or record.get("digest") != digest:
            return False
        outputs = record.get("outputs")
        if not isinstance(outputs, dict):
            return False
        for rel, facts in outputs.items():
            path = base / rel
            if (
                not path.is_file()
                or path.stat().st_size != facts.get("bytes")
                or sha256_file_cached(path) != facts.get("sha256")
            ):
                return False
        return True

    def outputs(self, stage: str) -> dict[str, dict[str, Any]]:
        record = self.stages.get(stage)
        return record.get("outputs", {}) if isinstance(record, dict) else {}

    def record(self, stage: str, digest: str, base: Path, outputs: Sequence[Path], seconds: float) -> None:
        self.stages[stage] = {
            "digest": digest,
            "seconds": round(seconds, 3),
            "outputs": {
                p.resolve().relative_to(base.resolve()).as_posix(): {
                    "bytes": p.stat().st_size,
                    "sha256": sha256_file_cached(p),
                }
                for p in outputs
            },
        }
        self.save()

    def forget(self, stage: str) -> None:
        if self.stages.pop(stage, None) is not None:
            self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(
            self.path, json.dumps({"version": STATE_VERSION, "stages": self.stages}, indent=1, sort_keys=True) + "\n"
        )
