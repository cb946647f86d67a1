"""From scores to a keep-set: top K per block, deterministic, group-aware, protected ids kept.

Order: within each block (each expert group, with grouped routing) protected experts first, then
by descending score; equal scores keep the lower original expert id. Kept ids are stored in
ascending original order, group by group, which is the order llama.cpp's grouped routing needs
(groups are contiguous id ranges and keep the same count each). The keep-set is checked against
llama.cpp's load rules (`check_keepset`) before anything is written.

The selection record is at once a keep-set the pruner reads (`layers`) and the full account of
the choice (`per_block`: retained, pruned, score per original expert, routed counts).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ggufcarve.errors import BadInput
from ggufcarve.moe.keepset import KeepSet, check_keepset, keep_per_block, load_keepset, parse_id_list
from ggufcarve.moe.kept import groups_of
from ggufcarve.reports import envelope
from ggufcarve.select.scores import ExpertScores, ModelFacts

TIE_BREAK = "higher score first; equal scores: the lower original expert id wins"
SELECTION_REPORT = "expert-selection"
# REAP's super-expert rule (Cerebras reap): a per-expert maximum output above
# max(99.5th percentile of all per-expert maxima, global maximum / 10), in the first 75% of the MoE blocks.
SUPER_EXPERT_PERCENTILE = 99.5
SUPER_EXPERT_FRACTION_OF_MAX = 0.1
SUPER_EXPERT_BLOCK_FRACTION = 0.75


def protected_from(spec: str | None, facts: ModelFacts) -> dict[int, set[int]]:
    """--protect IDS (the same ids in every block) or FILE (a keep-set-like file: ids per block)."""
    if not spec:
        return {}
    blocks = facts.blocks
    path = Path(spec)
    if path.suffix == ".json" or path.exists():
        listed = load_keepset(path, facts.layout()).layers
        unknown = sorted(set(listed) - set(blocks))
        if unknown:
            raise BadInput(
                f"--protect {spec}: block(s) {unknown} are not MoE blocks of {facts.name}",
                f"MoE blocks are {list(blocks)}",
            )
        protected = {b: set(ids) for b, ids in listed.items()}
    else:
        ids = set(parse_id_list(spec))
        protected = {b: set(ids) for b in blocks}
    n = facts.expert_count
    for b, ids in protected.items():
        bad = sorted(i for i in ids if not 0 <= i < n)
        if bad:
            raise BadInput(f"--protect: blk.{b}: id(s) {bad} out of range 0..{n - 1}", "give original expert ids")
    return protected


def super_experts(scores: ExpertScores) -> dict[int, set[int]]:
    """REAP's super experts: outliers of the per-expert maximum output, in the first 75% of the MoE blocks."""
    with_maxima = {b: s.maxima for b, s in scores.blocks.items() if s.maxima is not None and not scores.model.is_mtp(b)}
    if not with_maxima:
        raise BadInput(
            f"--protect-super-experts needs per-expert maximum outputs; the {scores.method} scores have none",
            "use --method ean, reap or razor, which record them",
        )
    pooled = np.concatenate(list(with_maxima.values()))
    threshold = max(
        float(np.percentile(pooled, SUPER_EXPERT_PERCENTILE)), float(pooled.max()) * SUPER_EXPERT_FRACTION_OF_MAX
    )
    ordered = sorted(with_maxima)
    considered = ordered[: int(len(ordered) * SUPER_EXPERT_BLOCK_FRACTION)]
    return {b: {int(e) for e in np.flatnonzero(with_maxima[b] > threshold)} for b in considered}


def rank_experts(score: np.ndarray, ids: range | list[int], protected: set[int]) -> list[int]:
    """`ids` best first: protected first, then descending score, equal scores by ascending id."""
    return sorted(ids, key=lambda e: (e not in protected, -float(score[e]), e))


