"""The plan of a quantization ladder: a TOML spec of rungs, validated as a whole before anything runs.

    spec = load_spec("ladders/q8-to-iq1.toml")
    plan = plan_ladder(spec, source, out_dir, imatrix=imatrix, quantizer=make_quantizer("auto"))

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
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf.constants import Keys

from ggufcarve.errors import BadInput, OutputError
from ggufcarve.events import Event, Sink, ignore
from ggufcarve.fileio import bytes_on_disk, dead_temps, format_size, sha256_file_cached, temp_path_for
from ggufcarve.gguf.container import SHARD_NAME, GGUFModel, read_model
from ggufcarve.gguf.types import FILE_TYPES
from ggufcarve.listing import shortened
from ggufcarve.moe.experts_used import trained_experts_used, used_count
from ggufcarve.quant.quantizer import DryRun, QuantizeJob, Quantizer
from ggufcarve.quant.spec import DISK_MARGIN, LadderSpec, Rung
from ggufcarve.release.manifest import check_same_source, read_manifest
from ggufcarve.release.method import MethodReport, find_method_reports
from ggufcarve.reports import public_name


@dataclass(frozen=True)
class PlannedRung:
    rung: Rung
    output: Path
    job: QuantizeJob  # writes to the temp name
    fallback: tuple[str, ...]  # tensors given rung.imatrix_fallback_type for lack of imatrix data
    estimated_bytes: int
    inputs_key: str  # what the output depends on; equal key + equal sha256 = skip

    @property
    def routed(self) -> bool:
        """Whether the quantizer's output is rewritten to another used-expert count before it is the rung."""
        return self.job.output is not None and self.job.output != temp_path_for(self.output)

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
    experts_used: int | None = None  # every rung rewritten to N experts per token (None: the source's)
    trained_experts_used: int | None = None  # the source's N before any rewrite (its recorded trained value)

    @property
    def n_elements(self) -> int:
        return sum(t.n_elements for t in self.source.tensors)


def note(on_event: Sink, stage: str, message: str) -> None:
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


NAMING_FIELDS = frozenset({"name", "description", "file_pattern"})  # a rung's fields that only name its output


def rung_quantizer_fields(rung: Rung) -> dict[str, Any]:
    """Every field of the rung spec but those that only name its output: what the quantizer is asked
    for, so a field added to `Rung` is part of the resume key without being listed here."""
    from dataclasses import fields

    wanted = {f.name for f in fields(Rung)} - NAMING_FIELDS
    return {k: v for k, v in rung.to_json().items() if k in wanted}


def _inputs_key(
    rung: Rung,
    job: QuantizeJob,
    source_sha: Sequence[str],
    imatrix: ImatrixInfo | None,
    quantizer: dict[str, Any],
    experts_used: int | None = None,
) -> str:
    doc: dict[str, Any] = {
        "rung": rung_quantizer_fields(rung),
        "ftype": job.ftype,
        "tensor_types": [list(p) for p in job.tensor_types],
        "source_sha256": list(source_sha),
        "imatrix_sha256": imatrix.sha256 if imatrix else None,
        "quantizer": {k: quantizer.get(k) for k in ("backend", "sha256", "version", "build", "commit")},
    }
    if experts_used is not None:
        doc["experts_used"] = experts_used
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
    experts_used: int | None = None,
    on_event: Sink = ignore,
) -> LadderPlan:
    """Validate everything and resolve every rung's exact job before anything is written.

    `hash_inputs=False` (a dry run) skips the source's sha256 and the rungs' inputs keys, which
    only running and resuming need; such a plan cannot be run. `fresh` plans a new release in a
    directory that holds another (or an unreadable manifest). `selection` is the selection record
    the source's keep-set was chosen by, when it is not found beside the source (release.method).
    `experts_used` routes every rung to N experts per token: the quantizer writes under a temp name
    of `unrouted_name(rung)`, and that file is rewritten into the rung (`route_rung`).
    """
    rungs = spec.select(only)
    source_path = Path(source)
    note(on_event, "validate", f"reading {source_path}")
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
    trained = trained_experts_used(model)
    if experts_used is not None:
        from ggufcarve.moe.experts_used import check_experts_used
        from ggufcarve.moe.layout import inspect_layout

        check_experts_used(model, inspect_layout(model), experts_used)
        if experts_used == used_count(model):
            experts_used = None  # the source's own count: nothing to rewrite

    info: ImatrixInfo | None = None
    if imatrix is not None:
        note(on_event, "validate", f"checking imatrix {imatrix}")
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
            note(on_event, "validate", f"dry run {r.name} ({r.ftype})")
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
        temp = temp_path_for(final if experts_used is None else unrouted_name(final))
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
                _inputs_key(r, job, source_sha, info, qinfo, experts_used) if hash_inputs else "",
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
        experts_used,
        trained,
    )


def unrouted_name(rung: Path) -> Path:
    """The name the quantizer writes a rung under (as a temp name) before it is routed to N experts."""
    return rung.with_name(rung.name + ".unrouted")


def rung_names(planned: Sequence[PlannedRung], imatrix: ImatrixInfo | None = None) -> Callable[[str], bool]:
    """Accepts the file names of the planned rungs (and of their unrouted forms) and of the imatrix (to find their
    temp files)."""
    names = {p.output.name for p in planned} | {unrouted_name(p.output).name for p in planned}
    return (names | ({imatrix.path.name} if imatrix else set())).__contains__


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
        "expert_used_count": {
            "trained": plan.trained_experts_used,
            "written": plan.experts_used if plan.experts_used is not None else used_count(plan.source),
        },
    }
    return inputs, {"model_name": plan.model_name}, context


def _check_disk(out: Path, planned: Sequence[PlannedRung]) -> None:
    probe = out
    while not probe.exists():
        probe = probe.parent
    need = sum(p.estimated_bytes for p in planned if not p.output.exists()) + DISK_MARGIN
    need += max((p.estimated_bytes for p in planned if p.routed), default=0)  # a rung and its unrouted form
    reclaimable = sum(bytes_on_disk(t) for t in dead_temps(out, rung_names(planned)))  # run_ladder removes them first
    free = shutil.disk_usage(probe).free + reclaimable
    if free < need:
        raise OutputError(
            f"the ladder needs about {format_size(need)} but {probe} has {format_size(free)} free",
            "free disk space, write elsewhere, or run fewer rungs with --only",
        )
