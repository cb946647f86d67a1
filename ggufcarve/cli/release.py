"""release: assemble a release directory that several ladder runs (processes or hosts) wrote into.

Examples:
    # one job per rung, anywhere:
    ggufcarve ladder run ladders/q8-to-iq1.toml --source model-128e-Q8_0.gguf -o /shared/release --only Q4_K_M
    ggufcarve release merge /shared/release
    ggufcarve verify /shared/release
    ggufcarve release record /shared/release/LICENSE /shared/release/.gitattributes   # documentation you add
    ggufcarve release record /shared/release/README.md                                 # the card, after a hand edit
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ggufcarve import settings as S
from ggufcarve.cli.options import JsonOption, QuietOption, command_group, option
from ggufcarve.cli.render import escape, new_table, out, progress

app = command_group(
    "Release directories: assemble quant-manifest.json and SHA256SUMS from the rungs' fragments; record documentation."
)


@app.command("merge", short_help="Assemble the manifest and sums from rung fragments.")
def merge_command(
    directory: Annotated[Path, typer.Argument(help="The release directory ladder runs wrote into (-o DIR).")],
    jobs: Annotated[int | None, option(S.JOBS, "files hashed.")] = None,
    as_json: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Assemble quant-manifest.json and SHA256SUMS from every rung's fragment, checking each rung's files (size,
    sha256)."""
    from ggufcarve.fileio import format_size
    from ggufcarve.release.fragments import merge_release

    with progress(not quiet and not as_json, transient=True) as sink:
        result = merge_release(directory, workers=jobs, on_event=sink)
    if as_json:
        out.print_json(
            json.dumps(
                {
                    "directory": str(directory),
                    "fragments": result.fragments,
                    "adopted": result.adopted,
                    "changed": result.changed,
                    "bytes_hashed": result.bytes_hashed,
                    "seconds": round(result.seconds, 3),
                    "rungs": [
                        {"name": r.get("name"), "status": r.get("status"), "sha256": r.get("sha256")}
                        for r in result.rungs
                    ],
                }
            )
        )
        return
    table = new_table(title=f"release {directory}: {result.fragments} fragment(s)")
    for column in ("rung", "file", "size", "sha256", "status"):
        table.add_column(column)
    for r in result.rungs:
        files = r.get("files") or []
        table.add_row(
            escape(str(r.get("name"))),
            escape(", ".join(str(f.get("name")) for f in files)),
            format_size(sum(int(f.get("bytes") or 0) for f in files)) if files else "",
            str(r.get("sha256") or "")[:12],
            escape(str(r.get("status"))),
        )
    out.print(table)
    state = "written" if result.changed else "unchanged"
    out.print(
        f"quant-manifest.json and SHA256SUMS {state}: {len(result.rungs)} rung(s), "
        f"{format_size(result.bytes_hashed)} hashed in {result.seconds:.1f} s"
    )


@app.command("record", short_help="Record a hand-edited card or documentation file.")
def record_command(
    files: Annotated[
        list[Path],
        typer.Argument(
            help="Files inside a release: README.md (the card, as it is) or "
            "documentation (LICENSE, NOTICE, .md, .txt, images, .gitattributes)."
        ),
    ],
) -> None:
    """Make files you added part of the release: describe them in quant-manifest.json and list them in SHA256SUMS."""
    from ggufcarve.errors import BadInput
    from ggufcarve.release.publish import record_files, release_of

    releases = {p: release_of(p.absolute().parent) for p in files}
    outside = [p for p, r in releases.items() if r is None]
    if outside:
        raise BadInput(
            f"{outside[0]} is not inside a release directory (none with quant-manifest.json above it)",
            "give files inside the release directory",
        )
    found = {r for r in releases.values() if r is not None}
    if len(found) != 1:
        raise BadInput(
            f"the files are in {len(found)} release directories ({', '.join(sorted(map(str, found)))})",
            "record the files of one release at a time",
        )
    release = found.pop()
    recorded = record_files(release, files)
    names = [n for kind in recorded.values() for n in kind]
    out.print(f"recorded {', '.join(names)} in {release / 'quant-manifest.json'} and SHA256SUMS", highlight=False)
