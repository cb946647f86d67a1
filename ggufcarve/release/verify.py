"""Check a ladder directory before publishing it: `ggufcarve verify DIR`.

Checks, all reported together:
  * SHA256SUMS, like `sha256sum -c` (`ignore_missing` as `--ignore-missing`), hashed in parallel:
    hashlib releases the GIL while hashing, so one thread per core beats coreutils' single stream;
  * every file in the directory is described by quant-manifest.json (the one record of the
    release: rung files, the method reports it records, itself) and listed in SHA256SUMS;
  * quant-manifest.json agrees with SHA256SUMS and with the files' sizes;
  * every rung was made from the manifest's source (the sha256 of the source files it records);
  * the published method reports describe the manifest's source and imatrix, and the published
    selection record (method/expert-selection.json) keeps the experts the pruning report records;
  * every GGUF parses, and split sets are complete;
  * expert_count is the same in every rung and matches the manifest's source and the pruning
    report (method/pruning-report.json), when present;
  * completeness: every rung of the ladder spec built, every rung evaluated (the evaluation results
    the manifest records), the card recorded. What is missing fails only for the parts `require`
    names, by default those the release's manifest promises (`promised_parts`: the rungs; the
    evaluation and the card when its recorded run plan has those stages; the command line's
    --strict requires all, --partial none); it is always listed in `missing`;
  * the card's front matter is YAML (a failure otherwise, as the Hub refuses it); a base_model that
    is no Hub repo id, a license the Hub does not know, and relative links to files the release
    lacks are warnings.
Documentation files a user adds (LICENSE, NOTICE, .md, .gitattributes) are part of the release
once recorded (`ggufcarve release record FILE`); unrecorded ones are notes, not failures, as is
the ladder's .ggufcarve-fragments/ directory (not part of the release: removed once the ladder is
complete and merged).
A manifest that cannot be read at all (an I/O error) stops the check with an error.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ggufcarve.errors import BadInput, CarveError, OutputError
from ggufcarve.events import Sink, ignore
from ggufcarve.fileio import hash_files, published_files
from ggufcarve.release.manifest import (
    FRESH_START_HINT,
    MANIFEST_NAME,
    described_files,
    recorded_source,
)
from ggufcarve.release.publish import is_documentation
from ggufcarve.release.sums import SUMS_NAME, inside
from ggufcarve.reports import IMATRIX_REMAP_REPORT, PRUNING_REPORT, release_report_name

SELECTION_RECORD = "expert-selection"  # release.method.SELECTION_RECORD (not imported: verify starts without numpy)
FRAGMENTS_DIR = ".ggufcarve-fragments"  # release.fragments.FRAGMENTS_DIR
PARTS = ("rungs", "evaluation", "card")  # what a complete release holds

SUMS_LINE = re.compile(r"^(?P<digest>[0-9a-fA-F]{64}) (?P<mode>[ *])(?P<path>.+)$")


@dataclass(frozen=True)
class Failure:
    path: str
    problem: str


@dataclass
class VerifyReport:
    directory: Path
    files_ok: list[str] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    bytes_hashed: int = 0
    seconds: float = 0.0
    workers: int = 1
    expert_count: int | None = None
    missing: list[Failure] = field(default_factory=list)  # what a complete release would hold more (PARTS)
    required: tuple[str, ...] = ()  # the PARTS whose absence failed the check
    warnings: list[Failure] = field(default_factory=list)  # to fix before publishing; not failures
    notes: list[Failure] = field(default_factory=list)  # files in the directory that are not part of the release

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def complete(self) -> bool:
        return not self.missing

    def to_json(self) -> dict[str, Any]:
        return {
            "directory": str(self.directory),
            "ok": self.ok,
            "files_ok": self.files_ok,
            "failures": [f.__dict__ for f in self.failures],
            "bytes_hashed": self.bytes_hashed,
            "seconds": round(self.seconds, 3),
            "workers": self.workers,
            "expert_count": self.expert_count,
            "complete": self.complete,
            "missing": [f.__dict__ for f in self.missing],
            "warnings": [f.__dict__ for f in self.warnings],
            "notes": [f.__dict__ for f in self.notes],
        }


def parse_sums(path: Path) -> tuple[list[tuple[str, str]], list[str]]:
    """(digest, relative path) entries and the malformed lines."""
    entries, bad = [], []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        m = SUMS_LINE.match(line)
        if not m:
            bad.append(f"line {number}: improperly formatted SHA256 checksum line")
            continue
        entries.append((m["digest"].lower(), m["path"]))
    return entries, bad


def promised_parts(d: Path, manifest: dict[str, Any]) -> tuple[str, ...]:
    """The PARTS a release's own manifest promises: the ladder spec's rungs (unless its recorded run
    plan builds some only); evaluation results and the card when the run plan it records
    (`published.plan`, method/run-plan.json) has those stages. A ladder run alone promises its rungs."""
    published = manifest.get("published") if isinstance(manifest.get("published"), dict) else {}
    stages: set[str] = set()
    only: list[str] = []
    for f in _records(published.get("plan")):
        name = f.get("name")
        if isinstance(name, str) and name.endswith("run-plan.json") and inside(d, name) and (d / name).is_file():
            try:
                doc = json.loads((d / name).read_text())
                stages |= {str(s.get("name")) for s in doc.get("stages", []) if isinstance(s, dict)}
                only += list((doc.get("parameters", {}).get("ladder") or {}).get("only") or [])
            except (OSError, ValueError, AttributeError, TypeError):
                continue
    # a plan that builds some rungs only (ladder.only) does not promise the spec's others
    return (
        *(["rungs"] if not only else []),
        *(["evaluation"] if "evaluate" in stages else []),
        *(["card"] if "card" in stages else []),
    )


def verify_dir(
    directory: str | os.PathLike[str],
    *,
    ignore_missing: bool = False,
    workers: int | None = None,
    on_event: Sink = ignore,
    require: Collection[str] | None = None,
) -> VerifyReport:
    """Check the release in `directory` (see the module docstring). `require`: the PARTS whose
    absence fails the check (missing rungs, evaluation, card); None: what the manifest promises
    (`promised_parts`); others missing are only listed."""
    unknown = set(require or ()) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown release parts {sorted(unknown)}")
    d = Path(directory)
    if not d.is_dir():
        raise BadInput(f"{d} is not a directory", "give the ladder's output directory")
    started = time.monotonic()
    report = VerifyReport(d, workers=max(1, workers or os.cpu_count() or 1))
    fail = report.failures.append
    sums_path = d / SUMS_NAME
    if not sums_path.exists():
        raise BadInput(
            f"{d} has no {SUMS_NAME}", "run `ggufcarve ladder run` (it writes SHA256SUMS), or check the directory"
        )
    entries, bad = parse_sums(sums_path)
    for problem in bad:
        fail(Failure(SUMS_NAME, problem))
    listed: dict[str, str] = {}
    for digest, rel in entries:
        if not inside(d, rel):
            fail(Failure(rel, "SHA256SUMS names a path outside the directory"))
            continue
        if rel in listed and listed[rel] != digest:
            fail(Failure(rel, "listed twice in SHA256SUMS with different digests"))
        listed[rel] = digest

    present = {rel: d / rel for rel in listed if (d / rel).is_file()}
    for rel in sorted(set(listed) - set(present)):
        if not ignore_missing:
            fail(Failure(rel, "missing (listed in SHA256SUMS)"))
    manifest = _read_manifest(d, report)
    described = set(described_files(manifest)) | {MANIFEST_NAME} if manifest is not None else None
    published = [p.relative_to(d).as_posix() for p in published_files(d, leave_out=(SUMS_NAME,))]
    for rel in published:
        if described is not None and rel not in described and is_documentation(rel):
            report.notes.append(
                Failure(
                    rel,
                    "not recorded: not part of the release (publish it "
                    f"with `ggufcarve release record {rel}`, or remove it)",
                )
            )
        elif described is not None and rel not in described:
            fail(
                Failure(
                    rel,
                    f"not described by {MANIFEST_NAME}: not part of the release (remove it, or make it with ggufcarve)",
                )
            )
        elif rel not in listed:
            fail(Failure(rel, "not listed in SHA256SUMS"))
    _note_hidden(d, described or set(), report)

    with ThreadPoolExecutor(max_workers=1) as side:
        # GGUF structure checks run beside the hashing
        structure = side.submit(
            _check_ggufs, d, sorted(set(present) | {rel for rel in published if rel.endswith(".gguf")})
        )
        digests = hash_files(list(present.values()), report.workers, on_event)
        gguf_failures, expert_counts = structure.result()
    for rel, path in sorted(present.items()):
        got = digests[path]
        if isinstance(got, OSError):
            fail(Failure(rel, f"cannot read: {got.strerror or got}"))
        elif got != listed[rel]:
            fail(Failure(rel, f"sha256 mismatch: computed {got[:16]}..., SHA256SUMS says {listed[rel][:16]}..."))
        else:
            report.files_ok.append(rel)
        report.bytes_hashed += path.stat().st_size if path.exists() else 0
    report.failures.extend(gguf_failures)
    _check_manifest(d, manifest, listed, report, expert_counts)
    if manifest is not None:
        report.missing = missing_parts(d, manifest)
        report.required = tuple(promised_parts(d, manifest) if require is None else require)
        fail_missing = [m for m in report.missing if m.path.split(":", 1)[0] in report.required]
        report.failures.extend(Failure(m.path.split(":", 1)[1], f"missing: {m.problem}") for m in fail_missing)
        _check_card(d, manifest, report)
    report.seconds = time.monotonic() - started
    return report


def _note_hidden(d: Path, described: set[str], report: VerifyReport) -> None:
    """Hidden entries at the top of the directory that `hf upload DIR` would publish too."""
    try:
        names = sorted(n for n in os.listdir(d) if n.startswith("."))
    except OSError:
        return
    for name in names:
        if name == FRAGMENTS_DIR:
            report.notes.append(
                Failure(
                    f"{name}/",
                    "the ladder's rung fragments, not part of the release: a run of the whole ladder or "
                    "`ggufcarve release merge` removes them once every rung "
                    "is built; remove them before uploading the directory",
                )
            )
        elif name in described:
            continue
        elif is_documentation(name):
            report.notes.append(
                Failure(
                    name,
                    "not recorded: not part of the release (publish it "
                    f"with `ggufcarve release record {name}`, or remove it)",
                )
            )


def missing_parts(d: Path, manifest: dict[str, Any]) -> list[Failure]:
    """What a complete release would hold more, each as Failure("<part>:<name>", what): rungs of
    the ladder spec not built, built rungs without evaluation results, the card."""
    missing: list[Failure] = []
    rungs = {str(r.get("name")): r for r in _records(manifest.get("rungs"))}

    def present(rung: dict[str, Any]) -> bool:
        files = _records(rung.get("files"))
        return (
            rung.get("status") in ("built", "skipped")
            and bool(files)
            and all(
                isinstance(f.get("name"), str) and inside(d, f["name"]) and (d / f["name"]).is_file() for f in files
            )
        )

    spec = manifest.get("spec_rungs")
    for name in [str(n) for n in spec] if isinstance(spec, list) else list(rungs):
        rung = rungs.get(name)
        if rung is None or not present(rung):
            state = "not run" if rung is None else str(rung.get("status") or "not run")
            missing.append(
                Failure(
                    f"rungs:{name}",
                    f"rung {name} of the ladder is not built ({state}): run "
                    "`ggufcarve ladder run` again (finished rungs are kept)",
                )
            )
    built = [r for r in rungs.values() if present(r)]
    published = manifest.get("published") if isinstance(manifest.get("published"), dict) else {}
    evaluated: set[str] = set()
    results = [
        f
        for f in _records(published.get("evaluation"))
        if isinstance(f.get("name"), str) and f["name"].endswith(".json")
    ]
    for f in results:
        if not inside(d, f["name"]) or not (d / f["name"]).is_file():
            continue
        try:
            doc = json.loads((d / f["name"]).read_text())
        except (OSError, ValueError):
            continue
        model = doc.get("model") if isinstance(doc, dict) else None
        if isinstance(model, dict):
            evaluated.add(str(model.get("file")))
    if built and not results:
        missing.append(
            Failure(
                "evaluation:evaluation/",
                "no evaluation results recorded: run `ggufcarve eval RELEASE --reference ... -o RELEASE/evaluation`",
            )
        )
    else:
        for rung in built:
            first = _records(rung.get("files"))[0]["name"]
            if first not in evaluated:
                missing.append(
                    Failure(
                        f"evaluation:{first}",
                        f"rung {rung.get('name')} has no evaluation results: evaluate it "
                        "(`ggufcarve eval RELEASE ... -o RELEASE/evaluation --force`)",
                    )
                )
    card = [f for f in _records(published.get("card")) if f.get("name") == CARD_NAME]
    if not card or not (d / CARD_NAME).is_file():
        missing.append(
            Failure(
                f"card:{CARD_NAME}",
                "the model card is not recorded: write it with `ggufcarve card RELEASE`"
                + (
                    " (or record the one there with `ggufcarve card RELEASE --record`)"
                    if (d / CARD_NAME).is_file()
                    else ""
                ),
            )
        )
    return missing


CARD_NAME = "README.md"  # release.card.CARD_NAME
LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")


def card_front_matter(text: str) -> tuple[dict[str, Any] | None, str | None]:
    """The card's YAML front matter (None when there is none) and why it cannot be read (None when it can)."""
    if not text.startswith("---\n"):
        return None, None
    end = text.find("\n---\n", 3)
    if end < 0:
        return None, "the front matter has no closing --- line"
    import yaml

    try:
        doc = yaml.safe_load(text[4 : end + 1])
    except yaml.YAMLError as err:
        return None, f"the front matter is not valid YAML ({' '.join(str(err).split())})"
    if doc is None:
        return {}, None
    if not isinstance(doc, dict):
        return None, "the front matter is not a YAML mapping"
    return doc, None


