"""Watching llama.cpp route tokens: a graph eval callback on the MoE nodes, run in a child process.

    from ggufcarve.llama.trace import trace_routing
    trace = trace_routing("model.gguf", tokens, nodes=("ffn_moe_topk", "ffn_moe_probs"))
    trace.topk[3]                       # [n_tokens, k] int32: experts each token was routed to in blk.3
    trace.nodes["ffn_moe_probs"][3]     # [n_tokens, n_expert] float32
    trace.logits                        # [n_tokens, n_vocab] float32

`trace_routing` starts `python -m ggufcarve.llama.trace` through the one launcher (llama.cpp aborts
the whole process on a failed GGML_ASSERT) and reads its results back from an .npz file. The
child loads the model with llama-cpp-python's low-level API on the CPU (`use_extra_bufts` off:
the AMX buffer type crashes 0.3.36 on small models), sets `cb_eval` of the context to a
`GraphTracer`, turns warm-up off (a warm-up decode routes every token to every expert,
src/llama-graph.cpp `cparams.warmup`), and decodes the tokens in micro-batches with logits
requested for every token (the last layer computes only the tokens whose logits are requested).
With `context=N` the tokens are cut into chunks of N decoded independently (the KV cache is
cleared before each, positions restart at 0), as llama-imatrix and llama-perplexity do; without
it they are one sequence.

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

import argparse
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ggufcarve.errors import BadInput, ToolFailed
from ggufcarve.events import Event, Sink, ignore
from ggufcarve.llama import launch
from ggufcarve.llama.ggml import read_tensor, tensor_at
from ggufcarve.llama.libllama import (
    fill_batch,
    forward_warnings,
    load_model,
    traced_context,
    write_results,
)

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
PROGRESS_LINE = re.compile(r"^ggufcarve-trace: decoded (?P<done>\d+)/(?P<total>\d+) tokens$")
DEFAULT_BATCH = 512
TRACE_IDLE_TIMEOUT = 600.0  # one micro-batch of a large model on a slow CPU takes minutes, not ten


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

    def __call__(self, tensor_address: int, ask: bool, _user_data: object) -> bool:
        try:
            parsed = parse_node_name(tensor_at(tensor_address).label)
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

    def arrays(self) -> dict[str, dict[int, np.ndarray]]:
        """Every captured node and block, micro-batches concatenated along the tokens."""
        return {node: {block: np.concatenate(parts, axis=0) for block, parts in sorted(blocks.items())} for node, blocks in self.captured.items()}


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
    threads: int | None = None,
    batch: int | None = None,
    context: int | None = None,
    timeout: float | None = None,
    idle_timeout: float | None = TRACE_IDLE_TIMEOUT,
    verbose: bool = False,
    on_event: Sink = ignore,
    on_line: Callable[[str], None] | None = None,
) -> Trace:
    """Decode `tokens` with llama.cpp and capture `nodes` of every MoE block.

    `context`: tokens per independently decoded chunk (default: all of them, one sequence);
    `batch`: tokens per micro-batch (default 512, at most `context`).

    Raises BadInput for an empty token list or an unknown node, ToolFailed (with llama.cpp's last
    output lines) when the child fails. Progress: events of stage "trace" in tokens.
    `verbose` forwards llama.cpp's info and debug logs (otherwise warnings and errors only).
    """
    tokens = [int(t) for t in tokens]
    if not tokens:
        raise BadInput("no tokens to trace", "give at least one token id")
    if (context is not None and context < 1) or (batch is not None and batch < 1):
        raise BadInput(f"context {context} / batch {batch}: both must be at least 1 token", "give positive sizes")
    context = min(context or len(tokens), len(tokens))
    wanted = frozenset(nodes)
    GraphTracer(wanted)  # validates the node names before a child is started
    with tempfile.TemporaryDirectory(prefix="ggufcarve-trace-") as tmp:
        token_file, result_file = Path(tmp) / "tokens.npy", Path(tmp) / "trace.npz"
        np.save(token_file, np.asarray(tokens, dtype=np.int32))
        argv = [sys.executable, "-m", "ggufcarve.llama.trace", "--model", os.fspath(model), "--tokens", str(token_file), "--out", str(result_file),
                "--threads", str(threads or min(os.cpu_count() or 1, 8)), "--batch", str(min(batch or DEFAULT_BATCH, context)), "--context", str(context)]
        argv += [arg for node in sorted(wanted) for arg in ("--node", node)]
        argv += [] if logits else ["--no-logits"]
        argv += ["--verbose"] if verbose else []

        def watch(line: str) -> None:
            if m := PROGRESS_LINE.match(line):
                on_event(Event("trace", int(m["done"]), int(m["total"]), "tokens"))
            elif on_line is not None:
                on_line(line)

        finished = launch.run(argv, on_line=watch, timeout=timeout, idle_timeout=idle_timeout)
        launch.check(finished, f"tracing {Path(model).name} in llama.cpp", "check that the model loads in llama.cpp (ggufcarve inspect; llama.cpp's error is above)")
        if not result_file.exists():
            raise ToolFailed(f"tracing {Path(model).name}: the child exited 0 without writing its results", "run again with GGUFCARVE_DEBUG=1")
        with np.load(result_file) as data:
            nodes_out: dict[str, dict[int, np.ndarray]] = {}
            for key in data.files:
                if key.startswith("node:"):
                    _, node, block = key.split(":")
                    nodes_out.setdefault(node, {})[int(block)] = data[key].copy()
            result = Trace(len(tokens), data["logits"].copy() if "logits" in data.files else None,
                           {node: dict(sorted(blocks.items())) for node, blocks in nodes_out.items()})
    return result


# ---------------------------------------------------------------------------------------------
# the child process

EXIT_LOAD, EXIT_CONTEXT, EXIT_DECODE, EXIT_LOGITS, EXIT_CALLBACK, EXIT_TOKENS = 3, 4, 5, 6, 7, 8


def _child(model: str, tokens: list[int], out: Path, nodes: frozenset[str], want_logits: bool, threads: int, batch_size: int, context: int, verbose: bool) -> int:
    import llama_cpp

    forward_warnings(llama_cpp, verbose)
    tracer = GraphTracer(nodes)
    lmodel = load_model(llama_cpp, model)
    if not lmodel:
        print(f"ggufcarve-trace: llama.cpp could not load {model}", file=sys.stderr)
        return EXIT_LOAD
    n = len(tokens)
    ctx = traced_context(llama_cpp, lmodel, n_ctx=max(64, -(-context // 64) * 64), n_batch=batch_size, n_ubatch=batch_size, threads=threads, eval_callback=tracer)
    if not ctx:
        print("ggufcarve-trace: llama.cpp could not create a context", file=sys.stderr)
        return EXIT_CONTEXT
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(lmodel))
    logits = np.empty((n, n_vocab), dtype=np.float32) if want_logits else None
    batch = llama_cpp.llama_batch_init(batch_size, 0, 1)
    memory = llama_cpp.llama_get_memory(ctx)
    for chunk_start in range(0, n, context):
        llama_cpp.llama_memory_clear(memory, True)
        chunk_end = min(chunk_start + context, n)
        for start in range(chunk_start, chunk_end, batch_size):
            piece = tokens[start:min(start + batch_size, chunk_end)]
            fill_batch(batch, ((token, start - chunk_start + i, 0) for i, token in enumerate(piece)))
            rc = llama_cpp.llama_decode(ctx, batch)
            if rc != 0:
                print(f"ggufcarve-trace: llama_decode returned {rc} at token {start}", file=sys.stderr)
                return EXIT_DECODE
            if logits is not None:
                for i in range(len(piece)):
                    pointer = llama_cpp.llama_get_logits_ith(ctx, i)
                    if not pointer:
                        print(f"ggufcarve-trace: no logits for token {start + i}", file=sys.stderr)
                        return EXIT_LOGITS
                    logits[start + i] = np.ctypeslib.as_array(pointer, shape=(n_vocab,))
            print(f"ggufcarve-trace: decoded {start + len(piece)}/{n} tokens", file=sys.stderr, flush=True)
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(lmodel)
    if tracer.errors:
        print("ggufcarve-trace: the eval callback failed: " + "; ".join(tracer.errors[:5]), file=sys.stderr)
        return EXIT_CALLBACK
    arrays: dict[str, np.ndarray] = {} if logits is None else {"logits": logits}
    for node, blocks in tracer.arrays().items():
        for block, array in blocks.items():
            if array.shape[0] != n:
                print(f"ggufcarve-trace: {node}-{block} holds {array.shape[0]} tokens, expected {n}", file=sys.stderr)
                return EXIT_TOKENS
            arrays[f"node:{node}:{block}"] = array
    write_results(out, arrays)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ggufcarve.llama.trace", description="Decode tokens in llama.cpp and capture MoE graph nodes.")
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", required=True, type=Path, help=".npy file of int32 token ids")
    parser.add_argument("--out", required=True, type=Path, help=".npz file to write")
    parser.add_argument("--node", action="append", default=[], choices=sorted(NODES))
    parser.add_argument("--no-logits", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="tokens per micro-batch")
    parser.add_argument("--context", type=int, default=0, help="tokens per independently decoded chunk (0: all)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    tokens = [int(t) for t in np.load(args.tokens)]
    context = args.context if args.context > 0 else max(1, len(tokens))
    return _child(args.model, tokens, args.out, frozenset(args.node), not args.no_logits, args.threads, max(1, min(args.batch, context)), context, args.verbose)


if __name__ == "__main__":
    sys.exit(main())
