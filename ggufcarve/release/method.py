"""The method reports a release publishes: the pruning report of its source and the remap report
of its imatrix, found beside them by the per-output name and accepted only by content.

A pruning report describes a pruned model when the model's own keys say the same thing: the
kept experts (`ggufcarve.kept_*`) equal the report's `keep_set`, the source digests
(`ggufcarve.source.sha256`) equal the report's `inputs`, and its `output.files` have the sizes
of the model's files (names may differ: a renamed file is still the same model). A remap report describes an imatrix
when its `output.sha256` is the
imatrix's sha256. A release holds them as `method/pruning-report.json` and
`method/imatrix-remap-report.json`, byte for byte as found, and records them in its manifest.

The pruning report also names the keep-set file the model was pruned with (name and sha256 in its
`inputs`); that file, found by name beside the model, in its method/ directory or as the copy
prune keeps there (`method/<model stem>.<name>`), and accepted
only by its sha256, is published as `method/expert-selection.json` when it is the selection
record `ggufcarve select -o` writes (which is the keep-set as well), else as `method/keep-set.json`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ggufcarve.errors import BadInput
from ggufcarve.fileio import write_text_atomic
from ggufcarve.gguf.container import GGUFModel
from ggufcarve.moe.keepset import keepset_from_provenance
from ggufcarve.prune.plan import KEY_SOURCE_SHA256
from ggufcarve.prune.report import keep_copy_path
from ggufcarve.reports import (
    IMATRIX_REMAP_REPORT,
    METHOD_DIR,
    PRUNING_REPORT,
    SCHEMA_VERSION,
    read_json_object,
    release_report_name,
    report_path_for,
)

SELECTION_RECORD = "expert-selection"  # the kind `ggufcarve select -o SELECTION.json` writes
KEEP_SET_FILE = "keep-set"  # a plain keep-set file the model was pruned with
METHOD_KINDS = (PRUNING_REPORT, IMATRIX_REMAP_REPORT, SELECTION_RECORD, KEEP_SET_FILE)
WRITTEN_BY = {PRUNING_REPORT: "ggufcarve prune", IMATRIX_REMAP_REPORT: "ggufcarve imatrix remap"}


@dataclass(frozen=True)
class MethodReport:
    kind: str  # PRUNING_REPORT or IMATRIX_REMAP_REPORT
    text: str  # published byte for byte
    describes: str  # the name of the file it describes

    @property
    def release_name(self) -> str:
        return release_report_name(self.kind)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    def record(self) -> dict[str, Any]:
        """The manifest's entry for the published copy."""
        return {
            "name": self.release_name,
            "kind": self.kind,
            "describes": self.describes,
            "bytes": len(self.text.encode()),
            "sha256": self.sha256,
        }


def _field(doc: dict[str, Any], path: Path, *keys: str, json_type: type) -> Any:
    """doc[keys[0]][keys[1]]...; BadInput when it is missing or not of json_type (doc's kind is known)."""
    value: Any = doc
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    if not isinstance(value, json_type):
        raise BadInput(
            f"{path}: {'.'.join(keys)} is missing or not a JSON {json_type.__name__}",
            f"the report is damaged: re-run the {WRITTEN_BY[doc['kind']]} "
            "that wrote it (with --force), or move it away",
        )
    return value


def _pruning_mismatch(doc: dict[str, Any], path: Path, model: GGUFModel) -> str | None:
    """Why the pruning report does not describe `model`, or None when it does."""
    files = [
        (f.get("name"), f.get("bytes"))
        for f in _field(doc, path, "output", "files", json_type=list)
        if isinstance(f, dict)
    ]
    if [b for _, b in files] != [p.stat().st_size for p in model.paths]:
        return f"it describes {', '.join(f'{n} ({b} bytes)' for n, b in files)}"
    recorded = keepset_from_provenance(model.get, model.path.name)
    digests = model.get(KEY_SOURCE_SHA256)
    if recorded is None or digests is None:
        return f"{model.path.name} has no ggufcarve.* keys to match it by (pruned with --no-provenance)"
    layers = _field(doc, path, "keep_set", "layers", json_type=dict)
    if layers != recorded.to_json()["layers"]:
        return f"its kept experts differ from the ones {model.path.name} records"
    inputs = [
        i.get("sha256")
        for i in _field(doc, path, "inputs", json_type=list)
        if isinstance(i, dict) and i.get("kind") is None
    ]
    if inputs != [str(d) for d in digests]:
        return f"it was made from another source (sha256 {', '.join(str(i)[:12] for i in inputs)})"
    return None


