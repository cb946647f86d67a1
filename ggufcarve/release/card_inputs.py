"""What a model card is written from, all inside the release directory: the manifest, the first rung's GGUF
keys, the pruning and selection records, and the evaluation documents."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf.constants import Keys

from ggufcarve.errors import BadInput
from ggufcarve.moe.experts_used import TRAINED_KEY
from ggufcarve.moe.keepset import KEY_KEPT_COUNT, KEY_SOURCE_EXPERT_COUNT
from ggufcarve.release.card_metadata import gguf_key_names, key_name

EVALUATION_DIR = "evaluation"
KLD_CHART = "size-vs-kld.png"  # evaluate.summary.KLD_CHART
SPEED_CHART = "speed-vs-kld.png"  # evaluate.summary.SPEED_CHART
SEGMENT_CHART = "size-vs-kld-segments.png"  # evaluate.summary.SEGMENT_CHART
SUMMARY = "summary.md"  # evaluate.summary.SUMMARY


@dataclass
class CardInputs:
    manifest: dict
    rungs: list[dict]  # built rungs whose files are present
    keys: dict[str, Any]  # GGUF keys of the first rung
    pruning: dict | None
    selection: dict | None
    evaluation: dict[str, dict]  # model file name -> evaluation document (rungs and the models compared with them)
    evaluation_dir: str | None = None  # the evaluation directory relative to the release, when inside it
    linked: frozenset[str] = frozenset()  # files of the release the card may link (relative names)
    tournament: bool = False  # method/tune.md is in the release (the selection won `ggufcarve tune`)


def read_card_json(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
    except ValueError as err:
        raise BadInput(
            f"{path}: not valid JSON ({err})", "re-create it, or remove it to leave it out of the card"
        ) from None
    return doc if isinstance(doc, dict) else None


def rung_bytes(rung: dict) -> int:
    files = [f for f in rung.get("files") or [] if isinstance(f, dict)]
    return int(sum(f.get("bytes") or 0 for f in files)) or int(rung.get("bytes") or 0)


def gather(release: Path, evaluation_dir: Path | None = None) -> CardInputs:
    from ggufcarve.gguf.container import read_model
    from ggufcarve.release.manifest import MANIFEST_NAME, read_manifest

    manifest = read_manifest(release)
    if manifest is None:
        raise BadInput(f"{release}: no {MANIFEST_NAME}", "give a release directory made by ggufcarve ladder run")
    rungs = [
        r
        for r in manifest.get("rungs", [])
        if r.get("status") in ("built", "skipped")
        and r.get("files")
        and all((release / f["name"]).exists() for f in r["files"])
    ]
    if not rungs:
        raise BadInput(
            f"{release}: the manifest lists no built rung present in the directory", "run ggufcarve ladder run first"
        )
    model = read_model(release / rungs[0]["files"][0]["name"])
    names = gguf_key_names()
    arch = model.get(names["architecture"])
    wanted = [
        names[k]
        for k in (
            "name",
            "basename",
            "size_label",
            "license",
            "license_name",
            "license_link",
            "base_count",
            "architecture",
        )
    ]
    wanted += [KEY_KEPT_COUNT, KEY_SOURCE_EXPERT_COUNT, TRAINED_KEY]
    count = model.get(names["base_count"])
    for i in range(int(count) if isinstance(count, int) and count > 0 else 1):
        wanted += [key_name(names[k], id=i) for k in ("base_name", "base_org", "base_repo_url")]
    if arch:
        wanted += [
            k.format(arch=arch)
            for k in (
                Keys.LLM.EXPERT_COUNT,
                Keys.LLM.EXPERT_USED_COUNT,
                Keys.LLM.BLOCK_COUNT,
                Keys.LLM.NEXTN_PREDICT_LAYERS,
            )
        ]
        wanted.append(key_name(names["context_length"], arch=arch))
    keys = {k: model.get(k) for k in wanted}
    evaluation: dict[str, dict] = {}
    directory = (evaluation_dir or release / EVALUATION_DIR).resolve()
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        doc = read_card_json(path)
        if doc and isinstance(doc.get("model"), dict) and "ppl" in doc:
            evaluation[doc["model"]["file"]] = doc
    root = release.resolve()
    inside = directory.is_relative_to(root)
    linked = (
        frozenset(p.relative_to(root).as_posix() for p in directory.iterdir() if p.is_file())
        if inside and directory.is_dir()
        else frozenset()
    )
    return CardInputs(
        manifest,
        rungs,
        keys,
        read_card_json(release / "method" / "pruning-report.json"),
        read_card_json(release / "method" / "expert-selection.json"),
        evaluation,
        directory.relative_to(root).as_posix() if inside else None,
        linked,
        (release / "method" / "tune.md").is_file(),
    )
