"""A run plan turned into its list of stages, once: each stage's name, what it does, the files it
reads, its parameters, the files it writes and the library call that writes them. The dry run,
the run and the resume all iterate this one list (run.py), so the preview is the run.

The calls are the ones the commands make: `select_to_file` (`ggufcarve select`), `tune`
(`ggufcarve tune`, for `[selection] method = "tune"`), `plan_prune` /
`execute` (`prune`), `collect_imatrix` (`imatrix collect`), `plan_remap` / `execute_remap`
(`imatrix remap`), `plan_ladder` / `run_ladder` (`ladder run`), `evaluate_release` (`eval`),
`write_card` (`card`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ggufcarve.errors import BadInput, ToolFailed
from ggufcarve.events import Sink, ignore
from ggufcarve.fileio import format_size
from ggufcarve.llama.devices import CPU, Compute
from ggufcarve.pipeline.plan import EvaluationStep, RunPlan

SELECTION_NAME = "expert-selection.json"
EVALUATION_DIR = "evaluation"
RUN_PLAN_NAME = "run-plan.json"
TUNE_DIR = "tune"  # WORK/tune: what `ggufcarve tune -o` writes
TUNE_PUBLISHED = ("tune.md", "tune-kld.png")  # published in the release's method/ (tune.run's markdown and CHART)

# a stage's work: the files it wrote and a one-line summary
Work = Callable[[], tuple[list[Path], str]]


@dataclass
class Stage:
    name: str
    action: str  # what it does, in words (the preview)
    base: Path  # the directory its outputs are recorded relative to (work or output)
    parameters: dict[str, Any]
    inputs: tuple[
        Path, ...
    ]  # files it reads (every shard of a split model); those an earlier stage writes are hashed when it is reached
    outputs: tuple[str, ...]  # the files it writes (names, for the preview)
    bytes: int | None  # what its outputs take on disk; None: known once the stages before it ran
    work: Work
    publish: Callable[[], str] | None = (
        None  # runs also when the stage is skipped (records published files; idempotent)
    )
    later_inputs: Callable[[], list[Path]] | None = (
        None  # inputs named only once the stages before it ran (the release's rungs)
    )
    recorded: bool = True  # False: runs every time and records nothing (verify)
    elsewhere: tuple[Path, int] | None = (
        None  # a directory outside work and output it writes to, and at most how much (the reference's log-probs cache)
    )


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


def names_for(plan: RunPlan, layout: Any) -> Names:
    """The intermediate files' names; K checked against the model's load rules."""
    from ggufcarve.quant.ladder_plan import model_name_from

    base = model_name_from(plan.source)
    kept = _kept_count(plan, layout)
    name = plan.name or f"{base}-{kept}e"
    if name == base and plan.evaluation is not None and plan.evaluation.unpruned:
        raise BadInput(
            f"plan: name = {name!r} is also the unpruned model's name, so their rungs would share file names",
            f'give the pruned model another name, e.g. "{base}-{kept}e"',
        )
    stem = plan.source.name[:-5] if plan.source.name.endswith(".gguf") else plan.source.name
    tag = stem[len(base) :].lstrip("-._") if stem.startswith(base) else ""
    return Names(
        base=base,
        name=name,
        kept=kept,
        source_expert_count=layout.expert_count,
        pruned=plan.work / (f"{name}-{tag}.gguf" if tag else f"{name}.gguf"),
        selection=plan.work / SELECTION_NAME,
        collected_imatrix=plan.work / f"{base}.imatrix.gguf",
        remapped_imatrix=plan.work / f"{name}.imatrix.gguf",
        unpruned_dir=plan.work / "unpruned",
    )


def _kept_count(plan: RunPlan, layout: Any) -> int:
    if plan.selection.tunes:  # every K checked; the first is carved
        from ggufcarve.moe.kept import kept_count

        try:
            return [kept_count(layout, k, None) for k in plan.selection.keeps][0]
        except BadInput as err:
            raise BadInput(f"[selection]: {err.message}", err.hint) from None
    if plan.selection.keepset is not None:
        from ggufcarve.moe.keepset import check_keepset, load_keepset

        keepset = load_keepset(plan.selection.keepset, layout)
        check_keepset(keepset, layout)
        return keepset.kept_count
    from ggufcarve.moe.kept import kept_count

    try:
        return kept_count(layout, plan.selection.keep, plan.selection.ratio)
    except BadInput as err:
        raise BadInput(f"[selection]: {err.message}", err.hint) from None


@dataclass
class StageResult:
    name: str
    status: str  # "ran" or "skipped"
    seconds: float = 0.0
    outputs: list[str] = field(default_factory=list)
    summary: str = ""


@dataclass
class RunContext:
    """What the stages share in one process: the source read once, and the values one stage hands
    the next (the selection's keep-set, the ladder's result, the evaluation)."""

    plan: RunPlan
    model: Any
    layout: Any
    names: Names
    sink: Sink = ignore
    force: bool = False
    state: Any = None  # state.RunState
    compute: Compute = CPU  # where every llama.cpp stage runs, threads resolved
    keepset: Any = None  # moe.keepset.KeepSet of the selection, once read or written
    ladder_result: Any = None
    evaluation: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    results: list[StageResult] = field(default_factory=list)
    verification: Any = None  # release.verify.VerifyReport
    digests: dict[Path, str] = field(default_factory=dict)
    replacing: set[str] = field(default_factory=set)  # stages that run again over a recorded earlier run

    def digest_of(self, path: Path) -> str:
        """sha256 of a file, hashed once per run."""
        from ggufcarve.pipeline.state import file_digest

        if path not in self.digests:
            self.digests[path] = file_digest(path, self.sink)
        return self.digests[path]

    def selection_keepset(self) -> Any:
        """The keep-set: the select stage's value in this process, else the file (a given
        keep-set, or the selection an earlier run wrote)."""
        if self.keepset is None:
            from ggufcarve.moe.keepset import load_keepset

            self.keepset = load_keepset(self.keepset_file(), self.layout)
        return self.keepset

    def keepset_file(self) -> Path:
        return self.plan.selection.keepset or self.names.selection


def traces(plan: RunPlan) -> bool:
    from ggufcarve.select.criteria import criterion_named

    return (
        plan.selection.method is not None
        and not plan.selection.tunes
        and criterion_named(plan.selection.method).needs == "calibration"
    )


def one_pass(plan: RunPlan) -> bool:
    """The selection traces calibration text and the imatrix is collected in the same pass."""
    return traces(plan) and plan.imatrix is not None and plan.imatrix.collect


def build_stages(ctx: RunContext, *, sizes: bool = True) -> list[Stage]:
    """The plan's stages in order. `sizes`: predict the rungs' bytes also when only libllama can
    (seconds per rung); otherwise only a compiled llama-quantize is asked."""
    plan = ctx.plan
    stages: list[Stage] = []
    collects = plan.imatrix is not None and plan.imatrix.collect
    if collects and not one_pass(plan):
        stages.append(_collect_stage(ctx))
    if plan.selection.tunes:
        stages.append(_tune_stage(ctx))
    elif plan.selection.method is not None:
        stages.append(_select_stage(ctx))
    stages.append(_prune_stage(ctx))
    source_imatrix = imatrix_source(ctx)
    if source_imatrix is not None:
        stages.append(_remap_stage(ctx, source_imatrix))
    stages.append(_ladder_stage(ctx, sizes))
    if plan.evaluation is not None:
        if plan.evaluation.unpruned:
            stages.append(_unpruned_stage(ctx, plan.evaluation, sizes))
        stages.append(_evaluate_stage(ctx, plan.evaluation))
    if plan.card:
        stages.append(_card_stage(ctx))
    stages.append(_verify_stage(ctx))
    return stages


# ---------------------------------------------------------------------------------------------
# the stages


def _collect_stage(ctx: RunContext) -> Stage:
    """The full model's imatrix from the calibration text alone (no tracing selection method)."""
    plan, names = ctx.plan, ctx.names
    calibration = plan.calibration
    if calibration is None:
        raise BadInput("[imatrix]: collect = true needs a [calibration] table", "give [calibration] files = [...]")

    def work() -> tuple[list[Path], str]:
        from ggufcarve.imatrix.collect import collect_imatrix

        chunks = (
            calibration.max_tokens // calibration.ctx if calibration.max_tokens else None
        )  # whole chunks, as the selection's trace
        collect_imatrix(
            ctx.model,
            list(calibration.files),
            names.collected_imatrix,
            ctx=calibration.ctx,
            chunks=chunks,
            compute=ctx.compute,
            force=True,
            on_event=ctx.sink,
        )
        return [names.collected_imatrix], f"imatrix of {names.base} from {len(calibration.files)} calibration file(s)"

    return Stage(
        "imatrix-collect",
        "collect the full model's imatrix from the calibration text",
        plan.work,
        {"ctx": calibration.ctx, "max_tokens": calibration.max_tokens},
        (plan.source, *calibration.files),
        (names.collected_imatrix.name,),
        None,
        work,
    )