def card_problems(d: Path, text: str) -> tuple[list[str], list[str]]:
    """(failures, warnings) of a card as the Hugging Face Hub reads it: YAML front matter,
    base_model a repo id, license an identifier the Hub accepts, relative links to files present."""
    from ggufcarve.release.card_metadata import HF_LICENSES, valid_repo_id

    failures: list[str] = []
    warnings: list[str] = []
    front, why = card_front_matter(text)
    if why is not None:
        failures.append(why)
    elif front is None:
        warnings.append("no YAML front matter: the Hub shows no base model, license or tags")
    else:
        base = front.get("base_model")
        bases = base if isinstance(base, list) else [base] if base is not None else []
        if not bases:
            warnings.append(
                "no base_model: the Hub cannot link this model to its "
                "base (ggufcarve card --base-model OWNER/NAME --force)"
            )
        for b in bases:
            if not valid_repo_id(b):
                warnings.append(f"base_model {b!r} is not a Hub repo id (OWNER/NAME)")
        license_ = front.get("license")
        if license_ is None:
            warnings.append("no license (ggufcarve card --license ID --force)")
        elif str(license_) not in HF_LICENSES:
            warnings.append(f"license {license_!r} is not an identifier the Hub accepts")
        elif license_ == "other" and not (front.get("license_name") and front.get("license_link")):
            warnings.append('license "other" without license_name and license_link')
    body = text
    for m in LINK.finditer(body):
        target = m["target"].split("#", 1)[0]
        if not target or "://" in target or target.startswith(("mailto:", "/")):
            continue
        if not inside(d, target) or not (d / target).is_file():
            warnings.append(f"links {target}, which is not in the release")
    link = front.get("license_link") if isinstance(front, dict) else None
    if isinstance(link, str) and "://" not in link and (not inside(d, link) or not (d / link).is_file()):
        warnings.append(f"license_link {link} is not a URL nor a file of the release")
    return failures, warnings


