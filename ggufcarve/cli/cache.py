"""cache show | clear: ggufcarve's caches (measure tables, reference log-probs, llama.cpp tools).

Examples:
    ggufcarve cache show
    ggufcarve cache clear --tables
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Annotated

import typer

from ggufcarve import settings as S
from ggufcarve.cli.options import command_group, option
from ggufcarve.cli.render import new_table, out, size

app = command_group("Show and clear ggufcarve's caches.")


def _caches() -> dict[str, tuple[Path, str]]:
    from ggufcarve.evaluate.tables import table_cache
    from ggufcarve.fileio import cache_root

    root = cache_root()
    return {
        "tables": (table_cache(), "per-unit KLD tables of tune and best, by content; oldest dropped past the limit"),
        "references": (root / "reference-logprobs", "the unpruned models' log-probs on held-out texts, by content"),
        "tools": (root, "llama.cpp tools built per version and backend (llama.cpp-*), the sdists"),
    }


def _usage(path: Path, only_tools: bool = False) -> tuple[int, int]:
    files = total = 0
    if not path.exists():
        return 0, 0
    roots = (
        [p for p in path.iterdir() if p.name.startswith("llama.cpp-") or p.name == "sdist"] if only_tools else [path]
    )
    for root in roots:
        for item in root.rglob("*") if root.is_dir() else [root]:
            if item.is_file():
                files += 1
                total += item.stat().st_size
    return files, total


@app.command("show", short_help="Where each cache is and what it holds.")
def cache_show(as_json: Annotated[bool, option(S.JSON)] = False) -> None:
    """Where each cache is, its files and bytes (and the table cache's limit)."""
    from ggufcarve.evaluate.tables import LIMIT_ENV, cache_limit

    rows = {}
    for name, (path, what) in _caches().items():
        files, total = _usage(path, only_tools=name == "tools")
        rows[name] = {"path": str(path), "files": files, "bytes": total, "holds": what}
    rows["tables"]["limit_bytes"] = cache_limit()
    if as_json:
        out.print_json(json.dumps(rows))
        return
    table = new_table(title="ggufcarve's caches")
    for column, justify in (("cache", "left"), ("files", "right"), ("size", "right"), ("path", "left")):
        table.add_column(column, justify=justify)
    for name, row in rows.items():
        table.add_row(name, str(row["files"]), size(row["bytes"]), row["path"])
    out.print(table)
    out.print(f"tables: at most {size(cache_limit())}, the least recently used dropped first ({LIMIT_ENV} sets it)")


@app.command("clear", short_help="Remove cached tables and reference log-probs.")
def cache_clear(
    tables: Annotated[bool, typer.Option("--tables", help="The measure tables.")] = False,
    references: Annotated[bool, typer.Option("--references", help="The reference log-probs.")] = False,
) -> None:
    """Remove the measure tables and the reference log-probs (both unless one is named); they are
    computed again when needed. The llama.cpp tools stay (ggufcarve toolchain build --force rebuilds)."""
    chosen = [name for name, wanted in (("tables", tables), ("references", references)) if wanted] or [
        "tables",
        "references",
    ]
    for name in chosen:
        path = _caches()[name][0]
        files, total = _usage(path)
        shutil.rmtree(path, ignore_errors=True)
        out.print(f"cleared {name}: {files} files, {size(total)} ({path})", highlight=False)
