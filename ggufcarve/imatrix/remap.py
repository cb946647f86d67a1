"""Remapping an imatrix to a pruned model's kept experts."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGUFValueType, Keys

from ggufcarve.errors import BadInput, CarveError
from ggufcarve.events import Counter, Sink, ignore
from ggufcarve.fileio import (
    atomic_outputs,
    check_outputs,
    sha256_file,
    write_text_atomic,
)
from ggufcarve.gguf.container import (
    GGUFModel,
    make_kv,
    replace_kvs,
)
from ggufcarve.imatrix.check import check_against_model, expected_sizes, raise_problems
from ggufcarve.imatrix.convert import convert
from ggufcarve.imatrix_format import (
    DEFAULT_CHUNK_SIZE,
    FORMATS,
    KEY_REMAP_SOURCE_SHA256,
    Imatrix,
    ImatrixEntry,
    counts_of,
    encoded_size,
    ggml_ne,
    lround,
    read_imatrix,
    write_to_fd,
)
from ggufcarve.moe.keepset import (
    KEY_KEPT_COUNT,
    KEY_KEPT_EXPERTS,
    KEY_SOURCE_EXPERT_COUNT,
    KeepSet,
    check_keepset,
    provenance_kvs,
)
from ggufcarve.moe.layout import ExpertTensor, MoeLayer, MoeLayout, expert_weight_block
from ggufcarve.moe.routing import UNKNOWN_ROUTING
from ggufcarve.reports import (
    IMATRIX_REMAP_REPORT,
    dumps,
    envelope,
    file_input,
    public_name,
    report_path_for,
)

# ---------------------------------------------------------------------------------------------
# Remapping


@dataclass(frozen=True)
class TensorRemap:
    name: str
    block: int
    mtp: bool
    experts_before: int
    kept: tuple[int, ...]
    dropped: tuple[int, ...]
    routed_kept: int | None  # (token, slot) pairs routed to kept experts; None without per-expert counts
    routed_dropped: int | None


@dataclass(frozen=True)
class RemapPlan:
    source: Imatrix
    output: Imatrix  # values computed when written
    output_path: Path
    output_format: str
    keepset: KeepSet
    layout: MoeLayout  # of the source model (expert_count = experts before pruning)
    kept_count: int
    tensors: tuple[TensorRemap, ...]
    unchanged: tuple[str, ...]
    blocks_without_entries: tuple[int, ...]
    losses: tuple[str, ...]
    skipped: tuple[str, ...]
    warnings: tuple[str, ...]
    models: dict[str, dict[str, Any]]  # "pruned" / "source" -> path, architecture, expert_count
    chunk_size: int

    @property
    def routing(self) -> dict[str, Any]:
        """Share of the calibration's (token, slot) routing the kept experts received, over MoE blocks."""
        per_block: dict[int, TensorRemap] = {}
        for t in self.tensors:
            if t.routed_kept is not None:
                per_block.setdefault(t.block, t)
        if not per_block:
            return {
                "available": False,
                "reason": "the imatrix has no per-expert counts (a .dat, or converted from one)",
            }
        kept = sum(t.routed_kept or 0 for t in per_block.values())
        dropped = sum(t.routed_dropped or 0 for t in per_block.values())
        total = kept + dropped
        return {
            "available": True,
            "routed_total": total,
            "routed_kept": kept,
            "routed_dropped": dropped,
            "share_kept": kept / total if total else None,
            "blocks": [
                {
                    "block": b,
                    "mtp": t.mtp,
                    "routed_kept": t.routed_kept,
                    "routed_dropped": t.routed_dropped,
                    "share_kept": (t.routed_kept or 0) / max((t.routed_kept or 0) + (t.routed_dropped or 0), 1),
                }
                for b, t in sorted(per_block.items())
            ],
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "input": {"path": str(self.source.path), "format": self.source.format, "entries": len(self.source.entries)},
            "output": {
                "path": str(self.output_path),
                "format": self.output_format,
                "entries": len(self.output.entries),
                "bytes": encoded_size(self.output),
            },
            "expert_count": {"before": self.layout.expert_count, "after": self.kept_count},
            "tensors_remapped": [t.name for t in self.tensors],
            "entries_unchanged": list(self.unchanged),
            "blocks_without_entries": list(self.blocks_without_entries),
            "routing": self.routing,
            "losses": list(self.losses),
            "entries_skipped": list(self.skipped),
            "warnings": list(self.warnings),
        }


