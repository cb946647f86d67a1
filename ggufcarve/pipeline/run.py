"""Executing a run plan as stages: select -> prune -> imatrix -> ladder -> unpruned -> evaluate ->
card -> verify.

Each stage is one call of the library function the matching command uses (`score_model`/`choose`,
`plan_prune`/`execute`, `plan_remap`/`execute_remap`, `plan_ladder`/`run_ladder`, `evaluate`,
`write_card`, `verify_dir`), so a run writes exactly what the separate commands would. Each stage
records the digest of its inputs and parameters with its outputs (state.py) and is skipped when
they match: after a crash or a kill, the re-run starts at the stage that did not finish.

Files: the release directory (`output`) holds only what is published — the rungs, SHA256SUMS,
quant-manifest.json, method/ (expert-selection.json, pruning-report.json,
imatrix-remap-report.json, run-plan.json), evaluation/ and the card README.md. The work directory
holds the selection, the pruned source, the imatrices, the unpruned comparison rungs and the
run state.

With a calibration method and `[imatrix] collect = true`, the selection statistics and the full
model's imatrix come from one pass over the calibration text; the imatrix is then remapped to the
kept experts like any other.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ggufcarve.errors import BadInput, OutputError, ToolFailed, VerificationFailed
from ggufcarve.events import Event, Sink, ignore
from ggufcarve.pipeline.plan import RunPlan
from ggufcarve.pipeline.state import RunState, file_digest, stage_digest

RUN_PLAN_NAME = "run-plan.json"
SELECTION_NAME = "expert-selection.json"
DISK_MARGIN = 64 * 2**20


@dataclass
class StageResult:
    name: str
    status: str  # "ran" or "skipped"
    seconds: float = 0.0
    outputs: list[str] = field(default_factory=list)
    summary: str = ""


@dataclass
class RunResult:
    plan: RunPlan
    stages: list[StageResult]
    ladder: Any = None  # quant.run.LadderResult of the release's ladder stage, when it ran
    evaluation: list[dict[str, Any]] = field(default_factory=list)
    verification: Any = None  # release.verify.VerifyReport
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)  # of the selection, the prune plan and the ladder plans


@dataclass(frozen=True)
class StagePreview:
    name: str
    action: str
    outputs: tuple[str, ...]
    bytes: int | None  # None: known only once the stage before it ran
    done: bool  # an earlier run recorded it (it is skipped when its inputs are unchanged)


@dataclass(frozen=True)
class RunPreview:
    plan: RunPlan
    stages: tuple[StagePreview, ...]
    bytes_needed: int
    free: dict[str, int]  # probe directory -> free bytes

    @property
    def short(self) -> list[str]:
        return [d for d, free in self.free.items() if free < self.bytes_needed]


# ---------------------------------------------------------------------------------------------
# names of the intermediate files


@dataclass(frozen=True)
class Names:
    base: str  # the source's model name (no quant tag)
    name: str  # the pruned model's name: {model} in rung file names
    kept: int
    source_expert_count: int
    pruned: Path
    selection: Path
    collected_imatrix: Path
    remapped_imatrix: Path
    unpruned_dir: Path


def _kept_count(plan: RunPlan, layout: Any) -> int:
    if plan.selection.keepset is not None:
        from ggufcarve.moe.keepset import load_keepset

        return load_keepset(plan.selection.keepset, layout).kept_count
    from ggufcarve.select.keep import kept_count

    return kept_count(layout.expert_count, layout.group_count, plan.selection.keep, plan.selection.ratio)


def names_for(plan: RunPlan, model: Any, layout: Any) -> Names:
    from ggufcarve.quant.run import model_name_from

    base = model_name_from(plan.source)
    kept = _kept_count(plan, layout)
    name = plan.name or f"{base}-{kept}e"
    if name == base and plan.evaluation is not None and plan.evaluation.unpruned:
        raise BadInput(f"plan: name = {name!r} is also the unpruned model's name, so their rungs would share file names", f"give the pruned model another name, e.g. \"{base}-{kept}e\"")
    stem = plan.source.name[:-5] if plan.source.name.endswith(".gguf") else plan.source.name
    tag = stem[len(base):].lstrip("-._") if stem.startswith(base) else ""
    return Names(
        base=base, name=name, kept=kept, source_expert_count=layout.expert_count,
        pruned=plan.work / (f"{name}-{tag}.gguf" if tag else f"{name}.gguf"),
        selection=plan.work / SELECTION_NAME,
        collected_imatrix=plan.work / f"{base}.imatrix.gguf",
        remapped_imatrix=plan.work / f"{name}.imatrix.gguf",
        unpruned_dir=plan.work / "unpruned",
    )


# ---------------------------------------------------------------------------------------------
# the stages


class _Run:
    def __init__(self, plan: RunPlan, on_event: Sink, force: bool) -> None:
        from ggufcarve.gguf.container import read_model
        from ggufcarve.moe.layout import inspect_layout

        self.plan, self.sink, self.force = plan, on_event, force
        self.model = read_model(plan.source)
        self.layout = inspect_layout(self.model)
        self.names = names_for(plan, self.model, self.layout)
        self.state = RunState(plan.work)
        self.threads = plan.threads or os.cpu_count() or 1
        self.digests: dict[Path, str] = {}
        self.results: list[StageResult] = []
        self.ladder_result: Any = None
        self.evaluation: list[dict[str, Any]] = []
        self.warnings: list[str] = []

    def digest_of(self, path: Path) -> str:
        if path not in self.digests:
            self.digests[path] = file_digest(path, self.sink)
        return self.digests[path]

    def inputs(self, *paths: Path | None) -> list[tuple[str, str]]:
        found: list[tuple[str, str]] = []
        for p in paths:
            if p is None:
                continue
            for shard in _shards(p):
                found.append((shard.name, self.digest_of(shard)))
        return found

    def stage(self, name: str, parameters: dict[str, Any], inputs: list[tuple[str, str]], base: Path,
              work: Callable[[], tuple[list[Path], str]], *, always: Callable[[], str] | None = None) -> StageResult:
        """Run `work` unless the state says this digest already produced its outputs; `always`
        runs in both cases (recording published files in the manifest is idempotent)."""
        digest = stage_digest(name, parameters, inputs)
        if not self.force and self.state.done(name, digest, base):
            result = StageResult(name, "skipped", outputs=sorted(self.state.outputs(name)), summary="unchanged")
            if always is not None:
                result.summary = always() or result.summary
        else:
            self.sink(Event("run", len(self.results), 0, "stages", f"{name}"))
            started = time.monotonic()
            previous = self.state.outputs(name)
            self.state.forget(name)
            outputs, summary = work()
            if base.resolve() == self.plan.work.resolve():  # intermediates of the stage's last run that this one replaced
                kept = {p.resolve() for p in outputs}
                for rel in previous:
                    old = base / rel
                    if old.resolve() not in kept and old.is_file():
                        old.unlink()
            if always is not None:
                summary = always() or summary
            seconds = time.monotonic() - started
            self.state.record(name, digest, base, outputs, seconds)
            result = StageResult(name, "ran", seconds, sorted(p.resolve().relative_to(base.resolve()).as_posix() for p in outputs), summary)
        self.results.append(result)
        return result

    # --- select (and, in the same pass, the imatrix) ---------------------------------------

    def traces(self) -> bool:
        from ggufcarve.select.methods import method_named

        method = self.plan.selection.method
        return method is not None and method_named(method).needs == "calibration"

    def collect_stage(self) -> None:
        """The full model's imatrix from the calibration text alone (no tracing selection method)."""
        plan, names = self.plan, self.names
        assert plan.calibration is not None

        def work() -> tuple[list[Path], str]:
            from ggufcarve.imatrix.collect import collect_imatrix

            calibration = plan.calibration
            chunks = calibration.max_tokens // calibration.ctx if calibration.max_tokens else None  # whole chunks, as the selection's trace
            collect_imatrix(self.model, list(calibration.files), names.collected_imatrix, ctx=calibration.ctx, chunks=chunks, threads=self.threads, force=True, on_event=self.sink)
            return [names.collected_imatrix], f"imatrix of {names.base} from {len(plan.calibration.files)} calibration file(s)"

        parameters = {"ctx": plan.calibration.ctx, "max_tokens": plan.calibration.max_tokens}
        self.stage("imatrix-collect", parameters, self.inputs(plan.source, *plan.calibration.files), plan.work, work)

    def select_stage(self) -> None:
        plan, names, sel = self.plan, self.names, self.plan.selection
        one_pass = self.traces() and plan.imatrix is not None and plan.imatrix.collect
        imatrix_in = None
        if sel.method is not None and not self.traces() and plan.imatrix is not None and _method_needs_imatrix(sel.method):
            imatrix_in = plan.imatrix.file or names.collected_imatrix

        def work() -> tuple[list[Path], str]:
            from ggufcarve.fileio import write_text_atomic
            from ggufcarve.select.heatmap import write_heatmap
            from ggufcarve.select.keep import choose, protected_from
            from ggufcarve.select.scores import ModelFacts

            started = time.perf_counter()
            facts = ModelFacts.of(self.model, self.layout)
            protected = protected_from(sel.protect, facts)
            outputs = [names.selection]
            plan.work.mkdir(parents=True, exist_ok=True)
            if one_pass:
                from ggufcarve.select.calibrate import calibrate

                assert plan.calibration is not None
                scores = calibrate(self.model, self.layout, sel.method, list(plan.calibration.files), ctx=plan.calibration.ctx, max_tokens=plan.calibration.max_tokens,
                                   threads=self.threads, on_event=self.sink, imatrix_out=names.collected_imatrix, force=True)
                outputs.append(names.collected_imatrix)
            else:
                from ggufcarve.select.methods import score_model

                calibration = list(plan.calibration.files) if plan.calibration is not None and self.traces() else []
                scores = score_model(self.model, self.layout, sel.method, imatrix=imatrix_in, calibration=calibration, seed=sel.seed,
                                     ctx=plan.calibration.ctx if plan.calibration else 512, max_tokens=plan.calibration.max_tokens if plan.calibration else None,
                                     threads=self.threads, on_event=self.sink)
            selection = choose(scores, names.kept, protected, sel.protect_super_experts, ratio=sel.ratio)
            record = selection.record({"total_seconds": time.perf_counter() - started})
            write_text_atomic(names.selection, json.dumps(record, indent=1, sort_keys=True, allow_nan=False) + "\n")
            heatmap = write_heatmap(selection, names.selection.with_suffix(".png"))
            outputs.append(heatmap)
            self.warnings.extend(selection.warnings)
            return outputs, f"{sel.method}: keep {names.kept} of {names.source_expert_count} in {len(selection.keepset.layers)} MoE blocks" + (" (imatrix collected in the same pass)" if one_pass else "")

        parameters = {"method": sel.method, "keep": names.kept, "protect": sel.protect, "protect_super_experts": sel.protect_super_experts, "seed": sel.seed,
                      "calibration": None if plan.calibration is None else {"ctx": plan.calibration.ctx, "max_tokens": plan.calibration.max_tokens}, "one_pass": one_pass}
        files = list(plan.calibration.files) if plan.calibration is not None and (self.traces() or one_pass) else []
        self.stage("select", parameters, self.inputs(plan.source, *files, imatrix_in), plan.work, work)

    # --- prune, remap ----------------------------------------------------------------------

    def keepset_file(self) -> Path:
        return self.plan.selection.keepset or self.names.selection

    def prune_stage(self) -> None:
        names = self.names
        keepset_path = self.keepset_file()

        def work() -> tuple[list[Path], str]:
            from ggufcarve.moe.keepset import load_keepset
            from ggufcarve.prune.execute import execute
            from ggufcarve.prune.plan import plan_prune

            keepset = load_keepset(keepset_path, self.layout)
            pruned_plan = plan_prune(self.model, self.layout, keepset, names.pruned)
            self.warnings.extend(pruned_plan.warnings)
            result = execute(pruned_plan, self.model, force=True, on_event=self.sink)
            files = [f.path for f in pruned_plan.files]
            return [*files, result.report_path], f"{self.layout.expert_count} -> {keepset.kept_count} experts; {pruned_plan.bytes_in / 2**30:.3f} -> {pruned_plan.bytes_out / 2**30:.3f} GiB, {len(result.verification.tensors)} tensors verified"

        self.stage("prune", {"keepset": keepset_path.name, "output": names.pruned.name}, self.inputs(self.plan.source, keepset_path), self.plan.work, work)

    def imatrix_source(self) -> Path | None:
        im = self.plan.imatrix
        if im is None:
            return None
        return im.file or self.names.collected_imatrix

    def remap_stage(self) -> None:
        names, source_imatrix = self.names, self.imatrix_source()
        assert source_imatrix is not None

        def work() -> tuple[list[Path], str]:
            from ggufcarve.gguf.container import read_model
            from ggufcarve.imatrix.formats import read_imatrix
            from ggufcarve.imatrix.remap import execute_remap, plan_remap, resolve_source_layout
            from ggufcarve.moe.keepset import load_keepset
            from ggufcarve.moe.layout import inspect_layout

            imatrix = read_imatrix(source_imatrix)
            pruned = read_model(names.pruned)
            layout = resolve_source_layout(imatrix, pruned, inspect_layout(pruned), self.layout)
            keepset = load_keepset(self.keepset_file(), self.layout)
            remap_plan = plan_remap(imatrix, keepset, layout, names.remapped_imatrix, output_format="gguf", pruned=pruned, source=self.model)
            result = execute_remap(remap_plan, force=True, sources=[*pruned.paths, *self.model.paths], on_event=self.sink)
            return [names.remapped_imatrix, result.report_path], f"{len(remap_plan.output.entries)} entries remapped to {keepset.kept_count} experts"

        self.stage("imatrix", {"output": names.remapped_imatrix.name}, self.inputs(source_imatrix, self.keepset_file(), names.pruned), self.plan.work, work)

    # --- ladders ---------------------------------------------------------------------------

    def _ladder(self, source: Path, out_dir: Path, imatrix: Path | None, only: tuple[str, ...], model_name: str, fresh: bool) -> Any:
        from ggufcarve.quant.quantizer import make_quantizer
        from ggufcarve.quant.run import plan_ladder, run_ladder
        from ggufcarve.quant.spec import load_spec

        quantizer = make_quantizer(self.plan.ladder.quantizer, self.plan.ladder.llama_cpp)
        ladder_plan = plan_ladder(load_spec(self.plan.ladder.spec), source, out_dir, quantizer=quantizer, imatrix=imatrix, only=list(only) or None,
                                  model_name=model_name, nthreads=self.threads, fresh=fresh, on_event=self.sink)
        self.warnings.extend(ladder_plan.warnings)
        result = run_ladder(ladder_plan, on_event=self.sink)
        if result.failed:
            failed = result.failed[0]
            raise ToolFailed(f"rung {failed.name} failed: {failed.error}", "see the quantizer's last lines above; fix the cause and run the plan again (finished stages are skipped)")
        return result

    def ladder_stage(self) -> None:
        plan, names = self.plan, self.names
        imatrix = names.remapped_imatrix if plan.imatrix is not None else None
        # a release this run's ladder made is replaced when the pruned source changed; any other
        # release in the output directory is refused by the ladder unless --force
        fresh = self.force or "ladder" in self.state.stages

        def work() -> tuple[list[Path], str]:
            result = self._ladder(names.pruned, plan.output, imatrix, plan.ladder.only, names.name, fresh)
            self.ladder_result = result
            built = [r for r in result.rungs if r.status == "built"]
            outputs = [plan.output / r.output for r in result.rungs if r.output and (plan.output / r.output).is_file()]
            return outputs, f"{len(result.rungs)} rungs ({len(built)} built), {sum(r.bytes or 0 for r in result.rungs) / 2**30:.3f} GiB"

        parameters = {"spec": _spec_record(plan.ladder.spec), "only": list(plan.ladder.only), "quantizer": plan.ladder.quantizer, "name": names.name}
        self.stage("ladder", parameters, self.inputs(names.pruned, imatrix, self.selection_record()), plan.output, work)

    def selection_record(self) -> Path | None:
        path = self.keepset_file()
        return path if path.exists() else None

    def unpruned_stage(self) -> list[Path]:
        plan, names = self.plan, self.names
        assert plan.evaluation is not None
        imatrix = self.imatrix_source()

        def work() -> tuple[list[Path], str]:
            result = self._ladder(plan.source, names.unpruned_dir, imatrix, plan.evaluation.unpruned, names.base, True)
            files = [names.unpruned_dir / r.output for r in result.rungs if r.output]
            return files, f"{', '.join(r.name for r in result.rungs)} of the unpruned {names.base}"

        parameters = {"spec": _spec_record(plan.ladder.spec), "rungs": list(plan.evaluation.unpruned), "quantizer": plan.ladder.quantizer}
        self.stage("unpruned", parameters, self.inputs(plan.source, imatrix), plan.work, work)
        return [plan.work / rel for rel in sorted(self.state.outputs("unpruned"))]

    # --- evaluate, card, plan record, verify -----------------------------------------------

    def evaluate_stage(self, unpruned: list[Path]) -> None:
        plan = self.plan
        ev = plan.evaluation
        assert ev is not None
        directory = plan.output / "evaluation"

        def work() -> tuple[list[Path], str]:
            from ggufcarve.evaluate.gate import default_gate_path, load_gate
            from ggufcarve.evaluate.models import resolve_models
            from ggufcarve.evaluate.run import EvalSettings, evaluate
            from ggufcarve.evaluate.speed import SpeedSettings

            gate_path = ev.gate or default_gate_path()
            gate = load_gate(gate_path) if gate_path.exists() else None
            qa_checks = None
            if ev.qa is not None:
                from ggufcarve.evaluate.qa import load_suite

                qa_checks = [c.to_json() for c in load_suite(ev.qa)]
            settings = EvalSettings(ctx=ev.ctx, chunks=ev.chunks, threads=self.threads, top_k=ev.top_k, llama_cpp_dir=plan.ladder.llama_cpp,
                                    speed=SpeedSettings(runs=ev.speed_runs, engine=ev.speed_engine) if ev.speed_runs > 0 else None, gate=gate, qa_checks=qa_checks)
            from ggufcarve.fileio import make_temp_dir, remove_dead_temps

            entries = resolve_models([plan.output, *ev.compare, *unpruned])
            remove_dead_temps(plan.output, lambda name: name == directory.name)
            temp = make_temp_dir(directory)  # a hidden temp name: not part of the release while it fills
            try:
                run = evaluate(entries, ev.reference or plan.source, ev.heldout, settings, temp, self.sink)
                if directory.exists():
                    shutil.rmtree(directory)  # results of other rungs must not be published with these
                temp.rename(directory)
            finally:
                shutil.rmtree(temp, ignore_errors=True)
            self.evaluation = list(run.results)
            gates = [r.get("gate") for r in run.results]
            return _published(directory), f"{len(run.results)} models; " + ", ".join(f"{g} {gates.count(g)}" for g in ("PASS", "FAIL") if gates.count(g))

        def publish() -> str:
            from ggufcarve.release.publish import record_published

            record_published(plan.output, "evaluation", _published(directory))
            if not self.evaluation:
                self.evaluation = _read_results(directory)
            return ""

        parameters = {"ctx": ev.ctx, "chunks": ev.chunks, "top_k": ev.top_k, "speed_runs": ev.speed_runs, "speed_engine": ev.speed_engine, "reference": "source" if ev.reference is None else ev.reference.name}
        inputs = self.inputs(*self.rung_files(), ev.reference or plan.source, ev.heldout, *ev.compare, *unpruned, ev.gate, *(_qa_files(ev.qa)))
        self.stage("evaluate", parameters, inputs, plan.output, work, always=publish)

    def drop_evaluation(self) -> None:
        """A plan without [evaluation]: the results of an earlier run of this plan describe other rungs."""
        if "evaluate" in self.state.stages:
            directory = self.plan.output / "evaluation"
            if directory.is_dir():
                shutil.rmtree(directory)
            self.state.forget("evaluate")

    def rung_files(self) -> list[Path]:
        from ggufcarve.release.manifest import read_manifest

        manifest = read_manifest(self.plan.output) or {}
        rungs = manifest.get("rungs") if isinstance(manifest.get("rungs"), list) else []
        names = [f.get("name") for r in rungs if isinstance(r, dict) for f in r.get("files") or [] if isinstance(f, dict)]
        return [self.plan.output / n for n in names if isinstance(n, str) and (self.plan.output / n).is_file()]

    def card_stage(self) -> None:
        plan = self.plan

        def work() -> tuple[list[Path], str]:
            from ggufcarve.release.card import write_card

            path = write_card(plan.output, None, force=True)
            return [path], f"{path.name}"

        def publish() -> str:
            from ggufcarve.release.publish import record_published

            record_published(plan.output, "card", [plan.output / "README.md"])
            return ""

        evaluation = _published(plan.output / "evaluation")
        self.stage("card", {}, self.inputs(*self.rung_files(), *evaluation, *sorted(p for p in (plan.output / "method").glob("*.json") if p.name != RUN_PLAN_NAME)), plan.output, work, always=publish)

    def record_plan(self) -> None:
        """method/run-plan.json: the resolved plan (bare names), its inputs and the stages."""
        from ggufcarve.fileio import write_text_atomic
        from ggufcarve.release.publish import record_published
        from ggufcarve.reports import dumps, envelope, file_input

        plan = self.plan
        files = [p for p in (plan.source, *(plan.calibration.files if plan.calibration else ()), plan.imatrix.file if plan.imatrix else None,
                             plan.selection.keepset, plan.ladder.spec, *(_evaluation_inputs(plan))) if p is not None]
        inputs = [file_input(shard, self.digest_of(shard)) for p in files for shard in _shards(p)]
        stages = [{"name": s.name, "outputs": s.outputs or sorted(self.state.outputs(s.name))} for s in self.results]
        doc = envelope("run-plan", inputs=inputs, parameters=plan.to_json(),
                       results={"stages": stages, "kept_count": self.names.kept, "model_name": self.names.name}, timings={})
        path = plan.output / "method" / RUN_PLAN_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        if _without_created(_read_json(path)) != _without_created(doc):  # an unchanged plan leaves the release unchanged
            write_text_atomic(path, dumps(doc))
        record_published(plan.output, "plan", [path])

    def verify_stage(self) -> Any:
        from ggufcarve.release.verify import verify_dir

        started = time.monotonic()
        report = verify_dir(self.plan.output, workers=self.threads, on_event=self.sink)
        if not report.ok:
            first = report.failures[0]
            raise VerificationFailed(f"verify {self.plan.output}: {len(report.failures)} failure(s), first {first.path}: {first.problem}", f"run `ggufcarve verify {self.plan.output}` for the list")
        self.results.append(StageResult("verify", "ran", time.monotonic() - started, [], f"{len(report.files_ok)} files match SHA256SUMS and the manifest"))
        return report


