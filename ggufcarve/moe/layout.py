"""The Mixture-of-Experts layout of a GGUF model: which tensors carry the expert axis, per block.

In every expert-axis tensor the expert axis is the last ggml dimension (ne[-1]), the outermost in
storage, so expert e of a tensor is the contiguous byte range [e * slab, (e + 1) * slab) with
slab = nbytes / n_expert. Architecture knowledge lives in the tables below, not in code paths;
how tokens are routed is read from the file's keys (moe/routing.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gguf.constants import MODEL_TENSOR, Keys

from ggufcarve.errors import BadInput, UnsupportedModel
from ggufcarve.gguf.container import GGUFModel, TensorInfo
from ggufcarve.moe.routing import BLOCK_PREFIX, SELECTION_BIAS_SUFFIXES, Routing, routing_of, tensor_base

# Block tensor names without "blk.N." and the ".weight"/".bias"/... kind, as gguf-py's
# TENSOR_NAMES spells them (src/llama-arch.cpp's LLM_TENSOR_NAMES).
ROUTER = tensor_base(MODEL_TENSOR.FFN_GATE_INP)  # ffn_gate_inp
GATE_EXPS = tensor_base(MODEL_TENSOR.FFN_GATE_EXP)  # ffn_gate_exps
UP_EXPS = tensor_base(MODEL_TENSOR.FFN_UP_EXP)  # ffn_up_exps
DOWN_EXPS = tensor_base(MODEL_TENSOR.FFN_DOWN_EXP)  # ffn_down_exps
GATE_UP_EXPS = tensor_base(MODEL_TENSOR.FFN_GATE_UP_EXP)  # ffn_gate_up_exps: gate rows, then up rows
EXPERT_WEIGHTS = (GATE_EXPS, UP_EXPS, DOWN_EXPS, GATE_UP_EXPS)
# src/llama-arch.cpp names that gguf-py 0.19 does not have (deepseek4)
SELECTION_BIAS_VL = "exp_probs_b_vl"
TOKEN_TO_EXPERT = "ffn_gate_tid2eid"

# Tensor name suffix after "blk.N." -> role. Every one of these has ne[-1] == n_expert.
EXPERT_AXIS_ROLES: dict[str, str] = {
    f"{ROUTER}.weight": "router",
    f"{ROUTER}.bias": "router bias",
    **{suffix: "selection bias" for suffix in SELECTION_BIAS_SUFFIXES},  # hy-v3 names it without ".bias"
    f"{SELECTION_BIAS_VL}.bias": "selection bias",
}
for _base in EXPERT_WEIGHTS:
    EXPERT_AXIS_ROLES[f"{_base}.weight"] = "expert weight"
    EXPERT_AXIS_ROLES[f"{_base}.bias"] = "expert bias"
    EXPERT_AXIS_ROLES[f"{_base}.scale"] = "expert scale"
    EXPERT_AXIS_ROLES[f"{_base}.input_scale"] = "expert scale"

# Expert-related tensors that must not be sliced along a last axis; pruning them needs more than
# copying byte ranges, so a model carrying them is refused.
REFUSED_SUFFIXES: dict[str, str] = {
    f"{TOKEN_TO_EXPERT}.weight": "stores expert ids as values (deepseek4 token-id routing); "
    "slicing would leave ids pointing at dropped experts",
    **{
        f"{tensor_base(t)}.weight": "is a grovemoe chunk-expert tensor whose chunks are tied to expert groups"
        for t in (MODEL_TENSOR.FFN_GATE_CHEXP, MODEL_TENSOR.FFN_UP_CHEXP, MODEL_TENSOR.FFN_DOWN_CHEXP)
    },
}

# Names that look expert-related but carry no expert axis (shared experts, per-layer norms).
NOT_EXPERT_AXIS = re.compile(r"_shexp|^ffn_norm_exps\.")
# Anything else matching this inside a MoE block has an unknown expert role and is refused.
LOOKS_EXPERT_RELATED = re.compile(r"exps|exp_probs|gate_inp|tid2eid")

BLOCK_TENSOR = re.compile(r"^blk\.(?P<block>\d+)\.(?P<suffix>.+)$")


def block_tensor(block: int, base: str, kind: str = "weight") -> str:
    """A block tensor's name: block_tensor(3, DOWN_EXPS) -> "blk.3.ffn_down_exps.weight"."""
    return f"{BLOCK_PREFIX.format(bid=block)}{base}.{kind}"


