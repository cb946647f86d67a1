"""The parent side of the evaluation child: run it for one request, its progress lines as events, its failures as one-line errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ggufcarve.errors import OutputError, ToolFailed
from ggufcarve.evaluate.protocol import OS_ERROR, PROGRESS_PREFIX, Request
from ggufcarve.events import Event, Sink

CHILD_IDLE_TIMEOUT = 3600.0  # seconds without a progress line (one chunk, one QA answer) before the child is stopped


def run_child(request: Request, what: str, sink: Sink, work: Path, outputs: dict[str, tuple[Path, str]] | None = None) -> dict:
    """Run the evaluation child for one request; its progress lines become chunk events of stage `what`.

    `outputs` maps a file the child writes to the path an error names and the hint's other place
    to write to (a temp file to its final name); files it does not name are work files.
    """
    from ggufcarve.fileio import write_failed
    from ggufcarve.llama import launch

    request_path = work / f"{what}.request.json".replace(" ", "_")
    request.write(request_path)
    os_errors: list[dict] = []

    def on_line(line: str) -> None:
        if line.startswith(PROGRESS_PREFIX + OS_ERROR + " "):
            os_errors.append(json.loads(line[len(PROGRESS_PREFIX + OS_ERROR) + 1:]))
        elif line.startswith(PROGRESS_PREFIX):
            kind, done, total = line[1:].split()
            sink(Event(what if kind == "chunk" else f"{what} QA", int(done), int(total), "chunks" if kind == "chunk" else "steps"))

    finished = launch.run([sys.executable, "-m", "ggufcarve.evaluate.child", str(request_path)], on_line=on_line, idle_timeout=CHILD_IDLE_TIMEOUT)
    if os_errors:
        error = os_errors[0]
        shown, elsewhere = (outputs or {}).get(error["filename"], (Path(error["filename"] or work), "set TMPDIR to a directory with more room"))
        raise write_failed(OSError(error["errno"], error["strerror"]), shown, elsewhere)
    launch.check(finished, f"evaluating {Path(request.model).name} in libllama", "the last lines are llama.cpp's own; check that the model loads (ggufcarve inspect MODEL)")
    result = json.loads(Path(request.result_out).read_text())
    if "engine_error" in result:
        raise ToolFailed(f"{Path(request.model).name}: {result['engine_error']}", "check that llama.cpp loads the model (ggufcarve inspect)")
    if "no_space" in result:
        short = result["no_space"]
        shown, elsewhere = (outputs or {}).get(short["path"], (Path(short["path"]), "set TMPDIR to a directory with more room"))
        raise OutputError(f"{shown.name} needs {short['bytes'] / 2**20:.1f} MiB but {shown.parent} has {short['free'] / 2**20:.1f} MiB free",
                          f"free disk space or {elsewhere}; nothing was written")
    return result