def _check_card(d: Path, manifest: dict[str, Any], report: VerifyReport) -> None:
    path = d / CARD_NAME
    if not path.is_file():
        return
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        report.failures.append(Failure(CARD_NAME, f"cannot read: {err}"))
        return
    failures, warnings = card_problems(d, text)
    report.failures.extend(Failure(CARD_NAME, f) for f in failures)
    report.warnings.extend(Failure(CARD_NAME, w) for w in warnings)


def _check_ggufs(d: Path, rels: list[str]) -> tuple[list[Failure], dict[str, int | None]]:
    """Parse every GGUF (split sets complete); runs beside the hashing, so the GGUF reader (numpy,
    gguf-py) is imported here, while the hashing threads already read the files."""
    from gguf.constants import Keys

    from ggufcarve.gguf.container import SHARD_NAME, read_model, shard_paths

    failures: list[Failure] = []
    counts: dict[str, int | None] = {}
    covered: set[str] = set()
    firsts = []
    for rel in rels:
        if not rel.endswith(".gguf") or not (d / rel).exists():
            continue
        m = SHARD_NAME.match(rel)
        if m and int(m["no"]) != 1:
            continue
        firsts.append(rel)
    for rel in firsts:
        try:
            model = read_model(d / rel)
        except CarveError as err:
            failures.append(Failure(rel, f"does not parse: {err.message}"))
            m = SHARD_NAME.match(rel)
            if m:
                covered.update(p.relative_to(d).as_posix() for p in shard_paths(d / m["prefix"], int(m["count"])))
            continue
        covered.update(p.relative_to(d).as_posix() for p in model.paths if p.is_relative_to(d))
        arch = model.get(Keys.General.ARCHITECTURE)
        counts[rel] = model.get(Keys.LLM.EXPERT_COUNT.format(arch=arch)) if arch else None
    for rel in rels:
        m = SHARD_NAME.match(rel)
        if m and rel not in covered and (d / rel).exists():
            failures.append(
                Failure(
                    rel,
                    "shard of a split set whose first shard "
                    f"({shard_paths(Path(m['prefix']).name, int(m['count']))[0]}) is missing",
                )
            )
    return failures, counts