def expert_weight_block(name: str) -> int | None:
    """The block of an expert weight's name (blk.N.ffn_{gate,up,down,gate_up}_exps.weight, the
    MUL_MAT_ID matrices whose inputs llama-imatrix collects per expert); None for any other name."""
    match = BLOCK_TENSOR.match(name)
    return int(match["block"]) if match and EXPERT_AXIS_ROLES.get(match["suffix"]) == "expert weight" else None


@dataclass(frozen=True)
class ExpertTensor:
    name: str
    block: int
    role: str
    shape: tuple[int, ...]
    type_name: str
    nbytes: int
    bytes_per_expert: int


@dataclass(frozen=True)
class MoeLayer:
    block: int
    is_mtp: bool
    tensors: tuple[ExpertTensor, ...]

    @property
    def label(self) -> str:
        return f"blk.{self.block}" + (" (MTP)" if self.is_mtp else "")


@dataclass(frozen=True)
class MoeLayout:
    architecture: str
    block_count: int
    nextn_layers: int  # trailing MTP/NextN blocks, included in block_count
    expert_count: int
    expert_used_count: int  # the largest per-layer value
    group_count: int  # 0 or 1: ungrouped routing
    group_used_count: int
    shared_expert_count: int
    leading_dense_blocks: int
    layers: tuple[MoeLayer, ...]
    total_bytes: int  # tensor data of the whole model
    expert_bytes: int  # tensor data along the expert axis
    routing: Routing
    described_by: str = "model"  # "model", or "imatrix": blocks and expert count read from an imatrix alone

    @property
    def main_layer_count(self) -> int:
        return self.block_count - self.nextn_layers

    @property
    def blocks(self) -> tuple[int, ...]:
        return tuple(layer.block for layer in self.layers)

    def is_mtp(self, block: int) -> bool:
        return block >= self.main_layer_count

    @property
    def expert_tensors(self) -> dict[str, ExpertTensor]:
        return {t.name: t for layer in self.layers for t in layer.tensors}

    def to_json(self) -> dict[str, Any]:
        return {
            "architecture": self.architecture,
            "block_count": self.block_count,
            "nextn_predict_layers": self.nextn_layers,
            "expert_count": self.expert_count,
            "expert_used_count": self.expert_used_count,
            "expert_group_count": self.group_count,
            "expert_group_used_count": self.group_used_count,
            "expert_shared_count": self.shared_expert_count,
            "leading_dense_block_count": self.leading_dense_blocks,
            "routing": self.routing.to_json(),
            "total_tensor_bytes": self.total_bytes,
            "expert_tensor_bytes": self.expert_bytes,
            "moe_layers": [
                {
                    "block": layer.block,
                    "mtp": layer.is_mtp,
                    "tensors": [
                        {
                            "name": t.name,
                            "role": t.role,
                            "shape": list(t.shape),
                            "type": t.type_name,
                            "bytes": t.nbytes,
                            "bytes_per_expert": t.bytes_per_expert,
                        }
                        for t in layer.tensors
                    ],
                }
                for layer in self.layers
            ],
        }


def _u32(model: GGUFModel, key: str, default: int = 0) -> int:
    value = model.get(key)
    if value is None:
        return default
    try:
        return int(max(value)) if hasattr(value, "__len__") else int(value)
    except (TypeError, ValueError):
        raise BadInput(
            f"{model.path}: key {key} has a non-integer value {value!r}", "the file's metadata is corrupt"
        ) from None


def _vocab_size(model: GGUFModel, arch: str) -> int:
    """{arch}.vocab_size, else the length of tokenizer.ggml.tokens (llama.cpp's order)."""
    size = model.get(Keys.LLM.VOCAB_SIZE.format(arch=arch))
    if size is not None:
        return int(size)
    tokens = model.get(Keys.Tokenizer.LIST)
    return len(tokens) if tokens is not None else 0


def expert_role(suffix: str) -> str | None:
    """The role of a block tensor (name after "blk.N."), None if it has no expert axis.

    Raises UnsupportedModel for tensors that carry experts in a way byte slicing cannot prune.
    """
    if suffix in EXPERT_AXIS_ROLES:
        return EXPERT_AXIS_ROLES[suffix]
    if suffix in REFUSED_SUFFIXES:
        raise UnsupportedModel(
            f"tensor {suffix} {REFUSED_SUFFIXES[suffix]}",
            "ggufcarve cannot prune this architecture yet; no file was written",
        )
    if LOOKS_EXPERT_RELATED.search(suffix) and not NOT_EXPERT_AXIS.search(suffix):
        raise UnsupportedModel(
            f"tensor {suffix} looks expert-related but its role is unknown to ggufcarve",
            "refusing rather than risk a broken file; report the architecture so its tensors can be added to moe.py",
        )
    return None


