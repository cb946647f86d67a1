"""quant-manifest.json: the one record of what a release holds and how it was made."""

from __future__ import annotations

import json
import threading
import time
from typing import TYPE_CHECKING, Any

from ggufcarve import __version__
from ggufcarve.fileio import write_text_atomic

if TYPE_CHECKING:
    from ggufcarve.quant.run import LadderPlan, RungResult

MANIFEST_SCHEMA_VERSION = 1
MANIFEST_NAME = "quant-manifest.json"


def _write_manifest(plan: LadderPlan, previous: dict[str, dict[str, Any]], results: dict[str, RungResult], started: float, quantizer_seconds: float, hash_seconds: float, lock: threading.Lock) -> dict[str, Any]:
    with lock:
        rungs: dict[str, dict[str, Any]] = {}
        # rungs of earlier runs that this run did not touch stay recorded while their file exists
        for name, rec in previous.items():
            if name not in results and rec.get("files") and all((plan.out_dir / f["name"]).exists() for f in rec["files"]):
                rungs[name] = rec
        for name, r in results.items():
            if r.status == "not run" and name in previous:
                continue
            rungs[name] = r.to_json()
        order = {p.rung.name: i for i, p in enumerate(plan.rungs)}
        ordered = sorted(rungs.values(), key=lambda rec: (order.get(rec["name"], len(order)), rec["name"]))
        total = time.monotonic() - started
        doc = {
            "schema_version": MANIFEST_SCHEMA_VERSION,
            "tool": {"name": "ggufcarve", "version": __version__},
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "ladder": {"name": plan.spec.name, "description": plan.spec.description, "spec_file": str(plan.spec.path) if plan.spec.path else None, "spec_sha256": plan.spec.sha256},
            "source": {
                "path": str(plan.source.path), "name": plan.source.path.name, "bytes": plan.source.total_bytes, "n_elements": plan.n_elements,
                "architecture": plan.source.get("general.architecture"),
                "expert_count": plan.source.get(f"{plan.source.get('general.architecture')}.expert_count"),
                "files": [{"path": str(p.resolve()), "name": p.name, "bytes": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns, "sha256": h} for p, h in zip(plan.source.paths, plan.source_sha256)],
                "sha256": plan.source_sha256[0] if len(plan.source_sha256) == 1 else None,
            },
            "imatrix": plan.imatrix.to_json() if plan.imatrix else None,
            "quantizer": plan.quantizer.describe(),
            "rungs": ordered,
            "warnings": plan.warnings,
            "timings": {"total_seconds": round(total, 3), "quantizer_seconds": round(quantizer_seconds, 3), "hash_seconds": round(hash_seconds, 3), "overhead_seconds": round(total - quantizer_seconds, 3)},
        }
    write_text_atomic(plan.out_dir / MANIFEST_NAME, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return doc


