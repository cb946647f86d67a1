"""Per-rung manifest fragments, and quant-manifest.json and SHA256SUMS assembled from them.

Every rung a ladder run finishes (built, skipped, failed) is recorded in its own fragment,
`.ggufcarve-fragments/<RUNG>.json`: the rung's record and the context of the run that made it
(source, imatrix, quantizer, ladder spec, method reports). A fragment is replaced by rename, so
rungs run by several processes or hosts into one directory never overwrite each other's record.
The manifest is derived from all fragments under the release's lock (release.lock): by each
`ladder run` after each rung, and by `ggufcarve release merge DIR`, which also checks every
fragment against its files. Fragments are hidden files: not published, not in SHA256SUMS.

Assembling takes the manifest's header (ladder, source, imatrix, quantizer, timings) from the
newest fragment; when the rungs were made by different quantizers (another llama.cpp build on
another host), every rung records its own and the manifest says so in a warning. It orders
rungs as the newest fragment's spec lists them, keeps the method reports
whose files hold the recorded bytes, and carries the evaluation and card records of the earlier
manifest while its rungs are exactly the same files. Fragments that disagree on the source are
refused. The same fragments always give the same manifest.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ggufcarve.errors import BadInput, CarveError
from ggufcarve.events import Sink, ignore
from ggufcarve.fileio import sha256_file, write_text_atomic
from ggufcarve.listing import shortened
from ggufcarve.release.lock import lock_release
from ggufcarve.release.manifest import (
    KEPT_KINDS,
    MANIFEST_KIND,
    MANIFEST_NAME,
    PUBLISHED_KINDS,
    read_manifest,
)
from ggufcarve.release.sums import SUMS_NAME, inside, write_sums
from ggufcarve.reports import SCHEMA_VERSION, dumps, envelope, read_json_object

FRAGMENTS_DIR = ".ggufcarve-fragments"
FRAGMENT_KIND = "rung-fragment"
QUANTIZERS_WARNING = (
    "the rungs were made by different quantizers (llama.cpp builds): each rung records its own under `quantizer`"
)
CONTEXT_KEYS = ("ladder", "source", "imatrix", "quantizer", "method", "warnings", "spec_rungs", "expert_used_count")


@dataclass(frozen=True)
class Fragment:
    path: Path
    text: str
    doc: dict[str, Any]

    @property
    def rel(self) -> str:
        return f"{FRAGMENTS_DIR}/{self.path.name}"

    @property
    def rung(self) -> dict[str, Any]:
        return self.doc["rung"]

    @property
    def context(self) -> dict[str, Any]:
        return self.doc["run"]

    @property
    def source_sha256(self) -> list[str]:
        return [str(f.get("sha256")) for f in self.context["source"].get("files", []) if isinstance(f, dict)]

    @property
    def order(self) -> tuple[int, str]:
        return (int(self.doc.get("written_ns", 0)), self.path.name)


def fragment_path(out_dir: Path, rung: str) -> Path:
    return out_dir / FRAGMENTS_DIR / f"{rung}.json"


def write_fragment(
    out_dir: Path,
    rung: dict[str, Any],
    context: dict[str, Any],
    *,
    inputs: Sequence[dict[str, Any]],
    parameters: dict[str, Any],
    timings: dict[str, float],
) -> Path:
    """Record one rung (its manifest record) and the run that made it; replaces its earlier fragment."""
    path = fragment_path(out_dir, str(rung["name"]))
    doc = envelope(
        FRAGMENT_KIND,
        inputs=inputs,
        parameters=parameters,
        timings=timings,
        results={"rung": rung, "run": {k: context.get(k) for k in CONTEXT_KEYS}, "written_ns": time.time_ns()},
    )
    write_text_atomic(path, dumps(doc))
    return path


def _malformed(path: Path, why: str) -> BadInput:
    return BadInput(
        f"{FRAGMENTS_DIR}/{path.name} in {path.parent.parent} {why}",
        f"remove it and run that rung again (ggufcarve ladder run ... --only {path.stem})",
    )


def read_fragments(out_dir: Path) -> list[Fragment]:
    """The fragments in out_dir, by rung file name; BadInput for one that is not a fragment."""
    directory = out_dir / FRAGMENTS_DIR
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".json") and not n.startswith("."))
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        path = directory / name
        loaded = read_json_object(
            path, f"remove it and run that rung again (ggufcarve ladder run ... --only {path.stem})"
        )
        if loaded is None:
            continue  # replaced or removed since the listing
        text, doc = loaded
        if doc.get("kind") != FRAGMENT_KIND or doc.get("schema_version") != SCHEMA_VERSION:
            raise _malformed(path, f"is not a ggufcarve {FRAGMENT_KIND} of schema {SCHEMA_VERSION}")
        rung, run = doc.get("rung"), doc.get("run")
        if (
            not isinstance(rung, dict)
            or not isinstance(run, dict)
            or not isinstance(run.get("source"), dict)
            or rung.get("name") != path.stem
        ):
            raise _malformed(path, "is damaged (no rung record of its name, or no run context)")
        found.append(Fragment(path, text, doc))
    return found


def adopt_manifest(out_dir: Path) -> int:
    """Fragments for the rungs of a manifest written before fragments existed (a release made by
    an earlier ggufcarve): nothing to do when the directory has fragments. Returns how many."""
    if (out_dir / FRAGMENTS_DIR).is_dir():
        return 0
    manifest = read_manifest(out_dir)
    if manifest is None:
        return 0
    context = {k: manifest.get(k) for k in CONTEXT_KEYS}
    if not isinstance(context.get("spec_rungs"), list):
        context["spec_rungs"] = [r.get("name") for r in manifest["rungs"] if isinstance(r, dict)]
    context["warnings"] = [w for w in context.get("warnings") or [] if w != QUANTIZERS_WARNING]
    count = 0
    for rung in manifest["rungs"]:
        if isinstance(rung, dict) and isinstance(rung.get("name"), str):
            # a rung that records its own quantizer was made by another build: its fragment's run context
            own = rung.get("quantizer")
            record = {k: v for k, v in rung.items() if k != "quantizer"}
            write_fragment(
                out_dir,
                record,
                {**context, "quantizer": own} if isinstance(own, dict) else context,
                inputs=manifest.get("inputs", []),
                parameters=manifest.get("parameters", {}),
                timings=manifest.get("timings", {}),
            )
            count += 1
    return count


def _show_source(fragment: Fragment) -> str:
    files = [f for f in fragment.context["source"].get("files", []) if isinstance(f, dict)]
    return (
        f"{', '.join(str(f.get('name')) for f in files)} (sha256 {', '.join(str(f.get('sha256'))[:12] for f in files)})"
    )


def check_one_source(fragments: Sequence[Fragment]) -> None:
    """Refuse fragments made from different sources, naming one of each."""
    first: dict[tuple[str, ...], Fragment] = {}
    for f in fragments:
        first.setdefault(tuple(f.source_sha256), f)
    if len(first) > 1:
        a, b = list(first.values())[:2]
        raise BadInput(
            f"fragments disagree on the source: {a.rel} (rung {a.rung.get('name')}) was made "
            f"from {_show_source(a)}, {b.rel} (rung {b.rung.get('name')}) from {_show_source(b)}",
            "a release holds one source: move the other source's rung files and fragments "
            "to their own directory, or run those rungs again from this release's source",
        )


def check_one_imatrix(fragments: Sequence[Fragment]) -> None:
    """Refuse fragments whose runs used different imatrices (a rung run without one agrees with any)."""
    first: dict[str, Fragment] = {}
    for f in fragments:
        imatrix = f.context.get("imatrix")
        if isinstance(imatrix, dict) and imatrix.get("sha256") and f.rung.get("files"):
            first.setdefault(str(imatrix["sha256"]), f)
    if len(first) > 1:
        (da, a), (db, b) = list(first.items())[:2]
        raise BadInput(
            f"fragments disagree on the imatrix: {a.rel} was made with {a.context['imatrix'].get('name')} "
            f"(sha256 {da[:12]}), {b.rel} with {b.context['imatrix'].get('name')} (sha256 {db[:12]})",
            "a release has one imatrix: run those rungs again with the same --imatrix",
        )


def check_one_used_count(fragments: Sequence[Fragment]) -> None:
    """Refuse fragments whose rungs were routed to different experts per token (a fragment that records none, of
    an earlier version, agrees with any)."""
    first: dict[Any, Fragment] = {}
    for f in fragments:
        used = f.context.get("expert_used_count")
        if isinstance(used, dict) and used.get("written") is not None and f.rung.get("files"):
            first.setdefault(used["written"], f)
    if len(first) > 1:
        (na, a), (nb, b) = list(first.items())[:2]
        raise BadInput(
            f"fragments disagree on the experts per token: {a.rel} was routed to {na}, {b.rel} to {nb}",
            "a release has one top-k: run those rungs again with the same --topk (or without it)",
        )


def rung_problems(out_dir: Path, fragment: Fragment, digests: dict[str, str | OSError] | None) -> list[str]:
    """What is wrong with the files a fragment's rung records: missing, other size, other sha256
    (only when `digests`, computed from the files, are given)."""
    problems = []
    for f in fragment.rung.get("files") or []:
        name = f.get("name") if isinstance(f, dict) else None
        if not isinstance(name, str) or not inside(out_dir, name):
            problems.append(f"rung {fragment.rung.get('name')} records a file name outside the release ({name!r})")
            continue
        path = out_dir / name
        if not path.is_file():
            problems.append(f"{name} of rung {fragment.rung.get('name')} is missing")
        elif path.stat().st_size != f.get("bytes"):
            problems.append(
                f"{name} of rung {fragment.rung.get('name')} has "
                f"{path.stat().st_size} bytes, its fragment records {f.get('bytes')}"
            )
        elif digests is not None:
            got = digests.get(name)
            if isinstance(got, OSError):
                problems.append(f"{name} of rung {fragment.rung.get('name')} cannot be read: {got.strerror or got}")
            elif not f.get("sha256"):
                problems.append(
                    f"{name} of rung {fragment.rung.get('name')} has no "
                    "recorded sha256 (its run ended before hashing it)"
                )
            elif got != f["sha256"]:
                problems.append(
                    f"{name} of rung {fragment.rung.get('name')} has sha256 "
                    f"{str(got)[:12]}, its fragment records {str(f['sha256'])[:12]}"
                )
    return problems


def _method_records(out_dir: Path, fragments: Sequence[Fragment]) -> list[dict[str, Any]]:
    """The method records of all fragments whose files hold the recorded bytes, one per name."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for f in sorted(fragments, key=lambda f: f.order, reverse=True):
        for rec in f.context.get("method") or []:
            if isinstance(rec, dict) and isinstance(rec.get("name"), str) and inside(out_dir, rec["name"]):
                by_name.setdefault(rec["name"], []).append(rec)
    kept = []
    for name in sorted(by_name):
        path = out_dir / name
        if not path.is_file():
            continue
        digest = sha256_file(path)
        match = next(
            (r for r in by_name[name] if r.get("sha256") == digest and r.get("bytes") == path.stat().st_size), None
        )
        if match is not None:
            kept.append(match)
    return kept