def _method_needs_imatrix(method: str) -> bool:
    from ggufcarve.select.methods import method_named

    return method_named(method).needs == "imatrix"


def _spec_record(path: Path) -> dict[str, Any]:
    return {"name": path.name, "text": path.read_text(encoding="utf-8")}


def _shards(path: Path) -> list[Path]:
    if path.suffix == ".gguf" and path.is_file():
        from ggufcarve.gguf.container import read_model

        return list(read_model(path).paths)
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file())
    return [path]


def _qa_files(qa: Path | None) -> list[Path]:
    if qa is None:
        return []
    return sorted(qa.glob("*.jsonl")) if qa.is_dir() else [qa]


def _evaluation_inputs(plan: RunPlan) -> list[Path | None]:
    ev = plan.evaluation
    if ev is None:
        return []
    return [ev.heldout, ev.reference, ev.gate, *_qa_files(ev.qa), *ev.compare]


def _published(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return [p for p in sorted(directory.rglob("*")) if p.is_file() and not any(part.startswith(".") for part in p.relative_to(directory).parts)]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def _without_created(doc: Any) -> Any:
    return {k: v for k, v in doc.items() if k not in ("created", "timings")} if isinstance(doc, dict) else doc


def _read_results(directory: Path) -> list[dict[str, Any]]:
    results = []
    for path in sorted(directory.glob("*.json")):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(doc, dict) and "kld_mean" in doc:
            results.append(doc)
    return results


# ---------------------------------------------------------------------------------------------
# entry points


def execute_run(plan: RunPlan, *, force: bool = False, on_event: Sink = ignore) -> RunResult:
    """Run every stage of `plan` that has not already run with the same inputs; `force` re-runs
    them all and lets the ladder start the release afresh."""
    started = time.monotonic()
    preview = preview_run(plan, sizes=False)
    if preview.short:
        probe = preview.short[0]
        raise OutputError(f"the run needs about {preview.bytes_needed / 2**30:.2f} GiB more but {probe} has {preview.free[probe] / 2**30:.2f} GiB free",
                          "free disk space, or set work/output in the plan to a larger disk")
    plan.work.mkdir(parents=True, exist_ok=True)
    lock = _lock(plan.work)
    try:
        run = _Run(plan, on_event, force)
        if plan.selection.method is not None:
            if plan.imatrix is not None and plan.imatrix.collect and not run.traces():
                run.collect_stage()
            run.select_stage()
        elif plan.imatrix is not None and plan.imatrix.collect:
            run.collect_stage()
        run.prune_stage()
        if plan.imatrix is not None:
            run.remap_stage()
        run.ladder_stage()
        if plan.evaluation is not None:
            unpruned = run.unpruned_stage() if plan.evaluation.unpruned else []
            run.evaluate_stage(unpruned)
        else:
            run.drop_evaluation()
        if plan.card:
            run.card_stage()
        run.record_plan()
        report = run.verify_stage()
        return RunResult(plan, run.results, run.ladder_result, run.evaluation, report, time.monotonic() - started, list(dict.fromkeys(run.warnings)))
    finally:
        lock.close()


def _lock(work: Path) -> Any:
    import fcntl

    handle = open(work / ".run.lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise OutputError(f"another ggufcarve run is working in {work}", "wait for it to finish, or give this plan another work directory") from None
    return handle


def preview_run(plan: RunPlan, *, sizes: bool = True) -> RunPreview:
    """The stages `execute_run` would run, their outputs and sizes, and the disk they need.
    Without `sizes`, rung sizes are predicted only when a compiled llama-quantize answers fast."""
    from ggufcarve.gguf.container import read_model
    from ggufcarve.moe.keepset import keep_first
    from ggufcarve.moe.layout import inspect_layout
    from ggufcarve.prune.plan import plan_prune

    model = read_model(plan.source)
    layout = inspect_layout(model)
    names = names_for(plan, model, layout)
    if plan.selection.keepset is not None:
        from ggufcarve.moe.keepset import load_keepset

        keepset = load_keepset(plan.selection.keepset, layout)
    else:
        keepset = keep_first(layout, names.kept)  # every block keeps K equal slabs: the sizes of any keep-set of K
    pruned_plan = plan_prune(model, layout, keepset, names.pruned)
    state = RunState(plan.work)

    def done(stage: str) -> bool:
        return stage in state.stages

    stages: list[StagePreview] = []
    if plan.selection.method is not None:
        one_pass = plan.imatrix is not None and plan.imatrix.collect and plan.calibration is not None and _traces(plan.selection.method)
        if plan.imatrix is not None and plan.imatrix.collect and not one_pass:
            stages.append(StagePreview("imatrix-collect", "collect the full model's imatrix from the calibration text", (names.collected_imatrix.name,), None, done("imatrix-collect")))
        stages.append(StagePreview("select", f"score experts with {plan.selection.method}, keep {names.kept} of {layout.expert_count}" + ("; the imatrix in the same pass" if one_pass else ""),
                                   (names.selection.name,) + ((names.collected_imatrix.name,) if one_pass else ()), None, done("select")))
    elif plan.imatrix is not None and plan.imatrix.collect:
        stages.append(StagePreview("imatrix-collect", "collect the full model's imatrix from the calibration text", (names.collected_imatrix.name,), None, done("imatrix-collect")))
    stages.append(StagePreview("prune", f"{layout.expert_count} -> {names.kept} experts in {len(layout.layers)} MoE blocks", tuple(f.path.name for f in pruned_plan.files), pruned_plan.bytes_out, done("prune")))
    if plan.imatrix is not None:
        stages.append(StagePreview("imatrix", "remap the imatrix to the kept experts", (names.remapped_imatrix.name,), None, done("imatrix")))
    rungs = _rung_names(plan)
    stages.append(StagePreview("ladder", f"{plan.ladder.spec.name}: {', '.join(rungs)}", tuple(f"{names.name}-{r}.gguf" for r in rungs), _ladder_bytes(plan, model, layout, names.kept, rungs, sizes), done("ladder")))
    if plan.evaluation is not None:
        if plan.evaluation.unpruned:
            stages.append(StagePreview("unpruned", f"{', '.join(plan.evaluation.unpruned)} of the unpruned model, for the equal-size comparison",
                                       tuple(f"{names.base}-{r}.gguf" for r in plan.evaluation.unpruned), _ladder_bytes(plan, model, layout, layout.expert_count, list(plan.evaluation.unpruned), sizes), done("unpruned")))
        stages.append(StagePreview("evaluate", f"PPL, KLD vs the unpruned model, speed{', QA' if plan.evaluation.qa else ''}, gate", ("evaluation/",), None, done("evaluate")))
    if plan.card:
        stages.append(StagePreview("card", "the model card", ("README.md",), None, done("card")))
    stages.append(StagePreview("verify", "SHA256SUMS, manifest, GGUF structure", (), None, False))
    # a stage that ran before still needs its space when it runs again: its output is written
    # beside the old one, under a temp name, before the old one goes
    needed = sum(s.bytes or 0 for s in stages) + DISK_MARGIN
    free: dict[str, int] = {}
    for directory in (plan.work, plan.output):
        probe = directory
        while not probe.exists():
            probe = probe.parent
        free[str(directory)] = shutil.disk_usage(probe).free
    return RunPreview(plan, tuple(stages), needed, free)


def _traces(method: str) -> bool:
    from ggufcarve.select.methods import method_named

    return method_named(method).needs == "calibration"


def _rung_names(plan: RunPlan) -> list[str]:
    from ggufcarve.quant.spec import load_spec

    spec = load_spec(plan.ladder.spec)
    return [r.name for r in spec.rungs if not plan.ladder.only or r.name.upper() in plan.ladder.only]


def _ladder_bytes(plan: RunPlan, model: Any, layout: Any, kept: int, rungs: list[str], exact: bool) -> int | None:
    """The rungs' predicted bytes (quant/fit.py: llama.cpp's dry run on a sparse pruned header),
    or None when only libllama can answer and `exact` is not asked for (a libllama dry run takes
    seconds per rung; the ladder checks its own disk before writing)."""
    from ggufcarve.quant.fit import plan_fit
    from ggufcarve.quant.kvcache import ContextSettings
    from ggufcarve.quant.quantizer import make_quantizer
    from ggufcarve.quant.spec import load_spec

    quantizer = make_quantizer(plan.ladder.quantizer, plan.ladder.llama_cpp)  # the plan's choice: a libllama-only plan runs no compiled tool
    if quantizer.backend != "binary" and not exact:
        return None
    report = plan_fit(model, layout, load_spec(plan.ladder.spec), memory=2**62, context=ContextSettings(512), quantizer=quantizer, kept_counts=[kept], only=rungs)
    return sum(row.rung.bytes for row in report.rows)
