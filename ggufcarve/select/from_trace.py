"""Criteria from a calibration trace of llama.cpp's own MoE graph nodes (build_moe_ffn,
src/llama-graph.cpp), accumulated per micro-batch into mergeable statistics.

For every token t and slot j, llama.cpp selected expert S_tj = ffn_moe_topk[t, j] and computed its
output f = ffn_moe_down[t, j] (before weighting; the down bias of gpt-oss-style files is added here,
as ffn_moe_down_biased does). The weight it applied is the last of ffn_moe_weights_scaled,
ffn_moe_weights_norm, ffn_moe_weights_softmax, ffn_moe_weights present in the graph, and
λ (the routed scale) = scaled / unscaled weights when the graph scales them, else 1.

    frequency  count of (t, j) per expert                                  statistic "count"
    ean        mean over routed (t, j) of ||f||                            statistic "mean"
    ean-sum    sum over routed (t, j) of ||f|| (REAP's EAN sum form)       statistic "sum"
    msan       mean over routed (t, j) of ||f||^2                          statistic "mean_square"
    mone       n_e x mean over routed (t, j) of ||f - mu_e||^2             statistic "mone"
               (n_e the routed count, mu_e the mean of e's outputs)
    reap       mean over routed (t, j) of g_tj ||f||, g the applied weight  statistic "mean"
    hope       per pair (i, j) of experts both routed for t (i = j too):   statistic "pairwise"
               the sum of v_ti v_tj, v = g ||f||, and the count of such t
    razor      conditional RMS over routed (t, j) of                       statistic "rms"
               δ = λ ||w_j r_j - w_r r_r|| / max(1 - w_j + w_r, 1e-6)
with, for token t: w = applied weights / λ, c = Σ_j w_j f_j, r_j = f_j - c; the refill expert
r = ffn_moe_argsort[t, k] (rank k, 0-based: the router's own ranking, selection bias and group mask
included); f_r evaluated at the MoE input (src[1] of ffn_moe_logits) by build_moe_ffn's own op,
ggml_mul_mat_id, on the quantized weights of r (`select.experts`, engine "ggml": llama.cpp's
ffn_moe_down of r bit for bit on Q8_0), r_r = f_r - c, w_r = p_r / Σ_j p_Sj with p =
ffn_moe_probs (for softmax-weight gating, where ffn_moe_probs holds the logits, p = their softmax
over all experts).
Every criterion also records the largest |f| element per expert (REAP's max activation).

One pass fills several criteria (`filled_by`): a frequency pass captures ffn_moe_topk only; any
other pass captures ffn_moe_down and the weights and fills frequency, ean, ean-sum, msan, mone,
reap and hope together (razor's pass adds razor). All fold per micro-batch from the float32 capture: the
per-(t, j) norms and squared norms in float32, summed per expert in float64; mone's Σ f per expert
as float32 sums of each expert's rows of the micro-batch, added to a float64 [E, n_embd]
accumulator (no float64 copy of ffn_moe_down).

MoNE (arXiv 2507.00390) ranks by access frequency and output variance, f being the expert's own
output before the router weight (its novice replaces that output): here "frequency" is the count
n_e of routed (token, slot) pairs (its share n_e / (T k) differs by one constant per block, so the
order is the same) and the variance the biased E||f - mu_e||^2 over the n_e outputs. The paper's
output variance phi_var is sqrt(sum_d of the unbiased (n_e - 1) variance of dimension d), which
orders experts as E||f - mu_e||^2 does up to n_e / (n_e - 1); count x phi_var would order them
differently from count x E||f - mu_e||^2, the product scored here.

In the decode pass (`ggufcarve.llama.decode`) the criterion is the consumer `statistics`: a
`GraphTracer` copies the nodes it reads, and `BlockFolder` folds each block's copies into the
`TraceStatistics` once the graph moves on to the next block, so that memory holds one block of one
micro-batch (razor: up to HELD_BYTES across the micro-batches of one decode call, for larger
products). Its arrays are "method" and "<accumulator>:<block>" (`TraceStatistics.from_arrays`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ggufcarve.errors import BadInput
from ggufcarve.llama.decode import ConsumerSpec, DecodeRequest
from ggufcarve.llama.ggml import tensor_at
from ggufcarve.llama.trace import GraphTracer, parse_node_name
from ggufcarve.select.criteria import PASS_METHODS
from ggufcarve.select.experts import ExpertEvaluator
from ggufcarve.select.scores import BlockStats

STATISTIC = {
    "frequency": "count",
    "ean": "mean",
    "ean-sum": "sum",
    "msan": "mean_square",
    "mone": "mone",
    "reap": "mean",
    "hope": "pairwise",
    "razor": "rms",
}
ACCUMULATORS = (
    "counts",
    "norms",
    "squares",
    "gated",
    "outputs",
    "deltas",
    "deltas_sq",
    "maxima",
    "pair_sums",
    "pair_counts",
)
WEIGHT_NODES = ("ffn_moe_weights_scaled", "ffn_moe_weights_norm", "ffn_moe_weights_softmax", "ffn_moe_weights")
DELTA_FLOOR = 1e-6
# captures a batched criterion (razor) holds across micro-batches, over all blocks: its refill
# experts are evaluated for more tokens per product, one graph of products per block and batch
# (with numpy's products of dequantized weights, on 2 cores, a 512-token micro-batch of 32 experts
# took 1.9 s of products per 8,192 tokens, the 2,048 tokens of one decode call 0.9 s)
HELD_BYTES = 256 << 20


def filled_by(method: str) -> tuple[str, ...]:
    """The criteria a pass asked for `method` fills (all from the same captured nodes): a frequency
    pass captures only ffn_moe_topk (the cheapest pass); any other pass ffn_moe_down and the weights,
    which fill every criterion of the calibration pass (PASS_METHODS), and razor's pass razor too."""
    if method == "frequency":
        return ("frequency",)
    return (*PASS_METHODS, "razor") if method == "razor" else PASS_METHODS