def _select_settings(ctx: RunContext) -> tuple[Any, tuple[Path, ...]]:
    """The settings `ggufcarve select` would be given for this plan, and the files they read."""
    from ggufcarve.select.criteria import criterion_named
    from ggufcarve.select.run import SelectSettings

    plan, sel = ctx.plan, ctx.plan.selection
    imatrix_in = None
    if sel.method is not None and plan.imatrix is not None and criterion_named(sel.method).needs == "imatrix":
        imatrix_in = plan.imatrix.file or ctx.names.collected_imatrix
    calibration = plan.calibration.files if plan.calibration is not None and traces(plan) else ()
    settings = SelectSettings(
        method=sel.method,
        keep=sel.keep,
        ratio=sel.ratio,
        imatrix=imatrix_in,
        calibration=tuple(calibration),
        seed=sel.seed,
        ctx=plan.calibration.ctx if plan.calibration else 512,
        max_tokens=plan.calibration.max_tokens if plan.calibration else None,
        compute=ctx.compute,
        protect=sel.protect,
        protect_super_experts=sel.protect_super_experts,
        heatmap=True,
        imatrix_out=ctx.names.collected_imatrix if one_pass(plan) else None,
    )
    reads = tuple(p for p in (*calibration, imatrix_in, sel.protect_file) if p is not None)
    return settings, reads