@dataclass(frozen=True)
class Selection:
    scores: ExpertScores
    keepset: KeepSet
    protected: dict[int, tuple[int, ...]]  # per block: ids protected by --protect / super experts
    super_experts: dict[int, tuple[int, ...]]
    warnings: tuple[str, ...]
    parameters: dict[str, Any]
    sources: tuple[dict[str, Any], ...] = ()  # files selected from (a scores file), beside the scores' own inputs

    @property
    def kept_count(self) -> int:
        return self.keepset.kept_count

    def record(self, timings: Mapping[str, float] | None = None) -> dict[str, Any]:
        """The SELECTION.json document (in the one report envelope): a keep-set (`layers`) and the
        record of how it was chosen."""
        facts = self.scores.model
        scores = self.scores.scores()
        per_block: dict[str, Any] = {}
        for b, stats in sorted(self.scores.blocks.items()):
            retained = list(self.keepset.layers[b])
            entry: dict[str, Any] = {
                "retained": retained,
                "pruned": [e for e in range(facts.expert_count) if e not in set(retained)],
                "score": [float(x) for x in scores[b]],
                "rule": stats.rule,
                "statistic": stats.statistic,
                "mtp": facts.is_mtp(b),
            }
            if stats.counts is not None:
                entry["routed"] = [int(c) for c in stats.counts]
            if stats.note:
                entry["note"] = stats.note
            if self.protected.get(b):
                entry["protected"] = list(self.protected[b])
            if self.super_experts.get(b):
                entry["super_experts"] = list(self.super_experts[b])
            per_block[str(b)] = entry
        results = {
            "layers": {str(b): list(ids) for b, ids in sorted(self.keepset.layers.items())},
            "kept_count": self.kept_count,
            "source_expert_count": facts.expert_count,
            "method": self.scores.method,
            "model": facts.to_json(),
            "calibration": [i for i in self.scores.inputs if i.get("kind") == "calibration"],
            "tokens": self.scores.tokens,
            "tie_break": TIE_BREAK,
            "order": "kept ids in ascending original order (group by group with grouped routing)",
            "warnings": list(self.warnings),
            "per_block": per_block,
        }
        return envelope(
            SELECTION_REPORT,
            inputs=[*self.scores.inputs, *self.sources],
            parameters={**self.scores.parameters, **self.parameters},
            results=results,
            timings=timings or {},
        )


def choose(
    scores: ExpertScores,
    kept: int,
    protect: Mapping[int, set[int]] | None = None,
    protect_super_experts: bool = False,
    ratio: float | None = None,
    sources: tuple[dict[str, Any], ...] = (),
) -> Selection:
    """The top `kept` experts of every block; raises BadInput if the result would not load in llama.cpp."""
    facts = scores.model
    layout = facts.layout()
    protected = {b: set(ids) for b, ids in (protect or {}).items()}
    supers: dict[int, set[int]] = super_experts(scores) if protect_super_experts else {}
    for b, ids in supers.items():
        protected.setdefault(b, set()).update(ids)
    per_block = scores.scores()
    whole_block = groups_of(layout) == 1

    def pick(block: int, members: range, quota: int) -> list[int]:
        if block not in per_block:
            raise BadInput(
                f"the {scores.method} scores have no blk.{block} of {facts.name}", "score every MoE block of the model"
            )
        mine = protected.get(block, set())
        held = [e for e in members if e in mine]
        if len(held) > quota:
            where = (
                "the block"
                if whole_block
                else f"group {members.start // len(members)} (ids {members.start}-{members.stop - 1})"
            )
            raise BadInput(
                f"blk.{block}: {len(held)} protected experts in {where} but only {quota} can be kept",
                "protect fewer experts or keep more",
            )
        stats = scores.blocks[block]
        if stats.statistic == "pairwise":  # HOPE: a set per quota, not a ranking
            from ggufcarve.select.hope import hope_keep

            return hope_keep(stats.pair_matrix(), members, quota, mine)
        return rank_experts(per_block[block], members, mine)[:quota]

    keepset = keep_per_block(layout, kept, pick, selection=f"{scores.method}, top {kept}")
    warnings = check_keepset(keepset, layout)
    return Selection(
        scores=scores,
        keepset=keepset,
        protected={b: tuple(sorted(ids)) for b, ids in sorted(protected.items()) if ids},
        super_experts={b: tuple(sorted(ids)) for b, ids in sorted(supers.items()) if ids},
        warnings=tuple(warnings),
        parameters={
            "keep": kept,
            "ratio": ratio,
            "protect_super_experts": protect_super_experts,
            "protected": {str(b): sorted(ids) for b, ids in sorted(protected.items()) if ids},
        },
        sources=sources,
    )


def compare(a: Mapping[int, tuple[int, ...]], b: Mapping[int, tuple[int, ...]]) -> list[dict[str, Any]]:
    """Per block: overlap |A∩B|/K and the experts only one of the two keeps."""
    if set(a) != set(b):
        raise BadInput(
            f"the selections list different blocks ({sorted(a)} vs {sorted(b)})", "compare selections of the same model"
        )
    rows = []
    for block in sorted(a):
        sa, sb = set(a[block]), set(b[block])
        k = max(len(sa), len(sb))
        rows.append(
            {
                "block": block,
                "kept": k,
                "overlap": len(sa & sb) / k if k else 1.0,
                "only_a": sorted(sa - sb),
                "only_b": sorted(sb - sa),
            }
        )
    return rows
