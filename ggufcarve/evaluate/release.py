"""Evaluating a release: the evaluation settings assembled from their options in one place, and
the evaluation of models into a directory that a release then publishes. `ggufcarve eval` and the
run pipeline's evaluate stage both call these.

    settings, warnings = eval_settings(ctx=512, chunks=40, gate=None, qa=Path("evaluation/qa"))
    run = evaluate_release([Path("release")], Path("model-Q8_0.gguf"), Path("heldout.txt"), settings,
        Path("release/evaluation"))
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ggufcarve.errors import BadInput
from ggufcarve.events import Sink, ignore
from ggufcarve.fileio import published_files
from ggufcarve.llama.devices import CPU, Compute


@dataclass(frozen=True)
class EvaluatedRelease:
    run: Any  # evaluate.run.EvalRun
    files: tuple[Path, ...]  # the files written to the output directory
    release: Path | None  # the release that now publishes them, when the output is inside one
    records: tuple[dict[str, object], ...]  # their records in the release's manifest


def eval_settings(
    *,
    ctx: int = 512,
    chunks: int | None = None,
    compute: Compute = CPU,
    top_k: int | None = None,
    tail_samples: int | None = None,
    speed_runs: int | None = None,
    speed_engine: str = "auto",
    gate: Path | None = None,
    qa: Path | None = None,
    cross_check: bool = False,
    llama_cpp: Path | None = None,
    cache: Path | None = None,
    kl_base_out: Path | None = None,
    gate_segments: str | None = None,
    loops: bool = False,
    loop_prompts: Path | None = None,
    loop_tokens: int | None = None,
) -> tuple[Any, list[str]]:
    """EvalSettings from the options of `ggufcarve eval` (and of a plan's [evaluation]), and the
    warnings to show: no gate given and none beside the installation.

    `top_k` None keeps every token's reference log-prob (llama-perplexity's base file: the KLD is
    llama-perplexity's); a K keeps a top-K cache with `tail_samples` sampled tail tokens per token
    (an unbiased estimate of the KLD whose sampling error is reported; 0: a lower bound).
    `gate_segments` (every, overall) replaces the gate file's `segments`: with several held-out
    files, whether a model fails when any one of them fails the gate.

    `loops` (implied by `loop_prompts`): continue the loop prompts greedily for `loop_tokens` new
    tokens and report the share that ends in a repeating cycle (ggufcarve.evaluate.loops); the
    prompts are `loop_prompts`' or else the QA suite's (`qa`, or the shipped suite)."""
    from ggufcarve.evaluate.gate import SEGMENT_MODES, default_gate_path, load_gate
    from ggufcarve.evaluate.protocol import (
        DEFAULT_TAIL_SAMPLES,
        DEFAULT_TOP_K,
        REFERENCE_FULL,
        REFERENCE_TOPK,
        EvalSettings,
    )
    from ggufcarve.evaluate.speed import DEFAULT_RUNS, ENGINES, SpeedSettings

    tail_samples = DEFAULT_TAIL_SAMPLES if tail_samples is None else tail_samples
    speed_runs = DEFAULT_RUNS if speed_runs is None else speed_runs
    if top_k is not None and top_k < 1:
        raise BadInput(f"--top-k {top_k}: must be at least 1", "leave --top-k out to keep every token's log-prob")
    if tail_samples < 0 or tail_samples == 1:
        raise BadInput(
            f"--tail-samples {tail_samples}: must be 0 (a lower bound) "
            "or at least 2 (their spread measures the estimate's error)",
            f"for example --tail-samples {DEFAULT_TAIL_SAMPLES}",
        )
    if speed_engine not in ENGINES:
        raise BadInput(
            f"--speed-engine {speed_engine}: not one of {', '.join(ENGINES)}",
            "auto uses llama-bench when `ggufcarve toolchain build` has compiled it",
        )
    if gate_segments is not None and gate_segments not in SEGMENT_MODES:
        raise BadInput(
            f"--gate-segments {gate_segments}: not one of {', '.join(SEGMENT_MODES)}",
            "every: a model fails when any held-out file fails the gate",
        )
    warnings = []
    if gate is None and not default_gate_path().exists():
        warnings.append(f"no gate: {default_gate_path().name} is not beside this installation (give --gate FILE)")
        gate_rules = None
    else:
        gate_rules = load_gate(gate or default_gate_path())
        if gate_segments is not None:
            gate_rules = replace(gate_rules, segments=gate_segments)
    qa_checks = None
    if qa is not None:
        from ggufcarve.evaluate.qa import load_suite

        qa_checks = [c.to_json() for c in load_suite(qa)]
    loop_settings = _loop_settings(loops or loop_prompts is not None, loop_prompts, loop_tokens, qa_checks)
    settings = EvalSettings(
        ctx=ctx,
        chunks=chunks,
        top_k=top_k or DEFAULT_TOP_K,
        tail_samples=tail_samples,
        reference_store=REFERENCE_FULL if top_k is None else REFERENCE_TOPK,
        speed=SpeedSettings(runs=speed_runs, engine=speed_engine) if speed_runs > 0 else None,
        gate=gate_rules,
        qa_checks=qa_checks,
        cross_check=cross_check,
        llama_cpp_dir=llama_cpp,
        cache_dir=cache,
        kl_base_out=kl_base_out,
        loops=loop_settings,
        compute=compute,
    )
    return settings, warnings


def _loop_settings(wanted: bool, prompts_file: Path | None, tokens: int | None, qa_checks: list[dict] | None) -> Any:
    """LoopSettings of --loops / --loop-prompts / --loop-tokens, or None when loops are not asked for."""
    from ggufcarve.evaluate.loops import (
        DEFAULT_TOKENS,
        MAX_PERIOD,
        MIN_REPEATS,
        LoopSettings,
        load_loop_prompts,
        loop_prompts_from_checks,
    )

    if not wanted:
        if tokens is not None:
            raise BadInput("--loop-tokens sets the length of the loop test, which is not asked for", "add --loops")
        return None
    tokens = DEFAULT_TOKENS if tokens is None else tokens
    if not MIN_REPEATS * MAX_PERIOD <= tokens <= 4096:
        raise BadInput(
            f"--loop-tokens {tokens}: must be in {MIN_REPEATS * MAX_PERIOD}..4096 "
            f"(the detector needs {MIN_REPEATS} repeats of periods up to {MAX_PERIOD})",
            f"for example --loop-tokens {DEFAULT_TOKENS}",
        )
    if prompts_file is not None:
        return LoopSettings(prompts=load_loop_prompts(prompts_file), tokens=tokens, source=prompts_file.name)
    if qa_checks is None:
        from ggufcarve.evaluate.qa import default_suite_path, load_suite

        qa_checks = [c.to_json() for c in load_suite(default_suite_path())]
    return LoopSettings(prompts=loop_prompts_from_checks(qa_checks), tokens=tokens, source="QA suite")


def evaluate_release(
    models: list[Path],
    reference: Path,
    heldout: Path | Sequence[Path] | None,
    settings: Any,
    output: Path,
    on_event: Sink = ignore,
    *,
    replace: bool = False,
) -> EvaluatedRelease:
    """Evaluate `models` (GGUF files or release directories) against `reference` into `output`,
    then record the written files in the release that holds `output`, if one does.

    `replace`: `output` is filled under a hidden temp name and then takes the place of the old
    directory as a whole (results of models not evaluated now must not stay published beside
    these); otherwise the files are written into `output` beside what it holds. `heldout`: one
    file, or several scored as segments (`evaluate.run`)."""
    from ggufcarve.evaluate.models import resolve_models
    from ggufcarve.evaluate.run import evaluate
    from ggufcarve.fileio import make_temp_dir, remove_dead_temps
    from ggufcarve.release.publish import record_published, release_of

    entries = resolve_models(models)
    if replace:
        output.parent.mkdir(parents=True, exist_ok=True)
        remove_dead_temps(output.parent, lambda name: name == output.name)
        temp = make_temp_dir(output)  # a hidden temp name: not part of the release while it fills
        try:
            run = evaluate(entries, reference, heldout, settings, temp, on_event)
            if output.exists():
                shutil.rmtree(output)
            temp.rename(output)
        finally:
            shutil.rmtree(temp, ignore_errors=True)
        files = published_files(output)
    else:
        run = evaluate(entries, reference, heldout, settings, output, on_event)
        files = published_files(output)
    release = release_of(output.resolve())
    records: list[dict[str, object]] = []
    if release is not None and release != output.resolve():
        records = record_published(release, "evaluation", files)
    return EvaluatedRelease(run, tuple(files), release, tuple(records))
