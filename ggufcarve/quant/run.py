"""Quantization ladders: a TOML spec of rungs, validated as a whole, run rung by rung.

    spec = load_spec("ladders/q8-to-iq1.toml")
    plan = plan_ladder(spec, source, out_dir, imatrix=imatrix, quantizer=make_quantizer("auto"))
    result = run_ladder(plan, on_event=print)

`plan_ladder` validates everything before anything runs: the source parses, the imatrix matches
the source tensor for tensor (the exact size check llama-quantize applies), rungs that need an
imatrix have one, and the free disk space covers the estimated sizes. It asks the quantizer for a
dry run of every rung, so the per-tensor target types are llama.cpp's own; every tensor that would
need importance data but has no imatrix entry (the MTP block of Qwen3.5/3.6: llama-imatrix never
runs it) gets the rung's `imatrix_fallback_type` through a tensor-type override, recorded in the
manifest, instead of aborting hours into the run with `Missing importance matrix for tensor ...`.

The output directory is one release of one source: a plan for a directory whose manifest names
another source is refused, unless `fresh` starts the release afresh (its old rungs removed).
The pruning and imatrix remap reports beside the source and the imatrix, and the selection record
or keep-set file the pruning report names by sha256, are published into `method/` when their
content describes those exact files (see release.method).

`run_ladder` runs each rung into a temp name in the output directory, renames it on success and
deletes it on failure (llama-quantize leaves truncated files), hashes each finished file in a
background thread while the next rung runs, and keeps `quant-manifest.json` and `SHA256SUMS`
(sha256sum -c format) current. The manifest records each rung's command with file names only
(the final output name, not the temp name) and the sha256 of the source it was made from. A rung
whose output still matches its recorded inputs and sha256 is skipped (resume).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gguf.constants import Keys

from ggufcarve.errors import BadInput, CarveError, OutputError, ToolFailed
from ggufcarve.events import Counter, Event, Sink, ignore
from ggufcarve.fileio import (
    bytes_on_disk,
    dead_temps,
    disk_full_error,
    format_size,
    make_temp_dir,
    remember_sha256,
    remove_dead_temps,
    sha256_file,
    sha256_file_cached,
    temp_path_for,
)
from ggufcarve.gguf.container import SHARD_NAME, GGUFModel, read_model
from ggufcarve.gguf.types import FILE_TYPES
from ggufcarve.listing import shortened
from ggufcarve.quant.quantizer import (
    TENSOR_LINE,
    DryRun,
    QuantizeJob,
    Quantizer,
    QuantizeRun,
)
from ggufcarve.quant.spec import DISK_MARGIN, LadderSpec, Rung
from ggufcarve.release.fragments import (
    FRAGMENTS_DIR,
    adopt_manifest,
    fragment_path,
    read_fragments,
    rebuild,
    write_fragment,
)
from ggufcarve.release.lock import lock_release
from ggufcarve.release.manifest import (
    MANIFEST_NAME,
    check_same_source,
    described_files,
    read_manifest,
)
from ggufcarve.release.method import (
    METHOD_KINDS,
    MethodReport,
    find_method_reports,
    publish_method_reports,
)
from ggufcarve.release.sums import SUMS_NAME, inside
from ggufcarve.reports import public_name, release_report_name

# ---------------------------------------------------------------------------------------------
# Planning


@dataclass(frozen=True)
class PlannedRung:
    rung: Rung
    output: Path
    job: QuantizeJob  # writes to the temp name
    fallback: tuple[str, ...]  # tensors given rung.imatrix_fallback_type for lack of imatrix data
    estimated_bytes: int
    inputs_key: str  # what the output depends on; equal key + equal sha256 = skip

    @property
    def temp(self) -> Path:
        if self.job.output is None:
            raise RuntimeError(f"rung {self.rung.name}: its quantize job has no output path")
        return self.job.output


@dataclass
class ImatrixInfo:
    path: Path
    sha256: str
    format: str
    datasets: list[str]
    chunk_count: int | None
    chunk_size: int | None
    entries: set[str]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.path.name,
            "sha256": self.sha256,
            "format": self.format,
            "datasets": [public_name(d) for d in self.datasets],
            "chunk_count": self.chunk_count,
            "chunk_size": self.chunk_size,
            "entries": len(self.entries),
        }


@dataclass
class LadderPlan:
    spec: LadderSpec
    source: GGUFModel
    source_sha256: list[str]
    out_dir: Path
    model_name: str
    quantizer: Quantizer
    imatrix: ImatrixInfo | None
    rungs: list[PlannedRung]
    warnings: list[str] = field(default_factory=list)
    nthreads: int | None = None
    method_reports: list[MethodReport] = field(default_factory=list)
    fresh: bool = False  # start the release afresh: the old rungs are removed before running

    @property
    def n_elements(self) -> int:
        return sum(t.n_elements for t in self.source.tensors)


def _note(on_event: Sink, stage: str, message: str) -> None:
    """A message-only event: stage "validate" for the checks, a rung's name for its status."""
    on_event(Event(stage, 0, 0, "steps" if stage == "validate" else "tensors", message))


