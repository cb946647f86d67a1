"""Recording files made from a release's rungs (evaluation results, the model card) in its manifest.

The manifest is the one record of what a release publishes: a file that `ggufcarve eval` or
`ggufcarve card` writes into a release directory becomes part of it only once the manifest
describes it (`published.<kind>`: name, bytes, sha256) and SHA256SUMS lists it. A later ladder run
that rebuilds a rung drops these records, since they describe the old rungs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ggufcarve.errors import BadInput
from ggufcarve.fileio import sha256_file, write_text_atomic
from ggufcarve.release.lock import lock_release
from ggufcarve.release.manifest import MANIFEST_NAME, PUBLISHED_KINDS, read_manifest
from ggufcarve.release.sums import inside, write_sums
from ggufcarve.reports import dumps


def release_of(path: Path) -> Path | None:
    """The release directory holding `path` (itself or its nearest ancestor with a manifest)."""
    for candidate in [path, *path.parents]:
        if (candidate / MANIFEST_NAME).is_file():
            return candidate
    return None


def record_published(release: Path, kind: str, files: Sequence[Path]) -> list[dict[str, object]]:
    """Describe `files` (inside `release`) as the release's `kind` files, replacing the kind's
    earlier record, and rewrite SHA256SUMS; under the release's lock. Returns the records."""
    if kind not in PUBLISHED_KINDS:
        raise ValueError(f"unknown published kind {kind!r}")
    records = []
    for path in sorted(files, key=lambda p: p.resolve().relative_to(release.resolve()).as_posix()):
        rel = path.resolve().relative_to(release.resolve()).as_posix()
        if not inside(release, rel):
            raise BadInput(f"{path} is not inside the release {release}", "write evaluation results and the card inside the release directory")
        records.append({"name": rel, "bytes": path.stat().st_size, "sha256": sha256_file(path)})
    with lock_release(release):
        manifest = read_manifest(release)
        if manifest is None:
            raise BadInput(f"{release} has no {MANIFEST_NAME}", "run ggufcarve ladder run into it first")
        published = manifest.get("published") if isinstance(manifest.get("published"), dict) else {}
        manifest["published"] = {**published, kind: records}
        write_text_atomic(release / MANIFEST_NAME, dumps(manifest))
        write_sums(release)
    return records
