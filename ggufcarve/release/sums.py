"""SHA256SUMS in sha256sum -c format."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ggufcarve.errors import OutputError
from ggufcarve.fileio import sha256_file, write_text_atomic

SUMS_NAME = "SHA256SUMS"


def published_files(out_dir: Path) -> list[Path]:
    """Every file a release of out_dir publishes: all but SHA256SUMS, hidden files and temp files."""
    files = []
    for root, dirs, names in os.walk(out_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            if name.startswith(".") or (Path(root) == out_dir and name == SUMS_NAME):
                continue
            files.append(Path(root) / name)
    return sorted(files, key=lambda p: p.relative_to(out_dir).as_posix())


def write_sums(out_dir: Path, manifest: dict[str, Any] | None = None) -> Path:
    """SHA256SUMS in `sha256sum -c` format: sorted relative POSIX paths, two spaces, LF.

    Rung files take the manifest's digests when their size and mtime still match; the rest are hashed.
    """
    known: dict[str, tuple[int, int | None, str]] = {}
    for rec in (manifest or {}).get("rungs", []):
        for f in rec.get("files", []):
            if f.get("sha256"):
                known[f["name"]] = (f["bytes"], f.get("mtime_ns"), f["sha256"])
    lines = []
    for path in published_files(out_dir):
        rel = path.relative_to(out_dir).as_posix()
        st = path.stat()
        rec = known.get(rel)
        digest = rec[2] if rec and rec[0] == st.st_size and rec[1] == st.st_mtime_ns else sha256_file(path)
        if "\n" in rel or "\\" in rel:
            raise OutputError(f"{rel}: a file name with a newline or backslash cannot go into SHA256SUMS", "rename the file")
        lines.append(f"{digest}  {rel}\n")
    target = out_dir / SUMS_NAME
    write_text_atomic(target, "".join(lines))
    return target