QUANT_TAG = re.compile(
    r"[-_.](?:" + "|".join(sorted((re.escape(f) for f in FILE_TYPES), key=len, reverse=True)) + r")$", re.IGNORECASE
)


def model_name_from(source: Path) -> str:
    """The source file name without .gguf, shard suffix and a trailing quant tag."""
    name = source.name
    m = SHARD_NAME.match(name)
    if m:
        name = m["prefix"]
    name = name[:-5] if name.endswith(".gguf") else name
    return QUANT_TAG.sub("", name) or name


def read_imatrix_info(path: Path, model: GGUFModel) -> ImatrixInfo:
    """Read the imatrix and check it against the source the way llama-quantize will, all at once."""
    from ggufcarve.imatrix.check import check_against_model
    from ggufcarve.imatrix_format import read_imatrix

    imatrix = read_imatrix(path)
    check = check_against_model(imatrix, model)
    _raise_mismatch(path, model, list(check.problems))
    return ImatrixInfo(
        path,
        sha256_file_cached(path),
        imatrix.format,
        list(imatrix.datasets),
        imatrix.chunk_count,
        imatrix.chunk_size,
        {e.name for e in imatrix.entries},
    )


def _raise_mismatch(path: Path, model: GGUFModel, problems: list[str]) -> None:
    if problems:
        shown = shortened(problems, 4)
        raise BadInput(
            f"imatrix {path} does not match {model.path.name}: {shown}",
            "an imatrix of the unpruned model must be remapped first: "
            "ggufcarve imatrix remap IMATRIX --keep KEEPSET -o OUT",
        )


def _source_sha256(model: GGUFModel) -> list[str]:
    return [sha256_file_cached(p) for p in model.paths]


