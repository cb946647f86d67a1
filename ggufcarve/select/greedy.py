"""`greedy`: per MoE block, backward elimination on the block's own routed output over the
calibration tokens.

    error(S) = mean over tokens t of ||y_t - y_S,t||^2

y_t is the block's routed output in the full model, sum_j w_tj f_{e_tj}(x_t) over the k experts
llama.cpp selected (`route` over all experts reproduces llama.cpp's ffn_moe_out to 1.5e-7 of its
largest element on the F32 fixtures; shared experts are not routed and cancel out); y_S,t is the output when the
router picks top-k among the experts of S only, as a file keeping S computes it (build_moe_ffn,
src/llama-graph.cpp; `route`):
    probs     softmax gating: the softmax over S (ffn_moe_probs / their sum over S); sigmoid,
              sqrt(softplus): unchanged; softmax of the selected logits (gpt-oss): the logits
    selection probs (+ exp_probs_b), -inf outside S; with expert groups, the group_used groups
              with the largest sum of their two best selection scores among S stay selectable
    top-k of the selection; weights = probs of the top-k, softmax over them for gating 3,
              / max(sum, 6.103515625e-5) when normalised, x the scale when neither 0 nor 1.
f_e(x_t) is llama.cpp's own ffn_moe_down (+ the down bias) for the pairs the full model selected;
the pairs rerouting reaches are evaluated by ggml's own ggml_mul_mat_id on the quantized weights
(`select.experts.ExpertEvaluator`, engine "ggml": llama.cpp's ffn_moe_down bit for bit, the
engine RAZOR's refill uses too) on the traced MoE input, once, and cached.

Elimination: from S = all experts, at each step the expert whose removal raises error(S) least
leaves S, until no smaller S is loadable (K = expert_used_count, or with grouped routing the
smallest K the load rules of moe/kept.py allow). With grouped routing the candidates of a step are
the experts of the groups holding the most experts of S, so that the groups stay balanced (their
counts differ by at most one, equal at every multiple of the group count): top-K by score
within each group (moe/keepset.keep_per_block) is then the elimination's S of size K. Score of an
expert: 1 + the step that removed it (the survivors of the last step: 1 + the number of steps),
so that the top K scores of a block are its greedy S of size K for every loadable K.

Only the tokens whose routing the removal of e can change are recomputed for candidate e: those
that selected e under S, with expert groups also those where e is one of the two best of a
group. For softmax gating without renormalisation the other tokens keep their experts
and their output scales by Z_S / Z_{S-e} (Z the sum of probs over the set), from three dot
products per token; softmax gating with a selection bias has no such shortcut (the bias is added
to the softmax over S, which scales with S, so any removal can reorder any token): every token is
recomputed.

Memory: the traced nodes of every block are held until the decode ends (MoE input, probs, top-k,
the selected experts' outputs: T x (n_embd (1 + k) + n_expert + k) values per block, 4 bytes each,
T the calibration tokens), and while a block is eliminated the expert outputs rerouting reaches
([T, n_expert, n_embd] float32, its pages committed where written). `memory_estimate` bounds the
pass's own peak beyond the same pass without greedy:
    captures   B T (n_embd (1 + k) + E + k) 4                 B the traced MoE blocks
    block      T (E n_embd 4                                   the expert outputs
                  + E (1 + 7 x 8)                              have-mask; probs and the routing of
                                                               every token, [T, E] float64/int64
                  + n_embd (4 + 8 x 8)                         inputs; y, current, residual and
                                                               the combined outputs, float64
                  + s k 64                                     each candidate's top-k and weights,
                                                               the step's (expert, token) keys
                  + r n_embd 8                                 the pairs a step reaches: inputs
                                                               gathered, outputs, float32
                  + threads F 4)                               per evaluating thread one expert's
                                                               gate/up products and activation
    evaluator  min(every expert dequantized, select.experts.CACHE_BYTES + one block's experts)
with s the candidates a token is recomputed for (k; + 2 per group with expert groups; E for
softmax gating with a selection bias), r the new pairs a token reaches per step (1 without groups
and with local routing, else min(E - k, s k)), F = 3 n_ff (gate and up rows, the activation);
one block is eliminated at a time. On the demo model (4 blocks, 16 experts, top-4, n_embd 256,
n_ff 256, 2 threads) that is 64.7 KB per token + 50 MB; measured, the pass's live numpy arrays
(tracemalloc) peaked at 48.6 KB per token at 8,192 tokens and the child's peak resident memory grew
by 56.5 KiB per token from 4,096 to 8,192 tokens (the allocator keeps freed micro-batch captures),
1.04 GB in all at 17,408 tokens against 0.11 GB for the same pass without greedy.

`token_bound` bounds T before the text is tokenized (the decode child tokenizes it): a token
spells at least one byte of its document (the BOS, EOS and a leading-space marker apart; a chat
message's template counted as TEMPLATE_BYTES more), whole --ctx chunks, at most --max-tokens; on
the demo's text 57,600 against the 17,408 tokens it gives. `check_memory` refuses greedy when the
estimate exceeds REFUSE_SHARE of the available memory (`available_memory`: /proc/meminfo
MemAvailable, within what the memory cgroup, v2 or v1, and its ancestors have left below their limits).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ggufcarve.errors import BadInput
from ggufcarve.fileio import format_size
from ggufcarve.llama.calibration import CalibrationFile
from ggufcarve.llama.decode import ConsumerSpec, DecodeRequest
from ggufcarve.llama.trace import GraphTracer
from ggufcarve.moe.kept import groups_of
from ggufcarve.moe.routing import SIGMOID, SOFTMAX, SOFTMAX_WEIGHT, SQRT_SOFTPLUS
from ggufcarve.select.experts import CACHE_BYTES, ExpertEvaluator

NODES = ("ffn_moe_probs", "ffn_moe_input", "ffn_moe_topk", "ffn_moe_down")
WEIGHTS_SUM_FLOOR = 6.103515625e-5  # build_moe_ffn clamps the sum of the top-k weights to it
GATINGS = (SOFTMAX, SIGMOID, SOFTMAX_WEIGHT, SQRT_SOFTPLUS)
COMBINE_ROWS = (
    4096  # tokens per gathered [rows, k, n_embd] block of expert outputs (float32 products, float64 sums of squares)
)


@dataclass(frozen=True)
class Router:
    """What build_moe_ffn does with ffn_moe_probs in one block."""

    expert_count: int
    used: int  # top-k
    gating: int
    normalised: bool
    scale: float
    bias: np.ndarray | None = None  # exp_probs_b [n_expert]
    groups: int = 1
    groups_used: int = 0

    def route(self, probs: np.ndarray, allowed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(top-k [n, k], applied weights [n, k], selection scores [n, E]) of the rows of `probs`
        ([n, E], ffn_moe_probs of the full model) when only the experts `allowed` ([E] bool) exist."""
        p = np.asarray(probs, dtype=np.float64)
        if self.gating == SOFTMAX:
            p = np.where(allowed, p, 0.0)
            p = p / np.maximum(p.sum(axis=1, keepdims=True), np.finfo(np.float64).tiny)
        selection = p + self.bias if self.bias is not None else p.copy()
        selection[:, ~allowed] = -np.inf
        if self.groups > 1:
            by_group = selection.reshape(len(p), self.groups, -1)
            group_scores = np.sort(by_group, axis=2)[:, :, -2:].sum(
                axis=2
            )  # -inf when a group holds fewer than two of S
            chosen = np.argsort(-group_scores, axis=1, kind="stable")[:, : self.groups_used]
            keep = np.zeros((len(p), self.groups), dtype=bool)
            np.put_along_axis(keep, chosen, True, axis=1)
            selection = np.where(np.repeat(keep, self.expert_count // self.groups, axis=1), selection, -np.inf)
        topk = np.argsort(-selection, axis=1, kind="stable")[
            :, : self.used
        ].copy()  # not a view holding the [n, E] argsort
        weights = np.take_along_axis(p, topk, axis=1)
        if self.gating == SOFTMAX_WEIGHT:
            weights = np.exp(weights - weights.max(axis=1, keepdims=True))
            weights /= weights.sum(axis=1, keepdims=True)
        if self.normalised:
            weights = weights / np.maximum(weights.sum(axis=1, keepdims=True), WEIGHTS_SUM_FLOOR)
        if self.scale not in (0.0, 1.0):
            weights = weights * self.scale
        return topk, weights, selection

    @property
    def rescales(self) -> bool:
        """Removing an expert rescales every token's weights (softmax gating, no renormalisation)."""
        return self.gating == SOFTMAX and not self.normalised

    @property
    def local(self) -> bool:
        """Removing an expert changes the selection of the tokens that selected it (or, with groups,
        held it among a selectable group's two best) only."""
        return not (self.gating == SOFTMAX and self.bias is not None)

    def smallest(self) -> int:
        """The smallest loadable number of experts (moe/kept.py's rules)."""
        if self.groups <= 1:
            return max(self.used, 1)
        per_group = max(2, -(-self.used // max(self.groups_used, 1)))
        return per_group * self.groups


def check_routing(layout: Any) -> None:
    """BadInput unless greedy can recompute the model's routing (known gating and normalisation)."""
    routing = layout.routing
    if routing.gating not in GATINGS or routing.normalised is None:
        raise BadInput(
            f"greedy cannot recompute the routing of {layout.architecture} ({routing.describe()})",
            "use reap or frequency",
        )


def router_of(model: Any, layout: Any, block: int) -> Router:
    """The Router of `block` of a model (gating, normalisation, scale, selection bias, groups)."""
    from ggufcarve.gguf.tensors import tensor_values

    check_routing(layout)
    routing = layout.routing
    bias_names = [
        t.name for layer in layout.layers if layer.block == block for t in layer.tensors if t.role == "selection bias"
    ]
    bias = tensor_values(model, bias_names[0]).astype(np.float64).reshape(-1) if bias_names else None
    return Router(
        layout.expert_count,
        layout.expert_used_count,
        routing.gating,
        bool(routing.normalised),
        routing.scale,
        bias,
        groups_of(layout),
        layout.group_used_count,
    )


@dataclass
class BlockOutputs:
    """f_e(x_t) of one block, filled from llama.cpp's captures and evaluated lazily otherwise.

    `values` is one zero-filled [T, E, n_embd] float32 array (token-major: a token's experts are
    gathered from one span): its pages are committed by the operating system only where an output
    is written."""

    block: int
    inputs: np.ndarray  # [T, n_embd] float32
    evaluator: ExpertEvaluator | None
    expert_count: int
    down_bias: np.ndarray | None = None
    evaluated: int = 0  # (token, expert) pairs evaluated by the evaluator

    def __post_init__(self) -> None:
        self.values = np.zeros((len(self.inputs), self.expert_count, self.inputs.shape[1]), np.float32)
        self.have = np.zeros((self.expert_count, len(self.inputs)), dtype=bool)

    def seed(self, topk: np.ndarray, down: np.ndarray) -> None:
        """llama.cpp's ffn_moe_down [T, k, n_embd] of the experts `topk` [T, k] selected."""
        rows = np.broadcast_to(np.arange(len(topk))[:, None], topk.shape)
        self.values[rows, topk] = down if self.down_bias is None else down + self.down_bias[topk]
        self.have[topk, rows] = True

    def ensure(self, rows: np.ndarray, topk: np.ndarray) -> None:
        """Evaluate every (rows[i], topk[i, j]) not held yet, in one batch."""
        pairs = np.stack([topk.reshape(-1), np.broadcast_to(rows[:, None], topk.shape).reshape(-1)])
        pairs = pairs[:, ~self.have[pairs[0], pairs[1]]]
        if not pairs.size:
            return
        keys = np.unique(pairs[0].astype(np.int64) * len(self.inputs) + pairs[1])  # sorted by expert, then token
        pairs = np.stack([keys // len(self.inputs), keys % len(self.inputs)])
        experts, starts = np.unique(pairs[0], return_index=True)
        work = [(int(e), m) for e, m in zip(experts, np.split(pairs[1], starts[1:]))]
        if self.evaluator is None:
            raise RuntimeError("greedy needs the expert evaluator of the model")
        outputs = self.evaluator.outputs_many(self.block, [(e, self.inputs[m]) for e, m in work])
        for (expert, missing), out in zip(work, outputs):
            self.values[missing, expert] = out if self.down_bias is None else out + self.down_bias[expert]
            self.have[expert, missing] = True
            self.evaluated += len(missing)

    def combine(self, rows: np.ndarray, topk: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """sum_j weights[i, j] f_{topk[i, j]}(x_rows[i]): float64 [len(rows), n_embd]."""
        self.ensure(rows, topk)
        out = np.empty((len(rows), self.inputs.shape[1]))
        w32 = weights.astype(np.float32)
        for start in range(0, len(rows), COMBINE_ROWS):
            part = slice(start, start + COMBINE_ROWS)
            out[part] = np.einsum("nk,nkd->nd", w32[part], self.values[rows[part, None], topk[part]])
        return out


@dataclass
class Elimination:
    removed: list[int]  # in the order of removal
    errors: list[float]  # error(S) after each removal
    survivors: list[int]
    evaluated: int  # (token, expert) pairs evaluated in numpy
    seconds: float

    def scores(self, expert_count: int) -> np.ndarray:
        """1 + the removal step; survivors 1 + the number of steps: the top K are S of size K."""
        score = np.full(expert_count, float(len(self.removed) + 1))
        for step, expert in enumerate(self.removed):
            score[expert] = float(step + 1)
        return score


class GreedyBlock:
    """error(S) of one block and its backward elimination."""

    def __init__(self, router: Router, probs: np.ndarray, topk: np.ndarray, outputs: BlockOutputs) -> None:
        self.router, self.outputs = router, outputs
        self.probs = np.asarray(probs, dtype=np.float64)
        self.tokens = np.arange(len(self.probs))
        everything = np.ones(router.expert_count, dtype=bool)
        full_topk, weights, _ = router.route(self.probs, everything)
        self.y = outputs.combine(self.tokens, full_topk, weights)
        self.selection_agrees = (
            float(np.mean(np.sort(full_topk, axis=1) == np.sort(topk, axis=1))) if len(topk) else 1.0
        )

    def output(self, allowed: np.ndarray) -> np.ndarray:
        topk, weights, _ = self.router.route(self.probs, allowed)
        return self.outputs.combine(self.tokens, topk, weights)

    def error(self, keep: Sequence[int]) -> float:
        """mean over tokens ||y - y_S||^2 for S = `keep`."""
        allowed = np.zeros(self.router.expert_count, dtype=bool)
        allowed[list(keep)] = True
        return float(np.mean(np.sum((self.y - self.output(allowed)) ** 2, axis=1)))

    def _sensitive(self, topk: np.ndarray, selection: np.ndarray) -> np.ndarray:
        """[T, E] bool: the experts whose removal can change each token's selection (`topk` and
        `selection` the routing over the experts still allowed)."""
        mask = np.zeros((len(self.probs), self.router.expert_count), dtype=bool)
        np.put_along_axis(mask, topk, True, axis=1)
        if self.router.groups > 1:
            size = self.router.expert_count // self.router.groups
            by_group = selection.reshape(len(self.probs), self.router.groups, size)
            best2 = (
                np.argsort(-by_group, axis=2, kind="stable")[:, :, :2]
                + (np.arange(self.router.groups) * size)[None, :, None]
            )
            selectable = np.isfinite(np.take_along_axis(selection, best2.reshape(len(self.probs), -1), axis=1))
            rows = np.repeat(self.tokens, best2.shape[1] * 2)
            flat = best2.reshape(-1)
            mask[rows[selectable.reshape(-1)], flat[selectable.reshape(-1)]] = True
        return mask

    def eliminate(self) -> Elimination:
        started = time.perf_counter()
        n = self.router.expert_count
        groups = max(self.router.groups, 1)
        size = n // groups
        allowed = np.ones(n, dtype=bool)
        removed: list[int] = []
        errors: list[float] = []
        yy = np.sum(self.y**2, axis=1) if self.router.rescales else None
        while allowed.sum() > self.router.smallest():
            topk_now, weights_now, selection = self.router.route(self.probs, allowed)  # one routing a step
            current = self.outputs.combine(self.tokens, topk_now, weights_now)
            residual = self.y - current
            base = np.sum(residual**2, axis=1)  # [T]
            sensitive = self._sensitive(topk_now, selection) if self.router.local else None
            counts = allowed.reshape(groups, size).sum(axis=1)
            candidates = [e for e in np.flatnonzero(allowed) if counts[e // size] == counts.max()]
            if self.router.rescales:
                z = np.where(allowed, self.probs, 0.0).sum(axis=1)
                yc, cc = np.sum(self.y * current, axis=1), np.sum(current**2, axis=1)
            trials = []
            for e in candidates:
                trial = allowed.copy()
                trial[e] = False
                rows = self.tokens if sensitive is None else np.flatnonzero(sensitive[:, e])
                topk, weights, _ = self.router.route(self.probs[rows], trial)
                trials.append((int(e), rows, topk, weights))
            if trials:  # every output the step's candidates reach, evaluated in one batch
                self.outputs.ensure(np.concatenate([t[1] for t in trials]), np.concatenate([t[2] for t in trials]))
            best: tuple[float, int] | None = None
            for e, rows, topk, weights in trials:
                changed = np.sum((self.y[rows] - self.outputs.combine(rows, topk, weights)) ** 2, axis=1)
                if self.router.rescales and sensitive is not None:
                    factor = z / np.maximum(z - self.probs[:, e], np.finfo(np.float64).tiny)
                    others = yy - 2 * factor * yc + factor**2 * cc
                    others[rows] = 0.0
                    total = float(others.sum() + changed.sum())
                else:
                    total = float(
                        base.sum() - (base[rows].sum() if sensitive is not None else base.sum()) + changed.sum()
                    )
                if best is None or total < best[0]:
                    best = (total, e)
            if best is None:
                break
            allowed[best[1]] = False
            removed.append(best[1])
            errors.append(best[0] / max(len(self.probs), 1))
        return Elimination(
            removed,
            errors,
            [int(e) for e in np.flatnonzero(allowed)],
            self.outputs.evaluated,
            time.perf_counter() - started,
        )


def greedy_block(
    router: Router, nodes: dict[str, np.ndarray], evaluator: ExpertEvaluator | None, block: int
) -> GreedyBlock:
    """The GreedyBlock of traced nodes (token-major, micro-batches concatenated): ffn_moe_probs,
    ffn_moe_input, ffn_moe_topk, ffn_moe_down."""
    missing = [n for n in NODES if n not in nodes]
    if missing:
        raise BadInput(
            f"blk.{block}: the trace has no {', '.join(missing)}",
            "this llama.cpp graph does not route through build_moe_ffn",
        )
    topk = nodes["ffn_moe_topk"].astype(np.intp)
    bias = evaluator.down_bias(block) if evaluator is not None else None
    outputs = BlockOutputs(
        block, np.ascontiguousarray(nodes["ffn_moe_input"], dtype=np.float32), evaluator, router.expert_count, bias
    )
    outputs.seed(topk, np.asarray(nodes["ffn_moe_down"], dtype=np.float32))
    return GreedyBlock(router, nodes["ffn_moe_probs"], topk, outputs)


class GreedyConsumer:
    """The decode consumer: holds every traced token of every block, eliminates at the end (`arrays`)."""

    def __init__(self, model: Any, layout: Any, threads: int) -> None:
        self.model, self.layout = model, layout
        self.tracer = GraphTracer(frozenset(NODES))
        self.evaluator = ExpertEvaluator(model, layout, threads=threads, engine="ggml")

    @property
    def errors(self) -> list[str]:
        return self.tracer.errors

    def __call__(self, address: int, ask: bool, user_data: object) -> bool:
        return self.tracer(address, ask, user_data)

    def decoded(self) -> None:
        """The captures stay until every chunk is decoded."""

    def arrays(self) -> dict[str, np.ndarray]:
        """Per block "removed:<b>", "errors:<b>", "survivors:<b>", "seconds:<b>" (the block's
        outputs of the full model and its elimination), "evaluated:<b>",
        "agrees:<b>" (share of top-k slots numpy's routing of the full model reproduces)."""
        out: dict[str, np.ndarray] = {}
        blocks = sorted({b for per_block in self.tracer.captured.values() for b in per_block})
        for block in blocks:
            started = time.perf_counter()
            nodes = {
                node: np.concatenate(per_block.pop(block), axis=0)
                for node, per_block in self.tracer.captured.items()
                if block in per_block
            }
            greedy = greedy_block(router_of(self.model, self.layout, block), nodes, self.evaluator, block)
            del nodes
            result = greedy.eliminate()
            out.update(
                {
                    f"removed:{block}": np.asarray(result.removed, np.int64),
                    f"errors:{block}": np.asarray(result.errors),
                    f"survivors:{block}": np.asarray(result.survivors, np.int64),
                    f"seconds:{block}": np.asarray(time.perf_counter() - started),
                    f"evaluated:{block}": np.asarray(result.evaluated),
                    f"agrees:{block}": np.asarray(greedy.selection_agrees),
                }
            )
            del greedy, result  # the block's expert outputs go before the next block's are allocated
        return out


def greedy(request: DecodeRequest) -> GreedyConsumer:
    """The decode consumer factory (see the module docstring)."""
    from ggufcarve.gguf.container import read_model
    from ggufcarve.moe.layout import inspect_layout
    from ggufcarve.select.experts import activation_of

    model = read_model(request.model)
    layout = inspect_layout(model)
    activation_of(layout.architecture)
    return GreedyConsumer(model, layout, request.thread_count)


GREEDY_CONSUMER = ConsumerSpec("greedy", "ggufcarve.select.greedy:greedy")


def eliminations(arrays: dict[str, np.ndarray]) -> dict[int, Elimination]:
    """The consumer's arrays back as one Elimination per block."""
    blocks = sorted(int(k.partition(":")[2]) for k in arrays if k.startswith("removed:"))
    return {
        b: Elimination(
            [int(e) for e in arrays[f"removed:{b}"]],
            [float(x) for x in arrays[f"errors:{b}"]],
            [int(e) for e in arrays[f"survivors:{b}"]],
            int(arrays[f"evaluated:{b}"]),
            float(arrays[f"seconds:{b}"]),
        )
        for b in blocks
    }


# ---------------------------------------------------------------------------------------------
# memory, before the pass (see the module docstring)

REFUSE_SHARE = 0.8  # greedy asked: refused when its estimate exceeds this share of the available memory
TEMPLATE_BYTES = (
    128  # per chat message and per conversation: more than the text llama.cpp's built-in chat templates add
)
CGROUP_MOUNT = "sys/fs/cgroup"
CGROUP_NO_LIMIT = 1 << 62  # cgroup v1 writes LONG_MAX rounded down to whole pages where no limit is set


@dataclass(frozen=True)
class GreedyMemory:
    """`memory_estimate`'s bytes for `tokens` calibration tokens."""

    tokens: int
    captures: int  # the traced nodes of every block, held until the decode ends
    values: int  # one block's [T, E, n_embd] float32 expert outputs (part of `block`)
    block: int  # while one block is eliminated
    evaluator: int  # dequantized expert weights

    @property
    def peak(self) -> int:
        return self.captures + self.block + self.evaluator


def memory_estimate(layout: Any, tokens: int, threads: int = 8) -> GreedyMemory:
    """The greedy pass's peak bytes for `tokens` calibration tokens (the module docstring's terms)
    from the model's layout: n_embd the router's input rows, n_ff and expert bytes from the expert
    weights, k, E, the routing and the traced (non-MTP) MoE blocks."""
    n_expert, k = layout.expert_count, layout.expert_used_count
    blocks = [layer for layer in layout.layers if not layer.is_mtp]
    n_embd = max((t.shape[0] for layer in blocks for t in layer.tensors if t.role == "router"), default=0)
    expert_values = [
        sum(int(np.prod(t.shape[:-1])) for t in layer.tensors if t.role == "expert weight") for layer in blocks
    ]  # per expert
    per_token = max(expert_values, default=0) // max(n_embd, 1)  # F = 3 n_ff: gate and up rows, the activation
    groups = groups_of(layout)
    local = not (layout.routing.gating == SOFTMAX and layout.routing.selection_bias)
    sensitive = min(n_expert, k + (2 * groups if groups > 1 else 0)) if local else n_expert
    reached = 1 if local and groups == 1 else min(n_expert - k, sensitive * k)
    captures = len(blocks) * tokens * (n_embd * (1 + k) + n_expert + k) * 4
    values = tokens * n_expert * n_embd * 4
    block = values + tokens * (
        n_expert * (1 + 7 * 8)
        + n_embd * (4 + 8 * 8)
        + sensitive * k * 64
        + reached * n_embd * 8
        + threads * per_token * 4
    )
    every = sum(expert_values) * n_expert * 4
    evaluator = min(every, CACHE_BYTES + max(expert_values, default=0) * n_expert * 4)
    return GreedyMemory(tokens, captures, values, block, evaluator)


def token_bound(files: Sequence[CalibrationFile], ctx: int, max_tokens: int | None) -> int:
    """At least the tokens the decode pass traces from `files` (`llama.calibration.chunks`): whole
    chunks of `ctx` within `max_tokens` and within the text's bytes (a token spells at least one
    byte of its document, BOS, EOS and a leading-space marker apart: 3 per document; a chat
    message's rendering counted as its role and content plus TEMPLATE_BYTES, and TEMPLATE_BYTES
    more per conversation)."""
    total = 0
    for f in files:
        for doc in f.documents:
            if doc.messages is None:
                total += len((doc.text or "").encode("utf-8")) + 3
            else:
                total += (
                    sum(
                        len(role.encode("utf-8")) + len(content.encode("utf-8")) + TEMPLATE_BYTES
                        for role, content in doc.messages
                    )
                    + TEMPLATE_BYTES
                    + 3
                )
    if max_tokens is not None:
        total = min(total, max_tokens)
    return total // ctx * ctx


def available_memory(root: Path = Path("/")) -> int | None:
    """Bytes a new process can allocate without swapping: /proc/meminfo MemAvailable, at most what
    this process's memory cgroup has left below its limit, under `root` (the filesystem's root);
    None where /proc/meminfo is not readable."""
    try:
        fields = dict(line.split(":", 1) for line in (root / "proc/meminfo").read_text().splitlines() if ":" in line)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return None
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        # /proc/self/cgroup: "hierarchy-ID:controller,...:path"; cgroup v2's one line is "0::path"
        # (its groups under /sys/fs/cgroup), v1's memory controller has its own mount.
        hierarchy, controllers, listed = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and not controllers:
            left = _cgroup_left(root / CGROUP_MOUNT, listed, "memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            left = _cgroup_left(
                root / CGROUP_MOUNT / "memory", listed, "memory.limit_in_bytes", "memory.usage_in_bytes"
            )
        else:
            continue
        if left is not None:
            available = min(available, left)
    return max(available, 0)


def _cgroup_left(mount: Path, listed: str, limit_file: str, usage_file: str) -> int | None:
    """The fewest bytes left below a limit in the group `listed` and its ancestors up to `mount`;
    None where none of them has a limit. In a cgroup namespace the listed path is not under the
    mount, whose root is then the group. v2 writes "max" for no limit, v1 a number near 2**63."""
    group = mount / listed.strip("/")
    if not group.is_dir():
        group = mount
    left = None
    for directory in [group, *group.parents]:
        try:
            limit = (directory / limit_file).read_text().strip()
            if limit != "max" and int(limit) < CGROUP_NO_LIMIT:
                here = int(limit) - int((directory / usage_file).read_text())
                left = here if left is None else min(left, here)
        except (OSError, ValueError):
            pass
        if directory == mount:
            break
    return left


def fitting_tokens(layout: Any, budget: float, ctx: int, threads: int = 8) -> int:
    """The most tokens, whole chunks of `ctx`, whose estimate stays within `budget` bytes (0: not one chunk)."""
    unit = memory_estimate(layout, ctx, threads)
    fixed = unit.evaluator
    per_chunk = unit.captures + unit.block
    return max(0, int((budget - fixed) // per_chunk)) * ctx


def check_memory(
    layout: Any,
    files: Sequence[CalibrationFile],
    ctx: int,
    max_tokens: int | None,
    threads: int = 8,
    available: int | None = None,
) -> GreedyMemory:
    """The estimate of the greedy pass over `files`; BadInput when it exceeds REFUSE_SHARE of
    `available` (None: `available_memory()`; no check where that is unknown)."""
    text_tokens = token_bound(files, ctx, None)
    tokens = token_bound(files, ctx, max_tokens)
    estimate = memory_estimate(layout, tokens, threads)
    available = available_memory() if available is None else available
    if available is not None and estimate.peak > REFUSE_SHARE * available:
        fits = fitting_tokens(layout, REFUSE_SHARE * available, ctx, threads)
        bound = "--max-tokens" if tokens < text_tokens else "a token per byte of the text"
        hint = (
            f"give --max-tokens {fits} or fewer (a plan: [calibration] max_tokens), or use reap"
            if fits
            else "use reap: not one --ctx chunk of greedy fits"
        )
        raise BadInput(
            f"greedy needs up to {format_size(estimate.peak)} for at most {tokens:,} calibration tokens ({bound}), "
            f"above {REFUSE_SHARE:.0%} of the {format_size(available)} of memory available",
            hint,
        )
    return estimate
