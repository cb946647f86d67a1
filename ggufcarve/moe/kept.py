"""K, the number of experts kept per MoE block: the one check of a K against llama.cpp's load
rules, and K from a fraction (moe/keepset.py's `keep_per_block` builds the experts).

llama.cpp (src/llama-model.cpp, load_hparams; src/llama-graph.cpp, build_moe_ffn) needs K at
least the experts each token is routed to, at most the expert count, and with grouped routing
(`{arch}.expert_group_count` > 1: groups are contiguous id ranges, each scored by the sum of its
two best experts) the same count from every group, at least 2 per group, and enough experts in the
used groups for the top-k: group_used * K/groups >= expert_used_count.
"""

from __future__ import annotations

from ggufcarve.errors import BadInput
from ggufcarve.moe.layout import MoeLayout

KEPT_COUNT_HINT = (
    "choose K within [expert_used_count, expert_count] and, with grouped routing, the same count from every group"
)


def groups_of(layout: MoeLayout) -> int:
    """The number of routing groups (1 without grouped routing)."""
    return layout.group_count if layout.group_count > 1 else 1


def kept_count_problems(layout: MoeLayout, kept: int) -> list[str]:
    """Every load rule K experts per block break; empty when llama.cpp accepts K."""
    n, used = layout.expert_count, max(layout.expert_used_count, 1)
    if not 1 <= kept <= n:
        return [
            f"K={kept} is outside {min(used, n)}..{n} (the model has {n} experts per block, {used} routed per token)"
        ]
    problems = []
    if kept < used:
        problems.append(f"K={kept} is below the {used} experts each token is routed to (expert_used_count)")
    groups = groups_of(layout)
    if groups > 1:
        if kept % groups:
            problems.append(f"K={kept} is not a multiple of the {groups} expert groups")
        else:
            per_group = kept // groups
            if per_group < 2:
                problems.append(
                    f"K={kept} keeps {per_group} expert(s) per group; group "
                    "scoring sums each group's top 2, so at least 2 are needed"
                )
            if layout.group_used_count * per_group < layout.expert_used_count:
                problems.append(
                    f"K={kept}: {layout.group_used_count} used groups x "
                    f"{per_group} kept per group < top-k {layout.expert_used_count}"
                )
    return problems


def check_kept_count(layout: MoeLayout, kept: int) -> None:
    """Raise BadInput (the first problem, one line) unless llama.cpp accepts K experts per block."""
    problems = kept_count_problems(layout, kept)
    if problems:
        raise BadInput(problems[0], KEPT_COUNT_HINT)


def ratio_problem(ratio: float) -> str | None:
    """Why a kept fraction is refused, or None."""
    return None if 0 < ratio <= 1 else f"{ratio} is not a fraction in (0, 1]"


def kept_count(layout: MoeLayout, keep: int | None, ratio: float | None) -> int:
    """K from exactly one of keep (a count) and ratio (the fraction kept, rounded to whole
    groups), checked against the load rules."""
    if (keep is None) == (ratio is None):
        raise BadInput("give exactly one of --keep K and --ratio R", "for example --keep 128 or --ratio 0.5")
    if keep is not None:
        kept = keep
    elif ratio is not None:
        problem = ratio_problem(ratio)
        if problem:
            raise BadInput(f"--ratio {problem}", "--ratio is the fraction of experts kept, e.g. 0.5")
        step = groups_of(layout)
        kept = max(step, round(ratio * layout.expert_count / step) * step)
    check_kept_count(layout, kept)
    return kept