def nodes_for(method: str) -> tuple[str, ...]:
    """The graph nodes a pass asked for `method` reads (every criterion of `filled_by(method)`)."""
    if method == "frequency":
        return ("ffn_moe_topk",)
    if method != "razor":
        return ("ffn_moe_topk", "ffn_moe_down", *WEIGHT_NODES)
    return ("ffn_moe_topk", "ffn_moe_down", "ffn_moe_argsort", "ffn_moe_probs", "ffn_moe_input", *WEIGHT_NODES)


def applied_weights(nodes: dict[str, np.ndarray]) -> tuple[np.ndarray, float]:
    """The weights llama.cpp multiplied the expert outputs with [T, k], and λ."""
    present = [n for n in WEIGHT_NODES if n in nodes]
    if not present:
        raise BadInput(
            "the trace has no ffn_moe_weights node",
            "this llama.cpp graph does not weight its experts the way build_moe_ffn does",
        )
    applied = nodes[present[0]].astype(np.float64)
    scale = 1.0
    if present[0] == "ffn_moe_weights_scaled" and len(present) > 1:
        before = nodes[present[1]].astype(np.float64)
        ratio = applied[before != 0] / before[before != 0]
        scale = float(np.median(ratio)) if ratio.size else 1.0
    return applied, scale


def _norms(x: np.ndarray) -> np.ndarray:
    """||x||_2 along the last axis of a float32 array, as float64: one pass, no squared copy."""
    return np.sqrt(np.einsum("...i,...i->...", x, x).astype(np.float64))


