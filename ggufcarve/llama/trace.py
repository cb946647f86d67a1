"""Watching llama.cpp route tokens: a graph eval callback on the MoE nodes, run in a child process.

    from ggufcarve.llama.trace import trace_routing
    trace = trace_routing("model.gguf", tokens, nodes=("ffn_moe_topk", "ffn_moe_probs"))
    trace.topk[3]                       # [n_tokens, k] int32: experts each token was routed to in blk.3
    trace.nodes["ffn_moe_probs"][3]     # [n_tokens, n_expert] float32
    trace.logits                        # [n_tokens, n_vocab] float32

`trace_routing` is a decode pass (`ggufcarve.llama.decode`: a child process loads the model with
llama-cpp-python's low-level API on the CPU, warm-up off, since a warm-up decode routes every token
to every expert, src/llama-graph.cpp `cparams.warmup`) whose one consumer is a `GraphTracer`
(`capture`). The tokens are decoded in micro-batches with logits requested for every token (the
last layer computes only the tokens whose logits are requested). With `context=N` the tokens are
cut into chunks of N decoded independently (the KV cache is cleared before each, positions restart
at 0), as llama-imatrix and llama-perplexity do; without it they are one sequence.

The scheduler calls the callback twice per graph node: with ask=True ("observe this node?") and,
for observed nodes, with ask=False once computed (returning False there would stop the rest of
the graph split, and an exception escaping into ctypes reads as False: the callback never
raises). Node names are "<name>-<block>" and may carry a backend prefix: they are matched by
that suffix. What each capturable node is (`NODES`, from build_moe_ffn in src/llama-graph.cpp;
T = tokens, k = experts used, E = experts):
    ffn_moe_logits         router logits                     [T, E]
    ffn_moe_probs          after the gating function         [T, E]
    ffn_moe_probs_biased   + exp_probs_b (selection only)    [T, E]
    ffn_moe_argsort        full descending ranking used      [T, E] int32
    ffn_moe_topk           selected experts                  [T, k] int32
    ffn_moe_weights        probs of the selected experts     [T, k]
    ffn_moe_weights_norm   renormalised weights              [T, k]
    ffn_moe_weights_scaled scaled weights                    [T, k]
    ffn_moe_down           each selected expert's output     [T, k, n_embd]
    ffn_moe_out            the MoE block's output            [T, n_embd]
    ffn_moe_input          the MoE input: src[1] of ffn_moe_logits, [T, n_embd]
Blocks that llama.cpp's decode graph does not run (MTP/NextN blocks) and dense blocks have no entry.
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ggufcarve.errors import BadInput, ToolFailed
from ggufcarve.events import Sink, ignore
from ggufcarve.llama.calibration import Batching
from ggufcarve.llama.decode import IDLE_TIMEOUT, ConsumerSpec, DecodeRequest, decode
from ggufcarve.llama.devices import CPU, Compute
from ggufcarve.llama.ggml import GgmlTensor, read_tensor, tensor_at

TOPK = "ffn_moe_topk"
MOE_INPUT = "ffn_moe_input"
ROUTER_LOGITS = "ffn_moe_logits"
# node -> (ggml dimension that counts tokens, the other dimensions kept, outermost first)
NODES: dict[str, tuple[int, tuple[int, ...]]] = {
    "ffn_moe_logits": (1, (0,)),
    "ffn_moe_probs": (1, (0,)),
    "ffn_moe_probs_biased": (1, (0,)),
    "ffn_moe_argsort": (1, (0,)),
    TOPK: (1, (0,)),
    "ffn_moe_weights": (2, (1,)),
    "ffn_moe_weights_softmax": (2, (1,)),
    "ffn_moe_weights_norm": (1, (0,)),
    "ffn_moe_weights_scaled": (2, (1,)),
    "ffn_moe_down": (2, (1, 0)),
    "ffn_moe_out": (1, (0,)),
    MOE_INPUT: (1, (0,)),
}
NODE_NAME = re.compile(r"(?P<node>[A-Za-z_][A-Za-z0-9_]*)-(?P<block>\d+)$")
DEFAULT_BATCH = 512
NAME_OFFSET = GgmlTensor.name.offset  # of `char name[GGML_MAX_NAME]` in struct ggml_tensor, NUL-terminated


def parse_node_name(name: str) -> tuple[str, int] | None:
    """("ffn_moe_topk", 3) from "ffn_moe_topk-3" or a backend-prefixed "CUDA0#ffn_moe_topk-3"."""
    m = NODE_NAME.search(name)
    return (m["node"], int(m["block"])) if m else None


def token_major(array: np.ndarray, token_dim: int, kept: Sequence[int]) -> np.ndarray:
    """Reorder a (ne3, ne2, ne1, ne0) array to (tokens, *kept); the other dimensions must be 1."""
    axis = {d: 3 - d for d in range(4)}
    order = [axis[token_dim], *(axis[d] for d in kept)]
    rest = [a for a in range(4) if a not in order]
    if any(array.shape[a] != 1 for a in rest):
        raise ValueError(f"unexpected extent {array.shape} for token dimension {token_dim}, kept {tuple(kept)}")
    return np.transpose(array, order + rest).reshape([array.shape[a] for a in order])


@dataclass
class GraphTracer:
    """The eval callback: observes the named per-block nodes and keeps their values per block.

    `captured[node][block]` is a list of token-major arrays, one per computed micro-batch, in
    decode order. `errors` collects what went wrong inside the callback (which must not raise).
    """

    nodes: frozenset[str]
    captured: dict[str, dict[int, list[np.ndarray]]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.nodes) - set(NODES))
        if unknown:
            raise BadInput(f"cannot capture {', '.join(unknown)}", f"capturable nodes: {', '.join(NODES)}")
        self._observed = set(self.nodes) - {MOE_INPUT} | ({ROUTER_LOGITS} if MOE_INPUT in self.nodes else set())
        self._names: dict[bytes, tuple[str, int] | None] = {}  # raw node name -> parse_node_name of it

    def node_of(self, tensor_address: int) -> tuple[str, int] | None:
        """(node, block) of the graph node at `tensor_address` (`parse_node_name` of its name, kept
        per name: the scheduler asks about every node of every micro-batch's graph)."""
        raw = ctypes.string_at(tensor_address + NAME_OFFSET)
        try:
            return self._names[raw]
        except KeyError:
            parsed = self._names[raw] = parse_node_name(raw.decode("utf-8", errors="replace"))
            return parsed

    def __call__(self, tensor_address: int, ask: bool, _user_data: object) -> bool:
        try:
            parsed = self.node_of(tensor_address)
            if parsed is None or parsed[0] not in self._observed:
                return not ask
            if ask:
                return True
            node, block = parsed
            if node in self.nodes:
                self._keep(node, block, read_tensor(tensor_address))
            if node == ROUTER_LOGITS and MOE_INPUT in self.nodes:
                self._keep(MOE_INPUT, block, read_tensor(int(tensor_at(tensor_address).src[1])))
        except BaseException as err:
            if len(self.errors) < 20:
                self.errors.append(f"{type(err).__name__}: {err}")
        return True

    def _keep(self, node: str, block: int, array: np.ndarray) -> None:
        token_dim, kept = NODES[node]
        self.captured.setdefault(node, {}).setdefault(block, []).append(token_major(array, token_dim, kept))

    def decoded(self) -> None:
        """Nothing to do between decode calls: the captures are kept until the end."""

    def arrays(self) -> dict[str, np.ndarray]:
        """Every captured node and block as "<node>:<block>", micro-batches concatenated along the tokens."""
        return {
            f"{node}:{block}": np.concatenate(parts, axis=0)
            for node, blocks in self.captured.items()
            for block, parts in sorted(blocks.items())
        }


def capture(_request: DecodeRequest, nodes: Sequence[str]) -> GraphTracer:
    """The decode consumer that captures `nodes` of every MoE block (see `trace_routing`)."""
    return GraphTracer(frozenset(nodes))


@dataclass
class Trace:
    n_tokens: int
    logits: np.ndarray | None  # [n_tokens, n_vocab] float32, None when not asked for
    nodes: dict[str, dict[int, np.ndarray]]  # node -> block -> token-major array

    @property
    def topk(self) -> dict[int, np.ndarray]:
        """block -> [n_tokens, k] int32: the experts each token was routed to."""
        return self.nodes.get(TOPK, {})


def trace_routing(
    model: str | os.PathLike[str],
    tokens: Sequence[int],
    *,
    nodes: Iterable[str] = (TOPK,),
    logits: bool = True,
    compute: Compute = CPU,
    batch: int | None = None,
    context: int | None = None,
    timeout: float | None = None,
    idle_timeout: float | None = IDLE_TIMEOUT,
    verbose: bool = False,
    on_event: Sink = ignore,
    on_line: Callable[[str], None] | None = None,
) -> Trace:
    """Decode `tokens` with llama.cpp and capture `nodes` of every MoE block.

    `context`: tokens per independently decoded chunk (default: all of them, one sequence);
    `batch`: tokens per micro-batch (default 512, at most `context`).

    Raises BadInput for an empty token list or an unknown node, ToolFailed (with the child's last
    lines) when the child fails. Progress: events of stage "trace" in tokens.
    `verbose` forwards llama.cpp's info and debug logs (otherwise warnings and errors only).
    """
    tokens = [int(t) for t in tokens]
    if not tokens:
        raise BadInput("no tokens to trace", "give at least one token id")
    if (context is not None and context < 1) or (batch is not None and batch < 1):
        raise BadInput(f"context {context} / batch {batch}: both must be at least 1 token", "give positive sizes")
    context = min(context or len(tokens), len(tokens))
    wanted = sorted(frozenset(nodes))
    GraphTracer(frozenset(wanted))  # validates the node names before a child is started
    request = DecodeRequest(
        os.fspath(model),
        (ConsumerSpec("nodes", "ggufcarve.llama.trace:capture", {"nodes": wanted}),),
        Batching.single(context, min(batch or DEFAULT_BATCH, context)),
        tokens=tuple(tokens),
        logits=logits,
        compute=compute,
        verbose=verbose,
    )
    result = decode(
        request,
        what=f"tracing {Path(model).name}",
        stage="trace",
        on_event=on_event,
        on_line=on_line,
        timeout=timeout,
        idle_timeout=idle_timeout,
    )
    captured: dict[str, dict[int, np.ndarray]] = {}
    for key, array in result.outputs["nodes"].items():
        node, _, block = key.partition(":")
        if array.shape[0] != len(tokens):
            raise ToolFailed(
                f"tracing {Path(model).name}: {node}-{block} holds {array.shape[0]} tokens, expected {len(tokens)}",
                "the graph of this architecture decodes some tokens twice or not at all",
            )
        captured.setdefault(node, {})[int(block)] = array
    return Trace(len(tokens), result.logits, {node: dict(sorted(blocks.items())) for node, blocks in captured.items()})