def _select(e: ImatrixEntry, ids: Sequence[int], n_expert: int, ne0: int) -> ImatrixEntry:
    """The entry with only experts `ids` (in that order): rows of a per-expert entry, slices of a flat one."""
    index = np.asarray(ids, dtype=np.int64)
    if e.n_mat == n_expert and e.row_len == ne0:
        counts = None if e.counts is None else e.counts[index].astype(np.float32)
        sums_ne = None if e.sums_ne is None else ggml_ne(ne0, len(ids))
        counts_ne = None if e.counts_ne is None else ggml_ne(1, len(ids))

        def load() -> np.ndarray:
            return np.ascontiguousarray(e.sums()[index])

        load_in_sum = None
        if e.load_in_sum is not None:
            src_in_sum = e.load_in_sum
            load_in_sum = lambda: np.ascontiguousarray(src_in_sum()[index])
        return dataclasses.replace(
            e,
            n_mat=len(ids),
            counts=counts,
            load_sums=load,
            load_in_sum=load_in_sum,
            sums_ne=sums_ne,
            counts_ne=counts_ne,
        )
    # one row holding all experts (.dat, or a GGUF converted from one): expert-major slices
    if e.n_mat != 1 or e.row_len != n_expert * ne0:
        raise BadInput(
            f"{e.name}: {e.n_mat} rows of {e.row_len} values, expected one row of {n_expert} experts x {ne0}",
            "the imatrix belongs to another model",
        )

    def load_flat() -> np.ndarray:
        return np.ascontiguousarray(e.sums().reshape(n_expert, ne0)[index].reshape(1, -1))

    load_in_sum = None
    if e.load_in_sum is not None:
        src_in_sum = e.load_in_sum
        load_in_sum = lambda: np.ascontiguousarray(src_in_sum().reshape(n_expert, ne0)[index].reshape(1, -1))
    sums_ne = None if e.sums_ne is None else ggml_ne(len(ids) * ne0, 1)
    return dataclasses.replace(e, row_len=len(ids) * ne0, load_sums=load_flat, load_in_sum=load_in_sum, sums_ne=sums_ne)


def imatrix_expert_count(imatrix: Imatrix, ne0: Mapping[str, int]) -> dict[str, int]:
    """Experts per expert entry as the file holds them: GGUF rows, or .dat values / ne0."""
    result = {}
    for e in imatrix.entries:
        if e.name not in ne0:
            continue
        if e.n_mat > 1:
            result[e.name] = e.n_mat
        elif e.nval % ne0[e.name] == 0:
            result[e.name] = e.nval // ne0[e.name]
    return result


def resolve_source_layout(
    imatrix: Imatrix,
    pruned: GGUFModel | None,
    pruned_layout: MoeLayout | None,
    source_layout: MoeLayout | None,
) -> MoeLayout:
    """The layout of the unpruned model the keep-set selects from.

    From --source-model when given; else the pruned model's layout with expert_count set to the
    source's, read from its ggufcarve.source.expert_count key or, failing that, from the imatrix.
    """
    recorded = pruned.get(KEY_SOURCE_EXPERT_COUNT) if pruned is not None else None
    if source_layout is not None:
        if recorded is not None and int(recorded) != source_layout.expert_count:
            raise BadInput(
                f"{pruned.path if pruned else 'the pruned model'} was pruned from a {int(recorded)}-expert "
                f"model ({KEY_SOURCE_EXPERT_COUNT}), the source model has {source_layout.expert_count}",
                "give the source model the pruned model was made from",
            )
        return source_layout
    if pruned is None or pruned_layout is None:
        raise BadInput(
            "neither the source model nor the pruned model was given",
            "give --source-model (the unpruned model) or --model (the pruned one)",
        )
    if recorded is not None:
        return dataclasses.replace(pruned_layout, expert_count=int(recorded))
    ne0 = {t.name: t.shape[0] for t in pruned_layout.expert_tensors.values() if t.role == "expert weight"}
    found = sorted(set(imatrix_expert_count(imatrix, ne0).values()))
    if len(found) != 1:
        raise BadInput(
            f"{pruned.path} does not record the source expert count (no "
            f"{KEY_SOURCE_EXPERT_COUNT}) and the imatrix entries give {found or 'none'}",
            "pass --source-model with the unpruned model",
        )
    return dataclasses.replace(pruned_layout, expert_count=found[0])


