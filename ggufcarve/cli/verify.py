"""verify: check a release directory before publishing it.

Examples:
    ggufcarve verify release/
    ggufcarve verify release/ --json
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ggufcarve.cli.render import err, escape, new_table, out, progress


def verify_command(
    directory: Annotated[Path, typer.Argument(help="A ladder output directory (with SHA256SUMS and quant-manifest.json).")],
    ignore_missing: Annotated[bool, typer.Option("--ignore-missing", help="Do not fail for files listed in SHA256SUMS that are absent (as sha256sum -c --ignore-missing).")] = False,
    jobs: Annotated[int | None, typer.Option("--jobs", "-j", help="Files hashed in parallel (default: CPU count).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
) -> None:
    """Check a ladder directory before publishing: sums, manifest, GGUF structure, expert counts."""
    from ggufcarve.release.verify import verify_dir

    with progress(not quiet and not as_json, transient=True) as sink:
        report = verify_dir(directory, ignore_missing=ignore_missing, workers=jobs, on_event=sink)
    if as_json:
        out.print_json(json.dumps(report.to_json()))
    elif report.ok:
        rate = report.bytes_hashed / max(report.seconds, 1e-9) / 2**20
        out.print(f"OK: {len(report.files_ok)} files of {directory} match SHA256SUMS and the manifest" + (f"; expert_count {report.expert_count}" if report.expert_count is not None else "") + f" ({report.bytes_hashed / 2**30:.2f} GiB in {report.seconds:.1f} s, {rate:.0f} MiB/s, {report.workers} threads)")
    else:
        table = new_table(title=f"verify {directory}: {len(report.failures)} failure(s)")
        table.add_column("file")
        table.add_column("problem")
        for f in report.failures:
            table.add_row(escape(f.path), escape(f.problem))
        err.print(table)
    if not report.ok:
        raise typer.Exit(1)