def _select_stage(ctx: RunContext) -> Stage:
    plan, names, sel = ctx.plan, ctx.names, ctx.plan.selection
    settings, reads = _select_settings(ctx)
    together = settings.imatrix_out is not None

    def work() -> tuple[list[Path], str]:
        from ggufcarve.select.run import select_to_file

        plan.work.mkdir(parents=True, exist_ok=True)
        result = select_to_file(
            plan.source, settings, names.selection, force=True, model=ctx.model, layout=ctx.layout, on_event=ctx.sink
        )
        ctx.keepset = result.keepset
        ctx.warnings.extend(result.selection.warnings)
        return (
            list(result.outputs),
            f"{sel.method}: keep {names.kept} of {names.source_expert_count} in {len(result.keepset.layers)} MoE blocks"
            + (" (imatrix collected in the same pass)" if together else ""),
        )

    parameters = {
        "method": sel.method,
        "keep": names.kept,
        "protect": sel.protect if sel.protect_file is None else sel.protect_file.name,
        "protect_super_experts": sel.protect_super_experts,
        "seed": sel.seed,
        "calibration": None
        if plan.calibration is None
        else {"ctx": plan.calibration.ctx, "max_tokens": plan.calibration.max_tokens},
        "one_pass": together,
    }
    outputs = (names.selection.name, names.selection.with_suffix(".png").name) + (
        (names.collected_imatrix.name,) if together else ()
    )
    action = f"score experts with {sel.method}, keep {names.kept} of {ctx.layout.expert_count}" + (
        "; the imatrix in the same pass" if together else ""
    )
    return Stage("select", action, plan.work, parameters, (plan.source, *reads), outputs, None, work)


def tune_settings(ctx: RunContext) -> Any:
    """The settings `ggufcarve tune` is given for this plan: [calibration]'s files, ctx and
    max_tokens (ctx: [evaluation]'s without a calibration table), [selection]'s methods, keep,
    heldout, chunks, seed and stability."""
    from ggufcarve.select.criteria import ZERO_SHOT
    from ggufcarve.tune.run import TuneSettings

    plan, sel = ctx.plan, ctx.plan.selection
    reads = any(m not in ZERO_SHOT for m in sel.methods)
    cal = plan.calibration if reads else None
    ctx_tokens = cal.ctx if cal is not None else (plan.evaluation.ctx if plan.evaluation is not None else 512)
    return TuneSettings(
        keeps=sel.keeps,
        methods=sel.methods,
        calibration=cal.files if cal is not None else (),
        heldout=sel.heldout,
        ctx=ctx_tokens,
        chunks=sel.chunks,
        max_tokens=cal.max_tokens if cal is not None else None,
        compute=ctx.compute,
        seed=sel.seed,
        stability=sel.stability,
    )