def layout_from_imatrix(imatrix: Imatrix) -> MoeLayout:
    """The MoE blocks and the expert count as a GGUF imatrix states them, for a remap without a model.

    Expert entries are `blk.N.ffn_{gate,up,down,gate_up}_exps.weight`; their `in_sum2` has one row
    of ne0 values per expert (`[ne0, n_expert]`). A .dat stores each entry as one flat row, so the
    expert count cannot be told from it alone.
    """
    where = str(imatrix.path)
    if imatrix.format != "gguf":
        raise BadInput(
            f"{where} is a .dat imatrix: it stores each entry as one row, so the expert count cannot be read from it",
            "give --model PRUNED.gguf or --source-model SOURCE.gguf",
        )
    per_block: dict[int, list[ExpertTensor]] = {}
    counts = set()
    for e in imatrix.entries:
        block = expert_weight_block(e.name)
        if block is None:
            continue
        counts.add(e.n_mat)
        per_block.setdefault(block, []).append(
            ExpertTensor(e.name, block, "expert weight", (e.row_len, e.n_mat), "F32", e.nval * 4, e.row_len * 4)
        )
    if not per_block:
        raise BadInput(
            f"{where} has no expert entries (blk.N.ffn_*_exps.weight)",
            "an imatrix of a Mixture-of-Experts model is needed; or give --model",
        )
    if len(counts) != 1 or min(counts) < 2:
        raise BadInput(
            f"{where}: expert entries hold {sorted(counts)} rows each, not one common expert count",
            "give --source-model SOURCE.gguf so the expert count comes from the model",
        )
    n_expert = counts.pop()
    layers = tuple(MoeLayer(b, False, tuple(ts)) for b, ts in sorted(per_block.items()))
    expert_bytes = sum(t.nbytes for layer in layers for t in layer.tensors)
    return MoeLayout(
        architecture="(from the imatrix)",
        block_count=max(per_block) + 1,
        nextn_layers=0,
        expert_count=n_expert,
        expert_used_count=0,
        group_count=0,
        group_used_count=0,
        shared_expert_count=0,
        leading_dense_blocks=0,
        layers=layers,
        total_bytes=expert_bytes,
        expert_bytes=expert_bytes,
        routing=UNKNOWN_ROUTING,
        described_by="imatrix",
    )