def _read_json_object(path: Path, report: VerifyReport) -> dict[str, Any] | None:
    """The JSON object in `path`, or None with a failure recorded (unreadable, not JSON, not an object)."""
    try:
        text = path.read_text()
    except OSError as err:
        report.failures.append(
            Failure(path.relative_to(report.directory).as_posix(), f"cannot read: {err.strerror or err}")
        )
        return None
    return _parse_json_object(path, text, report)


def _parse_json_object(path: Path, text: str, report: VerifyReport) -> dict[str, Any] | None:
    rel = path.relative_to(report.directory).as_posix()
    try:
        doc = json.loads(text)
    except ValueError as err:
        report.failures.append(Failure(rel, f"not valid JSON ({err})"))
        return None
    if not isinstance(doc, dict):
        report.failures.append(Failure(rel, f"holds a JSON {type(doc).__name__}, not an object"))
        return None
    return doc


def _records(value: Any) -> list[dict[str, Any]]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _read_manifest(d: Path, report: VerifyReport) -> dict[str, Any] | None:
    """The manifest, or None with a failure recorded (missing, not JSON, not an object). One that
    cannot be read at all raises: nothing in the directory can be checked against it."""
    path = d / MANIFEST_NAME
    if not path.exists():
        report.failures.append(Failure(MANIFEST_NAME, "missing: nothing records how the files were made"))
        return None
    try:
        text = path.read_text()
    except OSError as err:
        raise OutputError(
            f"cannot read {path}: {err.strerror or err}",
            "fix its permissions or restore it from the published "
            f"release; or, to rebuild the release, {FRESH_START_HINT}",
        ) from None
    return _parse_json_object(path, text, report)