def _tune_stage(ctx: RunContext) -> Stage:
    """`ggufcarve tune` into WORK/tune/, its winner (at the first K) copied to the selection file the prune reads."""
    plan, names = ctx.plan, ctx.names
    settings = tune_settings(ctx)
    out_dir = plan.work / TUNE_DIR

    def work() -> tuple[list[Path], str]:
        from ggufcarve.fileio import write_text_atomic
        from ggufcarve.moe.keepset import load_keepset
        from ggufcarve.tune.run import tune

        plan.work.mkdir(parents=True, exist_ok=True)
        result = tune(plan.source, settings, out_dir, on_event=ctx.sink)
        write_text_atomic(names.selection, (out_dir / SELECTION_NAME).read_text(encoding="utf-8"))
        ctx.keepset = load_keepset(names.selection, ctx.layout)
        winner = next(c for c in result.report["candidates"] if c["id"] == result.winner)
        methods = len({c["method"] for c in result.report["candidates"]})  # greedy left out of "all" is not among them
        return [*result.outputs, names.selection], (
            f"{methods} methods at K = {', '.join(map(str, settings.keeps))}; winner {result.winner} "
            f"(mean KLD {winner['kld_mean']:.4f}), carved: keep {names.kept} of {names.source_expert_count}"
        )

    parameters = {
        "method": "tune",
        "methods": list(settings.methods),
        "keeps": list(settings.keeps),
        "ctx": settings.ctx,
        "chunks": settings.chunks,
        "max_tokens": settings.max_tokens,
        "seed": settings.seed,
        "stability": settings.stability,
    }
    outputs = tuple(f"{TUNE_DIR}/{n}" for n in (*TUNE_PUBLISHED, "tune.json", SELECTION_NAME, "candidates/")) + (
        names.selection.name,
    )
    action = (
        f"{len(settings.methods)} methods at K = {', '.join(map(str, settings.keeps))} "
        f"scored by masking on {', '.join(p.name for p in settings.heldout)}; "
        f"carve the winner at K = {names.kept}"
    )
    return Stage(
        "tune",
        action,
        plan.work,
        parameters,
        (plan.source, *settings.calibration, *settings.heldout),
        outputs,
        _tune_bytes(ctx, settings),
        work,
    )


def _tune_bytes(ctx: RunContext, settings: Any) -> int:
    """At most the unpruned model's log-prob records tune keeps in its work directory while it scores."""
    from ggufcarve.tune.run import reference_bytes

    return reference_bytes(ctx.model.path, settings)


def _prune_stage(ctx: RunContext) -> Stage:
    from ggufcarve.moe.keepset import keep_per_block
    from ggufcarve.prune.plan import plan_prune

    plan, names = ctx.plan, ctx.names
    # the sizes of any keep-set of K: every block keeps K equal slabs (group-balanced, as the selection is)
    preview = plan_prune(ctx.model, ctx.layout, keep_per_block(ctx.layout, names.kept), names.pruned)

    def work() -> tuple[list[Path], str]:
        from ggufcarve.prune.execute import execute

        keepset = ctx.selection_keepset()
        pruned_plan = plan_prune(ctx.model, ctx.layout, keepset, names.pruned)
        ctx.warnings.extend(pruned_plan.warnings)
        result = execute(pruned_plan, ctx.model, force=True, on_event=ctx.sink)
        files = [f.path for f in pruned_plan.files]
        return [*files, result.report_path], (
            f"{ctx.layout.expert_count} -> {keepset.kept_count} experts; "
            f"{format_size(pruned_plan.bytes_in)} -> {format_size(pruned_plan.bytes_out)}, "
            f"{len(result.verification.tensors)} tensors verified"
        )

    keepset_file = ctx.keepset_file()
    return Stage(
        "prune",
        f"{ctx.layout.expert_count} -> {names.kept} experts in {len(ctx.layout.layers)} MoE blocks",
        plan.work,
        {"keepset": keepset_file.name, "output": names.pruned.name},
        (plan.source, keepset_file),
        tuple(f.path.name for f in preview.files),
        preview.bytes_out,
        work,
    )


def imatrix_source(ctx: RunContext) -> Path | None:
    im = ctx.plan.imatrix
    if im is None:
        return None
    return im.file or ctx.names.collected_imatrix


