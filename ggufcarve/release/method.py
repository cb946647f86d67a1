"""Publishing the method reports (pruning, imatrix remap) that describe a release's inputs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ggufcarve.fileio import write_text_atomic
from ggufcarve.reports import IMATRIX_REMAP_REPORT, PRUNING_REPORT, release_report_name, report_path_for

if TYPE_CHECKING:
    from ggufcarve.quant.run import LadderPlan


def publish_method_reports(plan: LadderPlan) -> list[Path]:
    """Copy the reports that describe this ladder's inputs into OUT/method/, to be published with it.

    `method/<source stem>.pruning-report.json` beside the source counts when it describes the
    source files (names and sizes); `method/<imatrix stem>.imatrix-remap-report.json` beside the
    imatrix when its output sha256 is the imatrix's. They are published as
    `method/pruning-report.json` and `method/imatrix-remap-report.json`.
    """
    copied = []
    candidates = [(PRUNING_REPORT, report_path_for(plan.source.path, PRUNING_REPORT))]
    if plan.imatrix is not None:
        candidates.append((IMATRIX_REMAP_REPORT, report_path_for(plan.imatrix.path, IMATRIX_REMAP_REPORT)))
    for kind, report in candidates:
        try:
            doc = json.loads(report.read_text())
        except (OSError, ValueError):
            continue
        if kind == PRUNING_REPORT:
            described = [(f.get("name"), f.get("bytes")) for f in doc.get("output", {}).get("files", [])]
            matches = described == [(p.name, p.stat().st_size) for p in plan.source.paths]
        else:
            matches = plan.imatrix is not None and doc.get("output", {}).get("sha256") == plan.imatrix.sha256
        if matches:
            target = plan.out_dir / release_report_name(kind)
            write_text_atomic(target, report.read_text())
            copied.append(target)
    return copied