def _check_manifest(
    d: Path,
    manifest: dict[str, Any] | None,
    listed: dict[str, str],
    report: VerifyReport,
    counts: dict[str, int | None],
) -> None:
    fail = report.failures.append
    if manifest is not None:
        source_sha256 = [f.get("sha256") for f in recorded_source(manifest)]
        for rung in _records(manifest.get("rungs")):
            made_from = rung.get("source_sha256")
            if rung.get("files") and made_from != source_sha256:
                shown = ", ".join(str(h)[:12] for h in made_from) if isinstance(made_from, list) else "nothing"
                fail(
                    Failure(
                        MANIFEST_NAME,
                        f"rung {rung.get('name')} was made from another source (sha256 {shown}), "
                        f"not the manifest's ({', '.join(str(h)[:12] for h in source_sha256)})",
                    )
                )
            for f in _records(rung.get("files")):
                name = f.get("name")
                if not isinstance(name, str) or not name:
                    fail(Failure(MANIFEST_NAME, f"rung {rung.get('name')} lists a file without a name"))
                    continue
                path = d / name
                if name not in listed:
                    fail(Failure(name, f"rung {rung.get('name')} is in the manifest but the file is not in SHA256SUMS"))
                elif f.get("sha256") and listed[name] != f["sha256"]:
                    fail(
                        Failure(
                            name,
                            f"manifest sha256 {str(f['sha256'])[:16]}... "
                            f"disagrees with SHA256SUMS {listed[name][:16]}...",
                        )
                    )
                if path.is_file() and f.get("bytes") is not None and path.stat().st_size != f["bytes"]:
                    fail(Failure(name, f"size {path.stat().st_size} bytes, the manifest records {f['bytes']}"))
        for f in _records(manifest.get("method")):
            name = f.get("name")
            if name not in listed:
                fail(Failure(str(name), "recorded in the manifest's method reports but not in SHA256SUMS"))
            elif f.get("sha256") and listed[name] != f["sha256"]:
                fail(
                    Failure(
                        str(name),
                        f"manifest sha256 {str(f['sha256'])[:16]}... disagrees with SHA256SUMS {listed[name][:16]}...",
                    )
                )
        _check_method_reports(d, manifest, report)
    expected: dict[str, int] = {}
    source = manifest.get("source") if manifest is not None else None
    if isinstance(source, dict) and isinstance(source.get("expert_count"), int):
        expected["the manifest's source"] = source["expert_count"]
    pruning_name = release_report_name(PRUNING_REPORT)
    if (d / pruning_name).exists():
        pruning = _read_json_object(d / pruning_name, report)
        output = pruning.get("output") if pruning is not None else None
        if isinstance(output, dict) and isinstance(output.get("expert_count"), int):
            expected[pruning_name] = output["expert_count"]
    values = {v for v in counts.values() if v is not None}
    if len(values) > 1:
        detail = ", ".join(f"{rel}: {v}" for rel, v in sorted(counts.items()))
        fail(Failure("*.gguf", f"expert_count differs between rungs ({detail})"))
    if values:
        report.expert_count = min(values)
    for where, value in expected.items():
        for rel, v in sorted(counts.items()):
            if v is not None and v != value:
                fail(Failure(rel, f"expert_count {v}, but {where} says {value}"))