def _inputs_key(
    rung: Rung, job: QuantizeJob, source_sha: Sequence[str], imatrix: ImatrixInfo | None, quantizer: dict[str, Any]
) -> str:
    quantizer_fields = (
        "ftype",
        "output_tensor_type",
        "token_embedding_type",
        "tensor_types",
        "imatrix_fallback_type",
        "allow_requantize",
        "pure",
    )
    doc = {
        "rung": {
            k: v for k, v in rung.to_json().items() if k in quantizer_fields
        },  # not its name, description or file pattern
        "ftype": job.ftype,
        "tensor_types": [list(p) for p in job.tensor_types],
        "source_sha256": list(source_sha),
        "imatrix_sha256": imatrix.sha256 if imatrix else None,
        "quantizer": {k: quantizer.get(k) for k in ("backend", "sha256", "version", "build", "commit")},
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def plan_ladder(
    spec: LadderSpec,
    source: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    quantizer: Quantizer,
    imatrix: str | os.PathLike[str] | None = None,
    only: Sequence[str] | None = None,
    model_name: str | None = None,
    nthreads: int | None = None,
    hash_inputs: bool = True,
    fresh: bool = False,
    selection: str | os.PathLike[str] | None = None,
    on_event: Sink = ignore,
) -> LadderPlan:
    """Validate everything and resolve every rung's exact job before anything is written.

    `hash_inputs=False` (a dry run) skips the source's sha256 and the rungs' inputs keys, which
    only running and resuming need; such a plan cannot be run. `fresh` plans a new release in a
    directory that holds another (or an unreadable manifest). `selection` is the selection record
    the source's keep-set was chosen by, when it is not found beside the source (release.method).
    """
    rungs = spec.select(only)
    source_path = Path(source)
    _note(on_event, "validate", f"reading {source_path}")
    model = read_model(source_path)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out} is not a directory", "give -o a directory for the ladder's files")
    manifest = None if fresh else read_manifest(out)
    if any(p.resolve().parent == out.resolve() for p in model.paths):
        raise OutputError(
            f"{out} holds the source {source_path.name}",
            "write the ladder to its own directory; the source is never written next to or over",
        )
    flavour = getattr(quantizer, "flavour", "llama.cpp")

    info: ImatrixInfo | None = None
    if imatrix is not None:
        _note(on_event, "validate", f"checking imatrix {imatrix}")
        info = read_imatrix_info(Path(imatrix), model)
        if flavour == "ik_llama.cpp" and info.format != "dat":
            raise BadInput(
                f"{quantizer.describe()['path']} is ik_llama.cpp, whose quantizer reads only legacy .dat imatrices",
                "convert it: ggufcarve imatrix convert IMATRIX -o imatrix.dat --format dat",
            )
    source_sha = _source_sha256(model) if hash_inputs else []
    if manifest is not None:
        check_same_source(
            out,
            manifest,
            [
                {"name": p.name, "bytes": p.stat().st_size, "sha256": h}
                for p, h in zip(model.paths, source_sha or [None] * len(model.paths))
            ],
        )
    method_reports, method_warnings = find_method_reports(
        model, (info.path, info.sha256) if info else None, Path(selection) if selection is not None else None
    )
    needing = [r.name for r in rungs if r.needs_imatrix]
    if needing and info is None:
        raise BadInput(
            f"rung{'s' if len(needing) > 1 else ''} {', '.join(needing)} "
            f"need{'' if len(needing) > 1 else 's'} an imatrix and none was given",
            "pass --imatrix FILE (remapped to the pruned model), or leave these rungs out with --only",
        )

    names = [r.file_name(model_name or model_name_from(source_path)) for r in rungs]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise BadInput(
            f"rungs write the same file {', '.join(clash)}", "give each rung a distinct name or file_pattern"
        )

    # dry runs: llama.cpp's own per-tensor target types, and size estimates
    dry: dict[str, DryRun] = {}
    jobs = {}
    for r in rungs:
        jobs[r.name] = QuantizeJob(
            source_path,
            None,
            r.ftype,
            info.path if info else None,
            r.allow_requantize,
            r.output_tensor_type,
            r.token_embedding_type,
            r.tensor_types,
            r.pure,
            True,
            nthreads,
        )
    with ThreadPoolExecutor(max_workers=max(1, min(len(rungs), os.cpu_count() or 1))) as pool:
        futures = {name: pool.submit(quantizer.dry_run, job) for name, job in jobs.items()}
        for r in rungs:
            _note(on_event, "validate", f"dry run {r.name} ({r.ftype})")
            dry[r.name] = futures[r.name].result()

    qinfo = quantizer.describe()
    planned: list[PlannedRung] = []
    warnings: list[str] = list(method_warnings)
    unquantized_iq = []
    for r, file_name in zip(rungs, names):
        needs = dry[r.name].needs_imatrix_entries() if info is not None else dry[r.name].refused_without_imatrix()
        if needs and info is None:
            unquantized_iq.append(f"{r.name} ({', '.join(needs[:3])}{', ...' if len(needs) > 3 else ''})")
            continue
        fallback = tuple(n for n in needs if info is not None and n not in info.entries)
        overrides = tuple((f"^{re.escape(n)}$", r.imatrix_fallback_type) for n in fallback) + r.tensor_types
        if fallback:
            warnings.append(
                f"{r.name}: {len(fallback)} tensor(s) need an imatrix but have "
                f"no entry; quantized as {r.imatrix_fallback_type} instead: "
                f"{', '.join(fallback[:4])}{', ...' if len(fallback) > 4 else ''}"
            )
        final = out / file_name
        temp = temp_path_for(final)
        job = QuantizeJob(
            source_path,
            temp,
            r.ftype,
            info.path if info else None,
            r.allow_requantize,
            r.output_tensor_type,
            r.token_embedding_type,
            overrides,
            r.pure,
            False,
            nthreads,
        )
        planned.append(
            PlannedRung(
                r,
                final,
                job,
                fallback,
                dry[r.name].size_bytes,
                _inputs_key(r, job, source_sha, info, qinfo) if hash_inputs else "",
            )
        )
    if unquantized_iq:
        raise BadInput(
            f"without an imatrix these rungs would fail: {'; '.join(unquantized_iq)}",
            "pass --imatrix FILE, or leave these rungs out with --only",
        )
    _check_disk(out, planned)
    return LadderPlan(
        spec,
        model,
        source_sha,
        out,
        model_name or model_name_from(source_path),
        quantizer,
        info,
        planned,
        warnings,
        nthreads,
        method_reports,
        fresh,
    )


