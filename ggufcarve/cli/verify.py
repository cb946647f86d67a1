"""verify: check a release directory before publishing it.

Examples:
    ggufcarve verify release/
    ggufcarve verify release/ --partial      # a release still being built: list what is missing, do not fail for it
    ggufcarve verify release/ --strict       # evaluation results and the card required, whatever the release promises
    ggufcarve verify release/ --json
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ggufcarve import settings as S
from ggufcarve.cli.options import option
from ggufcarve.cli.render import err, escape, new_table, out, progress, warn


def verify_command(
    directory: Annotated[
        Path, typer.Argument(help="A ladder output directory (with SHA256SUMS and quant-manifest.json).")
    ],
    ignore_missing: Annotated[
        bool,
        typer.Option(
            "--ignore-missing",
            help="Do not fail for files listed in SHA256SUMS that are absent (as sha256sum -c --ignore-missing).",
        ),
    ] = False,
    partial: Annotated[
        bool,
        typer.Option(
            "--partial",
            help="Do not fail for what a complete release would hold more "
            "(rungs of the ladder, evaluation results, the card); list it.",
        ),
    ] = False,
    strict: Annotated[
        bool,
        option(
            S.STRICT,
            "a release without evaluation results and a card fails too (by default: what the release's "
            "manifest promises; a ladder alone promises its rungs).",
        ),
    ] = False,
    jobs: Annotated[int | None, option(S.JOBS, "files hashed.")] = None,
    as_json: Annotated[bool, option(S.JSON, "the report.")] = False,
    quiet: Annotated[bool, option(S.QUIET)] = False,
) -> None:
    """Check a release before publishing: sums, manifest, GGUF structure, expert counts, completeness, the card."""
    from ggufcarve.fileio import format_size
    from ggufcarve.release.verify import PARTS, verify_dir

    with progress(not quiet and not as_json, transient=True) as sink:
        if partial and strict:
            from ggufcarve.errors import BadInput

            raise BadInput("--partial and --strict ask opposite things", "give one of them")
        report = verify_dir(
            directory,
            ignore_missing=ignore_missing,
            workers=jobs,
            on_event=sink,
            require=() if partial else PARTS if strict else None,
        )
    if as_json:
        out.print_json(json.dumps(report.to_json()))
    elif report.ok:
        rate = report.bytes_hashed / max(report.seconds, 1e-9) / 2**20
        state = "complete" if report.complete else f"partial, {len(report.missing)} part(s) missing"
        out.print(
            f"OK: {len(report.files_ok)} files of {directory} match SHA256SUMS and the manifest"
            + (f"; expert_count {report.expert_count}" if report.expert_count is not None else "")
            + f"; {state} ({format_size(report.bytes_hashed)} in "
            f"{report.seconds:.1f} s, {rate:.0f} MiB/s, {report.workers} threads)",
            highlight=False,
            soft_wrap=True,
        )
    else:
        table = new_table(title=f"verify {directory}: {len(report.failures)} failure(s)")
        table.add_column("file")
        table.add_column("problem")
        for f in report.failures:
            table.add_row(escape(f.path), escape(f.problem))
        err.print(table)
        if any(f.problem.startswith("missing: ") for f in report.failures):
            err.print("The release is incomplete; `ggufcarve verify --partial` checks what is there.", highlight=False)
    if not as_json:
        for m in report.missing:
            if m.path.split(":", 1)[0] not in report.required:
                warn(m.problem, "missing" if partial else "note")
        for w in report.warnings:
            warn(f"{w.path}: {w.problem}")
        for n in report.notes:
            warn(f"{n.path}: {n.problem}", "note")
    if not report.ok:
        raise typer.Exit(1)