def plan_remap(
    imatrix: Imatrix,
    keepset: KeepSet,
    layout: MoeLayout,
    output: str | os.PathLike[str],
    *,
    output_format: str | None = None,
    chunk_size: int | None = None,
    pruned: GGUFModel | None = None,
    source: GGUFModel | None = None,
) -> RemapPlan:
    """Validate everything and decide the output; nothing is written.

    `layout` is the source (unpruned) layout: its expert_count is what the keep-set selects from.
    The input entries are checked against `source` (else against `pruned`, expert entries scaled
    back to the source's expert count); the output entries against `pruned` with llama-quantize's
    own size check. Without either model (`layout` from `layout_from_imatrix`) only the expert
    entries are checked, against the imatrix's own shapes. Problems are reported all at once.
    """
    output = Path(output)
    fmt = output_format or imatrix.format
    if fmt not in FORMATS:
        raise BadInput(f"unknown imatrix format {fmt!r}", "use --format gguf or --format dat")
    warnings = list(check_keepset(keepset, layout))
    k = keepset.kept_count
    n_expert = layout.expert_count
    where = str(imatrix.path)

    recorded = imatrix.remap_keepset
    if recorded is not None:
        raise BadInput(
            f"{where} was already remapped by ggufcarve to {imatrix.get(KEY_KEPT_COUNT)} experts ({KEY_KEPT_EXPERTS})",
            "remap the original imatrix (the one computed on the unpruned model)",
        )
    if pruned is not None:
        arch = pruned.get(Keys.General.ARCHITECTURE)
        if arch != layout.architecture:
            raise BadInput(
                f"{pruned.path} is {arch}, the source model is {layout.architecture}",
                "give the pruned model made from this source",
            )
        pruned_k = pruned.get(Keys.LLM.EXPERT_COUNT.format(arch=arch))
        if pruned_k != k:
            raise BadInput(
                f"the keep-set keeps {k} experts per block but {pruned.path} "
                f"has {Keys.LLM.EXPERT_COUNT.format(arch=arch)}={pruned_k}",
                "use the keep-set the model was pruned with (omit --keep to use the one it records)",
            )

    # Input checks against the unpruned model (or the pruned one, expert sizes scaled back to the
    # source's expert count): every entry names a tensor and has the size that model needs.
    reference = source if source is not None else pruned
    if reference is None and layout.described_by == "model":
        raise BadInput(
            "remapping needs the source or the pruned model, or a keep-set by block index",
            "give --source-model and/or --model",
        )
    expert_weights = {t.name: t for t in layout.expert_tensors.values() if t.role == "expert weight"}
    shapes = (
        {t.name: t.shape for t in reference.tensors}
        if reference is not None
        else {t.name: t.shape for t in expert_weights.values()}
    )
    ne0 = {name: shapes[name][0] for name in expert_weights if name in shapes}
    sizes = expected_sizes(reference) if reference is not None else {e.name: e.nval for e in imatrix.entries}
    sizes.update({name: width * n_expert for name, width in ne0.items()})
    reference_name = reference.path.name if reference is not None else "the imatrix"
    problems: list[str] = []
    expert_entries: dict[str, ImatrixEntry] = {}
    for e in imatrix.entries:
        if e.name in ne0:
            problem = _expert_entry_problem(e, n_expert, k, ne0[e.name])
            if problem:
                problems.append(problem)
            else:
                expert_entries[e.name] = e
        elif e.name not in sizes:
            problems.append(f"{e.name} is not a tensor of {reference_name}")
        elif e.nval != sizes[e.name] and e.name != "token_embd.weight":
            problems.append(
                f"{e.name} has {e.nval} values, but {reference_name} needs {sizes[e.name]} "
                "(ne0 x ne2); it fits neither the dense nor the expert layout"
            )
    problems = _group_problems(problems)
    raise_problems(
        problems,
        f"{where} does not fit the {n_expert}-expert source model",
        "check that the imatrix was computed on the unpruned model this keep-set selects from",
    )

    # Convert first (when asked), then select: remapping commutes with conversion, so a .dat
    # remapped from the GGUF equals the remap of llama-imatrix's own .dat of the same run.
    size = chunk_size if chunk_size is not None else (imatrix.chunk_size or DEFAULT_CHUNK_SIZE)
    conversion = convert(imatrix, fmt, size)
    converted = conversion.imatrix.entry_index
    tensors, entries, unchanged = [], [], []
    for e in imatrix.entries:
        if e.name not in converted:  # a .dat cannot hold an entry without any data
            continue
        if e.name not in expert_entries:
            entries.append(converted[e.name])
            unchanged.append(e.name)
            continue
        block = expert_weights[e.name].block
        ids = keepset.layers[block]
        dropped = tuple(i for i in range(n_expert) if i not in set(ids))
        routed_kept = routed_dropped = None
        if e.per_expert_counts:
            counts = lround(counts_of(e))
            routed_kept = int(counts[list(ids)].sum())
            routed_dropped = int(counts.sum()) - routed_kept
        tensors.append(
            TensorRemap(e.name, block, layout.is_mtp(block), n_expert, tuple(ids), dropped, routed_kept, routed_dropped)
        )
        entries.append(_select(converted[e.name], ids, n_expert, ne0[e.name]))

    covered = {t.block for t in tensors}
    without = tuple(b for b in layout.blocks if b not in covered)
    if without:
        mtp = [b for b in without if layout.is_mtp(b)]
        main = [b for b in without if not layout.is_mtp(b)]
        if mtp:
            warnings.append(
                f"MTP block(s) {', '.join(map(str, mtp))} have no imatrix entries (llama-imatrix "
                f"never runs MTP blocks); IQ rungs need a --tensor-type override for blk.{mtp[0]}"
            )
        if main:
            warnings.append(f"MoE block(s) {', '.join(map(str, main))} have no expert entries in the imatrix")

    result = dataclasses.replace(conversion.imatrix, entries=tuple(entries))
    if fmt == "gguf":  # a note of the remap, spelled as in the pruned model (a .dat has no metadata)
        source_sha256 = make_kv(KEY_REMAP_SOURCE_SHA256, GGUFValueType.STRING, "0" * 64)  # filled in when written
        provenance = provenance_kvs(keepset, n_expert)
        changes = {kv.key: kv for kv in (provenance[0], source_sha256, *provenance[1:])}
        result = dataclasses.replace(result, kvs=tuple(replace_kvs(result.kvs, changes)))
    for name in conversion.skipped:
        warnings.append(
            f"{name} has no data at all; a .dat cannot hold it (llama-imatrix "
            "skips such entries), so IQ rungs need a --tensor-type override for it"
        )

    if pruned is not None:
        check = check_against_model(result, pruned)
        raise_problems(
            check.problems,
            f"remapped imatrix does not fit {pruned.path}",
            "the pruned model and the keep-set do not match; re-prune or give the matching keep-set",
        )

    models = {}
    for role, m in (("pruned", pruned), ("source", source)):
        if m is not None:
            arch = m.get(Keys.General.ARCHITECTURE)
            models[role] = {
                "name": m.path.name,
                "architecture": arch,
                "expert_count": int(m.get(Keys.LLM.EXPERT_COUNT.format(arch=arch)) or 0),
            }
    return RemapPlan(
        source=imatrix,
        output=result,
        output_path=output,
        output_format=fmt,
        keepset=keepset,
        layout=layout,
        kept_count=k,
        tensors=tuple(tensors),
        unchanged=tuple(unchanged),
        blocks_without_entries=without,
        losses=conversion.losses if fmt != imatrix.format else (),
        skipped=conversion.skipped,
        warnings=tuple(warnings),
        models=models,
        chunk_size=size,
    )


