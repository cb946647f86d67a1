"""A keep-set scored without writing a file: the pruned experts taken out of llama.cpp's routing.

    mask = RoutingMask(dict(keepset.layers))
    context = engine.context(512, eval_callback=mask)   # evaluate.engine; the measure child does this
    mask.keep = dict(other_keepset.layers)              # another keep-set, the same loaded model

A pruned file routes among its kept experts only: a pruned expert is never selected and never
part of a normalisation. The same graph on the unpruned model computes that when, per MoE block,
the scores of the pruned experts are -inf where build_moe_ffn (src/llama-graph.cpp of the
llama.cpp in llama-cpp-python 0.3.36) reads them:
    ffn_moe_logits        router logits [n_expert, n_tokens]: every gating function maps -inf
                          to a weight of 0 (softmax: exp(-inf) = 0, so the softmax normalises over
                          the kept experts; sigmoid, sqrt(softplus): 0) and the router bias
                          (ffn_moe_logits_biased) keeps it -inf;
    ffn_moe_probs_biased  selection scores = probs + exp_probs_b (sigmoid gating with a selection
                          bias): the bias is added after the gating function, so a pruned expert's
                          score would be its bias; -inf again. The weights read the unbiased probs
                          (ffn_moe_probs) of the selected experts only.
Grouped routing (n_expert_groups > 1) then scores each group by the sum of its two best selection
scores, among kept experts only when every group keeps at least two (the load rule of a pruned
file, moe/keepset.py), as the pruned file's groups hold exactly the kept experts of each group.
Top-k picks kept experts only while a block keeps at least n_expert_used, which every loadable
keep-set does.

Precision (tests/test_masking.py, against the pruned files in llama.cpp): bit-identical logits
for sigmoid gating, softmax over the selected weights (gpt-oss) and, as measured, renormalised
softmax (qwen3moe, qwen35moe); softmax gating sums exp() in SIMD lanes (ggml_vec_soft_max_f32),
where the -inf entries regroup the sum, so its last bit may differ from the pruned file's:
DeepSeek-V2 routing (softmax, no renormalisation, weights x16) differs by up to 1.5e-3 in the
logits of an F16 fixture, less than decoding in another micro-batch size moves them. On the
trained demo model (renormalised softmax, Q8_0, 16 experts) the same last-bit regrouping reaches
some rows: at reap-8, 182 of 508 scored rows differed by up to 0.046 in a logit, and the mean KLD
against the unpruned model agreed with the pruned file's to 1.2e-5 relative over 16 chunks
(tests/test_tune.py holds 1e-4).

Architectures whose graph names no `ffn_moe_logits-N` node (or no `ffn_moe_probs_biased-N` where
the block has a selection bias) cannot be masked: `required_nodes` names the nodes a keep-set
needs, and the measure layer (measure/tournament.py) refuses a keep-set whose nodes were not masked
(score the keep-set by pruning a file instead).

The mask is an eval callback (ggml_backend_sched_eval_callback): the scheduler computes the graph
up to an observed node, synchronises the backend, calls the callback with ask=False, then computes
the nodes that depend on it (ggml_backend_sched_compute_splits in ggml/src/ggml-backend.cpp).
On the CPU backend the node lies in a host buffer and is written in place; in a device buffer
(a GPU build) it is copied out, masked and written back (`llama.ggml.copy_out`, `copy_in`). `RoutingMask` is
the eval callback of the evaluation engine's contexts (`evaluate.engine`, used by the measure
child); its keep-set can be replaced between decodes (`keep`), so one loaded model scores any
number of keep-sets.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ggufcarve.llama.ggml import copy_in, copy_out, in_host_memory, tensor_at
from ggufcarve.llama.trace import parse_node_name
from ggufcarve.moe.keepset import KeepSet
from ggufcarve.moe.layout import MoeLayout

ROUTER_LOGITS = "ffn_moe_logits"
SELECTION_SCORES = "ffn_moe_probs_biased"
MASKED_NODES = frozenset({ROUTER_LOGITS, SELECTION_SCORES})
F32 = 0  # enum ggml_type GGML_TYPE_F32


@dataclass
class RoutingMask:
    """The eval callback that writes -inf into the routing scores of the experts a keep-set drops.

    `keep`: block -> kept expert ids (blocks not listed are left alone); `masked` counts the
    writes per "<node>:<block>". Never raises inside the callback: what went wrong is kept in
    `errors` (the decode child stops on it)."""

    keep: dict[int, tuple[int, ...]] = field(default_factory=dict)
    nodes: frozenset[str] = MASKED_NODES
    masked: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def __call__(self, address: int, ask: bool, _user_data: object) -> bool:
        try:
            t = tensor_at(address)
            parsed = parse_node_name(t.label)
            if parsed is None or parsed[0] not in self.nodes or parsed[1] not in self.keep:
                return not ask
            if ask:
                return True
            self._mask(address, t, f"{parsed[0]}:{parsed[1]}", self.keep[parsed[1]])
        except BaseException as err:
            if len(self.errors) < 20:
                self.errors.append(f"{type(err).__name__}: {err}")
        return True

    def _mask(self, address: int, t: Any, key: str, kept: Sequence[int]) -> None:
        if int(t.type) != F32:
            raise TypeError(f"{t.label!r} has ggml type {t.type}, not F32")
        n_expert, n_tokens = int(t.ne[0]), int(t.ne[1])
        if int(t.ne[2]) != 1 or int(t.ne[3]) != 1 or int(t.nb[0]) != 4:
            raise ValueError(f"{t.label!r} has extents {list(t.ne)} and strides {list(t.nb)}, not [n_expert, n_tokens]")
        if n_tokens == 0:
            return
        span = (n_tokens - 1) * int(t.nb[1]) + n_expert * 4
        in_place = in_host_memory(t)  # else (a device buffer): copied out, masked, written back through the backend
        raw: Any = (ctypes.c_char * span).from_address(t.data) if in_place else copy_out(address, span)
        scores = np.ndarray((n_tokens, n_expert), dtype=np.float32, buffer=raw, strides=(int(t.nb[1]), 4))
        dropped = np.ones(n_expert, dtype=bool)
        dropped[list(kept)] = False
        scores[:, dropped] = -np.inf
        if not in_place:
            copy_in(address, raw, span)
        self.masked[key] = self.masked.get(key, 0) + 1

    def decoded(self) -> None:
        """Nothing is kept between decode calls."""

    def arrays(self) -> dict[str, Any]:
        """How many times each node was masked: "<node>:<block>" -> count."""
        return {key: np.asarray(count) for key, count in sorted(self.masked.items())}


def required_nodes(layout: MoeLayout, keepset: KeepSet) -> list[tuple[str, int]]:
    """The (node, block) pairs a decode must mask for `keepset`: the router logits of every block
    llama.cpp's decode graph runs (not MTP blocks) that drops an expert, and the selection scores
    where the block has a selection bias."""
    needed = []
    for layer in layout.layers:
        if layer.is_mtp or len(keepset.layers.get(layer.block, ())) >= layout.expert_count:
            continue
        needed.append((ROUTER_LOGITS, layer.block))
        if any(t.role == "selection bias" for t in layer.tensors):
            needed.append((SELECTION_SCORES, layer.block))
    return needed
