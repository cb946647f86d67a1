"""ladder run: every rung of a spec from one source, hashed and recorded.

Examples:
    ggufcarve ladder run ladders/q8-to-iq1.toml --source model-128e-Q8_0.gguf --imatrix model-128e.imatrix.gguf -o \\
        release/
    ggufcarve ladder run ladders/q8-to-iq1.toml --source model-128e-Q8_0.gguf -o release/ --only Q4_K_M --dry-run
    # every rung routed to 6 experts per token (the trained top-k recorded beside it in the manifest):
    ggufcarve ladder run ladders/q8-to-iq1.toml --source model-128e-Q8_0.gguf -o release-top6/ --topk 6
    # a new release in release/:
    ggufcarve ladder run ladders/q8-to-iq1.toml --source other-model-Q8_0.gguf -o release/ --force
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated

import typer

from ggufcarve import settings as S
from ggufcarve.cli.options import LlamaCppOption, command_group, option
from ggufcarve.cli.render import err, escape, new_table, out, progress, size, warn

app = command_group("Quantization ladders: every rung from one pruned source, hashed and recorded.")


@app.command("run", short_help="Quantize every rung of a spec; resumable.")
def ladder_run(
    spec: Annotated[
        str, typer.Argument(help="Ladder spec: a TOML path or the name of a shipped spec, e.g. q8-to-iq1.")
    ],
    source: Annotated[Path, option(S.SOURCE, "the pruned model to requantize.")],
    output: Annotated[Path, option(S.OUTPUT, "DIR: the rungs, quant-manifest.json and SHA256SUMS.")],
    imatrix: Annotated[
        Path | None,
        option(S.IMATRIX, "remapped to the source's kept experts; needed by IQ rungs."),
    ] = None,
    only: Annotated[
        list[str] | None,
        option(S.ONLY, "rungs run, e.g. Q4_K_M,IQ2_XS."),
    ] = None,
    keep_going: Annotated[bool, typer.Option("--keep-going", help="Continue past a failed rung.")] = False,
    quantizer_choice: Annotated[
        str,
        option(S.QUANTIZER),
    ] = "auto",
    llama_cpp: LlamaCppOption = None,
    name: Annotated[str | None, option(S.NAME)] = None,
    model_name: Annotated[str | None, typer.Option("--model-name", hidden=True)] = None,
    threads: Annotated[int | None, option(S.THREADS)] = None,
    dry_run: Annotated[bool, option(S.DRY_RUN, "validate and print the plan.")] = False,
    force: Annotated[
        bool,
        option(
            S.FORCE,
            "start the release in -o afresh: the rungs, reports and sums its manifest describes are removed "
            "(needed when it holds another source's release).",
        ),
    ] = False,
    selection: Annotated[
        Path | None,
        typer.Option(
            "--selection",
            help="The SELECTION.json (ggufcarve select -o) the source's experts were chosen by, "
            "published as method/expert-selection.json; found beside the source by the sha256 "
            "its pruning report records when the source was pruned with --keep SELECTION.json.",
        ),
    ] = None,
    topk: Annotated[str | None, option(S.TOPK, "One count: every rung is rewritten to it once quantized.")] = None,
    quiet: Annotated[bool, option(S.QUIET)] = False,
) -> None:
    """Quantize every rung of SPEC from --source into -o DIR; resumable; writes quant-manifest.json and SHA256SUMS."""
    from ggufcarve.llama.tools import physical_cores
    from ggufcarve.quant.ladder_plan import plan_ladder
    from ggufcarve.quant.ladder_run import run_ladder
    from ggufcarve.quant.quantizer import make_quantizer
    from ggufcarve.quant.spec import find_spec, load_spec

    ladder_spec = load_spec(find_spec(spec))
    quantizer = make_quantizer(quantizer_choice, llama_cpp)
    plan = plan_ladder(
        ladder_spec,
        source,
        output,
        quantizer=quantizer,
        imatrix=imatrix,
        only=only,
        model_name=one_name(name, model_name),
        nthreads=threads or physical_cores(),
        hash_inputs=not dry_run,
        fresh=force,
        selection=selection,
        experts_used=S.one_used_count(topk),
    )
    for warning in plan.warnings:
        warn(warning)
    described = quantizer.describe()
    err.print(
        f"quantizer: {described['backend']} {described['path']}"
        + (
            f" (build {described['build']}, {described['commit']})"
            if described.get("build") is not None
            else f" ({described.get('version')})"
        ),
        highlight=False,
    )
    if plan.experts_used is not None:
        err.print(
            f"experts per token: {plan.experts_used} in every rung (trained: {plan.trained_experts_used})",
            highlight=False,
        )
    if dry_run:
        table = new_table(title=f"ladder {ladder_spec.name} (dry run: nothing written)")
        for column in ("rung", "output", "est. size", "imatrix fallback", "command"):
            table.add_column(column, overflow="fold")
        for p in plan.rungs:
            table.add_row(
                p.rung.name,
                str(p.output),
                size(p.estimated_bytes),
                f"{len(p.fallback)} -> {p.rung.imatrix_fallback_type}" if p.fallback else "",
                escape(
                    (f"cd {shlex.quote(str(p.job.cwd))} && " if p.job.cwd else "") + shlex.join(quantizer.argv(p.job))
                ),
            )
        out.print(table)
        return
    with progress(not quiet) as sink:
        result = run_ladder(plan, keep_going=keep_going, on_event=sink)
    table = new_table(title=f"ladder {ladder_spec.name}: {output}")
    for column in ("rung", "size", "bits/weight", "sha256", "seconds", "status"):
        table.add_column(column, justify="left" if column in ("rung", "sha256", "status") else "right")
    for r in result.rungs:
        status = {
            "built": "[green]built[/]",
            "skipped": "skipped (unchanged)",
            "failed": f"[red]FAILED[/]: {escape(r.error or '')}",
            "not run": "not run",
        }[r.status]
        table.add_row(
            r.name,
            size(r.bytes) if r.bytes else "",
            f"{r.bits_per_weight:.2f}" if r.bits_per_weight else "",
            (r.sha256 or "")[:12],
            f"{r.seconds:.1f}",
            status,
        )
    out.print(table)
    out.print(
        f"manifest: {result.manifest_path}; sums: {result.sums_path}; "
        f"{result.seconds:.1f} s total, {result.quantizer_seconds:.1f} s in the quantizer"
    )
    if result.failed:
        raise typer.Exit(1)


def one_name(name: str | None, older: str | None) -> str | None:
    """--name, or its older spelling --model-name; both given is refused."""
    from ggufcarve.errors import BadInput

    if name is not None and older is not None:
        raise BadInput(
            "--name and --model-name name the same thing", "give --name alone (--model-name is its older spelling)"
        )
    return name if name is not None else older
