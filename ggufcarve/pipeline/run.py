"""Executing a run plan: its stages (stages.py: select or tune -> prune -> imatrix -> ladder ->
unpruned -> evaluate -> card -> plan -> verify), listed by the dry run and run in order.

Each stage records the digest of its input files and parameters with its outputs (state.py) and
is skipped when they match: after a crash or a kill, the re-run starts at the stage that did not
finish. One run works in a work directory at a time: it holds the directory's lock file, taken as
the release's lock is (release/lock.py: O_EXCL and a heartbeat, which hold across the hosts of a
shared file system).

Files: the release directory (`output`) holds only what is published — the rungs, SHA256SUMS,
quant-manifest.json, method/ (expert-selection.json, pruning-report.json,
imatrix-remap-report.json, run-plan.json; tune.md and tune-kld.png when the plan tunes),
evaluation/ and the card README.md. The work directory holds the selection (and tune/, the
tournament's directory), the pruned source, the imatrices, the unpruned comparison rungs and the
run state.

With a calibration method and `[imatrix] collect = true`, the selection statistics and the full
model's imatrix come from one pass over the calibration text; the imatrix is then remapped to the
kept experts like any other.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

from ggufcarve.errors import OutputError
from ggufcarve.events import Event, Sink, ignore
from ggufcarve.pipeline.plan import RunPlan
from ggufcarve.pipeline.stages import (
    RUN_PLAN_NAME,
    SELECTION_NAME,
    Names,
    RunContext,
    Stage,
    StageResult,
    build_stages,
    names_for,
    run_compute,
    shards,
)
from ggufcarve.pipeline.state import RunState, stage_digest

__all__ = [
    "RUN_PLAN_NAME",
    "SELECTION_NAME",
    "Names",
    "RunPreview",
    "RunResult",
    "StagePreview",
    "StageResult",
    "execute_run",
    "names_for",
    "preview_run",
]

DISK_MARGIN = 64 * 2**20
WORK_LOCK_NAME = ".ggufcarve-run.lock"


@dataclass
class RunResult:
    plan: RunPlan
    stages: list[StageResult]
    ladder: Any = None  # quant.ladder_run.LadderResult of the release's ladder stage, when it ran
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
    bytes_needed: int  # in the work and output directories
    free: dict[str, int]  # probe directory -> free bytes
    needed: dict[str, int] = field(default_factory=dict)  # probe directory -> bytes the run writes on its file system
    reference_bytes: int = 0  # at most, the reference's log-probs in ggufcarve's cache (not yet cached)

    @property
    def short(self) -> list[str]:
        return [d for d, free in self.free.items() if free < self.needed.get(d, self.bytes_needed)]


def _context(plan: RunPlan, on_event: Sink = ignore, force: bool = False) -> RunContext:
    from ggufcarve.gguf.container import read_model
    from ggufcarve.moe.layout import inspect_layout

    model = read_model(plan.source)
    layout = inspect_layout(model)
    return RunContext(
        plan,
        model,
        layout,
        names_for(plan, layout),
        on_event,
        force,
        RunState(plan.work),
        run_compute(plan),
    )


def _preview(ctx: RunContext, stages: list[Stage]) -> RunPreview:
    plan = ctx.plan
    listed = tuple(
        StagePreview(s.name, s.action, s.outputs, s.bytes, s.recorded and s.name in ctx.state.stages) for s in stages
    )
    # a stage that ran before still needs its space when it runs again: its output is written
    # beside the old one, under a temp name, before the old one goes
    needed = sum(s.bytes or 0 for s in stages) + DISK_MARGIN
    elsewhere = [s.elsewhere for s in stages if s.elsewhere is not None]
    free: dict[str, int] = {}
    devices: dict[str, int] = {}
    for directory in (plan.work, plan.output, *(d for d, _ in elsewhere)):
        probe = directory
        while not probe.exists():
            probe = probe.parent
        free[str(directory)] = shutil.disk_usage(probe).free
        devices[str(directory)] = os.stat(probe).st_dev
    # what the run writes, per file system: work and output hold the stages' outputs, a cache
    # directory its own; directories on one file system share its free space
    on_device: dict[int, int] = {}
    for directory in {str(plan.work), str(plan.output)}:
        on_device[devices[directory]] = needed
    for directory, amount in elsewhere:
        on_device[devices[str(directory)]] = on_device.get(devices[str(directory)], 0) + amount
    return RunPreview(
        plan, listed, needed, free, {d: on_device[devices[d]] for d in free}, sum(amount for _, amount in elsewhere)
    )


def preview_run(plan: RunPlan, *, sizes: bool = True) -> RunPreview:
    """The stages `execute_run` would run, their outputs and sizes, and the disk they need.
    Without `sizes`, rung sizes are predicted only when a compiled llama-quantize answers fast."""
    ctx = _context(plan)
    return _preview(ctx, build_stages(ctx, sizes=sizes))


def _inputs(ctx: RunContext, stage: Stage) -> list[tuple[str, str]]:
    paths = [*stage.inputs, *(stage.later_inputs() if stage.later_inputs is not None else [])]
    return [(shard.name, ctx.digest_of(shard)) for p in paths for shard in shards(p)]


def _run_stage(ctx: RunContext, stage: Stage) -> StageResult:
    """Run `stage` unless the state says this digest already produced its outputs; its `publish`
    runs in both cases (recording published files in the manifest is idempotent)."""
    if not stage.recorded:
        started = time.monotonic()
        ctx.sink(Event("run", len(ctx.results), 0, "stages", stage.name))
        outputs, summary = stage.work()
        return StageResult(stage.name, "ran", time.monotonic() - started, [], summary)
    state, base = ctx.state, stage.base
    digest = stage_digest(stage.name, stage.parameters, _inputs(ctx, stage))
    if not ctx.force and state.done(stage.name, digest, base):
        result = StageResult(stage.name, "skipped", outputs=sorted(state.outputs(stage.name)), summary="unchanged")
        if stage.publish is not None:
            result.summary = stage.publish() or result.summary
        return result
    ctx.sink(Event("run", len(ctx.results), 0, "stages", stage.name))
    started = time.monotonic()
    previous = state.outputs(stage.name)
    if stage.name in state.stages:
        ctx.replacing.add(stage.name)
    state.forget(stage.name)
    outputs, summary = stage.work()
    if base.resolve() == ctx.plan.work.resolve():  # intermediates of the stage's last run that this one replaced
        kept = {p.resolve() for p in outputs}
        for rel in previous:
            old = base / rel
            if old.resolve() not in kept and old.is_file():
                old.unlink()
    if stage.publish is not None:
        summary = stage.publish() or summary
    seconds = time.monotonic() - started
    state.record(stage.name, digest, base, outputs, seconds)
    return StageResult(
        stage.name, "ran", seconds, sorted(p.resolve().relative_to(base.resolve()).as_posix() for p in outputs), summary
    )


def _drop_evaluation(ctx: RunContext) -> None:
    """A plan without [evaluation]: the results of an earlier run of this plan describe other rungs."""
    if "evaluate" in ctx.state.stages:
        from ggufcarve.release.manifest import read_manifest
        from ggufcarve.release.publish import record_published

        directory = ctx.plan.output / "evaluation"
        if directory.is_dir():
            shutil.rmtree(directory)
        if read_manifest(ctx.plan.output) is not None:
            record_published(ctx.plan.output, "evaluation", [])
        ctx.state.forget("evaluate")


def execute_run(plan: RunPlan, *, force: bool = False, on_event: Sink = ignore) -> RunResult:
    """Run every stage of `plan` that has not already run with the same inputs; `force` re-runs
    them all and lets the ladder start the release afresh."""
    from ggufcarve.release.lock import lock_release

    started = time.monotonic()
    ctx = _context(plan, on_event, force)
    stages = build_stages(ctx, sizes=False)
    preview = _preview(ctx, stages)
    if preview.short:
        from ggufcarve.fileio import format_size

        probe = preview.short[0]
        raise OutputError(
            f"the run needs about {format_size(preview.needed[probe])} "
            f"more but {probe} has {format_size(preview.free[probe])} free",
            "free disk space, or set work/output in the plan to a larger "
            "disk (and GGUFCARVE_CACHE for the reference's log-probs)",
        )
    plan.work.mkdir(parents=True, exist_ok=True)
    with lock_release(
        plan.work,
        name=WORK_LOCK_NAME,
        wait=0,
        hint="wait for the other run to finish, or give this plan another work directory",
    ):
        ctx.state = RunState(plan.work)  # as the lock's holder found it
        if plan.evaluation is None:
            _drop_evaluation(ctx)
        for stage in stages:
            ctx.results.append(_run_stage(ctx, stage))
    return RunResult(
        plan,
        ctx.results,
        ctx.ladder_result,
        ctx.evaluation,
        ctx.verification,
        time.monotonic() - started,
        list(dict.fromkeys(ctx.warnings)),
    )