def _check_method_reports(d: Path, manifest: dict[str, Any], report: VerifyReport) -> None:
    """The published method reports describe this release's inputs: the pruning report files of
    the source's sizes, the remap report the imatrix (sha256)."""
    fail = report.failures.append
    source = [(f.get("name"), f.get("bytes")) for f in recorded_source(manifest)]
    imatrix = manifest.get("imatrix") if isinstance(manifest.get("imatrix"), dict) else None
    for f in _records(manifest.get("method")):
        name, kind = f.get("name"), f.get("kind")
        path = d / str(name)
        if name != release_report_name(str(kind)) or not path.is_file():
            continue
        doc = _read_json_object(path, report)
        output = doc.get("output") if doc is not None else None
        if not isinstance(output, dict) and kind != SELECTION_RECORD:
            continue
        if kind == PRUNING_REPORT:
            described = [(o.get("name"), o.get("bytes")) for o in _records(output.get("files"))]
            if [b for _, b in described] != [b for _, b in source]:

                def show(files: list[tuple[Any, Any]]) -> str:
                    return ", ".join(f"{n} ({b} bytes)" for n, b in files) or "no files"

                fail(Failure(str(name), f"describes {show(described)}, not the manifest's source ({show(source)})"))
        elif kind == SELECTION_RECORD:
            pruning = (
                _read_json_object(d / release_report_name(PRUNING_REPORT), report)
                if (d / release_report_name(PRUNING_REPORT)).is_file()
                else None
            )
            kept = (
                pruning.get("keep_set", {}).get("layers")
                if pruning is not None and isinstance(pruning.get("keep_set"), dict)
                else None
            )
            if kept is not None and doc is not None and doc.get("layers") != kept:
                fail(Failure(str(name), f"keeps other experts than {release_report_name(PRUNING_REPORT)} records"))
        elif kind == IMATRIX_REMAP_REPORT and isinstance(output, dict):
            if imatrix is None or output.get("sha256") != imatrix.get("sha256"):
                fail(
                    Failure(
                        str(name),
                        f"describes an imatrix with sha256 {str(output.get('sha256'))[:12]}, "
                        f"not the manifest's ({str((imatrix or {}).get('sha256'))[:12]})",
                    )
                )