def _identity(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _rung_identity(rungs: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    return sorted(
        (str(f.get("name")), str(f.get("sha256")))
        for r in rungs
        if isinstance(r, dict)
        for f in r.get("files") or []
        if isinstance(f, dict)
    )


def assemble(out_dir: Path, fragments: Sequence[Fragment], *, drop_missing: bool) -> dict[str, Any] | None:
    """The manifest the fragments describe; None when there are none. `drop_missing` leaves out
    rungs whose files are gone or changed size (a ladder run: as the rungs of earlier runs stay
    recorded only while their files exist); otherwise the caller has checked them."""
    if not fragments:
        return None
    check_one_source(fragments)
    newest = max(fragments, key=lambda f: f.order)
    kept = [f for f in fragments if not (drop_missing and f.rung.get("files") and rung_problems(out_dir, f, None))]
    check_one_used_count(kept)
    spec_order = [str(n) for n in newest.context.get("spec_rungs") or []]
    position = {name: i for i, name in enumerate(spec_order)}
    kept.sort(key=lambda f: (position.get(str(f.rung.get("name")), len(position)), str(f.rung.get("name"))))
    rungs = [f.rung for f in kept]
    warnings = list(newest.context.get("warnings") or [])
    if len({_identity(f.context.get("quantizer")) for f in fragments if f.rung.get("files")}) > 1:
        rungs = [{**f.rung, "quantizer": f.context.get("quantizer")} for f in kept]
        warnings.append(QUANTIZERS_WARNING)
    try:
        earlier = read_manifest(out_dir)
    except CarveError:
        earlier = None
    published: dict[str, Any] = {}
    if earlier is not None and isinstance(earlier.get("published"), dict):
        same_rungs = _rung_identity(earlier["rungs"]) == _rung_identity(rungs)
        published = {
            k: v for k, v in earlier["published"].items() if k in PUBLISHED_KINDS and (same_rungs or k in KEPT_KINDS)
        }
    context = newest.context
    doc = envelope(
        MANIFEST_KIND,
        inputs=newest.doc.get("inputs", []),
        parameters={**newest.doc.get("parameters", {}), "selected_rungs": [r.get("name") for r in rungs]},
        timings=newest.doc.get("timings", {}),
        results={
            "ladder": context.get("ladder"),
            "source": context["source"],
            "imatrix": context.get("imatrix"),
            "quantizer": context.get("quantizer"),
            "rungs": rungs,
            "spec_rungs": spec_order,
            "method": _method_records(out_dir, fragments),
            "published": published,
            "warnings": warnings,
            **({"expert_used_count": context["expert_used_count"]} if context.get("expert_used_count") else {}),
        },
    )
    return doc


def write_release(out_dir: Path, manifest: dict[str, Any]) -> Path:
    """Write quant-manifest.json and SHA256SUMS (digests taken from the manifest where the files'
    size and mtime still match); under the lock. Returns the SHA256SUMS path."""
    write_text_atomic(out_dir / MANIFEST_NAME, dumps(manifest))
    return write_sums(out_dir, manifest)


def ladder_complete(out_dir: Path, manifest: dict[str, Any]) -> bool:
    """Whether the manifest records every rung of its ladder spec as built (or kept), with its files present."""
    spec = manifest.get("spec_rungs")
    done = {
        str(r.get("name"))
        for r in manifest.get("rungs") or []
        if isinstance(r, dict)
        and r.get("status") in ("built", "skipped")
        and r.get("files")
        and all(
            isinstance(f, dict)
            and isinstance(f.get("name"), str)
            and inside(out_dir, f["name"])
            and (out_dir / f["name"]).is_file()
            for f in r["files"]
        )
    }
    return isinstance(spec, list) and bool(spec) and all(str(n) in done for n in spec)


def remove_fragments(out_dir: Path) -> bool:
    """Remove .ggufcarve-fragments/ once the manifest holds all it records (the ladder is
    complete), so that uploading the directory uploads only the release; under the lock. A later
    ladder run or `release merge` re-creates the fragments from the manifest (adopt_manifest)."""
    directory = out_dir / FRAGMENTS_DIR
    if not directory.is_dir():
        return False
    import shutil

    shutil.rmtree(directory)
    return True


def rebuild(out_dir: Path, *, finish: bool = False) -> dict[str, Any] | None:
    """Re-derive the manifest and SHA256SUMS from the fragments (a ladder run's step, under the
    lock): rungs whose files are gone are left out, as before fragments. `finish` (the end of a
    run of the whole spec) removes the fragments once every rung of the spec is built."""
    with lock_release(out_dir):
        manifest = assemble(out_dir, read_fragments(out_dir), drop_missing=True)
        if manifest is not None:
            write_release(out_dir, manifest)
            if finish and ladder_complete(out_dir, manifest):
                remove_fragments(out_dir)
        return manifest


@dataclass
class MergeResult:
    directory: Path
    manifest: dict[str, Any]
    fragments: int
    adopted: int
    bytes_hashed: int
    seconds: float
    changed: bool  # whether quant-manifest.json or SHA256SUMS changed

    @property
    def rungs(self) -> list[dict[str, Any]]:
        return self.manifest["rungs"]


def _stat_key(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_size, st.st_mtime_ns)


def merge_release(
    directory: str | os.PathLike[str],
    *,
    workers: int | None = None,
    on_event: Sink = ignore,
    hash_files: Callable[..., dict[Path, str | OSError]] | None = None,
) -> MergeResult:
    """`ggufcarve release merge DIR`: assemble quant-manifest.json and SHA256SUMS from the
    fragments, refusing (BadInput, one line) fragments of different sources or imatrices and
    fragments whose files are missing or differ in size or sha256. The files are hashed outside the
    lock (with verify's parallel hasher); under the lock, fragments or files that changed since are
    checked again. Running it again changes nothing."""
    if hash_files is None:
        from ggufcarve.fileio import hash_files
    out = Path(directory)
    if not out.is_dir():
        raise BadInput(f"{out} is not a directory", "give the release directory that ladder runs wrote into")
    started = time.monotonic()
    with lock_release(out):
        adopted = adopt_manifest(out)
    if not read_fragments(out):
        raise BadInput(
            f"{out} has no rung fragments ({FRAGMENTS_DIR}/)",
            "run ggufcarve ladder run ... -o DIR (with --only RUNG per job) into it first",
        )
    hashed_bytes = 0
    digests: dict[str, str | OSError] = {}
    stats: dict[str, tuple[int, int] | None] = {}
    lock_for_digests = threading.Lock()

    def hash_names(names: Sequence[str]) -> None:
        nonlocal hashed_bytes
        paths = [out / n for n in names if (out / n).is_file()]
        for path, digest in hash_files(paths, workers, on_event).items():
            with lock_for_digests:
                rel = path.relative_to(out).as_posix()
                digests[rel] = digest
                stats[rel] = _stat_key(path)
                hashed_bytes += path.stat().st_size

    def names_of(fragments: Sequence[Fragment]) -> list[str]:
        return sorted(
            {
                f["name"]
                for fr in fragments
                for f in fr.rung.get("files") or []
                if isinstance(f, dict) and isinstance(f.get("name"), str) and inside(out, f["name"])
            }
        )

    first = read_fragments(out)
    check_one_source(first)
    check_one_imatrix(first)
    hash_names(names_of(first))
    before = {
        name: (out / name).read_bytes() if (out / name).is_file() else None for name in (MANIFEST_NAME, SUMS_NAME)
    }
    with lock_release(out):
        fragments = read_fragments(out)
        check_one_source(fragments)
        check_one_imatrix(fragments)
        stale = [n for n in names_of(fragments) if n not in digests or stats.get(n) != _stat_key(out / n)]
        if stale:
            hash_names(stale)
        problems = [p for f in fragments for p in rung_problems(out, f, digests)]
        if problems:
            raise BadInput(
                f"cannot merge {out}: {shortened(problems, 1)}",
                "run that rung again (ggufcarve ladder run ... --only RUNG), or "
                "remove its fragment from .ggufcarve-fragments/ to leave it out",
            )
        manifest = assemble(out, fragments, drop_missing=False)
        if manifest is None:
            raise BadInput(f"cannot merge {out}: it holds no rung fragment", "run ggufcarve ladder run into it first")
        previous = read_manifest(out) if before[MANIFEST_NAME] is not None else None
        if previous is not None and _same_apart_from_creation(previous, manifest):
            manifest["created"] = previous.get("created", manifest["created"])
        write_release(out, manifest)
        if ladder_complete(out, manifest):
            remove_fragments(out)
    after = {name: (out / name).read_bytes() if (out / name).is_file() else None for name in (MANIFEST_NAME, SUMS_NAME)}
    return MergeResult(
        out, manifest, len(fragments), adopted, hashed_bytes, time.monotonic() - started, after != before
    )


def _same_apart_from_creation(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return {k: v for k, v in a.items() if k != "created"} == {k: v for k, v in b.items() if k != "created"}