def _remap_stage(ctx: RunContext, source_imatrix: Path) -> Stage:
    plan, names = ctx.plan, ctx.names

    def work() -> tuple[list[Path], str]:
        from ggufcarve.gguf.container import read_model
        from ggufcarve.imatrix.remap import execute_remap, plan_remap, resolve_source_layout
        from ggufcarve.imatrix_format import read_imatrix
        from ggufcarve.moe.layout import inspect_layout

        imatrix = read_imatrix(source_imatrix)
        pruned = read_model(names.pruned)
        layout = resolve_source_layout(imatrix, pruned, inspect_layout(pruned), ctx.layout)
        keepset = ctx.selection_keepset()
        remap_plan = plan_remap(
            imatrix, keepset, layout, names.remapped_imatrix, output_format="gguf", pruned=pruned, source=ctx.model
        )
        result = execute_remap(remap_plan, force=True, sources=[*pruned.paths, *ctx.model.paths], on_event=ctx.sink)
        return [
            names.remapped_imatrix,
            result.report_path,
        ], f"{len(remap_plan.output.entries)} entries remapped to {keepset.kept_count} experts"

    return Stage(
        "imatrix",
        "remap the imatrix to the kept experts",
        plan.work,
        {"output": names.remapped_imatrix.name},
        (source_imatrix, ctx.keepset_file(), names.pruned, plan.source),
        (names.remapped_imatrix.name,),
        None,
        work,
    )


def _quantizer(ctx: RunContext) -> Any:
    from ggufcarve.quant.quantizer import make_quantizer

    return make_quantizer(ctx.plan.ladder.quantizer, ctx.plan.ladder.llama_cpp)


def _run_ladder(
    ctx: RunContext,
    source: Path,
    out_dir: Path,
    imatrix: Path | None,
    only: Sequence[str],
    model_name: str,
    fresh: bool,
    label: str = "",
) -> Any:
    from ggufcarve.quant.ladder_plan import plan_ladder
    from ggufcarve.quant.ladder_run import run_ladder
    from ggufcarve.quant.spec import load_spec

    ladder_plan = plan_ladder(
        load_spec(ctx.plan.ladder.spec),
        source,
        out_dir,
        quantizer=_quantizer(ctx),
        imatrix=imatrix,
        only=list(only) or None,
        model_name=model_name,
        nthreads=ctx.compute.threads,
        fresh=fresh,
        experts_used=None if label else ctx.plan.ladder.topk,  # the unpruned comparison: as trained
        on_event=ctx.sink,
    )
    ctx.warnings.extend(ladder_plan.warnings)
    result = run_ladder(ladder_plan, on_event=ctx.sink, label=label)
    if result.failed:
        failed = result.failed[0]
        raise ToolFailed(
            f"rung {failed.name} failed: {failed.error}",
            "see the quantizer's last lines above; fix the cause and run the plan again (finished stages are skipped)",
        )
    return result


def _rung_names(plan: RunPlan, only: Sequence[str]) -> list[str]:
    from ggufcarve.quant.spec import load_spec

    return [r.name for r in load_spec(plan.ladder.spec).rungs if not only or r.name.upper() in only]


def _ladder_bytes(ctx: RunContext, kept: int, rungs: list[str], exact: bool) -> int | None:
    """The rungs' predicted bytes (quant/fit.py: llama.cpp's dry run on a sparse pruned header),
    or None when only libllama can answer and `exact` is not asked for (a libllama dry run takes
    seconds per rung; the ladder checks its own disk before writing)."""
    from ggufcarve.placement.kvcache import ContextSettings
    from ggufcarve.quant.fit import plan_fit
    from ggufcarve.quant.spec import load_spec

    quantizer = _quantizer(ctx)  # the plan's choice: a libllama-only plan runs no compiled tool
    if quantizer.backend != "binary" and not exact:
        return None
    report = plan_fit(
        ctx.model,
        ctx.layout,
        load_spec(ctx.plan.ladder.spec),
        memory=2**62,
        context=ContextSettings(512),
        quantizer=quantizer,
        kept_counts=[kept],
        only=rungs,
    )
    return sum(row.rung.bytes for row in report.rows)


def _spec_record(path: Path) -> dict[str, Any]:
    return {"name": path.name, "text": path.read_text(encoding="utf-8")}