def _rung_names(planned: Sequence[PlannedRung], imatrix: ImatrixInfo | None = None) -> Callable[[str], bool]:
    """Accepts the file names of the planned rungs and of the imatrix (to find their temp files)."""
    return ({p.output.name for p in planned} | ({imatrix.path.name} if imatrix else set())).__contains__


def _public_quantizer(described: dict[str, object]) -> dict[str, object]:
    """The quantizer record without local paths: `program` is the file name of the binary (or of
    libllama), `python` the interpreter's file name; never their directories."""
    record = {k: v for k, v in described.items() if k != "path"}
    record["program"] = public_name(str(described["path"]))
    if isinstance(record.get("python"), str):
        record["python"] = public_name(str(record["python"]))
    return record


def ladder_context(
    plan: LadderPlan, method: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """What a ladder run records beside each rung it made: the manifest's inputs, parameters and
    header (ladder, source, imatrix, quantizer, method reports, warnings, the spec's rung order)."""
    source_files = [
        {"name": p.name, "bytes": p.stat().st_size, "sha256": h} for p, h in zip(plan.source.paths, plan.source_sha256)
    ]
    inputs = list(source_files)
    if plan.imatrix is not None:
        inputs.append(
            {"name": plan.imatrix.path.name, "bytes": plan.imatrix.path.stat().st_size, "sha256": plan.imatrix.sha256}
        )
    if plan.spec.path is not None:
        inputs.append({"name": plan.spec.path.name, "bytes": plan.spec.path.stat().st_size, "sha256": plan.spec.sha256})
    architecture = plan.source.get(Keys.General.ARCHITECTURE)
    context = {
        "ladder": {
            "name": plan.spec.name,
            "description": plan.spec.description,
            "spec_file": plan.spec.path.name if plan.spec.path else None,
            "spec_sha256": plan.spec.sha256,
        },
        "source": {
            "name": plan.source.path.name,
            "bytes": plan.source.total_bytes,
            "n_elements": plan.n_elements,
            "architecture": architecture,
            "expert_count": plan.source.get(Keys.LLM.EXPERT_COUNT.format(arch=architecture)),
            "files": source_files,
            "sha256": plan.source_sha256[0] if len(plan.source_sha256) == 1 else None,
        },
        "imatrix": plan.imatrix.to_json() if plan.imatrix else None,
        "quantizer": _public_quantizer(plan.quantizer.describe()),
        "method": method,
        "warnings": plan.warnings,
        "spec_rungs": [r.name for r in plan.spec.rungs],
    }
    return inputs, {"model_name": plan.model_name}, context


def _imatrix_without_directories(plan: LadderPlan, out: Path, to_run: Sequence[PlannedRung]) -> Path | None:
    """A copy of the imatrix whose dataset names are bare file names, or None when they already are.

    llama-quantize (and llama_model_quantize) copy the imatrix's first dataset name, which
    llama-imatrix records as given on its command line (often an absolute path), into every rung's
    `quantize.imatrix.dataset` key; a published rung must not carry a local directory. The copy
    holds the same values under the same file name, in this run's temp directory of the release.
    """
    from gguf.constants import GGUFValueType

    from ggufcarve.gguf.container import make_kv, replace_kvs
    from ggufcarve.imatrix_format import KEY_DATASETS, read_imatrix, write_to_fd

    if plan.imatrix is None or not any(p.job.imatrix is not None for p in to_run):
        return None
    imatrix = read_imatrix(plan.imatrix.path)
    bare = tuple(public_name(d) for d in imatrix.datasets)
    if bare == tuple(imatrix.datasets):
        return None
    if imatrix.format == "gguf":
        changed = replace(
            imatrix,
            datasets=bare,
            kvs=tuple(
                replace_kvs(
                    imatrix.kvs,
                    {KEY_DATASETS: make_kv(KEY_DATASETS, GGUFValueType.ARRAY, list(bare), GGUFValueType.STRING)},
                )
            ),
        )
    else:
        chunks, dataset = imatrix.dat_trailer or (0, None)
        changed = replace(
            imatrix,
            datasets=bare,
            dat_trailer=(
                chunks,
                public_name(dataset.decode("utf-8", errors="replace")).encode() if dataset is not None else None,
            ),
        )
    copy = make_temp_dir(out / plan.imatrix.path.name) / plan.imatrix.path.name
    fd = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_to_fd(changed, fd)
    finally:
        os.close(fd)
    return copy


def _check_disk(out: Path, planned: Sequence[PlannedRung]) -> None:
    probe = out
    while not probe.exists():
        probe = probe.parent
    need = sum(p.estimated_bytes for p in planned if not p.output.exists()) + DISK_MARGIN
    reclaimable = sum(bytes_on_disk(t) for t in dead_temps(out, _rung_names(planned)))  # run_ladder removes them first
    free = shutil.disk_usage(probe).free + reclaimable
    if free < need:
        raise OutputError(
            f"the ladder needs about {format_size(need)} but {probe} has {format_size(free)} free",
            "free disk space, write elsewhere, or run fewer rungs with --only",
        )


# ---------------------------------------------------------------------------------------------
# Running


@dataclass
class RungResult:
    name: str
    ftype: str
    status: str  # "built", "skipped", "failed", "not run"
    output: str
    command: list[str] = field(default_factory=list)
    exit_status: int | None = None
    seconds: float = 0.0
    bytes: int = 0
    bits_per_weight: float | None = None
    sha256: str | None = None
    error: str | None = None
    fallback: tuple[str, ...] = ()
    fallback_type: str | None = None
    inputs_key: str = ""
    description: str = ""
    tensor_types: list[list[str]] = field(default_factory=list)
    mtime_ns: int | None = None
    source_sha256: list[str] = field(default_factory=list)  # of the source files the rung was made from

    @property
    def gib(self) -> float:
        return self.bytes / 2**30

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ftype": self.ftype,
            "description": self.description,
            "status": self.status,
            "command": self.command,
            "exit_status": self.exit_status,
            "seconds": round(self.seconds, 3),
            "error": self.error,
            "files": [{"name": self.output, "bytes": self.bytes, "sha256": self.sha256, "mtime_ns": self.mtime_ns}]
            if self.bytes
            else [],
            "bytes": self.bytes,
            "gib": round(self.gib, 4),
            "bits_per_weight": self.bits_per_weight,
            "sha256": self.sha256,
            "tensor_types": self.tensor_types,
            "imatrix_fallback": {"type": self.fallback_type, "tensors": list(self.fallback)} if self.fallback else None,
            "inputs_key": self.inputs_key,
            "source_sha256": self.source_sha256,
        }


