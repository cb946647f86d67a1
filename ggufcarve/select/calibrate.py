"""Scoring experts from a calibration run through llama.cpp itself (llama-cpp-python, eval callback).

`calibrate` starts `python -m ggufcarve.select.calibrate` through the one launcher (llama.cpp
aborts the whole process on a failed GGML_ASSERT). The child loads the model on the CPU (extra
buffer types off), tokenizes and chunks the calibration documents (see `calibration`), turns
warm-up off (a warm-up decode routes every token to every expert), and decodes chunk by chunk with
an empty KV cache and logits requested for every token (the last block computes only tokens whose
logits are requested), micro-batches of at most 512 tokens as llama-imatrix's default. An eval
callback (`GraphTracer`) copies the MoE nodes a criterion needs; each block's nodes are folded into
the statistics as soon as the graph moves on to the next block, so memory holds one block of one
micro-batch. The child writes the statistics to an .npz file; progress lines
"ggufcarve-calibrate: traced N/M tokens" become events of stage "calibrate" in tokens.

MTP blocks are not run by llama.cpp's decode graph: they are scored by the weights rule, noted in
their block record.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ggufcarve.errors import BadInput, ToolFailed
from ggufcarve.events import Event, Sink, ignore
from ggufcarve.gguf.container import GGUFModel
from ggufcarve.llama.ggml import tensor_at
from ggufcarve.llama.libllama import (
    forward_warnings,
    load_model,
    traced_context,
    write_results,
)
from ggufcarve.moe.layout import MoeLayout
from ggufcarve.select.calibration import Document, read_calibration
from ggufcarve.select.scores import BlockStats, ExpertScores, ModelFacts

DEFAULT_CTX = 512
MICRO_BATCH = 512  # llama-imatrix's default n_ubatch
PROGRESS_LINE = re.compile(r"^ggufcarve-calibrate: traced (?P<done>\d+)/(?P<total>\d+) tokens$")
ERROR_LINE = re.compile(r"^ggufcarve-calibrate: error: (?P<message>.*?)(?: \|\| (?P<hint>.*))?$")
IDLE_TIMEOUT = 600.0
MTP_NOTE = "MTP block: llama.cpp's decode graph does not run it; scored by the weights rule"
# numpy's matrix products (RAZOR's refill experts) run beside llama.cpp's own threads: a BLAS
# thread pool on top oversubscribes the cores (measured: 30x slower products on 2 cores).
SINGLE_THREADED_BLAS = {"OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
EXIT_BAD_INPUT, EXIT_LOAD, EXIT_DECODE, EXIT_CALLBACK = 2, 3, 5, 7


def calibrate(
    model: GGUFModel,
    layout: MoeLayout,
    method: str,
    files: Sequence[Path],
    *,
    ctx: int = DEFAULT_CTX,
    max_tokens: int | None = None,
    threads: int | None = None,
    on_event: Sink = ignore,
) -> ExpertScores:
    """Trace the calibration files through llama.cpp and score every expert with `method`."""
    from ggufcarve.llama import launch
    from ggufcarve.select.from_trace import TRACE_METHODS
    from ggufcarve.select.zero_shot import weights_stats

    if method not in TRACE_METHODS:
        raise BadInput(f"{method} is not a calibration method", f"one of {', '.join(TRACE_METHODS)}")
    if ctx < 2:
        raise BadInput(f"--ctx {ctx} is too small", "give a context of at least 2 tokens (llama-imatrix uses 512)")
    if max_tokens is not None and max_tokens < ctx:
        raise BadInput(f"--max-tokens {max_tokens} is less than one --ctx chunk of {ctx}", "raise --max-tokens or lower --ctx")
    if method == "razor" and layout.expert_used_count < 2:
        raise BadInput("razor needs at least 2 experts per token (top-k >= 2)", "use reap or ean for top-1 routing")
    if method == "razor":
        from ggufcarve.select.experts import activation_of

        activation_of(layout.architecture)
    calibration = read_calibration(files)
    with tempfile.TemporaryDirectory(prefix="ggufcarve-calibrate-") as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "statistics.npz"
        request.write_text(json.dumps({
            "model": os.fspath(model.path), "method": method, "ctx": ctx, "max_tokens": max_tokens,
            "threads": threads or min(os.cpu_count() or 1, 8),
            "files": [[d.to_json() for d in f.documents] for f in calibration],
        }))
        refused: list[BadInput] = []

        def watch(line: str) -> None:
            if m := PROGRESS_LINE.match(line):
                on_event(Event("calibrate", int(m["done"]), int(m["total"]), "tokens"))
            elif m := ERROR_LINE.match(line):
                refused.append(BadInput(m["message"], m["hint"] or ""))

        finished = launch.run([sys.executable, "-m", "ggufcarve.select.calibrate", "--request", str(request), "--out", str(result)],
                              on_line=watch, idle_timeout=IDLE_TIMEOUT, env=SINGLE_THREADED_BLAS)
        if refused:
            raise refused[0]
        launch.check(finished, f"calibrating {model.path.name} in llama.cpp", "check that the model loads in llama.cpp (llama.cpp's last lines are above)")
        if not result.exists():
            raise ToolFailed(f"calibrating {model.path.name}: the child exited 0 without writing its statistics", "run again with GGUFCARVE_DEBUG=1")
        with np.load(result) as data:
            file_tokens = [int(n) for n in data["file_tokens"]]
            traced, chunk_count = int(data["tokens"]), int(data["chunks"])
            blocks: dict[int, BlockStats] = {}
            for block in layout.blocks:
                if f"counts:{block}" not in data.files:
                    continue
                arrays = {name: data[f"{name}:{block}"].copy() for name in ("counts", "sums", "sums_sq", "maxima") if f"{name}:{block}" in data.files}
                blocks[block] = BlockStats(method, str(data["statistic"]), **arrays)
    untraced = [b for b in layout.blocks if b not in blocks]
    missing = [b for b in untraced if not layout.is_mtp(b)]
    if missing:
        raise ToolFailed(f"the trace of {model.path.name} has no MoE nodes for block(s) {missing}", "the llama.cpp graph of this architecture does not go through build_moe_ffn")
    parameters: dict[str, Any] = {"ctx": ctx, "max_tokens": max_tokens, "micro_batch": min(ctx, MICRO_BATCH), "chunks": chunk_count}
    if untraced:
        extra, rules = weights_stats(model, layout, untraced, on_event, note=MTP_NOTE)
        blocks.update(extra)
        parameters["scale_rules"] = rules
    inputs = tuple(f.record(n) for f, n in zip(calibration, file_tokens))
    scores = ExpertScores(method, ModelFacts.of(model, layout), blocks, parameters, inputs, traced)
    scores.check()
    return scores


# ---------------------------------------------------------------------------------------------
# the child process



def _refuse(message: str, hint: str) -> int:
    print(f"ggufcarve-calibrate: error: {message} || {hint}", file=sys.stderr, flush=True)
    return EXIT_BAD_INPUT



class BlockFolder:
    """The eval callback: GraphTracer's copies, folded into TraceStatistics one block at a time."""

    def __init__(self, tracer: Any, statistics: Any, parse: Any) -> None:
        self.tracer, self.statistics, self.parse = tracer, statistics, parse
        self.block: int | None = None
        self.errors: list[str] = []

    def __call__(self, address: int, ask: bool, user_data: object) -> bool:
        answer = self.tracer(address, ask, user_data)
        if ask:
            return answer
        try:
            parsed = self.parse(tensor_at(address).label)
            if parsed is not None and parsed[0] in self.tracer.nodes | {"ffn_moe_logits"} and parsed[1] != self.block:
                self.flush(keep=parsed[1])
                self.block = parsed[1]
        except BaseException as err:  # an exception escaping into ctypes would read as False
            if len(self.errors) < 20:
                self.errors.append(f"{type(err).__name__}: {err}")
        return True

    def flush(self, keep: int | None = None) -> None:
        """Fold every captured block except `keep` (the one being computed) into the statistics."""
        blocks = {b for per_block in self.tracer.captured.values() for b in per_block} - {keep}
        for block in sorted(blocks):
            nodes = {node: np.concatenate(per_block.pop(block), axis=0) for node, per_block in self.tracer.captured.items() if block in per_block}
            self.statistics.add(block, nodes)


