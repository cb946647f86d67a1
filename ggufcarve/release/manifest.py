"""quant-manifest.json: the one record of what a release holds and how it was made.

It is assembled from per-rung fragments (release.fragments) under the release's lock
(release.lock). It describes every file the release publishes: each rung's files (with the sha256
of the source files the rung was made from), the method reports under `method/`, and itself. SHA256SUMS lists
exactly these files, and `verify` fails on any other file in the directory. A release is made
from one source: a ladder run with another source is refused unless it starts the release afresh.
File names are relative to the release directory; no local path is recorded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ggufcarve.errors import BadInput, OutputError
from ggufcarve.reports import read_json_object

MANIFEST_KIND = "quant-manifest"
MANIFEST_NAME = "quant-manifest.json"
# Files made from the rungs after the ladder (evaluation results, the model card, the run plan), recorded under
# manifest["published"][kind]; a manifest whose rung files changed drops them: they describe the old rungs.
# "docs" records documentation a user adds (`ggufcarve release record FILE`); it describes no rung and stays.
PUBLISHED_KINDS = ("evaluation", "card", "plan", "docs")
KEPT_KINDS = ("docs",)
FRESH_START_HINT = (
    "write to another -o directory, or pass --force to start the release afresh, which removes its old rungs"
)


def read_manifest(out_dir: Path) -> dict[str, Any] | None:
    """The manifest of the release in out_dir; None when there is none. A manifest that cannot be
    read or is not a ladder manifest raises: the directory's record must never be guessed at."""
    path = out_dir / MANIFEST_NAME
    hint = f"restore it from the published release, {FRESH_START_HINT}"
    loaded = read_json_object(path, hint)
    if loaded is None:
        return None
    doc = loaded[1]
    if not isinstance(doc.get("rungs"), list) or not isinstance(doc.get("source"), dict):
        raise BadInput(f"{path} is not a ladder manifest (no rungs and source records)", hint)
    for i, rung in enumerate(doc["rungs"]):
        files = (rung.get("files") or []) if isinstance(rung, dict) else None
        if not isinstance(files, list) or not all(
            isinstance(f, dict) and isinstance(f.get("name"), str) for f in files
        ):
            raise BadInput(
                f"{path}: rungs[{i}] is not a rung record (an object whose files are objects with a name)", hint
            )
    return doc


def recorded_source(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The source files a manifest names: [{name, bytes, sha256}] in shard order."""
    files = manifest.get("source", {}).get("files")
    return [f for f in files if isinstance(f, dict)] if isinstance(files, list) else []


def check_same_source(out_dir: Path, manifest: dict[str, Any], source: list[dict[str, Any]]) -> None:
    """Refuse a run whose source is not the one the release in out_dir was made from.

    `source` entries carry name, bytes and sha256; a sha256 of None (a dry run hashes nothing)
    compares sizes only.
    """
    recorded = recorded_source(manifest)
    hashed = all(f.get("sha256") for f in source)
    if hashed:
        same = [f.get("sha256") for f in recorded] == [f["sha256"] for f in source]
    else:
        same = [f.get("bytes") for f in recorded] == [f["bytes"] for f in source]
    if not same:

        def show(files: list[dict[str, Any]]) -> str:
            names = ", ".join(str(f.get("name")) for f in files) or "nothing"
            digests = ", ".join(str(f.get("sha256"))[:12] for f in files if f.get("sha256"))
            return f"{names} (sha256 {digests})" if digests else names

        raise OutputError(
            f"{out_dir} holds the release of {show(recorded)}; this source, {show(source)}, is another model",
            FRESH_START_HINT,
        )


def described_files(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every file the manifest describes, by relative name: rung files and method reports
    ({name, bytes, sha256, ...} as recorded). The manifest itself is not included."""
    described: dict[str, dict[str, Any]] = {}
    for rung in manifest.get("rungs", []) if isinstance(manifest.get("rungs"), list) else []:
        if isinstance(rung, dict) and isinstance(rung.get("files"), list):
            for f in rung["files"]:
                if isinstance(f, dict) and isinstance(f.get("name"), str) and f["name"]:
                    described[f["name"]] = f
    for f in manifest.get("method", []) if isinstance(manifest.get("method"), list) else []:
        if isinstance(f, dict) and isinstance(f.get("name"), str) and f["name"]:
            described[f["name"]] = f
    published = manifest.get("published") if isinstance(manifest.get("published"), dict) else {}
    for kind in PUBLISHED_KINDS:
        for f in published.get(kind, []) if isinstance(published.get(kind), list) else []:
            if isinstance(f, dict) and isinstance(f.get("name"), str) and f["name"]:
                described[f["name"]] = f
    return described