@dataclass
class LadderResult:
    plan: LadderPlan
    rungs: list[RungResult]
    manifest_path: Path
    sums_path: Path
    seconds: float
    quantizer_seconds: float
    hash_seconds: float

    @property
    def failed(self) -> list[RungResult]:
        return [r for r in self.rungs if r.status == "failed"]

    @property
    def ok(self) -> bool:
        return not self.failed


def _previous_rungs(plan: LadderPlan) -> dict[str, dict[str, Any]]:
    """The rungs the release in the output directory records (its fragments; a manifest of an
    earlier ggufcarve is adopted into fragments first), by name; the release must be of this plan's
    source (checked again here: the directory may have changed since planning)."""
    adopt_manifest(plan.out_dir)
    this = [
        {"name": p.name, "bytes": p.stat().st_size, "sha256": h} for p, h in zip(plan.source.paths, plan.source_sha256)
    ]
    manifest = read_manifest(plan.out_dir)
    if manifest is not None:
        check_same_source(plan.out_dir, manifest, this)
    previous = {}
    for fragment in read_fragments(plan.out_dir):
        check_same_source(plan.out_dir, {"source": fragment.context["source"]}, this)
        previous[str(fragment.rung["name"])] = fragment.rung
    return previous


def _start_afresh(out_dir: Path) -> list[str]:
    """Remove the release in out_dir: the files its manifest describes, the release's method
    reports, the manifest, SHA256SUMS and the rung fragments. Files the manifest does not describe
    are left alone.
    Returns the removed names."""
    try:
        manifest = read_manifest(out_dir)
    except CarveError:
        manifest = None
    names = set(described_files(manifest)) if manifest else set()
    names |= {release_report_name(kind) for kind in METHOD_KINDS} | {MANIFEST_NAME, SUMS_NAME}
    removed = []
    for rel in sorted(names):
        path = out_dir / rel
        if inside(out_dir, rel) and path.is_file():
            path.unlink()
            removed.append(rel)
    shutil.rmtree(out_dir / FRAGMENTS_DIR, ignore_errors=True)
    return removed


