"""The run of a planned quantization ladder (quant.ladder_plan), rung by rung.

    plan = plan_ladder(spec, source, out_dir, imatrix=imatrix, quantizer=make_quantizer("auto"))
    result = run_ladder(plan, on_event=print)

`run_ladder` runs each rung into a temp name in the output directory, renames it on success and
deletes it on failure (llama-quantize leaves truncated files), hashes each finished file in a
background thread while the next rung runs, and keeps `quant-manifest.json` and `SHA256SUMS`
(sha256sum -c format) current. The manifest records each rung's command with file names only
(the final output name, not the temp name) and the sha256 of the source it was made from. A rung
whose output still matches its recorded inputs and sha256 is skipped (resume).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ggufcarve.errors import BadInput, CarveError, OutputError, ToolFailed
from ggufcarve.events import Counter, Event, Sink, ignore
from ggufcarve.fileio import (
    disk_full_error,
    format_size,
    make_temp_dir,
    remember_sha256,
    remove_dead_temps,
    sha256_file,
    sha256_file_cached,
    temp_path_for,
)
from ggufcarve.gguf.container import read_model
from ggufcarve.quant.ladder_plan import (
    LadderPlan,
    PlannedRung,
    ladder_context,
    note,
    rung_names,
)
from ggufcarve.quant.quantizer import TENSOR_LINE, QuantizeRun
from ggufcarve.release.fragments import (
    FRAGMENTS_DIR,
    adopt_manifest,
    fragment_path,
    read_fragments,
    rebuild,
    write_fragment,
)
from ggufcarve.release.lock import lock_release
from ggufcarve.release.manifest import MANIFEST_NAME, check_same_source, described_files, read_manifest
from ggufcarve.release.method import METHOD_KINDS, publish_method_reports
from ggufcarve.release.sums import SUMS_NAME, inside
from ggufcarve.reports import public_name, release_report_name


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


def imatrix_without_directories(plan: LadderPlan, out: Path, to_run: Sequence[PlannedRung]) -> Path | None:
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
                    note(on_event, "validate", f"started the release afresh: removed {', '.join(removed)}")
            previous = _previous_rungs(plan)
            method = publish_method_reports(out, plan.method_reports)
            remove_dead_temps(out, rung_names(plan.rungs, plan.imatrix))  # left by an interrupted run
        inputs, parameters, context = ladder_context(plan, method)
        resumable = _check_resumable(plan, previous, on_event, stop, label)
        quantizer_imatrix = imatrix_without_directories(
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
            note(on_event, rung_stage(r.name, label), "starting")
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
            placed = False  # the rung's file is this run's output
            if run.returncode == 0 and p.temp.exists() and run.error is None and p.routed:
                try:
                    route_rung(p.temp, p.output, plan.experts_used or 0)
                    placed = True
                except CarveError as err:
                    run.error = f"routing it to {plan.experts_used} experts per token failed: {err.message}"
            elif run.returncode == 0 and p.temp.exists() and run.error is None:
                fd = os.open(p.temp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(p.temp, p.output)  # replaces an earlier output only now that this one exists
                placed = True
            if placed:
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
                note(on_event, rung_stage(r.name, label), f"failed: {result.error}")
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


def route_rung(unrouted: Path, rung: Path, experts_used: int) -> None:
    """`unrouted` (the quantizer's output) rewritten into `rung` routed to N experts per token
    (prune.execute.write_routed: verified, written under the rung's temp name, fsynced and renamed);
    `unrouted` is removed."""
    from ggufcarve.prune.execute import write_routed

    write_routed(unrouted, rung, experts_used)
    unrouted.unlink()


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
    note(on_event, "validate", f"checking {len(candidates)} finished rung(s)")
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        try:
            digests = list(pool.map(lambda c: sha256_file_cached(c[0].output, _until(stop)), candidates))
        except BaseException:
            stop.set()  # on the way out (Ctrl-C): the hashes still running stop at their next chunk
            raise
    out: dict[str, RungResult] = {}
    for (p, rec), digest in zip(candidates, digests):
        if digest != rec["sha256"]:
            note(
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