def _ladder_stage(ctx: RunContext, sizes: bool) -> Stage:
    plan, names = ctx.plan, ctx.names
    imatrix = names.remapped_imatrix if plan.imatrix is not None else None
    rungs = _rung_names(plan, plan.ladder.only)

    def work() -> tuple[list[Path], str]:
        # a release this run's ladder made is replaced when the pruned source changed; any other
        # release in the output directory is refused by the ladder unless --force
        fresh = ctx.force or "ladder" in ctx.replacing
        result = _run_ladder(ctx, names.pruned, plan.output, imatrix, plan.ladder.only, names.name, fresh)
        ctx.ladder_result = result
        built = [r for r in result.rungs if r.status == "built"]
        outputs = [plan.output / r.output for r in result.rungs if r.output and (plan.output / r.output).is_file()]
        return (
            outputs,
            f"{len(result.rungs)} rungs ({len(built)} built), {format_size(sum(r.bytes or 0 for r in result.rungs))}",
        )

    def selection_record() -> list[
        Path
    ]:  # published as method/expert-selection.json when it is beside the pruned source
        path = ctx.keepset_file()
        return [path] if path.exists() else []

    parameters = {
        "spec": _spec_record(plan.ladder.spec),
        "only": list(plan.ladder.only),
        "quantizer": _public_quantizer(plan.ladder.quantizer),
        "name": names.name,
    }
    inputs = tuple(p for p in (names.pruned, imatrix) if p is not None)
    return Stage(
        "ladder",
        f"{plan.ladder.spec.name}: {', '.join(rungs)}",
        plan.output,
        parameters,
        inputs,
        tuple(f"{names.name}-{r}.gguf" for r in rungs),
        _ladder_bytes(ctx, names.kept, rungs, sizes),
        work,
        later_inputs=selection_record,
    )


def _public_quantizer(choice: str) -> str:
    return choice if choice in ("auto", "binary", "libllama") else Path(choice).name


def _unpruned_stage(ctx: RunContext, ev: EvaluationStep, sizes: bool) -> Stage:
    plan, names = ctx.plan, ctx.names
    imatrix = imatrix_source(ctx)

    def work() -> tuple[list[Path], str]:
        result = _run_ladder(ctx, plan.source, names.unpruned_dir, imatrix, ev.unpruned, names.base, True, "unpruned")
        files = [names.unpruned_dir / r.output for r in result.rungs if r.output]
        return files, f"{', '.join(r.name for r in result.rungs)} of the unpruned {names.base}"

    parameters = {
        "spec": _spec_record(plan.ladder.spec),
        "rungs": list(ev.unpruned),
        "quantizer": _public_quantizer(plan.ladder.quantizer),
    }
    inputs = tuple(p for p in (plan.source, imatrix) if p is not None)
    return Stage(
        "unpruned",
        f"{', '.join(ev.unpruned)} of the unpruned model, for the equal-size comparison",
        plan.work,
        parameters,
        inputs,
        tuple(f"{names.base}-{r}.gguf" for r in ev.unpruned),
        _ladder_bytes(ctx, ctx.layout.expert_count, list(ev.unpruned), sizes),
        work,
    )


def rung_files(output: Path) -> list[Path]:
    """The GGUF files of the release's rungs, as its manifest describes them."""
    from ggufcarve.release.manifest import described_files, read_manifest

    manifest = read_manifest(output) or {}
    return [
        output / name
        for name in sorted(described_files(manifest))
        if name.endswith(".gguf") and (output / name).is_file()
    ]


def qa_files(qa: Path | None) -> list[Path]:
    if qa is None:
        return []
    return sorted(qa.glob("*.jsonl")) if qa.is_dir() else [qa]


