"""SHA256SUMS in sha256sum -c format, listing exactly the files the manifest describes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ggufcarve.errors import CarveError, OutputError
from ggufcarve.fileio import sha256_file, write_text_atomic
from ggufcarve.release.manifest import MANIFEST_NAME, described_files, read_manifest

SUMS_NAME = "SHA256SUMS"


def inside(out_dir: Path, rel: str) -> bool:
    """Whether a recorded relative name stays inside out_dir."""
    return not Path(rel).is_absolute() and (out_dir / rel).resolve().is_relative_to(out_dir.resolve())


def write_sums(out_dir: Path, manifest: dict[str, Any] | None = None) -> Path:
    """SHA256SUMS in `sha256sum -c` format: sorted relative POSIX paths, two spaces, LF.

    Lists the manifest and the files it describes that exist, nothing else (a file the manifest
    does not describe is not part of the release). A given `manifest` is the one its caller just
    wrote: files take its digests when their size and mtime still match the record. Without one,
    the manifest in out_dir is read (one that cannot be read describes nothing) and every file
    is hashed: digests read back from disk are what SHA256SUMS is there to check.
    """
    trusted = manifest is not None
    if manifest is None:
        try:
            manifest = read_manifest(out_dir)
        except CarveError:
            manifest = None
    described = described_files(manifest or {})
    names = sorted({MANIFEST_NAME, *described}, key=lambda rel: rel)
    lines = []
    for rel in names:
        if "\n" in rel or "\\" in rel:
            raise OutputError(
                f"{rel}: a file name with a newline or backslash cannot go into SHA256SUMS", "rename the file"
            )
        path = out_dir / rel
        if not inside(out_dir, rel) or not path.is_file():
            continue
        st = path.stat()
        rec = described.get(rel, {})
        recorded = (
            rec.get("sha256")
            if trusted and rec.get("bytes") == st.st_size and rec.get("mtime_ns") == st.st_mtime_ns
            else None
        )
        lines.append(f"{recorded or sha256_file(path)}  {rel}\n")
    target = out_dir / SUMS_NAME
    write_text_atomic(target, "".join(lines))
    return target
