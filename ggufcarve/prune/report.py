"""The pruning report: what a prune read, wrote and verified, in the one report envelope.

It names what it describes by content: `inputs` are the source files (name, sha256, bytes) and,
when the keep-set was read from a file, that file (name, sha256, bytes, kind "keep-set"),
`keep_set` the kept experts the output's `ggufcarve.kept_*` keys record, and `output.files` the
files written; a release publishes it only when these match the model it was made from. The
keep-set file itself is copied beside the report (keep_copy_path), where a release finds it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from ggufcarve.fileio import atomic_file
from ggufcarve.prune.check import Verification
from ggufcarve.prune.plan import PrunePlan, jsonable
from ggufcarve.reports import METHOD_DIR, PRUNING_REPORT, envelope, output_stem, report_path_for

KEEP_SET_INPUT = "keep-set"  # the `kind` of the inputs entry naming the keep-set file (the source files have none)


def keep_copy_path(output: Path, keep_name: str) -> Path:
    """Where a prune keeps a copy of its keep-set file, for a later release to publish:
    `method/<output stem>.<keep-set file name>` beside the (first) output file."""
    return output.parent / METHOD_DIR / f"{output_stem(output)}.{keep_name}"


def save_keep_file(plan: PrunePlan, keep: Path) -> Path | None:
    """Copy the keep-set file the plan was made from next to its pruning report (keep_copy_path),
    byte for byte; None when the file no longer has the sha256 the plan recorded."""
    recorded = plan.keepset.file
    if not recorded:
        return None
    data = keep.read_bytes()
    if hashlib.sha256(data).hexdigest() != recorded["sha256"]:
        return None
    path = keep_copy_path(plan.outputs[0], recorded["name"])
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as temp:
        temp.write_bytes(data)
    return path


def default_report_path(plan: PrunePlan) -> Path:
    """`method/<output stem>.pruning-report.json` beside the (first) output file."""
    return report_path_for(plan.outputs[0], PRUNING_REPORT)


def pruning_report(
    plan: PrunePlan, source_sha256: list[str], verification: Verification, timings: dict[str, float]
) -> dict[str, Any]:
    """The report of `plan` executed: the sha256 of each source file (in shard order), the
    verification of the written outputs, and the timings (seconds by name)."""
    files = [
        {"name": p.name, "bytes": s, "sha256": h} for p, s, h in zip(plan.sources, plan.source_sizes, source_sha256)
    ]
    keep_file = [{**plan.keepset.file, "kind": KEEP_SET_INPUT}] if plan.keepset.file else []
    return envelope(
        PRUNING_REPORT,
        inputs=[*files, *keep_file],
        parameters={"provenance_keys": plan.provenance, "split_max_size": plan.split_max_size, "merge": plan.merge},
        timings=dict(sorted(timings.items())),
        results={
            "source": {
                "files": files,
                "architecture": plan.layout.architecture,
                "expert_count": plan.layout.expert_count,
                "expert_used_count": plan.layout.expert_used_count,
                "moe_blocks": list(plan.layout.blocks),
                "mtp_blocks": [b for b in plan.layout.blocks if plan.layout.is_mtp(b)],
            },
            "output": {
                "files": [{"name": f.path.name, "bytes": f.size, "tensors": len(f.tensors)} for f in plan.files],
                "expert_count": plan.kept_count,
                "expert_used_count": plan.layout.expert_used_count if plan.experts_used is None else plan.experts_used,
            },
            "keep_set": plan.keepset.to_json(),
            "changed_keys": {
                k: {"before": jsonable(a), "after": jsonable(b)} for k, (a, b) in sorted(plan.changed_keys.items())
            },
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
            "verification": {
                "ok": verification.ok,
                "tensors_checked": len(verification.tensors),
                "keys_checked": verification.keys_checked,
                "hash": "xxh3_128",
            },
            "warnings": list(plan.warnings),
        },
    )