def inspect_layout(model: GGUFModel) -> MoeLayout:
    """The MoE layout of `model`; raises UnsupportedModel for dense or unsafe models."""
    arch = model.get(Keys.General.ARCHITECTURE)
    if not isinstance(arch, str):
        raise BadInput(f"{model.path}: no {Keys.General.ARCHITECTURE} key", "this is not a llama.cpp model file")

    def key(template: str) -> str:
        return template.format(arch=arch)

    expert_count = _u32(model, key(Keys.LLM.EXPERT_COUNT))
    if expert_count < 2:
        raise UnsupportedModel(
            f"{model.path}: {arch} model has no routed experts "
            f"({key(Keys.LLM.EXPERT_COUNT)} is {expert_count or 'absent'})",
            "expert pruning needs a Mixture-of-Experts model",
        )
    block_count = _u32(model, key(Keys.LLM.BLOCK_COUNT))
    nextn = _u32(model, key(Keys.LLM.NEXTN_PREDICT_LAYERS))

    per_block: dict[int, list[ExpertTensor]] = {}
    for tensor in model.tensors:
        match = BLOCK_TENSOR.match(tensor.name)
        if not match:
            continue
        block, suffix = int(match["block"]), match["suffix"]
        try:
            role = expert_role(suffix)
        except UnsupportedModel as err:
            raise UnsupportedModel(f"{model.path}: blk.{block}.{err.message}", err.hint) from None
        if role is None:
            continue
        per_block.setdefault(block, []).append(_expert_tensor(model, tensor, block, role, expert_count))

    if not per_block:
        raise UnsupportedModel(
            f"{model.path}: {key(Keys.LLM.EXPERT_COUNT)} is {expert_count} but no tensor carries an expert axis",
            "the model is dense or its expert tensors are named in a way ggufcarve does not know",
        )
    layers = []
    for block in sorted(per_block):
        tensors = tuple(per_block[block])
        roles = {t.role for t in tensors}
        if "router" not in roles or "expert weight" not in roles:
            raise UnsupportedModel(
                f"{model.path}: blk.{block} has expert tensors but "
                f"{'no router (ffn_gate_inp.weight)' if 'router' not in roles else 'no expert weights'}",
                "the file is incomplete or uses an unknown layout",
            )
        if block >= block_count:
            raise BadInput(
                f"{model.path}: tensor blk.{block}.* is beyond {key(Keys.LLM.BLOCK_COUNT)}={block_count}",
                "the file's metadata is corrupt",
            )
        layers.append(MoeLayer(block, block >= block_count - nextn, tensors))

    expert_bytes = sum(t.nbytes for layer in layers for t in layer.tensors)
    return MoeLayout(
        architecture=arch,
        block_count=block_count,
        nextn_layers=nextn,
        expert_count=expert_count,
        expert_used_count=_u32(model, key(Keys.LLM.EXPERT_USED_COUNT)),
        group_count=_u32(model, key(Keys.LLM.EXPERT_GROUP_COUNT)),
        group_used_count=_u32(model, key(Keys.LLM.EXPERT_GROUP_USED_COUNT)),
        shared_expert_count=_u32(
            model, key(Keys.LLM.EXPERT_SHARED_COUNT), default=int(any("_shexp." in t.name for t in model.tensors))
        ),
        leading_dense_blocks=_u32(model, key(Keys.LLM.LEADING_DENSE_BLOCK_COUNT)),
        layers=tuple(layers),
        total_bytes=sum(t.nbytes for t in model.tensors),
        expert_bytes=expert_bytes,
        routing=routing_of(
            model.get, arch, (t.name for t in model.tensors), block_count - nextn, _vocab_size(model, arch)
        ),
    )


def _expert_tensor(model: GGUFModel, tensor: TensorInfo, block: int, role: str, expert_count: int) -> ExpertTensor:
    if tensor.shape[-1] != expert_count:
        raise UnsupportedModel(
            f"{model.path}: {tensor.name} has shape {list(tensor.shape)} "
            f"whose last axis is not expert_count={expert_count}",
            "the tensor's layout is not the one llama.cpp loads; no file was written",
        )
    if tensor.nbytes % expert_count:
        raise UnsupportedModel(
            f"{model.path}: {tensor.name} has {tensor.nbytes} bytes, not divisible into {expert_count} experts",
            "the file is corrupt",
        )
    return ExpertTensor(
        tensor.name, block, role, tensor.shape, tensor.type_name, tensor.nbytes, tensor.nbytes // expert_count
    )