def _child(request: dict[str, Any], out: Path) -> int:
    import llama_cpp

    from ggufcarve.gguf.container import read_model
    from ggufcarve.llama.trace import GraphTracer, parse_node_name
    from ggufcarve.moe.layout import inspect_layout
    from ggufcarve.select.calibration import chunks, render_chat, tokenize
    from ggufcarve.select.experts import ExpertEvaluator
    from ggufcarve.select.from_trace import STATISTIC, TraceStatistics, nodes_for

    method, ctx_size = request["method"], int(request["ctx"])
    model_path = request["model"]
    layout = inspect_layout(read_model(model_path))
    forward_warnings(llama_cpp)
    lmodel = load_model(llama_cpp, model_path)
    if not lmodel:
        print(f"ggufcarve-calibrate: llama.cpp could not load {model_path}", file=sys.stderr)
        return EXIT_LOAD
    vocab = llama_cpp.llama_model_get_vocab(lmodel)
    bos = int(llama_cpp.llama_vocab_bos(vocab)) if llama_cpp.llama_vocab_get_add_bos(vocab) else None
    template = None
    tokens: list[int] = []
    file_tokens = []
    for documents in request["files"]:
        count = 0
        for raw in documents:
            doc = Document.from_json(raw)
            if doc.messages is not None:
                template = template or llama_cpp.llama_model_chat_template(lmodel, None)
                if not template:
                    return _refuse(f"{Path(model_path).name} has no chat template (tokenizer.chat_template) to render \"messages\"", "give JSONL with \"text\" or \"prompt\" + \"response\" fields")
                text = render_chat(llama_cpp, template, doc.messages)
            else:
                text = doc.text or ""
            ids = tokenize(llama_cpp, vocab, text)
            count += len(ids)
            tokens.extend(ids)
        file_tokens.append(count)
    work = chunks(tokens, ctx_size, bos, request["max_tokens"])
    if not work:
        return _refuse(f"the calibration input tokenizes to {len(tokens)} tokens, fewer than one --ctx chunk of {ctx_size}", "give more text or a smaller --ctx")

    evaluator = ExpertEvaluator(read_model(model_path), layout) if method in ("razor", "ean", "reap") else None
    statistics = TraceStatistics(method, layout.expert_count, evaluator)
    tracer = GraphTracer(frozenset(nodes_for(method)))
    folder = BlockFolder(tracer, statistics, parse_node_name)
    ctx = traced_context(llama_cpp, lmodel, n_ctx=ctx_size, n_batch=ctx_size, n_ubatch=min(ctx_size, MICRO_BATCH), threads=int(request["threads"]), eval_callback=folder)
    if not ctx:
        print("ggufcarve-calibrate: llama.cpp could not create a context", file=sys.stderr)
        return EXIT_LOAD
    memory = llama_cpp.llama_get_memory(ctx)
    batch = llama_cpp.llama_batch_init(ctx_size, 0, 1)
    total = len(work) * ctx_size
    for number, chunk in enumerate(work):
        llama_cpp.llama_memory_clear(memory, True)
        for i, token in enumerate(chunk):
            batch.token[i] = token
            batch.pos[i] = i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1
        batch.n_tokens = len(chunk)
        rc = llama_cpp.llama_decode(ctx, batch)
        if rc != 0:
            print(f"ggufcarve-calibrate: llama_decode returned {rc} on chunk {number}", file=sys.stderr)
            return EXIT_DECODE
        try:
            folder.flush()
            folder.block = None
        except BadInput as err:
            return _refuse(err.message, err.hint)
        if folder.errors or tracer.errors:
            print("ggufcarve-calibrate: the eval callback failed: " + "; ".join((tracer.errors + folder.errors)[:5]), file=sys.stderr)
            return EXIT_CALLBACK
        print(f"ggufcarve-calibrate: traced {(number + 1) * ctx_size}/{total} tokens", file=sys.stderr, flush=True)
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(lmodel)
    arrays: dict[str, np.ndarray] = {"file_tokens": np.asarray(file_tokens), "tokens": np.asarray(total), "chunks": np.asarray(len(work)), "statistic": np.asarray(STATISTIC[method])}
    for block, stats in statistics.blocks().items():
        for name, values in stats.arrays().items():
            arrays[f"{name}:{block}"] = values
    write_results(out, arrays)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ggufcarve.select.calibrate", description="Trace calibration text through llama.cpp and accumulate expert statistics.")
    parser.add_argument("--request", required=True, type=Path, help="JSON request written by calibrate()")
    parser.add_argument("--out", required=True, type=Path, help=".npz file to write")
    args = parser.parse_args(argv)
    return _child(json.loads(args.request.read_text()), args.out)


if __name__ == "__main__":
    sys.exit(main())
