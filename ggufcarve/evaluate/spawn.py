"""The parent side of the evaluation child: one request run through the child-task protocol
(`ggufcarve.llama.child`)."""

from __future__ import annotations

import json
from pathlib import Path

from ggufcarve.evaluate.protocol import CHILD_MODULE, CHUNK_TASK, LOOP_TASK, QA_TASK, Request
from ggufcarve.events import Sink

CHILD_IDLE_TIMEOUT = 3600.0  # seconds without a progress line (one chunk, one QA answer) before the child is stopped


def run_child(
    request: Request, what: str, sink: Sink, work: Path, outputs: dict[str, tuple[Path, str]] | None = None
) -> dict:
    """Run the evaluation child for one request; its progress lines become events of stage `what`
    (chunks) and `what QA` (steps); its result JSON, read.

    `outputs` maps a file the child writes to the path an error names and the hint's other place
    to write to (a temp file to its final name); a file it does not name is shown by its own
    name. `work` is unused: the result file's path is in the request.
    """
    from ggufcarve.llama import child

    def read(path: Path) -> dict:
        return json.loads(path.read_text())  # type: ignore[no-any-return]

    return child.run(
        CHILD_MODULE,
        request,
        Path(request.result_out),
        read,
        what=f"evaluating {Path(request.model).name} in libllama",
        hint="the last lines are llama.cpp's own; check that the model loads (ggufcarve inspect MODEL)",
        sink=sink,
        stages={CHUNK_TASK: what, QA_TASK: f"{what} QA", LOOP_TASK: f"{what} loops"},
        outputs=outputs,
        idle_timeout=CHILD_IDLE_TIMEOUT,
    )