def _without_dirs(text: str | None, dirs: Sequence[Path]) -> str | None:
    """A message as a release records it: the given local directories removed from file paths."""
    if text is None:
        return None
    for d in sorted({str(p) for p in dirs} | {str(p.resolve()) for p in dirs}, key=len, reverse=True):
        text = text.replace(d + os.sep, "")
    return text


def _out_of_space(p: PlannedRung, run: QuantizeRun) -> str | None:
    """Why a failed rung's output did not fit, or None when its failure was not a full disk.

    llama.cpp's quantizer writes through an ofstream that throws on a failed write, and says only
    `failed to quantize: basic_ios::clear: iostream error`; the temp file it leaves and the free
    space tell a full disk or the file size limit from another write error. Past the file size
    limit with SIGXFSZ at its default (a shell's `ulimit -f`), the quantizer is killed by SIGXFSZ.
    Call before the temp file is removed.
    """
    import resource
    import signal

    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if run.returncode == -signal.SIGXFSZ:
        return f"the file size limit (ulimit -f) of {soft:,} bytes was reached"
    if not run.error or "iostream error" not in run.error:
        return None
    written = p.temp.stat().st_size if p.temp.exists() else 0
    if soft != resource.RLIM_INFINITY and written >= soft:
        return f"the file size limit (ulimit -f) of {soft:,} bytes was reached"
    free = shutil.disk_usage(p.output.parent).free
    if free < max(p.estimated_bytes - written, 1 << 20):
        return f"{free / 2**20:.1f} MiB free after {written / 2**20:.1f} MiB written"
    return None


class _HashStopped(Exception):
    """A background hash abandoned because the run is stopping."""


def _until(stop: threading.Event) -> Callable[[int], None]:
    """A progress callback for sha256_file that abandons the hash once `stop` is set: a stopped
    run does not wait for the hash of a big rung to finish."""

    def progress(_: int) -> None:
        if stop.is_set():
            raise _HashStopped

    return progress


def bits_per_weight(path: Path) -> float | None:
    """Tensor data bits per weight; raises BadInput when the file does not parse."""
    model = read_model(path)
    elements = sum(t.n_elements for t in model.tensors)
    return round(sum(t.nbytes for t in model.tensors) * 8 / elements, 4) if elements else None


def rung_stage(rung: str, label: str = "") -> str:
    """The progress stage of a rung: its name, after the ladder's label when it has one."""
    return f"{label} {rung}" if label else rung


