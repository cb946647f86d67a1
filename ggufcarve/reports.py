"""The one report envelope: every JSON report ggufcarve writes (pruning, imatrix remap, the
release manifest) has the same outer shape, so a reader finds what a file describes in one place.

    {
     "schema_version": 2,
     "kind": "pruning-report",
     "tool": {"name": "ggufcarve", "version": "..."},
     "created": "2026-12-01T09:00:00Z",
     "inputs": [{"name": "model.gguf", "sha256": "...", "bytes": 123}],
     "parameters": {...},
     "timings": {"total_seconds": 1.234},
     ... the report's results, under their own keys
    }

Reports are published, so they hold file names, never directories: `inputs` names are bare file
names, and paths inside results are relative to the report's release. Keys are sorted on
writing; lists are written in the order given, which callers keep deterministic (file order,
block order).

Per-output reports live beside the output in `method/<output stem>.<kind>.json`, so any number of
outputs share one folder; a release holds each kind once, as `method/<kind>.json`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ggufcarve import __version__
from ggufcarve.errors import BadInput, OutputError

SCHEMA_VERSION = 2
PRUNING_REPORT = "pruning-report"
IMATRIX_REMAP_REPORT = "imatrix-remap-report"
METHOD_DIR = "method"


def file_input(path: Path, sha256: str, size: int | None = None) -> dict[str, Any]:
    """One entry of `inputs`: the file's name (no directory), sha256 and size in bytes."""
    return {"name": path.name, "sha256": sha256, "bytes": path.stat().st_size if size is None else size}


def envelope(
    kind: str,
    *,
    inputs: Sequence[Mapping[str, Any]],
    parameters: Mapping[str, Any],
    results: Mapping[str, Any],
    timings: Mapping[str, float],
) -> dict[str, Any]:
    """A report: the envelope fields, then the results' own keys (which must not collide with them)."""
    doc: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "kind": kind,
        "tool": {"name": "ggufcarve", "version": __version__},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "inputs": [dict(i) for i in inputs],
        "parameters": dict(parameters),
        "timings": {k: round(float(v), 3) for k, v in timings.items()},
    }
    clash = sorted(set(doc) & set(results))
    if clash:
        raise ValueError(f"report results use envelope keys: {', '.join(clash)}")
    doc.update(results)
    return doc


def read_json(path: str | Path, what: str, hint: str) -> Any:
    """The JSON value in an input file `path` (a keep-set, a scores or selection file); BadInput,
    with `hint`, when it is missing, unreadable or not JSON."""
    return read_json_bytes(path, what, hint)[0]


def read_json_bytes(path: str | Path, what: str, hint: str) -> tuple[Any, bytes]:
    """read_json, and the bytes it was parsed from (one read: a digest of them is the digest of what was parsed)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        return json.loads(raw.decode("utf-8")), raw
    except FileNotFoundError:
        raise BadInput(f"{path}: no such {what}", "check the path") from None
    except OSError as err:
        raise BadInput(
            f"{path}: cannot read the {what} ({err.strerror or err})", "check the path and its permissions"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BadInput(f"{path}: not valid JSON ({err})", hint) from None


def read_json_object(path: Path, hint: str) -> tuple[str, dict[str, Any]] | None:
    """The text of a report file and the JSON object it holds; None when the file does not exist.

    Raises OutputError when it cannot be read and BadInput when it is not a JSON object, both with
    `hint`. The text is read without newline translation, so it can be republished byte for byte.
    """
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        return None
    except OSError as err:
        raise OutputError(f"cannot read {path}: {err.strerror or err}", hint) from None
    except UnicodeDecodeError as err:
        raise BadInput(f"{path} is not UTF-8 text ({err})", hint) from None
    try:
        doc = json.loads(text)
    except ValueError as err:
        raise BadInput(f"{path} is not valid JSON ({err})", hint) from None
    if not isinstance(doc, dict):
        raise BadInput(f"{path} holds a JSON {type(doc).__name__}, not an object", hint)
    return text, doc


def dumps(doc: Mapping[str, Any]) -> str:
    """The bytes of a report file: sorted keys, one-space indent, a final newline."""
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def output_stem(output: Path) -> str:
    """The name a per-output report is keyed by: the file name without its extension, and
    without the shard suffix for a split set (`m-00001-of-00003.gguf` -> `m`)."""
    from ggufcarve.gguf.container import (
        SHARD_NAME,  # numpy and gguf-py: only when a name is needed
    )

    shard = SHARD_NAME.match(output.name)
    if shard:
        return shard["prefix"]
    return Path(output.name).stem or output.name


def report_path_for(output: Path, kind: str) -> Path:
    """Where the `kind` report of `output` goes by default: `method/<output stem>.<kind>.json` beside it."""
    return output.parent / METHOD_DIR / f"{output_stem(output)}.{kind}.json"


def release_report_name(kind: str) -> str:
    """The relative name under which a release publishes its one report of `kind`."""
    return f"{METHOD_DIR}/{kind}.json"


def public_name(value: str) -> str:
    """A recorded file reference without its directory (dataset files, tools): published files
    hold no local paths."""
    trimmed = value.rstrip("/\\")
    return trimmed[max(trimmed.rfind("/"), trimmed.rfind("\\")) + 1 :] or value