def largest_magnitudes(x: np.ndarray) -> np.ndarray:
    """max |x| along the last axis of a float32 array: its bits with the sign bit cleared, compared
    as int32 (an IEEE float's magnitude orders as its bits do; a NaN stays a NaN), then viewed back
    as float32. Equal to max(x.max(-1), -x.min(-1)); one reduction, not two, and integer
    comparisons, which numpy vectorizes without a float maximum's NaN checks (2.7x on 2 cores)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.int32)
    return np.bitwise_and(bits, np.int32(0x7FFFFFFF)).max(axis=-1).view(np.float32)


def softmax(x: np.ndarray) -> np.ndarray:
    z = x - x.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


@dataclass
class TraceStatistics:
    """Per block accumulators of one decode pass; `add` takes one micro-batch of one block's nodes.

    `method` is the criterion asked for; the pass fills every criterion of `filled_by(method)`
    from the same captured nodes: counts, Σ||f||, Σ||f||², Σ g||f||, Σ f (a vector per expert) and
    the largest |f| element, each folded in float32 per micro-batch into float64 accumulators."""

    method: str
    expert_count: int
    evaluator: ExpertEvaluator | None = None  # razor (refill experts) and down biases
    counts: dict[int, np.ndarray] = field(default_factory=dict)
    norms: dict[int, np.ndarray] = field(default_factory=dict)  # Σ ||f||
    squares: dict[int, np.ndarray] = field(default_factory=dict)  # Σ ||f||²
    gated: dict[int, np.ndarray] = field(default_factory=dict)  # Σ g ||f||
    outputs: dict[int, np.ndarray] = field(default_factory=dict)  # Σ f [E, n_embd]
    deltas: dict[int, np.ndarray] = field(default_factory=dict)  # razor: Σ δ
    deltas_sq: dict[int, np.ndarray] = field(default_factory=dict)  # razor: Σ δ²
    maxima: dict[int, np.ndarray] = field(default_factory=dict)
    pair_sums: dict[int, np.ndarray] = field(default_factory=dict)  # hope: Σ v_i v_j [E, E], v = g ||f||
    pair_counts: dict[int, np.ndarray] = field(default_factory=dict)  # hope: tokens routing to both [E, E]

    @property
    def batched(self) -> bool:
        """Whether `add` gains from many tokens at once (razor evaluates refill experts per product)."""
        return self.method == "razor"

    @property
    def filled(self) -> tuple[str, ...]:
        return filled_by(self.method)

    def _zeros(self, table: dict[int, np.ndarray], block: int, width: int = 0) -> np.ndarray:
        if block not in table:
            table[block] = np.zeros((self.expert_count, width) if width else self.expert_count)
        return table[block]

    def add(self, block: int, nodes: dict[str, np.ndarray]) -> None:
        n = self.expert_count
        if block not in self.counts:
            self.counts[block] = np.zeros(n, np.int64)
        topk = nodes["ffn_moe_topk"].astype(np.intp)  # [T, k]
        flat = topk.reshape(-1)
        routed = np.bincount(flat, minlength=n)
        self.counts[block] += routed
        if self.method == "frequency":
            return
        outputs = np.asarray(nodes["ffn_moe_down"], dtype=np.float32)  # [T, k, n_embd], as llama.cpp computed it
        bias = self.evaluator.down_bias(block) if self.evaluator is not None else None
        if bias is not None:
            outputs = outputs + bias[topk]
        squares = np.einsum("...i,...i->...", outputs, outputs)  # float32 [T, k]
        norms = np.sqrt(squares.astype(np.float64))
        # the (t, j) pairs grouped by expert, in decode order within each expert (a stable sort)
        order = np.argsort(flat, kind="stable")
        experts = np.flatnonzero(routed)
        ends = np.cumsum(routed[experts])
        starts = ends - routed[experts]
        peaks = largest_magnitudes(outputs).reshape(-1)
        maxima = self._zeros(self.maxima, block)
        if len(experts):
            maxima[experts] = np.maximum(maxima[experts], np.maximum.reduceat(peaks[order], starts))
        self._zeros(self.norms, block)[:] += np.bincount(flat, weights=norms.reshape(-1), minlength=n)
        self._zeros(self.squares, block)[:] += np.bincount(
            flat, weights=squares.reshape(-1).astype(np.float64), minlength=n
        )
        self._add_output_sums(
            block, order, experts, starts.tolist(), ends.tolist(), outputs.reshape(-1, outputs.shape[-1])
        )
        if not any(name in nodes for name in WEIGHT_NODES):
            return
        weights, scale = applied_weights(nodes)
        gated = weights * norms  # [T, k]
        self._zeros(self.gated, block)[:] += np.bincount(flat, weights=gated.reshape(-1), minlength=n)
        pairs = (topk[:, :, None] * n + topk[:, None, :]).reshape(-1)  # (i, j) of every token's selected pairs
        products = (gated[:, :, None] * gated[:, None, :]).reshape(-1)
        self._zeros(self.pair_sums, block, n)[:] += np.bincount(pairs, weights=products, minlength=n * n).reshape(n, n)
        self._zeros(self.pair_counts, block, n)[:] += np.bincount(pairs, minlength=n * n).reshape(n, n)
        if self.method != "razor":
            return
        deltas = self.razor_deltas(block, nodes, topk, outputs, weights, scale).reshape(-1)
        self._zeros(self.deltas, block)[:] += np.bincount(flat, weights=deltas, minlength=n)
        self._zeros(self.deltas_sq, block)[:] += np.bincount(flat, weights=deltas**2, minlength=n)

    def _add_output_sums(
        self, block: int, order: np.ndarray, experts: np.ndarray, starts: list[int], ends: list[int], rows: np.ndarray
    ) -> None:
        """Σ f per expert: float32 sums of each expert's rows of this micro-batch (`order[start:end]`
        its rows, in decode order), added to the float64 accumulator. Each sum is sequential, row
        after row, as np.add.reduce along axis 0 of a C-contiguous array adds (np.add.reduceat, or
        a gather of all rows, is several times slower): per expert when the busiest expert has
        more rows than there are experts, else by rank, the r-th row of every expert with more than r
        rows added at once (the same additions in the same order). `starts` and `ends` are Python
        ints: slicing with numpy integers costs several times more per expert."""
        counts = np.subtract(ends, starts)
        if len(experts) and int(counts.max()) < len(experts):
            busiest = np.argsort(-counts, kind="stable")  # experts by row count, descending
            first = np.asarray(starts)[busiest]
            ordered = counts[busiest]
            sums = rows[order[first]]
            for rank in range(1, int(ordered[0])):
                live = int(np.count_nonzero(ordered > rank))  # a prefix: the experts with more than `rank` rows
                sums[:live] += rows[order[first[:live] + rank]]
            self._zeros(self.outputs, block, rows.shape[1])[experts[busiest]] += sums
            return
        sums = np.empty((len(experts), rows.shape[1]), np.float32)
        reduce = np.add.reduce
        for i, (start, end) in enumerate(zip(starts, ends)):
            reduce(rows[order[start:end]], axis=0, out=sums[i])
        self._zeros(self.outputs, block, rows.shape[1])[experts] += sums

    def razor_deltas(
        self,
        block: int,
        nodes: dict[str, np.ndarray],
        topk: np.ndarray,
        outputs: np.ndarray,
        weights: np.ndarray,
        scale: float,
    ) -> np.ndarray:
        """δ [T, k] (float64) of every selected (token, slot); the [T, k, n_embd] terms in float32."""
        if self.evaluator is None:
            raise RuntimeError("razor statistics need the expert evaluator of the model")
        k = topk.shape[1]
        if k < 2:
            raise BadInput("razor needs at least 2 experts per token (top-k >= 2)", "use reap or ean for top-1 routing")
        w = weights / scale  # [T, k]
        w32 = w.astype(np.float32)
        mixture = np.matmul(w32[:, None, :], outputs)[:, 0, :]  # c [T, n_embd]
        refill = nodes["ffn_moe_argsort"][:, k].astype(np.intp)  # [T]
        probs = nodes["ffn_moe_probs"].astype(np.float64)  # [T, E]
        if "ffn_moe_weights_softmax" in nodes:
            probs = softmax(probs)
        selected_sum = np.take_along_axis(probs, topk, axis=1).sum(axis=1)
        w_refill = probs[np.arange(len(refill)), refill] / np.maximum(selected_sum, DELTA_FLOOR)  # [T]
        inputs = nodes["ffn_moe_input"]
        refill_out = np.empty_like(mixture)
        bias = self.evaluator.down_bias(block)
        order = np.argsort(refill, kind="stable")
        experts, starts = np.unique(refill[order], return_index=True)
        groups = np.split(order, starts[1:])
        for expert, rows, out in zip(
            experts, groups, self.evaluator.outputs_many(block, [(e, inputs[rows]) for e, rows in zip(experts, groups)])
        ):
            refill_out[rows] = out if bias is None else out + bias[expert]
        refill_out -= mixture  # r_r [T, n_embd]
        refill_out *= w_refill.astype(np.float32)[:, None]  # w_r r_r
        difference = outputs - mixture[:, None, :]  # r_j
        difference *= w32[:, :, None]
        difference -= refill_out[:, None, :]  # w_j r_j - w_r r_r
        numerator = _norms(difference)
        return scale * numerator / np.maximum(1.0 - w + w_refill[:, None], DELTA_FLOOR)

    def blocks(self, method: str | None = None) -> dict[int, BlockStats]:
        """The statistics of `method` (default: the one asked for), one BlockStats per traced block."""
        method = method or self.method
        if method not in self.filled:
            raise BadInput(
                f"a {self.method} pass does not fill {method} statistics", f"it fills {', '.join(self.filled)}"
            )
        statistic = STATISTIC[method]
        out = {}
        for b in sorted(self.counts):
            counts, maxima = self.counts[b], self.maxima.get(b, np.zeros(self.expert_count))
            if method == "frequency":
                out[b] = BlockStats(method, statistic, counts=counts)
            elif method in ("ean", "ean-sum"):
                out[b] = BlockStats(method, statistic, counts=counts, sums=self._zeros(self.norms, b), maxima=maxima)
            elif method == "msan":
                out[b] = BlockStats(
                    method, statistic, counts=counts, sums_sq=self._zeros(self.squares, b), maxima=maxima
                )
            elif method == "mone":
                width = self.outputs[b].shape[1] if b in self.outputs else 1
                out[b] = BlockStats(
                    method,
                    statistic,
                    counts=counts,
                    sums_sq=self._zeros(self.squares, b),
                    output_sums=self._zeros(self.outputs, b, width),
                    maxima=maxima,
                )
            elif method == "reap":
                out[b] = BlockStats(method, statistic, counts=counts, sums=self._zeros(self.gated, b), maxima=maxima)
            elif method == "hope":
                n = self.expert_count
                out[b] = BlockStats(
                    method,
                    statistic,
                    counts=counts,
                    maxima=maxima,
                    pair_sums=self._zeros(self.pair_sums, b, n),
                    pair_counts=self._zeros(self.pair_counts, b, n),
                )
            else:
                out[b] = BlockStats(
                    method,
                    statistic,
                    counts=counts,
                    sums=self._zeros(self.deltas, b),
                    sums_sq=self._zeros(self.deltas_sq, b),
                    maxima=maxima,
                )
        return out

    def arrays(self) -> dict[str, np.ndarray]:
        """\"method" and "<accumulator>:<block>": what `from_arrays` reads back."""
        arrays: dict[str, np.ndarray] = {"method": np.asarray(self.method)}
        for name in ACCUMULATORS:
            arrays.update({f"{name}:{b}": values for b, values in getattr(self, name).items()})
        return arrays

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], expert_count: int) -> TraceStatistics:
        statistics = cls(str(arrays["method"]), expert_count)
        for key, values in arrays.items():
            name, _, block = key.partition(":")
            if name in ACCUMULATORS and block.isdigit():
                getattr(statistics, name)[int(block)] = values
        return statistics


class BlockFolder:
    """The eval callback: GraphTracer's copies, folded into TraceStatistics block by block.

    A block's captures are folded once the graph has moved on to another block: micro-batch by
    micro-batch, or, for a criterion that evaluates experts in batches (`statistics.batched`),
    once the block holds `hold_bytes` of captures or the decode call ends (`flush()`), so that its
    products see as many tokens at once as that memory allows."""

    def __init__(
        self,
        tracer: GraphTracer,
        statistics: TraceStatistics,
        parse: Callable[[str], tuple[str, int] | None] | None,
        hold_bytes: int = 0,
    ) -> None:
        self.tracer, self.statistics, self.parse = tracer, statistics, parse
        self.hold_bytes = hold_bytes if statistics.batched else 0
        self.block: int | None = None
        self._errors: list[str] = []
        self._folded = tracer.nodes | {"ffn_moe_logits"}  # the nodes whose block starts a block's computation

    @property
    def errors(self) -> list[str]:
        """What went wrong inside the callback: the tracer's and the folding's."""
        return [*self.tracer.errors, *self._errors]

    def __call__(self, address: int, ask: bool, user_data: object) -> bool:
        answer = self.tracer(address, ask, user_data)
        if ask:
            return answer
        try:
            if self.parse is None:
                parsed = None
            elif self.parse is parse_node_name:
                parsed = self.tracer.node_of(address)  # the same parse, kept per node name
            else:
                parsed = self.parse(tensor_at(address).label)
            if parsed is not None and parsed[0] in self._folded and parsed[1] != self.block:
                self.flush(keep=parsed[1], held=True)
                self.block = parsed[1]
        except BaseException as err:  # an exception escaping into ctypes would read as False
            if len(self._errors) < 20:
                self._errors.append(f"{type(err).__name__}: {err}")
        return True

    def _held(self, block: int) -> int:
        return sum(part.nbytes for per_block in self.tracer.captured.values() for part in per_block.get(block, ()))

    def flush(self, keep: int | None = None, held: bool = False) -> None:
        """Fold every captured block except `keep` (the one being computed) into the statistics;
        with `held`, a batched criterion's blocks stay until they hold `hold_bytes`."""
        blocks = {b for per_block in self.tracer.captured.values() for b in per_block} - {keep}
        for block in sorted(blocks):
            if held and self.hold_bytes and self._held(block) < self.hold_bytes:
                continue
            parts = {
                node: per_block.pop(block) for node, per_block in self.tracer.captured.items() if block in per_block
            }
            if self.statistics.batched or len({len(p) for p in parts.values()}) != 1:
                self.statistics.add(block, {node: np.concatenate(p, axis=0) for node, p in parts.items()})
            else:  # one micro-batch at a time: every node holds one part per micro-batch
                for i in range(len(next(iter(parts.values())))):
                    self.statistics.add(block, {node: p[i] for node, p in parts.items()})

    def decoded(self) -> None:
        """A decode call ended: every block is folded."""
        self.flush()
        self.block = None

    def arrays(self) -> dict[str, np.ndarray]:
        return self.statistics.arrays()


def statistics(request: DecodeRequest, method: str) -> BlockFolder:
    """The decode consumer that accumulates the statistics of every criterion `filled_by(method)`
    of every MoE block."""
    if method not in STATISTIC:
        raise BadInput(f"{method} is not a trace criterion", f"one of {', '.join(STATISTIC)}")
    from ggufcarve.gguf.container import read_model
    from ggufcarve.moe.layout import inspect_layout

    model = read_model(request.model)
    layout = inspect_layout(model)
    evaluator = (
        ExpertEvaluator(model, layout, threads=request.thread_count, engine="ggml") if method != "frequency" else None
    )
    tracer = GraphTracer(frozenset(nodes_for(method)))
    return BlockFolder(
        tracer,
        TraceStatistics(method, layout.expert_count, evaluator),
        parse_node_name,
        hold_bytes=HELD_BYTES // max(1, len(layout.blocks)),
    )


def statistics_consumer(method: str) -> ConsumerSpec:
    return ConsumerSpec("statistics", "ggufcarve.select.from_trace:statistics", {"method": method})
