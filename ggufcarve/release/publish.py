"""Recording files made from a release's rungs (evaluation results, the model card) and the
documentation a user adds (LICENSE, NOTICE, extra .md files, .gitattributes) in its manifest.

The manifest is the one record of what a release publishes: a file that `ggufcarve eval` or
`ggufcarve card` writes into a release directory becomes part of it only once the manifest
describes it (`published.<kind>`: name, bytes, sha256) and SHA256SUMS lists it. A later ladder run
that rebuilds a rung drops the evaluation, card and plan records, since they describe the old
rungs; documentation records (`published.docs`, `ggufcarve release record FILE`) stay.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from pathlib import Path

from ggufcarve.errors import BadInput
from ggufcarve.fileio import sha256_file, write_text_atomic
from ggufcarve.release.lock import lock_release
from ggufcarve.release.manifest import MANIFEST_NAME, PUBLISHED_KINDS, described_files, read_manifest
from ggufcarve.release.sums import SUMS_NAME, inside, write_sums
from ggufcarve.reports import dumps

CARD_NAME = "README.md"  # release.card.CARD_NAME
DOCS_KIND = "docs"
# Files a user may add to a release as documentation (matched case-insensitively against the file name).
DOC_PATTERNS = (
    "license*",
    "licence*",
    "notice*",
    "copying*",
    "authors*",
    "citation*",
    "*.md",
    "*.txt",
    "*.cff",
    "*.png",
    "*.jpg",
    "*.jpeg",
    "*.gif",
    "*.svg",
    "*.webp",
    ".gitattributes",
)


def is_documentation(rel: str) -> bool:
    """Whether a release-relative name is a documentation file a user may add (DOC_PATTERNS)."""
    name = rel.rsplit("/", 1)[-1].lower()
    hidden = any(part.startswith(".") for part in rel.split("/")[:-1])
    return not hidden and any(fnmatch.fnmatchcase(name, pattern) for pattern in DOC_PATTERNS)


def release_of(path: Path) -> Path | None:
    """The release directory holding `path` (itself or its nearest ancestor with a manifest)."""
    for candidate in [path, *path.parents]:
        if (candidate / MANIFEST_NAME).is_file():
            return candidate
    return None


def _describe(release: Path, files: Sequence[Path]) -> list[dict[str, object]]:
    records = []
    for path in sorted(
        files,
        key=lambda p: (
            p.resolve().relative_to(release.resolve()).as_posix()
            if p.resolve().is_relative_to(release.resolve())
            else str(p)
        ),
    ):
        if not path.resolve().is_relative_to(release.resolve()):
            raise BadInput(
                f"{path} is not inside the release {release}",
                "write evaluation results, the card and documentation inside the release directory",
            )
        rel = path.resolve().relative_to(release.resolve()).as_posix()
        if not inside(release, rel):
            raise BadInput(
                f"{path} is not inside the release {release}",
                "write evaluation results, the card and documentation inside the release directory",
            )
        if not path.is_file():
            raise BadInput(f"{path}: no such file", "give files inside the release directory")
        records.append({"name": rel, "bytes": path.stat().st_size, "sha256": sha256_file(path)})
    return records


def _write(release: Path, kind: str, records: list[dict[str, object]], *, merge: bool) -> list[dict[str, object]]:
    with lock_release(release):
        manifest = read_manifest(release)
        if manifest is None:
            raise BadInput(f"{release} has no {MANIFEST_NAME}", "run ggufcarve ladder run into it first")
        published = manifest.get("published") if isinstance(manifest.get("published"), dict) else {}
        if merge:
            earlier = [
                r
                for r in published.get(kind) or []
                if isinstance(r, dict) and r.get("name") not in {n["name"] for n in records}
            ]
            records = sorted([*earlier, *records], key=lambda r: str(r.get("name")))
        manifest["published"] = {**published, kind: records}
        write_text_atomic(release / MANIFEST_NAME, dumps(manifest))
        write_sums(release)
    return records


def record_published(release: Path, kind: str, files: Sequence[Path]) -> list[dict[str, object]]:
    """Describe `files` (inside `release`) as the release's `kind` files, replacing the kind's
    earlier record, and rewrite SHA256SUMS; under the release's lock. Returns the records."""
    if kind not in PUBLISHED_KINDS:
        raise ValueError(f"unknown published kind {kind!r}")
    return _write(release, kind, _describe(release, files), merge=False)


def record_files(release: Path, files: Sequence[Path]) -> dict[str, list[str]]:
    """`ggufcarve release record FILE...`: README.md is recorded as the card (as it is, e.g. after a
    hand edit), documentation files (DOC_PATTERNS) as `published.docs`, added to the earlier ones.
    Other files, and files the manifest describes as rungs, method reports or evaluation results,
    are refused. Returns the recorded names by kind."""
    root = release.resolve()
    manifest = read_manifest(release)
    if manifest is None:
        raise BadInput(f"{release} has no {MANIFEST_NAME}", "run ggufcarve ladder run into it first")
    published = manifest.get("published") if isinstance(manifest.get("published"), dict) else {}
    own = {str(r.get("name")) for kind in (DOCS_KIND, "card") for r in published.get(kind) or [] if isinstance(r, dict)}
    others = set(described_files(manifest)) - own
    card: list[Path] = []
    docs: list[Path] = []
    for path in files:
        full = (path if path.is_absolute() else Path.cwd() / path).resolve()
        if not full.is_relative_to(root):
            raise BadInput(
                f"{path} is not inside the release {release}", "copy it into the release directory, then record it"
            )
        rel = full.relative_to(root).as_posix()
        if not full.is_file():
            raise BadInput(f"{path}: no such file", "give a file inside the release directory")
        if rel in others or rel in (MANIFEST_NAME, SUMS_NAME):
            raise BadInput(
                f"{rel} is already part of the release as a file ggufcarve made",
                "it is recorded by the command that wrote it (ladder run, eval)",
            )
        if rel == CARD_NAME:
            card.append(full)
        elif is_documentation(rel):
            docs.append(full)
        else:
            raise BadInput(
                f"{rel} is not a documentation file",
                "record LICENSE, NOTICE, COPYING, .md, .txt, images or "
                ".gitattributes; rungs and results are recorded by ladder run and eval",
            )
    recorded: dict[str, list[str]] = {}
    if card:
        recorded["card"] = [str(r["name"]) for r in record_published(release, "card", card)]
    if docs:
        records = _describe(release, docs)
        _write(release, DOCS_KIND, records, merge=True)
        recorded[DOCS_KIND] = [str(r["name"]) for r in records]
    return recorded