def run_ladder(plan: LadderPlan, *, keep_going: bool = False, on_event: Sink = ignore, label: str = "") -> LadderResult:
    """Run the planned rungs; see the module docstring. Raises ToolFailed on the first failure unless keep_going.

    Progress: stage "ladder" counts the rungs and each rung has its own stage (`rung_stage`), both
    after `label` when given: two ladders of the same rung names (the pruned model's and the
    unpruned model's) then report on separate rows. A finished rung's stage ends at done == total.

    Each finished rung is recorded in its fragment and the manifest and SHA256SUMS are rebuilt from
    all fragments, under the release's lock (release.lock, held only for these steps): runs of
    other rungs into the same directory, from other processes or hosts, may go on at the same time.
    """
    if not plan.source_sha256:
        raise ValueError("run_ladder needs a plan made with hash_inputs=True")
    out = plan.out_dir
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    quantizer_seconds = 0.0
    hash_seconds = [0.0]
    state_lock = threading.Lock()
    results: dict[str, RungResult] = {}
    hasher: ThreadPoolExecutor | None = None
    stop = threading.Event()  # set on the way out: background hashes still running are abandoned
    local_dirs = [
        out.absolute(),
        *(p.parent.absolute() for p in plan.source.paths),
        *([plan.imatrix.path.parent.absolute()] if plan.imatrix else []),
    ]
    quantizer_imatrix: Path | None = None
    try:
        with lock_release(out):
            if plan.fresh:
                removed = _start_afresh(out)
                if removed:
                    _note(on_event, "validate", f"started the release afresh: removed {', '.join(removed)}")
            previous = _previous_rungs(plan)
            method = publish_method_reports(out, plan.method_reports)
            remove_dead_temps(out, _rung_names(plan.rungs, plan.imatrix))  # left by an interrupted run
        inputs, parameters, context = ladder_context(plan, method)
        resumable = _check_resumable(plan, previous, on_event, stop, label)
        quantizer_imatrix = _imatrix_without_directories(
            plan, out, [p for p in plan.rungs if p.rung.name not in resumable]
        )
        hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ggufcarve-hash")
        pending: list[Future[None]] = []

        def record(result: RungResult) -> None:
            """The rung's fragment, then the manifest and SHA256SUMS from all fragments, under the lock."""
            with state_lock:
                total = time.monotonic() - started
                timings = {
                    "total_seconds": total,
                    "quantizer_seconds": quantizer_seconds,
                    "hash_seconds": hash_seconds[0],
                    "overhead_seconds": total - quantizer_seconds,
                }
            with lock_release(out):
                write_fragment(out, result.to_json(), context, inputs=inputs, parameters=parameters, timings=timings)
                rebuild(out)

        def hash_later(result: RungResult, path: Path) -> None:
            t0 = time.monotonic()
            digest = sha256_file(path, _until(stop))
            remember_sha256(path, digest)
            st = path.stat()
            with state_lock:
                result.sha256 = digest
                result.mtime_ns = st.st_mtime_ns
                hash_seconds[0] += time.monotonic() - t0
            record(result)
            on_event(Event(rung_stage(result.name, label), 1, 1, "tensors", f"done, sha256 {digest[:12]}"))

        failure: RungResult | None = None
        out_of_space: tuple[Path, str] | None = None  # the rung whose output did not fit, and why
        rungs_done = Counter(on_event, rung_stage("ladder", label), len(plan.rungs), "rungs")
        for p in plan.rungs:
            r = p.rung
            if p.rung.name in resumable:
                results[r.name] = resumable[r.name]
                record(resumable[r.name])
                on_event(Event(rung_stage(r.name, label), 1, 1, "tensors", "skipped: unchanged (sha256 verified)"))
                rungs_done(1, r.name)
                continue
            if (failure is not None and not keep_going) or out_of_space is not None:
                results[r.name] = RungResult(
                    r.name,
                    r.ftype,
                    "not run",
                    p.output.name,
                    description=r.description,
                    source_sha256=list(plan.source_sha256),
                )
                if r.name not in previous and not fragment_path(out, r.name).exists():
                    record(results[r.name])
                continue
            _note(on_event, rung_stage(r.name, label), "starting")
            result = RungResult(
                r.name,
                r.ftype,
                "failed",
                p.output.name,
                command=plan.quantizer.recorded_argv(p.job, p.output),
                fallback=p.fallback,
                fallback_type=r.imatrix_fallback_type if p.fallback else None,
                inputs_key=p.inputs_key,
                description=r.description,
                tensor_types=[list(t) for t in p.job.tensor_types],
                source_sha256=list(plan.source_sha256),
            )

            def on_line(line: str, name: str = rung_stage(r.name, label)) -> None:
                m = TENSOR_LINE.match(line)
                if m:
                    on_event(Event(name, int(m["index"]), int(m["total"]), "tensors", m["name"]))

            job = (
                replace(p.job, imatrix=quantizer_imatrix)
                if quantizer_imatrix is not None and p.job.imatrix is not None
                else p.job
            )
            run: QuantizeRun = plan.quantizer.run(job, on_line)
            with state_lock:
                quantizer_seconds += run.seconds
            result.exit_status, result.seconds = run.returncode, run.seconds
            if run.returncode == 0 and p.temp.exists():
                try:
                    result.bits_per_weight = bits_per_weight(p.temp)
                except BadInput as err:
                    run.error = f"the quantizer's output does not parse: {err.message}"
            if run.returncode == 0 and p.temp.exists() and run.error is None:
                fd = os.open(p.temp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(p.temp, p.output)  # replaces an earlier output only now that this one exists
                result.status = "built"
                result.bytes = p.output.stat().st_size
                results[r.name] = result
                pending.append(hasher.submit(hash_later, result, p.output))
                on_event(
                    Event(
                        rung_stage(r.name, label),
                        1,
                        1,
                        "tensors",
                        f"hashing; {format_size(result.bytes)} in {run.seconds:.1f} s",
                    )
                )
            else:
                full = _out_of_space(p, run)
                p.temp.unlink(missing_ok=True)
                p.output.unlink(missing_ok=True)  # an earlier output: it does not match this rung's inputs
                result.error = _without_dirs(run.error, local_dirs) or "the quantizer wrote no output"
                if full is not None:
                    out_of_space = (p.output, full)
                    result.error = f"disk full while writing {p.output.name} ({full}): {result.error}"
                failure = failure or result
                results[r.name] = result
                record(result)
                _note(on_event, rung_stage(r.name, label), f"failed: {result.error}")
            rungs_done(1, r.name)
        for f in pending:
            f.result()
        manifest = rebuild(
            out, finish=len(plan.rungs) == len(plan.spec.rungs)
        )  # a run of the whole spec removes the fragments once it is complete
        if manifest is None:
            raise OutputError(f"{out}: no rung fragment to assemble the manifest from", "run the ladder again")
        sums = out / SUMS_NAME
    finally:
        stop.set()
        if hasher is not None:
            hasher.shutdown(wait=True, cancel_futures=True)
        for p in plan.rungs:
            p.temp.unlink(missing_ok=True)
        if plan.imatrix is not None:
            shutil.rmtree(temp_path_for(out / plan.imatrix.path.name), ignore_errors=True)
    ordered = [results[p.rung.name] for p in plan.rungs]
    result = LadderResult(
        plan, ordered, out / MANIFEST_NAME, sums, time.monotonic() - started, quantizer_seconds, hash_seconds[0]
    )
    if out_of_space is not None:
        raise disk_full_error(*out_of_space)
    if result.failed and not keep_going:
        first = result.failed[0]
        raise ToolFailed(
            f"rung {first.name} failed: {first.error}",
            f"the exact command is in {result.manifest_path}; fix the "
            "cause and run again (finished rungs are kept and skipped)",
        )
    return result


def _check_resumable(
    plan: LadderPlan, previous: dict[str, dict[str, Any]], on_event: Sink, stop: threading.Event, label: str = ""
) -> dict[str, RungResult]:
    """Rungs whose output matches the recorded inputs key and sha256 (hashed in parallel)."""
    candidates = []
    for p in plan.rungs:
        rec = previous.get(p.rung.name)
        if (
            not rec
            or rec.get("status") not in ("built", "skipped")
            or rec.get("inputs_key") != p.inputs_key
            or not rec.get("sha256")
        ):
            continue
        if not p.output.exists() or p.output.stat().st_size != rec.get("bytes"):
            continue
        candidates.append((p, rec))
    if not candidates:
        return {}
    _note(on_event, "validate", f"checking {len(candidates)} finished rung(s)")
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        try:
            digests = list(pool.map(lambda c: sha256_file_cached(c[0].output, _until(stop)), candidates))
        except BaseException:
            stop.set()  # on the way out (Ctrl-C): the hashes still running stop at their next chunk
            raise
    out: dict[str, RungResult] = {}
    for (p, rec), digest in zip(candidates, digests):
        if digest != rec["sha256"]:
            _note(
                on_event,
                rung_stage(p.rung.name, label),
                f"{p.output.name}: sha256 {digest[:12]} != recorded {rec['sha256'][:12]}; rebuilding",
            )
            continue
        out[p.rung.name] = RungResult(
            p.rung.name,
            p.rung.ftype,
            "skipped",
            p.output.name,
            command=list(rec.get("command", [])),
            exit_status=rec.get("exit_status"),
            seconds=float(rec.get("seconds", 0.0)),
            bytes=int(rec["bytes"]),
            bits_per_weight=rec.get("bits_per_weight"),
            sha256=digest,
            fallback=tuple((rec.get("imatrix_fallback") or {}).get("tensors", [])),
            fallback_type=(rec.get("imatrix_fallback") or {}).get("type"),
            inputs_key=p.inputs_key,
            description=p.rung.description,
            tensor_types=rec.get("tensor_types", []),
            mtime_ns=p.output.stat().st_mtime_ns,
            source_sha256=list(plan.source_sha256),
        )
    return out
