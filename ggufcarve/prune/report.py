"""The pruning report: what a prune read, wrote and verified."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ggufcarve import __version__
from ggufcarve.prune.plan import _jsonable

REPORT_SCHEMA_VERSION = 1
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ggufcarve.prune.execute import PruneResult
from ggufcarve.prune.plan import PrunePlan


def default_report_path(plan: PrunePlan) -> Path:
    return plan.outputs[0].parent / "method" / "pruning-report.json"

def pruning_report(result: PruneResult) -> dict[str, Any]:
    plan, verification = result.plan, result.verification
    return {
        "schema_version": REPORT_SCHEMA_VERSION,
        "tool": {"name": "ggufcarve", "version": __version__},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": {
            "files": [{"path": str(p), "bytes": s, "sha256": h} for p, s, h in zip(plan.sources, plan.source_sizes, result.source_sha256)],
            "architecture": plan.layout.architecture,
            "expert_count": plan.layout.expert_count,
            "expert_used_count": plan.layout.expert_used_count,
            "moe_blocks": list(plan.layout.blocks),
            "mtp_blocks": [b for b in plan.layout.blocks if plan.layout.is_mtp(b)],
        },
        "output": {
            "files": [{"name": f.path.name, "bytes": f.size, "tensors": len(f.tensors)} for f in plan.files],
            "expert_count": plan.kept_count,
        },
        "keep_set": plan.keepset.to_json(),
        "changed_keys": {k: {"before": _jsonable(a), "after": _jsonable(b)} for k, (a, b) in sorted(plan.changed_keys.items())},
        "provenance_keys": plan.provenance,
        "tensors": [
            {
                "name": t.name,
                "pruned": t.pruned,
                "type": t.type_name,
                "source_shape": list(t.source_shape),
                "output_shape": list(t.output_shape),
                "source_bytes": t.source_bytes,
                "output_bytes": t.output_bytes,
                "expected_xxh3_128": t.expected_xxh3,
                "output_xxh3_128": t.output_xxh3,
            }
            for t in verification.tensors
        ],
        "bytes_in": plan.bytes_in,
        "bytes_out": plan.bytes_out,
        "verification": {"ok": verification.ok, "tensors_checked": len(verification.tensors), "keys_checked": verification.keys_checked, "hash": "xxh3_128"},
        "warnings": list(plan.warnings),
        "timings": {k: round(v, 3) for k, v in sorted(result.timings.items())},
    }


def _dumps(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"