def _evaluate_stage(ctx: RunContext, ev: EvaluationStep) -> Stage:
    from ggufcarve.evaluate.gate import default_gate_path

    plan = ctx.plan
    directory = plan.output / EVALUATION_DIR

    def unpruned() -> list[Path]:
        return [plan.work / rel for rel in sorted(ctx.state.outputs("unpruned"))] if ev.unpruned else []

    from ggufcarve.evaluate.reference import reference_cache_dir, reference_disk_bytes
    from ggufcarve.evaluate.release import eval_settings

    settings, warnings = eval_settings(
        ctx=ev.ctx,
        chunks=ev.chunks,
        compute=ctx.compute,
        top_k=ev.top_k,
        tail_samples=ev.tail_samples,
        speed_runs=ev.speed_runs,
        speed_engine=ev.speed_engine,
        gate=ev.gate,
        qa=ev.qa,
        llama_cpp=plan.ladder.llama_cpp,
        gate_segments=ev.gate_segments,
        loops=ev.loops,
        loop_prompts=ev.loop_prompts,
        loop_tokens=ev.loop_tokens,
    )
    reference_bytes = reference_disk_bytes(ev.reference or plan.source, ev.heldout, settings, hash_reference=False)

    def work() -> tuple[list[Path], str]:
        from ggufcarve.evaluate.release import evaluate_release

        ctx.warnings.extend(warnings)
        evaluated = evaluate_release(
            [plan.output, *ev.compare, *unpruned()],
            ev.reference or plan.source,
            ev.heldout,
            settings,
            directory,
            ctx.sink,
            replace=True,
        )
        ctx.evaluation = list(evaluated.run.results)
        gates = [r.get("gate") for r in evaluated.run.results]
        return list(evaluated.files), f"{len(evaluated.run.results)} models; " + ", ".join(
            f"{g} {gates.count(g)}" for g in ("PASS", "FAIL") if gates.count(g)
        )

    def publish() -> str:
        from ggufcarve.fileio import published_files
        from ggufcarve.release.publish import record_published

        record_published(plan.output, "evaluation", published_files(directory))
        if not ctx.evaluation:
            ctx.evaluation = read_results(directory)
        return ""

    parameters = {
        "ctx": ev.ctx,
        "chunks": ev.chunks,
        "top_k": ev.top_k,
        "speed_runs": ev.speed_runs,
        "speed_engine": ev.speed_engine,
        "reference": "source" if ev.reference is None else ev.reference.name,
    }
    if ev.top_k is not None:
        parameters["tail_samples"] = settings.tail_samples
    if ev.gate_segments is not None:
        parameters["gate_segments"] = ev.gate_segments
    if settings.loops is not None:
        parameters["loops"] = {
            "prompts": ev.loop_prompts.name if ev.loop_prompts else "qa",
            "tokens": settings.loops.tokens,
        }
    gate = ev.gate or default_gate_path()
    inputs = tuple(
        p
        for p in (
            ev.reference or plan.source,
            *ev.heldout_files,
            *ev.compare,
            gate if gate.exists() else None,
            *qa_files(ev.qa),
            ev.loop_prompts,
        )
        if p is not None
    )
    return Stage(
        "evaluate",
        f"PPL, KLD vs the unpruned model, speed{', QA' if ev.qa else ''}, gate",
        plan.output,
        parameters,
        inputs,
        (f"{EVALUATION_DIR}/",),
        None,
        work,
        publish=publish,
        later_inputs=lambda: [*rung_files(plan.output), *unpruned()],
        elsewhere=(reference_cache_dir(settings), reference_bytes) if reference_bytes else None,
    )


def read_results(directory: Path) -> list[dict[str, Any]]:
    import json

    results = []
    for path in sorted(directory.glob("*.json")):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(doc, dict) and "kld_mean" in doc:
            results.append(doc)
    return results


def method_reports(output: Path, except_name: str) -> list[Path]:
    return sorted(p for p in (output / "method").glob("*.json") if p.name != except_name)


def _card_stage(ctx: RunContext) -> Stage:
    from ggufcarve.fileio import published_files

    plan = ctx.plan

    def work() -> tuple[list[Path], str]:
        from ggufcarve.errors import OutputError
        from ggufcarve.release.card import card_edited, card_warnings, write_card

        if card_edited(plan.output) and not ctx.force:
            raise OutputError(
                f"{plan.output / 'README.md'} was edited since ggufcarve wrote it, and this run would replace it",
                "keep the edit (card = false in the plan, then `ggufcarve "
                "card --record`), or let the run write the card again: "
                "remove README.md (or run with --force, which also runs every stage again)",
            )
        if (
            plan.selection.tunes or (plan.output / "method" / TUNE_PUBLISHED[0]).exists()
        ):  # the card links the tournament it finds: published (or dropped) first
            from ggufcarve.release.publish import record_published

            plan_record = plan.output / "method" / RUN_PLAN_NAME
            record_published(
                plan.output, "plan", [*([plan_record] if plan_record.is_file() else []), *_publish_tune(plan)]
            )
        path = write_card(plan.output, None, force=True, settings=plan.card_settings)
        ctx.warnings.extend(card_warnings(plan.output, plan.card_settings))
        return [path], f"{path.name}"

    def publish() -> str:
        from ggufcarve.release.publish import record_published

        record_published(plan.output, "card", [plan.output / "README.md"])
        return ""

    def reads() -> list[Path]:
        return [
            *rung_files(plan.output),
            *published_files(plan.output / EVALUATION_DIR),
            *method_reports(plan.output, RUN_PLAN_NAME),
        ]

    parameters = plan.card_settings.to_json() if plan.card_settings is not None else {}
    return Stage(
        "card",
        "the model card",
        plan.output,
        parameters,
        (),
        ("README.md",),
        None,
        work,
        publish=publish,
        later_inputs=reads,
    )


def shards(path: Path) -> list[Path]:
    """A stage input as files: every shard of a GGUF split set, every file of a directory."""
    if path.suffix == ".gguf" and path.is_file():
        from ggufcarve.gguf.container import read_model

        return list(read_model(path).paths)
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file())
    return [path]


