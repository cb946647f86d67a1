"""How llama.cpp routes a token through a MoE block of a given file: gating, selection, weights.

`build_moe_ffn` (src/llama-graph.cpp) computes, per token (graph node names in brackets):
    probs     = gating(router logits)                                [ffn_moe_probs]
    selection = probs + exp_probs_b, when the block has that tensor  [ffn_moe_probs_biased]
    with {arch}.expert_group_count > 1: only the {arch}.expert_group_used_count groups (contiguous
    index ranges) with the largest sum of their two best selection scores stay selectable
    top-k of selection                                               [ffn_moe_topk]
    weights   = probs of the top-k                                   [ffn_moe_weights]
    softmax over the k weights, for gating 3                         [ffn_moe_weights_softmax]
    weights / sum(weights), when normalised                          [ffn_moe_weights_norm]
    weights * scale, when scale is neither 0 nor 1                   [ffn_moe_weights_scaled]
Gating functions are `llama_expert_gating_func_type` (src/llama-hparams.h): 1 softmax, 2 sigmoid,
3 softmax of the selected logits, 4 sqrt(softplus).

Which of gating, normalisation and scale an architecture reads from the file
(`{arch}.expert_gating_func`, `{arch}.expert_weights_norm`, `{arch}.expert_weights_scale`) and
which its graph fixes is stated per architecture in src/models/<arch>.cpp; `ARCHITECTURES` holds
exactly that, including the default llama.cpp applies when the file omits a key it reads.
Expert groups and the selection bias are read from every file (llama-model.cpp, load_hparams;
the `exp_probs_b` tensor). `routing_of` combines the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gguf.constants import MODEL_TENSOR, TENSOR_NAMES, ExpertGatingFuncType, Keys

SOFTMAX, SIGMOID = int(ExpertGatingFuncType.SOFTMAX), int(ExpertGatingFuncType.SIGMOID)
SOFTMAX_WEIGHT, SQRT_SOFTPLUS = 3, 4  # llama-hparams.h values that gguf-py 0.19 does not name
# gguf-py's names of the gating functions it knows, llama.cpp's for the others
GATING_NAMES: dict[int, str] = {int(g): g.name.lower() for g in ExpertGatingFuncType}
GATING_NAMES.setdefault(SOFTMAX_WEIGHT, "softmax_weight")
GATING_NAMES.setdefault(SQRT_SOFTPLUS, "sqrtsoftplus")


BLOCK_PREFIX = "blk.{bid}."  # of every block tensor in gguf-py's TENSOR_NAMES


def tensor_base(tensor: MODEL_TENSOR) -> str:
    """gguf-py's name of a block tensor without "blk.N.": tensor_base(FFN_GATE_INP) -> "ffn_gate_inp"."""
    name = TENSOR_NAMES[tensor]
    if not name.startswith(BLOCK_PREFIX):
        raise ValueError(f"{tensor.name} is not a block tensor in gguf-py ({name})")
    return name.removeprefix(BLOCK_PREFIX)


SELECTION_BIAS = tensor_base(MODEL_TENSOR.FFN_EXP_PROBS_B)  # exp_probs_b
SELECTION_BIAS_SUFFIXES = (f"{SELECTION_BIAS}.bias", SELECTION_BIAS)


@dataclass(frozen=True)
class ArchitectureRouting:
    """What one architecture's llama.cpp graph takes from the file and what it fixes.

    gating / normalises: the value the graph passes to build_moe_ffn, or None when it passes the
    hparam read from the file's key; gating_default / normalises_default: the hparam when the key
    is absent (gating_default None: llama.cpp has no default and refuses or aborts);
    reads_scale: whether {arch}.expert_weights_scale is read (otherwise the scale is 0: none).
    """

    gating: int | None
    normalises: bool | None
    reads_scale: bool
    gating_default: int | None = None
    normalises_default: bool = False