def _group_problems(problems: list[str]) -> list[str]:
    """The same expert-count problem of many entries becomes one line naming the first entry."""
    grouped: dict[str, list[str]] = {}
    for p in problems:
        name, _, rest = p.partition(" ")
        if expert_weight_block(name) is not None and "experts" in rest:
            grouped.setdefault(rest, []).append(name)
        else:
            grouped.setdefault(p, [])
    out = []
    for key, names in grouped.items():
        if not names:
            out.append(key)
        elif len(names) == 1:
            out.append(f"{names[0]} {key}")
        else:
            out.append(f"{names[0]} (and {len(names) - 1} more expert entries) {key}")
    return out


def _expert_entry_problem(e: ImatrixEntry, n_expert: int, kept: int, ne0: int) -> str | None:
    if e.nval == n_expert * ne0 and (e.n_mat in (1, n_expert)) and (e.n_mat == 1 or e.row_len == ne0):
        return None
    found = e.n_mat if e.n_mat > 1 else (e.nval // ne0 if e.nval % ne0 == 0 else None)
    if found == kept and kept != n_expert:
        return (
            f"{e.name} already holds {kept} experts (the pruned count), "
            f"not the source's {n_expert}: it looks remapped already"
        )
    if found is not None and found != n_expert:
        return (
            f"{e.name} holds {found} experts but the keep-set selects from {n_expert} (the source model's expert_count)"
        )
    return (
        f"{e.name} has {e.nval} values ({e.n_mat} x {e.row_len}); it fits "
        f"neither the dense ({ne0}) nor the expert ({n_expert} x {ne0}) layout"
    )


@dataclass
class RemapResult:
    plan: RemapPlan
    output_path: Path
    report_path: Path
    input_sha256: str
    output_sha256: str
    output_bytes: int
    timings: dict[str, float]


def default_report_path(output: Path) -> Path:
    """`method/<output stem>.imatrix-remap-report.json` beside the output."""
    return report_path_for(output, IMATRIX_REMAP_REPORT)


def execute_remap(
    plan: RemapPlan,
    *,
    force: bool = False,
    on_event: Sink = ignore,
    report_path: Path | None = None,
    sources: Sequence[Path] = (),
) -> RemapResult:
    """Write the remapped imatrix under a temp name, fsync and re-read it, write the report
    (default OUTPUT_DIR/method/<output stem>.imatrix-remap-report.json), then rename the output
    into place: a crash at any point leaves no output without its report."""
    t0 = time.perf_counter()
    report_path = report_path or default_report_path(plan.output_path)
    input_sha = sha256_file(_read_from(plan.source))
    output = plan.output
    if output.format == "gguf" and any(kv.key == KEY_REMAP_SOURCE_SHA256 for kv in output.kvs):
        output = dataclasses.replace(
            output,
            kvs=tuple(
                replace_kvs(
                    output.kvs,
                    {KEY_REMAP_SOURCE_SHA256: make_kv(KEY_REMAP_SOURCE_SHA256, GGUFValueType.STRING, input_sha)},
                )
            ),
        )
    size = encoded_size(output)
    check_outputs([plan.output_path], [plan.source.path, *sources], size, force)
    with atomic_outputs([plan.output_path]) as opened:
        ((temp, fd),) = opened
        written_bytes = write_to_fd(output, fd, Counter(on_event, "write", size))
        if written_bytes != size:
            raise CarveError(f"internal error: wrote {written_bytes} bytes, planned {size}")
        os.fsync(fd)
        t_write = time.perf_counter()
        output_sha = sha256_file(temp)
        written = read_imatrix(temp)  # re-read: the file parses and every value is finite
        if len(written.entries) != len(output.entries):
            raise CarveError(
                f"internal error: {plan.output_path.name} has "
                f"{len(written.entries)} entries, planned {len(output.entries)}"
            )
        timings = {"write_seconds": t_write - t0, "total_seconds": time.perf_counter() - t0}
        result = RemapResult(plan, plan.output_path, report_path, input_sha, output_sha, size, timings)
        write_text_atomic(report_path, dumps(remap_report(result)))
    return result


def _read_from(imatrix: Imatrix) -> Path:
    if imatrix.path is None:
        raise RuntimeError("the imatrix to remap was not read from a file")
    return imatrix.path


def remap_report(result: RemapResult) -> dict[str, Any]:
    """The remap report; `output.sha256` names the imatrix it describes."""
    plan = result.plan
    source = plan.source
    results = {
        "input": {
            "name": _read_from(source).name,
            "format": source.format,
            "bytes": source.size,
            "sha256": result.input_sha256,
            "entries": len(source.entries),
            "chunk_count": source.chunk_count,
            "chunk_size": source.chunk_size,
            "datasets": [public_name(d) for d in source.datasets],
        },
        "output": {
            "name": result.output_path.name,
            "format": plan.output_format,
            "bytes": result.output_bytes,
            "sha256": result.output_sha256,
            "entries": len(plan.output.entries),
        },
        "models": plan.models,
        "expert_count": {"before": plan.layout.expert_count, "after": plan.kept_count},
        "keep_set": plan.keepset.to_json(),
        "tensors": [
            {
                "name": t.name,
                "block": t.block,
                "mtp": t.mtp,
                "experts_before": t.experts_before,
                "kept": list(t.kept),
                "dropped": list(t.dropped),
                "routed_kept": t.routed_kept,
                "routed_dropped": t.routed_dropped,
                "routed_share_kept": None
                if t.routed_kept is None
                else t.routed_kept / max(t.routed_kept + (t.routed_dropped or 0), 1),
            }
            for t in plan.tensors
        ],
        "routing": plan.routing,
        "entries_unchanged": list(plan.unchanged),
        "entries_skipped": list(plan.skipped),
        "blocks_without_entries": list(plan.blocks_without_entries),
        "conversion_losses": list(plan.losses),
        "warnings": list(plan.warnings),
    }
    return envelope(
        IMATRIX_REMAP_REPORT,
        inputs=[file_input(source.path, result.input_sha256, source.size)],
        parameters={
            "format": plan.output_format,
            "chunk_size": plan.chunk_size if "dat" in (source.format, plan.output_format) else source.chunk_size,
        },
        timings=dict(sorted(result.timings.items())),
        results=results,
    )