def _keep_set_input(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The pruning report's record of the keep-set file it pruned with (name, sha256, bytes)."""
    for i in doc.get("inputs") or []:
        if (
            isinstance(i, dict)
            and i.get("kind") == KEEP_SET_FILE
            and isinstance(i.get("name"), str)
            and isinstance(i.get("sha256"), str)
        ):
            return i
    return None


def _read_text(path: Path) -> tuple[str, dict[str, Any] | None] | None:
    """The file's text (for publishing byte for byte) and its JSON object, or None for no such file."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise BadInput(f"cannot read {path}: {err.strerror or err}", "check its permissions, or move it away") from None
    try:
        text = raw.decode("utf-8")
        doc = json.loads(text)
    except (UnicodeDecodeError, ValueError):
        return None
    return text, doc if isinstance(doc, dict) else None


def find_selection(
    model: GGUFModel, pruning: dict[str, Any] | None, selection: Path | None
) -> tuple[list[MethodReport], list[str]]:
    """The selection record and keep-set file the model was pruned with, and warnings.

    The pruning report names the keep-set file by name and sha256; a file of that name beside
    the model or in its method/ directory, or the given `selection`, with that sha256 is it. A
    selection record (kind expert-selection, as `ggufcarve select -o` writes) is published as
    method/expert-selection.json, which is then the keep-set too; a plain keep-set file as
    method/keep-set.json. A `selection` with other bytes is accepted when it is a selection
    record whose kept experts are the model's (it chose the keep-set the model was pruned with).
    """
    found: list[MethodReport] = []
    warnings: list[str] = []
    wanted = _keep_set_input(pruning) if pruning is not None else None
    layers = (
        (pruning or {}).get("keep_set", {}).get("layers") if isinstance((pruning or {}).get("keep_set"), dict) else None
    )
    if layers is None:
        recorded = keepset_from_provenance(model.get, model.path.name)
        layers = recorded.to_json()["layers"] if recorded is not None else None
    keep_file: tuple[str, dict[str, Any] | None] | None = None
    if wanted is not None:
        candidates = [
            *([selection] if selection is not None else []),
            keep_copy_path(model.path, wanted["name"]),
            model.path.parent / wanted["name"],
            model.path.parent / METHOD_DIR / wanted["name"],
        ]
        for candidate in candidates:
            loaded = _read_text(candidate)
            if loaded is None:
                continue
            if hashlib.sha256(loaded[0].encode()).hexdigest() == wanted["sha256"]:
                keep_file = loaded
                break
            if candidate != selection:
                warnings.append(
                    f"{candidate.name} not published: it is not the keep-set {model.path.name} was "
                    f"pruned with (sha256 {hashlib.sha256(loaded[0].encode()).hexdigest()[:12]}, "
                    f"the pruning report records {wanted['sha256'][:12]})"
                )
    is_record = keep_file is not None and keep_file[1] is not None and keep_file[1].get("kind") == SELECTION_RECORD
    if keep_file is not None:
        found.append(MethodReport(SELECTION_RECORD if is_record else KEEP_SET_FILE, keep_file[0], model.path.name))
    if selection is not None and not is_record:
        loaded = _read_text(selection)
        if loaded is None:
            raise BadInput(
                f"--selection {selection}: no such file, or not JSON",
                "give the SELECTION.json that ggufcarve select -o wrote",
            )
        text, doc = loaded
        if doc is None or doc.get("kind") != SELECTION_RECORD:
            raise BadInput(
                f"--selection {selection} is not a selection record (kind {SELECTION_RECORD})",
                "give the SELECTION.json that ggufcarve select -o wrote",
            )
        if layers is None or doc.get("layers") != layers:
            raise BadInput(
                f"--selection {selection} chose other experts than {model.path.name} keeps",
                "give the selection the model was pruned with, or prune again with --keep SELECTION.json",
            )
        found.append(MethodReport(SELECTION_RECORD, text, model.path.name))
    if (pruning is not None or layers is not None) and not any(r.kind == SELECTION_RECORD for r in found):
        pruned_with = (
            f"was pruned with {wanted['name']}, not found beside it"
            if wanted is not None and keep_file is None
            else f"was pruned with the plain keep-set {wanted['name']}"
            if wanted is not None
            else "was pruned without a keep-set file"
        )
        warnings.append(
            f"no selection record published: {model.path.name} {pruned_with}; "
            "add the one `ggufcarve select -o` wrote with --selection FILE"
        )
    return found, warnings


def find_method_reports(
    model: GGUFModel, imatrix: tuple[Path, str] | None, selection: Path | None = None
) -> tuple[list[MethodReport], list[str]]:
    """The reports beside the source (and the imatrix, given as path and sha256) that describe
    them, the selection record and keep-set file the source was pruned with (find_selection), and
    a warning for each such file found that does not describe them. Raises BadInput for a
    malformed report."""
    found: list[MethodReport] = []
    warnings: list[str] = []
    pruning: dict[str, Any] | None = None
    candidates: list[tuple[str, Path, str]] = [
        (PRUNING_REPORT, report_path_for(model.path, PRUNING_REPORT), model.path.name)
    ]
    if imatrix is not None:
        candidates.append((IMATRIX_REMAP_REPORT, report_path_for(imatrix[0], IMATRIX_REMAP_REPORT), imatrix[0].name))
    for kind, path, described in candidates:
        loaded = read_json_object(path, f"re-run the {WRITTEN_BY[kind]} that wrote it (with --force), or move it away")
        if loaded is None:
            continue
        text, doc = loaded
        if doc.get("schema_version") != SCHEMA_VERSION or doc.get("kind") != kind:
            warnings.append(
                f"{path.name} not published: written by another ggufcarve version (schema "
                f"{doc.get('schema_version')}); re-run the {WRITTEN_BY[kind]} to publish it"
            )
            continue
        if kind == PRUNING_REPORT:
            why = _pruning_mismatch(doc, path, model)
        else:  # the imatrix remap report, a candidate only when an imatrix is given
            digest = _field(doc, path, "output", "sha256", json_type=str)
            wanted = imatrix[1] if imatrix is not None else ""
            why = (
                None
                if digest == wanted
                else f"it describes an imatrix with sha256 {digest[:12]}, not this one ({wanted[:12]})"
            )
        if why is not None:
            warnings.append(f"{path.name} not published: it does not describe {described}: {why}")
            continue
        found.append(MethodReport(kind, text, described))
        if kind == PRUNING_REPORT:
            pruning = doc
    chosen, more = find_selection(model, pruning, selection)
    return found + chosen, warnings + more


def publish_method_reports(out_dir: Path, reports: list[MethodReport]) -> list[dict[str, Any]]:
    """Write the reports into OUT/method/ under their release names; remove release reports of
    other kinds left by earlier runs (nothing describes them now). Returns the manifest records."""
    for report in reports:
        write_text_atomic(out_dir / report.release_name, report.text)
    published = {r.kind for r in reports}
    for kind in METHOD_KINDS:
        if kind not in published:
            (out_dir / release_report_name(kind)).unlink(missing_ok=True)
    method_dir = out_dir / METHOD_DIR
    if not reports and method_dir.is_dir() and not any(method_dir.iterdir()):
        method_dir.rmdir()
    return [r.record() for r in sorted(reports, key=lambda r: r.release_name)]
