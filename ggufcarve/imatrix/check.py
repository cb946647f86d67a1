"""Checking an imatrix against a model as llama-quantize will, and summarizing its routing statistics."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ggufcarve.errors import BadInput
from ggufcarve.gguf.container import (
    GGUFModel,
)
from ggufcarve.imatrix_format import (
    KEY_REMAP_SOURCE_SHA256,
    Imatrix,
    ImatrixEntry,
    counts_of,
    lround,
)
from ggufcarve.listing import shortened
from ggufcarve.moe.keepset import (
    KEY_KEPT_COUNT,
    KEY_SOURCE_EXPERT_COUNT,
    keepset_from_provenance,
)

# ---------------------------------------------------------------------------------------------
# Checking against a model


@dataclass(frozen=True)
class ModelCheck:
    problems: tuple[str, ...]  # each would make llama-quantize fail, or shows the wrong model
    warnings: tuple[str, ...]
    missing: tuple[str, ...]  # model weight matrices without an entry


def expected_sizes(model: GGUFModel) -> dict[str, int]:
    """The entry size llama-quantize accepts for each tensor: ne[0] * ne[2]."""
    return {t.name: t.shape[0] * (t.shape[2] if len(t.shape) > 2 else 1) for t in model.tensors}


def check_against_model(imatrix: Imatrix, model: GGUFModel, *, sizes: Mapping[str, int] | None = None) -> ModelCheck:
    """llama-quantize's per-tensor check, for every entry at once: the weight exists and the entry
    has ne0 * ne2 values (`imatrix size X is different from tensor size Y for W`)."""
    sizes = dict(sizes) if sizes is not None else expected_sizes(model)
    problems, warnings = [], []
    for e in imatrix.entries:
        if e.name not in sizes:
            problems.append(f"{e.name} is not a tensor of {model.path.name}")
            continue
        if e.nval != sizes[e.name]:
            message = f"imatrix size {e.nval} is different from tensor size {sizes[e.name]} for {e.name}"
            (warnings if e.name == "token_embd.weight" else problems).append(message)
    # weight matrices of blocks the imatrix has no entry for at all (MTP blocks: never run by llama-imatrix)
    covered = {e.block for e in imatrix.entries}
    missing = tuple(
        t.name
        for t in model.tensors
        if len(t.shape) >= 2
        and t.name.endswith(".weight")
        and (m := re.match(r"^blk\.(\d+)\.", t.name))
        and int(m[1]) not in covered
    )
    if missing:
        blocks = sorted({int(n.split(".")[1]) for n in missing})
        warnings.append(
            f"block(s) {', '.join(map(str, blocks))} of {model.path.name} "
            "have no imatrix entries (llama-imatrix never runs MTP blocks); "
            f"IQ1/IQ2/IQ3_XXS targets fail on their {len(missing)} weight matrices ('Missing "
            f"importance matrix'): give them a --tensor-type override such as blk\\.{blocks[0]}\\.=q4_K"
        )
    recorded = imatrix.remap_keepset
    if recorded is not None:
        pruned_with = keepset_from_provenance(model.get, model.path.name)
        if pruned_with is not None and pruned_with.layers != recorded.layers:
            differ = sorted(
                b
                for b in set(recorded.layers) | set(pruned_with.layers)
                if recorded.layers.get(b) != pruned_with.layers.get(b)
            )
            problems.append(
                f"the imatrix was remapped with another keep-set than {model.path.name} "
                f"was pruned with (blocks {', '.join(map(str, differ))} differ)"
            )
    return ModelCheck(tuple(problems), tuple(warnings), missing)


def raise_problems(problems: Sequence[str], where: str, hint: str) -> None:
    if problems:
        shown = shortened(problems, 6)
        raise BadInput(f"{where}: {len(problems)} problem{'s' if len(problems) > 1 else ''}: {shown}", hint)


# ---------------------------------------------------------------------------------------------
# Inspection


@dataclass(frozen=True)
class BlockRouting:
    block: int
    entries: tuple[str, ...]
    expert_count: int | None  # None: no per-expert counts
    counts: tuple[int, ...] | None
    zero: tuple[int, ...] | None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"block": self.block, "entries": list(self.entries), "expert_count": self.expert_count}
        if self.counts is not None:
            c = np.asarray(self.counts, dtype=np.float64)
            total = float(c.sum())
            top = np.sort(c)[::-1]
            quarter = max(1, len(c) // 4)
            doc.update(
                counts=list(self.counts),
                zero_count_experts=list(self.zero or ()),
                routed_total=int(total),
                min=int(c.min()),
                median=float(np.median(c)),
                max=int(c.max()),
                top_quarter_share=float(top[:quarter].sum() / total) if total else None,
            )
        return doc


@dataclass(frozen=True)
class ImatrixSummary:
    imatrix: Imatrix
    expert_entries: int
    dense_entries: int
    blocks: tuple[BlockRouting, ...]
    remapped: dict[str, Any] | None
    model_check: ModelCheck | None

    def to_json(self) -> dict[str, Any]:
        im = self.imatrix
        return {
            "path": str(im.path),
            "format": im.format,
            "bytes": im.size,
            "entries": len(im.entries),
            "expert_entries": self.expert_entries,
            "dense_entries": self.dense_entries,
            "chunk_count": im.chunk_count,
            "chunk_size": im.chunk_size,
            "datasets": list(im.datasets),
            "per_expert_counts": any(b.counts is not None for b in self.blocks),
            "remapped_by_ggufcarve": self.remapped,
            "moe_blocks": [b.to_json() for b in self.blocks],
            "model_check": None
            if self.model_check is None
            else {
                "problems": list(self.model_check.problems),
                "warnings": list(self.model_check.warnings),
                "entries_missing": list(self.model_check.missing),
            },
            "entry_list": [
                {
                    "name": e.name,
                    "values": e.nval,
                    "matrices": e.n_mat,
                    **({"ncall": e.ncall} if e.ncall is not None else {}),
                }
                for e in im.entries
            ],
        }


def summarize(imatrix: Imatrix, model: GGUFModel | None = None) -> ImatrixSummary:
    """Entries, chunks, datasets, and per MoE block the routing counts (zero-count experts)."""
    per_block: dict[int, list[ImatrixEntry]] = {}
    for e in imatrix.entries:
        if e.is_expert_weight and e.block is not None:
            per_block.setdefault(e.block, []).append(e)
    blocks = []
    for block, entries in sorted(per_block.items()):
        with_counts = [e for e in entries if e.per_expert_counts]
        if with_counts:
            first = with_counts[0]
            counts = tuple(int(c) for c in lround(counts_of(first)))
            zero = tuple(i for i, c in enumerate(counts) if c == 0)
            blocks.append(BlockRouting(block, tuple(e.name for e in entries), first.n_mat, counts, zero))
        else:
            blocks.append(BlockRouting(block, tuple(e.name for e in entries), None, None, None))
    remapped = None
    if imatrix.get(KEY_KEPT_COUNT) is not None:
        remapped = {
            "source_expert_count": imatrix.get(KEY_SOURCE_EXPERT_COUNT),
            "kept_expert_count": imatrix.get(KEY_KEPT_COUNT),
            "source_sha256": imatrix.get(KEY_REMAP_SOURCE_SHA256),
        }
    expert_entries = sum(len(v) for v in per_block.values())
    check = check_against_model(imatrix, model) if model is not None else None
    return ImatrixSummary(
        imatrix, expert_entries, len(imatrix.entries) - expert_entries, tuple(blocks), remapped, check
    )
