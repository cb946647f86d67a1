"""eval: perplexity, KL divergence against a reference, speed, QA checks and a PASS/FAIL gate for every model; card:
the model card.

Examples:
    ggufcarve eval release/ --reference model-Q8_0.gguf --heldout heldout.txt -o evaluation/
    ggufcarve eval release/ unpruned-Q2_K.gguf unpruned-Q3_K_M.gguf --reference model-Q8_0.gguf --heldout \\
        heldout.txt --ctx 512 --chunks 40 -o evaluation/
    ggufcarve eval model-Q4_K_M.gguf --reference base.kld -o evaluation/      (a llama-perplexity \\
        --kl-divergence-base file)
    ggufcarve eval model-Q4_K_M.gguf --reference model-Q8_0.gguf --heldout heldout.txt --cross-check -o evaluation/
    ggufcarve eval release/ --reference model-Q8_0.gguf --heldout heldout.txt --qa evaluation/qa -o \\
        release/evaluation && ggufcarve card release/
    ggufcarve eval release/ --reference model-Q8_0.gguf --heldout heldout.txt --strict -o evaluation/      (exit 1 \\
        when a model fails the gate: for CI)
    ggufcarve eval release/ --reference model-Q8_0.gguf --heldout wiki.txt --heldout code.txt --gate-segments every \\
        -o evaluation/      (each file reported as its own segment)
    ggufcarve eval release/ --reference model-Q8_0.gguf --heldout heldout.txt --loops --loop-tokens 512 -o \\
        evaluation/      (repetition loops on the QA prompts)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ggufcarve import settings as S
from ggufcarve.cli.options import (
    ChunkCtxOption,
    GpuLayersOption,
    JsonOption,
    LlamaCppOption,
    NCpuMoeOption,
    QuietOption,
    RpcOption,
    TensorSplitOption,
    ThreadsOption,
    option,
)
from ggufcarve.cli.render import err, escape, out, progress, size, warn


def eval_command(
    models: Annotated[
        list[Path],
        typer.Argument(
            help="GGUF files, first shards of split sets, or release directories (every rung of the manifest)."
        ),
    ],
    reference: Annotated[Path, option(S.REFERENCE)],
    output: Annotated[Path, option(S.OUTPUT, "DIR: <model>.json per model, summary.md, charts.")],
    heldout: Annotated[
        list[Path] | None,
        option(
            S.HELDOUT, "Scored by every model (needed with a GGUF reference), each file beside the overall figures."
        ),
    ] = None,
    ctx: ChunkCtxOption = 512,
    chunks: Annotated[int | None, option(S.CHUNKS, "the held-out files scored (default: the whole text).")] = None,
    qa: Annotated[Path | None, option(S.QA)] = None,
    gate: Annotated[Path | None, option(S.GATE)] = None,
    gate_segments: Annotated[str | None, option(S.GATE_SEGMENTS)] = None,
    threads: ThreadsOption = None,
    gpu_layers: GpuLayersOption = None,
    rpc: RpcOption = None,
    tensor_split: TensorSplitOption = None,
    n_cpu_moe: NCpuMoeOption = 0,
    top_k: Annotated[int | None, option(S.TOP_K)] = None,
    tail_samples: Annotated[int, option(S.TAIL_SAMPLES)] = 32,
    speed_runs: Annotated[int, option(S.SPEED_RUNS)] = 5,
    speed_engine: Annotated[str, option(S.SPEED_ENGINE)] = "auto",
    save_kl_base: Annotated[
        Path | None,
        typer.Option(
            "--save-kl-base",
            help="Also write the reference's log-probs as a llama-perplexity --kl-divergence-base file.",
        ),
    ] = None,
    cross_check: Annotated[
        bool, typer.Option("--cross-check", help="Also run llama-perplexity on the same text and report both.")
    ] = False,
    loops: Annotated[bool, option(S.LOOPS)] = False,
    loop_prompts: Annotated[Path | None, option(S.LOOP_PROMPTS)] = None,
    loop_tokens: Annotated[int | None, option(S.LOOP_TOKENS)] = None,
    llama_cpp: LlamaCppOption = None,
    cache: Annotated[
        Path | None,
        typer.Option(
            "--cache", help="Directory of cached reference log-probs (default: ggufcarve's cache/reference-logprobs)."
        ),
    ] = None,
    force: Annotated[bool, option(S.FORCE, "results already in the output directory.")] = False,
    strict: Annotated[
        bool, option(S.STRICT, "any model failing the gate exits 1 (the results are written all the same).")
    ] = False,
    quiet: QuietOption = False,
    as_json: JsonOption = False,
) -> None:
    """Evaluate MODELs against --reference: PPL, KLD, speed, QA and the gate; writes -o DIR/<model>.json and
    DIR/summary.md."""
    from ggufcarve.errors import BadInput, OutputError
    from ggufcarve.evaluate.models import resolve_models
    from ggufcarve.evaluate.release import eval_settings, evaluate_release
    from ggufcarve.evaluate.speed import speed_text

    settings, warnings = eval_settings(
        ctx=ctx,
        chunks=chunks,
        compute=S.compute(threads, gpu_layers, rpc, tensor_split, n_cpu_moe),
        top_k=top_k,
        speed_runs=speed_runs,
        speed_engine=speed_engine,
        gate=gate,
        qa=qa,
        cross_check=cross_check,
        llama_cpp=llama_cpp,
        cache=cache,
        kl_base_out=save_kl_base,
        tail_samples=tail_samples,
        gate_segments=gate_segments,
        loops=loops,
        loop_prompts=loop_prompts,
        loop_tokens=loop_tokens,
    )
    for warning in warnings:
        warn(warning)
    entries = resolve_models(models)
    if strict and settings.gate is None:
        raise BadInput("--strict judges the models by a gate, and there is none", "give --gate FILE")
    existing = [output / f"{e.name}.json" for e in entries if (output / f"{e.name}.json").exists()]
    if existing and not force:
        raise OutputError(
            f"{existing[0]} already exists", "use --force to replace the results, or another -o directory"
        )
    with progress(not quiet and not as_json) as sink:
        evaluated = evaluate_release(models, reference, heldout, settings, output, sink)
    run = evaluated.run
    if as_json:
        out.print_json(json.dumps({"results": run.results, "files": [p.name for p in run.files]}))
        _strict_exit(strict, run.results)
        return
    for r in run.results:
        line = (
            f"{r['model']['name']} ({size(r['model']['bytes'])}): PPL {r['ppl']:.4f} ± "
            f"{r['ppl_stderr']:.4f} ({round(r['ppl_delta_percent'], 2) + 0.0:+.2f}%), "
            f"mean KLD {_kld_text(r)}, same top p {100 * r['same_top_p']:.2f}%"
        )
        if r.get("tg_tok_s") is not None:
            line += f", pp {speed_text(r, 'pp')}, tg {speed_text(r, 'tg')}"
        if r.get("qa_total"):
            line += f", QA {r['qa_passed']}/{r['qa_total']}"
        if r.get("loops"):
            lp = r["loops"]
            line += f", loops {lp['looped']}/{lp['total']}" + (
                f" (reference {lp['reference_looped']}/{lp['total']})" if lp.get("reference_looped") is not None else ""
            )
        if r.get("cross_check"):
            c = r["cross_check"]
            line += f"; llama-perplexity PPL {c['ppl']:.4f} ({'agrees' if c['ppl_agrees'] else 'DIFFERS'})"
            if isinstance(c.get("kld_mode"), dict) and c["kld_mode"].get("kld_mean") is not None:
                line += f", mean KLD {c['kld_mode']['kld_mean']:.6f}"
        out.print(
            line
            + f" — {r['gate'] or 'no gate'}"
            + (f" ({'; '.join(r['gate_failed'])})" if r.get("gate_failed") else ""),
            highlight=False,
            soft_wrap=True,
        )
        for s in r.get("segments") or []:
            out.print(escape(_segment_line(s)), highlight=False, soft_wrap=True)
        for check in [r.get("cross_check")] + [s.get("cross_check") for s in r.get("segments") or []]:
            for note in (check or {}).get("notes", []):
                warn(note, "note")
    err.print(
        f"wrote {len(run.files)} files to {output} (reference "
        f"{run.reference.label}{', cached log-probs' if run.reference.cached else ''})",
        highlight=False,
    )
    if evaluated.records:
        err.print(
            f"recorded {len(evaluated.records)} evaluation files in "
            f"{evaluated.release / 'quant-manifest.json'} and SHA256SUMS",
            highlight=False,
        )
    _strict_exit(strict, run.results)


def _strict_exit(strict: bool, results: list[dict]) -> None:
    """With --strict, one line naming the models that failed the gate and their failed criteria, and exit 1."""
    failed = [r for r in results if r.get("gate") == "FAIL"]
    if strict and failed:
        err.print(
            f"[bold red]strict:[/] {len(failed)} of {len(results)} models failed the gate: "
            + escape("; ".join(f"{r['model']['name']} ({', '.join(r.get('gate_failed') or [])})" for r in failed)),
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(1)


def _segment_line(s: dict) -> str:
    """One held-out file's figures under its model's line."""
    line = (
        f"  {s['name']}: PPL {s['ppl']:.4f} ({round(s['ppl_delta_percent'], 2) + 0.0:+.2f}%), "
        f"mean KLD {s['kld_mean']:.6f} ± {s['kld_mean_stderr']:.6f}, "
        f"99.9% KLD {s['kld_p999']:.6f}, same top p {100 * s['same_top_p']:.2f}%, {s['tokens']} tokens"
    )
    if s.get("cross_check"):
        line += (
            f"; llama-perplexity PPL {s['cross_check']['ppl']:.4f} "
            f"({'agrees' if s['cross_check']['ppl_agrees'] else 'DIFFERS'})"
        )
    if s.get("gate"):
        line += f" — {s['gate']}" + (f" ({'; '.join(s['gate_failed'])})" if s.get("gate_failed") else "")
    return line


def _kld_text(r: dict) -> str:
    """The mean KLD as printed: with the sampling error of a top-k estimate, or marked as a lower bound."""
    text = f"{r['kld_mean']:.6f} ± {r['kld_mean_stderr']:.6f}"
    if r.get("kld_method") == "topk-sampled-tail":
        return text + f" (top-{r['parameters']['top_k']} estimate; tail sampling adds ± {r['kld_tail_stderr']:.6f})"
    if r.get("kld_method") == "topk-lower-bound":
        return f"≥ {text} (top-{r['parameters']['top_k']} lower bound)"
    return text


def card_command(
    release: Annotated[
        Path, typer.Argument(help="A release directory (quant-manifest.json, rungs, method/, evaluation/).")
    ],
    evaluation: Annotated[
        Path | None,
        typer.Option("--evaluation", help="Directory of ggufcarve eval results (default: RELEASE/evaluation)."),
    ] = None,
    base_model: Annotated[str | None, option(S.BASE_MODEL)] = None,
    license_: Annotated[str | None, option(S.LICENSE)] = None,
    license_name: Annotated[str | None, option(S.LICENSE_NAME)] = None,
    license_link: Annotated[str | None, option(S.LICENSE_LINK)] = None,
    model_name: Annotated[str | None, option(S.MODEL_NAME)] = None,
    repo_id: Annotated[str | None, option(S.REPO_ID)] = None,
    record: Annotated[
        bool,
        typer.Option(
            "--record",
            help="Write nothing: record RELEASE/README.md as it is (after a hand edit) in the manifest and SHA256SUMS.",
        ),
    ] = False,
    force: Annotated[bool, option(S.FORCE, "an existing README.md.")] = False,
) -> None:
    """Write the Hugging Face model card RELEASE/README.md from the manifest, the method reports and the evaluation,
    and record it in the release."""
    from ggufcarve.errors import BadInput
    from ggufcarve.release.card import card_warnings, record_card, write_card
    from ggufcarve.release.card_metadata import CardSettings

    settings = CardSettings(
        base_model=base_model,
        license=license_,
        license_name=license_name,
        license_link=license_link,
        model_name=model_name,
        repo_id=repo_id,
    )
    if record:
        if (
            any(
                v is not None
                for v in (base_model, license_, license_name, license_link, model_name, repo_id, evaluation)
            )
            or force
        ):
            raise BadInput(
                "--record writes nothing, so it takes no card options",
                "record the card as it is with --record alone, or write it again with the options and --force",
            )
        path = record_card(release)
        out.print(f"recorded {path} as it is in {release / 'quant-manifest.json'} and SHA256SUMS", highlight=False)
        return
    path = write_card(release, evaluation, force, settings.check())
    for message in card_warnings(release, settings, evaluation):
        warn(message)
    out.print(f"wrote {path}; recorded in {release / 'quant-manifest.json'} and SHA256SUMS", highlight=False)
