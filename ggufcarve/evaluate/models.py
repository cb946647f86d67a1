"""What is evaluated: models given as GGUF files, split sets (their first shard) or release directories (every rung
of the manifest)."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ggufcarve.errors import BadInput

SPLIT_SUFFIX = re.compile(r"-\d{5}-of-\d{5}$")
RUNG_STATUSES = ("built", "skipped")  # manifest statuses of rungs whose files are in the release


@dataclass(frozen=True)
class ModelEntry:
    name: str  # file stem without a split suffix: DIR/<name>.json
    path: Path  # the file libllama loads (a split set's first shard)
    files: tuple[Path, ...]
    bytes: int
    quant: str  # the rung's name, else the file type named in general.file_type
    architecture: str
    expert_count: int | None
    source_expert_count: int | None  # before pruning (ggufcarve.source.expert_count)
    n_vocab: int
    vocab_sha256: str  # of the raw tokenizer.ggml.tokens record

    @property
    def pruned(self) -> bool:
        return self.source_expert_count is not None

    @property
    def family(self) -> str:
        """The series a model belongs to in the size comparison: its architecture and expert count."""
        if self.pruned:
            return f"{self.architecture} {self.expert_count} of {self.source_expert_count} experts"
        return f"{self.architecture} {self.expert_count} experts" if self.expert_count else self.architecture

    @property
    def gib(self) -> float:
        return self.bytes / 2**30


def _file_type_name(value: int | None) -> str:
    if value is None:
        return "unknown"
    from gguf.constants import LlamaFileType

    try:
        name = LlamaFileType(int(value)).name
    except ValueError:
        return f"file type {value}"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def read_entry(path: Path, quant: str | None = None) -> ModelEntry:
    """A model entry for a GGUF file or split set; the first shard names it."""
    from gguf.constants import Keys

    from ggufcarve.gguf.container import read_model
    from ggufcarve.moe.keepset import KEY_KEPT_COUNT, KEY_SOURCE_EXPERT_COUNT

    model = read_model(path)
    architecture = str(model.get(Keys.General.ARCHITECTURE, "unknown"))
    tokens = model.metadata.kv_index.get(Keys.Tokenizer.LIST)
    if tokens is None:
        raise BadInput(f"{path}: no {Keys.Tokenizer.LIST} in the file", "a model without a vocabulary cannot be scored")
    expert_count = model.get(Keys.LLM.EXPERT_COUNT.format(arch=architecture))
    source_count = model.get(KEY_SOURCE_EXPERT_COUNT) if model.get(KEY_KEPT_COUNT) is not None else None
    return ModelEntry(
        name=SPLIT_SUFFIX.sub("", model.path.stem),
        path=model.path,
        files=tuple(model.paths),
        bytes=model.total_bytes,
        quant=quant or _file_type_name(model.get(Keys.General.FILE_TYPE)),
        architecture=architecture,
        expert_count=int(expert_count) if expert_count is not None else None,
        source_expert_count=int(source_count) if source_count is not None else None,
        n_vocab=len(tokens.value),
        vocab_sha256=hashlib.sha256(tokens.raw).hexdigest(),
    )


def release_entries(directory: Path) -> list[ModelEntry]:
    """Every rung of a release directory whose files its quant-manifest.json lists and the directory holds."""
    from ggufcarve.release.manifest import MANIFEST_NAME

    manifest_path = directory / MANIFEST_NAME
    try:
        manifest = json.loads(manifest_path.read_text())
    except OSError:
        raise BadInput(
            f"{directory}: a directory but no {MANIFEST_NAME}",
            "give GGUF files or a release directory made by ggufcarve ladder run",
        ) from None
    except ValueError as err:
        raise BadInput(f"{manifest_path}: not valid JSON ({err})", "run ggufcarve verify on the release") from None
    entries = []
    for rung in manifest.get("rungs", []):
        files = rung.get("files") or []
        if rung.get("status") not in RUNG_STATUSES or not files:
            continue
        paths = [directory / f["name"] for f in files]
        if not all(p.exists() for p in paths):
            continue
        entries.append(read_entry(paths[0], quant=rung.get("name")))
    if not entries:
        raise BadInput(
            f"{directory}: the manifest lists no built rung present in the directory", "run ggufcarve ladder run first"
        )
    return entries


def resolve_models(paths: list[Path]) -> list[ModelEntry]:
    """The models named on the command line, in order; names must be unique (they name the output files)."""
    entries: list[ModelEntry] = []
    for path in paths:
        if path.is_dir():
            entries.extend(release_entries(path))
        elif path.exists():
            entries.append(read_entry(path))
        else:
            raise BadInput(
                f"{path}: no such file or directory",
                "give GGUF files, first shards of split sets or release directories",
            )
    seen: dict[str, Path] = {}
    for entry in entries:
        if entry.name in seen and seen[entry.name] != entry.path:
            raise BadInput(
                f"two models are named {entry.name}: {seen[entry.name]} and {entry.path}",
                "evaluate them into different -o directories",
            )
        seen[entry.name] = entry.path
    unique = {entry.path: entry for entry in entries}
    return list(unique.values())
