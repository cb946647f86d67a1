"""N, the number of experts each token is routed to (`{arch}.expert_used_count`): the one check of an
N against llama.cpp's load rules, and the header records that write it.

llama.cpp (src/llama-model.cpp, load_hparams) reads the key as a uint32 scalar or a per-layer
array; every graph but nemotron-h's takes `hparams.n_expert_used()`, the first layer's value, so
an array is reduced to its first entry there. In build_moe_ffn (src/llama-graph.cpp) N is the k of
the top-k over the router's scores (inside the chosen groups with grouped routing: at most
group_used x experts per group). Where a file has no `{arch}.expert_feed_forward_length`, several
graphs (qwen2moe, qwen3moe, qwen35moe, glm4moe, ...) derive the expert width as
`n_ff / n_expert_used`: a file whose N changes must then carry the width its tensors have.
"""

from __future__ import annotations

import dataclasses

from gguf.constants import GGUFValueType, Keys

from ggufcarve.errors import BadInput
from ggufcarve.gguf.container import GGUFModel, KeyValue, make_kv
from ggufcarve.moe.kept import groups_of
from ggufcarve.moe.layout import DOWN_EXPS, MoeLayout

# The graphs that read N per layer (src/models/nemotron-h.cpp: hparams.n_expert_used(il)).
PER_LAYER_READERS = frozenset({"nemotron_h", "nemotron_h_moe"})
TRAINED_KEY = "ggufcarve.expert_used_count_trained"  # prune --topk's provenance: the source's N
EXPERTS_USED_HINT = "choose N within [1, expert_count] (within the used groups' experts with grouped routing)"


def used_count_key(layout: MoeLayout) -> str:
    return Keys.LLM.EXPERT_USED_COUNT.format(arch=layout.architecture)


def expert_width_key(layout: MoeLayout) -> str:
    return Keys.LLM.EXPERT_FEED_FORWARD_LENGTH.format(arch=layout.architecture)


def grouped_limit(layout: MoeLayout) -> int:
    """The largest N grouped routing can choose: group_used x experts per group (expert_count
    without groups)."""
    groups = groups_of(layout)
    if groups == 1:
        return layout.expert_count
    return max(layout.group_used_count, 1) * (layout.expert_count // groups)


def experts_used_problems(model: GGUFModel, layout: MoeLayout, used: int) -> list[str]:
    """Every rule N used experts per token breaks for this file; empty when llama.cpp accepts N."""
    key = used_count_key(layout)
    problems = []
    if used < 1:
        problems.append(f"N={used} is below 1: every token is routed to at least one expert")
    if used > layout.expert_count:
        problems.append(f"N={used} is above {layout.architecture}.expert_count={layout.expert_count}")
    elif used > grouped_limit(layout):
        problems.append(
            f"N={used} is above what grouped routing can choose: {layout.group_used_count} used groups x "
            f"{layout.expert_count // groups_of(layout)} experts per group = {grouped_limit(layout)}"
        )
    value = model.get(key)
    if value is None:
        problems.append(f"the file has no {key}")
    elif hasattr(value, "__len__") and layout.architecture not in PER_LAYER_READERS:
        problems.append(
            f"{key} is a per-layer array, of which {layout.architecture} reads only the first value "
            f"({int(value[0])}); ggufcarve does not rewrite it"
        )
    return problems


def check_experts_used(model: GGUFModel, layout: MoeLayout, used: int) -> None:
    """Raise BadInput (the first problem, one line) unless llama.cpp accepts N used experts."""
    problems = experts_used_problems(model, layout, used)
    if problems:
        raise BadInput(problems[0], EXPERTS_USED_HINT)


def expert_width(layout: MoeLayout) -> int:
    """The width of one expert's FFN as its tensors have it (ffn_down_exps: n_ff_exp x n_embd x n_expert)."""
    widths = {t.shape[0] for t in layout.expert_tensors.values() if t.name.endswith(f".{DOWN_EXPS}.weight")}
    if len(widths) != 1:
        raise BadInput(
            f"the expert width cannot be read from the tensors: {DOWN_EXPS} widths {sorted(widths)}",
            f"the file needs {expert_width_key(layout)}; write it with the converter that made the file",
        )
    return widths.pop()


def experts_used_records(model: GGUFModel, layout: MoeLayout, used: int) -> dict[str, KeyValue]:
    """The header records of a copy routed to N experts: `{arch}.expert_used_count` (a uint32, or the
    per-layer array with every MoE layer's entry N) and, where the file lacks it,
    `{arch}.expert_feed_forward_length` with the width the tensors have. N is one check_experts_used
    accepted (plan_prune checks it first)."""
    key = used_count_key(layout)
    current = model.metadata.kv_index[key]
    if current.value_type == GGUFValueType.ARRAY:
        values = [used if int(v) else 0 for v in current.value]
        records = {key: make_kv(key, GGUFValueType.ARRAY, values, current.item_type)}
    else:
        records = {key: make_kv(key, GGUFValueType.UINT32, used)}
    if model.get(expert_width_key(layout)) is None:
        width_key = expert_width_key(layout)
        records[width_key] = make_kv(width_key, GGUFValueType.UINT32, expert_width(layout))
    return records


def experts_used_overrides(model: GGUFModel, layout: MoeLayout, used: int) -> tuple[tuple[str, int], ...]:
    """The load-time overrides (llama.devices.Compute.kv_overrides, --override-kv KEY=int:N) that route
    this file to N experts as the file `experts_used_records` writes would: `{arch}.expert_used_count`
    and, where the file lacks it, `{arch}.expert_feed_forward_length` at the tensors' width. None at
    the file's own N. A per-layer array is not replaced at load (an override is one value)."""
    check_experts_used(model, layout, used)
    key = used_count_key(layout)
    if model.metadata.kv_index[key].value_type == GGUFValueType.ARRAY:
        raise BadInput(
            f"{key} is a per-layer array: an override at load replaces it by one value",
            f"write a file routed to N experts instead (ggufcarve topk MODEL {used} -o OUT)",
        )
    if used == layout.expert_used_count:
        return ()
    overrides = [(key, used)]
    if model.get(expert_width_key(layout)) is None:
        overrides.append((expert_width_key(layout), expert_width(layout)))
    return tuple(overrides)


def used_count(model: GGUFModel) -> int | None:
    """The file's experts per token (the first entry of a per-layer array: what llama.cpp's graphs read); None
    without one."""
    value = model.get(Keys.LLM.EXPERT_USED_COUNT.format(arch=model.get(Keys.General.ARCHITECTURE)))
    if value is None:
        return None
    return int(value[0]) if hasattr(value, "__len__") else int(value)


def trained_experts_used(model: GGUFModel) -> int | None:
    """The file's experts per token as trained: the value `prune --topk` / `topk` recorded, else its own count."""
    recorded = model.get(TRAINED_KEY)
    return int(recorded) if recorded is not None else used_count(model)


def with_experts_used(layout: MoeLayout, used: int) -> MoeLayout:
    """The layout as a file routed to N experts describes it (the kept-count rules then hold K >= N)."""
    return dataclasses.replace(layout, expert_used_count=used)