def _record_plan(ctx: RunContext) -> None:
    """method/run-plan.json: the resolved plan (bare names), its input files and the stages before it."""
    import json

    from ggufcarve.fileio import write_text_atomic
    from ggufcarve.release.publish import record_published
    from ggufcarve.reports import dumps, envelope, file_input

    plan = ctx.plan
    path = plan.output / "method" / RUN_PLAN_NAME
    ev = plan.evaluation
    files = [
        plan.source,
        *(plan.calibration.files if plan.calibration else ()),
        plan.imatrix.file if plan.imatrix else None,
        plan.selection.keepset,
        plan.selection.protect_file,
        plan.ladder.spec,
    ]
    files += plan.selection.heldout
    if ev is not None:
        files += [*ev.heldout_files, ev.reference, ev.gate, *qa_files(ev.qa), *ev.compare]
    inputs = [
        file_input(shard, ctx.digest_of(shard))
        for p in dict.fromkeys(p for p in files if p is not None)
        for shard in shards(p)
    ]
    stages = [{"name": r.name, "outputs": r.outputs or sorted(ctx.state.outputs(r.name))} for r in ctx.results]
    doc = envelope(
        "run-plan",
        inputs=inputs,
        parameters=plan.to_json(),
        results={"stages": stages, "kept_count": ctx.names.kept, "model_name": ctx.names.name},
        timings={},
    )
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        old = None
    path.parent.mkdir(parents=True, exist_ok=True)
    if _without_created(old) != _without_created(doc):  # an unchanged plan leaves the release unchanged
        write_text_atomic(path, dumps(doc))
    record_published(plan.output, "plan", [path, *_publish_tune(plan)])


def _publish_tune(plan: RunPlan) -> list[Path]:
    """method/tune.md and method/tune-kld.png: the tournament the carved keep-set won, copied from
    WORK/tune when their bytes differ; removed from the release when the plan does not tune."""
    import shutil

    from ggufcarve.fileio import atomic_file

    published = []
    for name in TUNE_PUBLISHED:
        target = plan.output / "method" / name
        if not plan.selection.tunes:
            target.unlink(missing_ok=True)
            continue
        made = plan.work / TUNE_DIR / name
        if not target.is_file() or target.read_bytes() != made.read_bytes():
            with atomic_file(target) as temp:
                shutil.copyfile(made, temp)
        published.append(target)
    return published


def _without_created(doc: Any) -> Any:
    return {k: v for k, v in doc.items() if k not in ("created", "timings")} if isinstance(doc, dict) else doc


def _verify_stage(ctx: RunContext) -> Stage:
    """Publish the plan's record, then check the release as `ggufcarve verify` does; runs every time."""

    def work() -> tuple[list[Path], str]:
        from ggufcarve.errors import VerificationFailed
        from ggufcarve.release.verify import verify_dir

        _record_plan(ctx)
        plan = ctx.plan
        # what the recorded plan promises (release.verify.promised_parts): every rung of the spec
        # unless it builds some only, and the evaluation and the card it makes
        report = verify_dir(plan.output, workers=ctx.compute.threads, on_event=ctx.sink)
        if not report.ok:
            first = report.failures[0]
            raise VerificationFailed(
                f"verify {ctx.plan.output}: {len(report.failures)} failure(s), first {first.path}: {first.problem}",
                f"run `ggufcarve verify {ctx.plan.output}` for the list",
            )
        ctx.verification = report
        return [], f"{len(report.files_ok)} files match SHA256SUMS and the manifest"

    published = (RUN_PLAN_NAME, *(TUNE_PUBLISHED if ctx.plan.selection.tunes else ()))
    return Stage(
        "verify",
        f"{', '.join(f'method/{n}' for n in published)}; SHA256SUMS, manifest, GGUF structure",
        ctx.plan.output,
        {},
        (),
        tuple(f"method/{n}" for n in published),
        None,
        work,
        recorded=False,
    )


def run_compute(plan: RunPlan) -> Compute:
    """The plan's `Compute` with its threads resolved (the plan's, else the physical cores) and an
    automatic placement placed for the source at the longest context the plan decodes."""
    from ggufcarve.llama.tools import physical_cores
    from ggufcarve.placement.auto import resolve

    compute = plan.compute.with_threads(plan.compute.threads or physical_cores())
    contexts = [plan.calibration.ctx if plan.calibration else 512, *([plan.evaluation.ctx] if plan.evaluation else [])]
    return resolve(compute, plan.source, max(contexts)) if plan.source is not None else compute
