"""The one place that draws: consoles, warnings, errors, and every progress `Event` as a bar.

Each event stage gets one bar; its unit decides the counter: bytes (size, speed, time left),
tokens/chunks/rungs/tensors (n/total), percent (a percentage). A stage's message is shown beside
its bar.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ggufcarve.events import ignore

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from ggufcarve.events import Event, Sink


PIPE_WIDTH = 240  # columns of output that is not a terminal (without COLUMNS)


class _LazyConsole:
    """A rich Console created on first use: `--version` and `--help` never import rich."""

    def __init__(self, stderr: bool) -> None:
        self._stderr = stderr
        self._console: Console | None = None

    def console(self) -> Console:
        if self._console is None:
            from rich.console import Console

            stream = sys.stderr if self._stderr else sys.stdout
            piped = not stream.isatty() and "COLUMNS" not in os.environ
            # piped or logged: lines are not wrapped and tables get PIPE_WIDTH columns, so no value is cut or split
            self._console = (
                Console(stderr=self._stderr, width=PIPE_WIDTH, soft_wrap=True)
                if piped
                else Console(stderr=self._stderr)
            )
        return self._console

    def __getattr__(self, name: str) -> Any:
        return getattr(self.console(), name)


out: Console = _LazyConsole(stderr=False)  # type: ignore[assignment]
err: Console = _LazyConsole(stderr=True)  # type: ignore[assignment]


def escape(text: str) -> str:
    """Text shown literally inside rich markup."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


def new_table(*args: Any, **kwargs: Any) -> Table:
    """A rich Table (rich is imported only when something is drawn)."""
    from rich.table import Table

    return Table(*args, **kwargs)


def print_command(label: str, argv: Sequence[str], after: str = "") -> None:
    """A command line to paste: shell-quoted, on one line however narrow the terminal (a soft wrap: the
    terminal folds it for the eye, a copy of it is one line)."""
    import shlex

    out.print(f"{label}: {shlex.join(argv)}{after}", highlight=False, markup=False, soft_wrap=True)


def warn(message: str, label: str = "warning") -> None:
    err.print(f"[yellow]{label}:[/] {escape(message)}", soft_wrap=True, highlight=False)


def print_error(message: str, hint: str) -> None:
    err.print(
        f"[bold red]error:[/] {escape(message)}" + (f" [dim](hint: {escape(hint)})[/]" if hint else ""),
        soft_wrap=True,
        highlight=False,
    )


def size(n: float, unit: tuple[str, int] | None = None) -> str:
    """A size as users read it: MiB under 1 GiB, GiB from 1 GiB (fileio.format_size), or in `unit`."""
    from ggufcarve.fileio import format_size

    return format_size(n, unit)


def ranges(blocks: Any) -> str:
    """0,1,2,5,7,8 -> "0-2,5,7-8"."""
    blocks = list(blocks)
    parts, start = [], None
    for i, b in enumerate(blocks):
        if start is None:
            start = b
        if i + 1 == len(blocks) or blocks[i + 1] != b + 1:
            parts.append(str(start) if start == b else f"{start}-{b}")
            start = None
    return ",".join(parts)


@contextmanager
def progress(enabled: bool = True, transient: bool = False) -> Iterator[Sink]:
    """A sink that draws each event stage as one bar on stderr; with enabled=False it draws nothing."""
    if not enabled:
        yield ignore
        return
    from rich.filesize import decimal
    from rich.progress import (
        BarColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class Count(ProgressColumn):
        def render(self, task: Any) -> Text:
            unit = task.fields.get("unit", "bytes")
            done, total = task.completed, task.total
            if unit == "bytes":
                size = f"{done / 2**20:.1f}/{total / 2**20:.1f} MiB" if total else f"{done / 2**20:.1f} MiB"
                speed = f" {decimal(int(task.speed))}/s" if task.speed else ""
                return Text(size + speed)
            if unit == "percent":
                return Text(f"{done:3.0f}%")
            return Text(f"{done:,.0f}/{total:,.0f} {unit}" if total else f"{done:,.0f} {unit}")

    bars = Progress(
        TextColumn("{task.description:<12}"),
        BarColumn(),
        Count(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[message]}"),
        console=err.console(),
        transient=transient,
    )
    tasks: dict[str, Any] = {}

    def sink(event: Event) -> None:
        task = tasks.get(event.stage)
        if task is None:
            if not tasks:
                # drawn from the first event on: a command that fails before any leaves no empty line above its error
                bars.start()
            task = tasks[event.stage] = bars.add_task(
                event.stage, total=event.total or None, unit=event.unit, message=""
            )
        fields: dict[str, Any] = {"completed": event.done, "unit": event.unit}
        if event.total:
            fields["total"] = event.total
        if event.message:
            fields["message"] = escape(event.message[-60:])
        bars.update(task, **fields)

    try:
        yield sink
    finally:
        if tasks:
            bars.stop()