_FIXED_SOFTMAX_NORMALISED = ArchitectureRouting(SOFTMAX, True, False)
_FIXED_SOFTMAX_PLAIN = ArchitectureRouting(SOFTMAX, False, False)
_FROM_KEYS = ArchitectureRouting(None, None, True)

# GGUF architecture name -> what src/models/<arch>.cpp does (llama.cpp of llama-cpp-python 0.3.36).
ARCHITECTURES: dict[str, ArchitectureRouting] = {
    **{
        arch: _FIXED_SOFTMAX_NORMALISED
        for arch in (
            "qwen3moe",
            "qwen35moe",
            "qwen3next",
            "qwen3vlmoe",
            "llama",
            "granitemoe",
            "hunyuan-moe",
            "ernie4_5-moe",
            "phimoe",
            "dbrx",
            "arctic",
            "grok",
            "minimax-01",
        )
    },
    **{arch: _FIXED_SOFTMAX_PLAIN for arch in ("qwen2moe", "olmoe", "jamba", "llada-moe")},
    "gpt-oss": ArchitectureRouting(SOFTMAX_WEIGHT, False, False),
    "llama4": ArchitectureRouting(SIGMOID, False, False),
    "deepseek": ArchitectureRouting(SOFTMAX, False, True),
    "bailingmoe": ArchitectureRouting(SOFTMAX, None, True),
    # DeepSeek-V2/V2.5 files predate the gating key: softmax (GLM-4.7-Lite shapes aside, see below)
    "deepseek2": ArchitectureRouting(None, None, True, gating_default=SOFTMAX),
    "glm4moe": ArchitectureRouting(None, None, True, gating_default=SIGMOID),
    "step35": ArchitectureRouting(None, None, True, gating_default=SIGMOID),
    "afmoe": ArchitectureRouting(None, None, True, gating_default=SIGMOID),
    "cohere2moe": ArchitectureRouting(None, None, True, gating_default=SIGMOID),
    "dots1": _FROM_KEYS,
    "bailingmoe2": _FROM_KEYS,
    "exaone-moe": _FROM_KEYS,
    "minimax-m2": ArchitectureRouting(None, True, False),
    "smallthinker": ArchitectureRouting(None, True, False),
    "kimi-linear": ArchitectureRouting(None, True, True),
}
# src/models/deepseek2.cpp: a deepseek2 file without the gating key and 47 or 48 main blocks with a
# 154880-token vocabulary is GLM-4.7-Lite, which gates with a sigmoid.
DEEPSEEK2_SIGMOID_SHAPES = ({47, 48}, 154880)


@dataclass(frozen=True)
class Routing:
    """The routing of one file as llama.cpp will run it."""

    gating: int | None  # a llama_expert_gating_func_type; None: unknown
    gating_source: str  # "key", "architecture default", "fixed by the architecture", "unknown"
    normalised: bool | None  # top-k weights divided by their sum; None: unknown
    scale: float  # multiplies the weights when neither 0 nor 1
    selection_bias: bool  # exp_probs_b adds to the scores used to select, not to the weights
    group_count: int  # 0 or 1: no groups
    group_used_count: int
    known_architecture: bool

    @property
    def gating_name(self) -> str:
        return "unknown" if self.gating is None else GATING_NAMES.get(self.gating, f"gating {self.gating}")

    @property
    def scaled(self) -> bool:
        return self.scale not in (0.0, 1.0)

    @property
    def keeps_outputs(self) -> bool:
        """The selected experts' weights do not depend on the other experts' scores, so a token
        whose top-k holds no dropped expert keeps its weights. (Selection can still change with
        expert groups when a dropped expert was among a group's two best.)"""
        if self.gating is None or not self.known_architecture:
            return False
        return self.gating != SOFTMAX or bool(self.normalised)

    @property
    def grouped(self) -> bool:
        return self.group_count > 1

    def describe(self) -> str:
        """One line, e.g. "sigmoid (expert_gating_func=2): selection bias exp_probs_b; 8 groups, best 4 by top-2 sum;
        ..."."""
        if self.gating is None:
            head = "unknown gating" + ("" if self.known_architecture else " (architecture not in ggufcarve's table)")
        else:
            source = {
                "key": f"expert_gating_func={self.gating}",
                "architecture default": "default: no expert_gating_func",
                "fixed by the architecture": "fixed by the architecture",
            }.get(self.gating_source, self.gating_source)
            head = f"{self.gating_name} ({source})"
        parts = []
        if self.selection_bias:
            parts.append("selection bias exp_probs_b")
        if self.grouped:
            parts.append(f"{self.group_count} groups, best {self.group_used_count} by top-2 sum")
        if self.normalised is None:
            parts.append("weight normalisation unknown")
        elif self.gating == SOFTMAX_WEIGHT:
            parts.append("softmax over the top-k")
        else:
            parts.append("top-k weights renormalised" if self.normalised else "top-k weights not renormalised")
        if self.scaled:
            parts.append(f"scaled by {self.scale:g}")
        if not self.keeps_outputs and self.gating is not None and self.known_architecture:
            parts.append("dropping experts changes the kept experts' weights")
        return f"{head}: " + "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "gating": self.gating_name,
            "gating_func": self.gating,
            "gating_source": self.gating_source,
            "weights_normalised": self.normalised,
            "weights_scale": self.scale,
            "selection_bias": self.selection_bias,
            "expert_group_count": self.group_count,
            "expert_group_used_count": self.group_used_count,
            "keeps_outputs_of_unaffected_tokens": self.keeps_outputs,
            "description": self.describe(),
        }


def _key(arch: str, template: str) -> str:
    return template.format(arch=arch)


def routing_of(get: Any, arch: str, tensor_names: Any, main_block_count: int, vocab_size: int) -> Routing:
    """The routing of a file: `get(key)` reads its metadata (None when absent)."""
    table = ARCHITECTURES.get(arch)
    gating_key = get(_key(arch, Keys.LLM.EXPERT_GATING_FUNC))
    norm_key = get(_key(arch, Keys.LLM.EXPERT_WEIGHTS_NORM))
    scale_key = get(_key(arch, Keys.LLM.EXPERT_WEIGHTS_SCALE))

    gating: int | None
    if table is None:
        gating, source = (int(gating_key), "key") if gating_key else (None, "unknown")
        normalised = bool(norm_key) if norm_key is not None else None
        scale = float(scale_key or 0.0)
    else:
        if table.gating is not None:
            gating, source = table.gating, "fixed by the architecture"
        elif gating_key:  # 0 is LLAMA_EXPERT_GATING_FUNC_TYPE_NONE: treated as absent
            gating, source = int(gating_key), "key"
        elif (
            arch == "deepseek2"
            and main_block_count in DEEPSEEK2_SIGMOID_SHAPES[0]
            and vocab_size == DEEPSEEK2_SIGMOID_SHAPES[1]
        ):
            gating, source = SIGMOID, "architecture default"
        elif table.gating_default is not None:
            gating, source = table.gating_default, "architecture default"
        else:
            gating, source = None, "unknown"
        normalised = (
            table.normalises
            if table.normalises is not None
            else (bool(norm_key) if norm_key is not None else table.normalises_default)
        )
        scale = float(scale_key or 0.0) if table.reads_scale else 0.0

    names = list(tensor_names)
    bias = any(n.startswith("blk.") and n.split(".", 2)[-1] in SELECTION_BIAS_SUFFIXES for n in names)
    group_count = int(get(_key(arch, Keys.LLM.EXPERT_GROUP_COUNT)) or 0)
    group_used = int(get(_key(arch, Keys.LLM.EXPERT_GROUP_USED_COUNT)) or 0)
    return Routing(gating, source, normalised, scale, bias, group_count, group_used, table is not None)


# The routing of a layout read from an imatrix alone: nothing about gating is known.
UNKNOWN_ROUTING = Routing(None, "unknown", None, 0.0, False, 0, 0, False)
