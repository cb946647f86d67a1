"""Scoring experts from a calibration run through llama.cpp itself (llama-cpp-python, eval callback),
and the importance matrix of the same run.

`run_calibration` starts `python -m ggufcarve.select.calibrate` through the one launcher (llama.cpp
aborts the whole process on a failed GGML_ASSERT), or adopts the one a command started ahead
(`ggufcarve.select.prestart`), and writes its request to the child's stdin. The child loads the
model on the CPU (extra buffer types off), tokenizes and chunks the calibration documents and
decodes the chunks exactly as llama-imatrix does (see `calibration`: sequences side by side, an
empty KV cache per group, logits for every token, llama.cpp's own micro-batches), with warm-up off
(a warm-up decode routes every token to every expert). One eval callback serves two consumers in that one decode:
  * a selection criterion: `GraphTracer` copies the MoE nodes it needs; each block's nodes are
    folded into the statistics once the graph moves on to the next block (`BlockFolder`), so
    memory holds one block of one micro-batch (razor: up to HELD_BYTES across the micro-batches
    of one decode call, for larger products);
  * the importance matrix (`ggufcarve.imatrix.collect.ImatrixAccumulator`): llama-imatrix's
    statistics of every MUL_MAT / MUL_MAT_ID of a blk.* weight;
`EvalDispatch` observes the union of their nodes. The child writes both to an .npz file; progress
lines "ggufcarve-calibrate: traced N/M tokens" become events in tokens (stage "calibrate", or
"imatrix" for `collect_imatrix`). `calibrate(..., imatrix_out=PATH)` writes the imatrix too.

MTP blocks are not run by llama.cpp's decode graph: they are scored by the weights rule, noted in
their block record (and have no imatrix entries, as with llama-imatrix).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ggufcarve.errors import BadInput, ToolFailed
from ggufcarve.events import Event, Sink, ignore
from ggufcarve.gguf.container import GGUFModel
from ggufcarve.llama.ggml import tensor_at
from ggufcarve.llama.libllama import (
    fill_batch,
    forward_warnings,
    load_model,
    traced_context,
    write_results,
)
from ggufcarve.moe.layout import MoeLayout
from ggufcarve.select import prestart
from ggufcarve.select.calibration import Batching, CalibrationFile, read_calibration
from ggufcarve.select.prestart import CHILD_ARGV, SINGLE_THREADED_BLAS
from ggufcarve.select.scores import BlockStats, ExpertScores, ModelFacts

if TYPE_CHECKING:
    from ggufcarve.imatrix.collect import Collected

DEFAULT_CTX = 512
PROGRESS_LINE = re.compile(r"^ggufcarve-calibrate: traced (?P<done>\d+)/(?P<total>\d+) tokens$")
ERROR_LINE = re.compile(r"^ggufcarve-calibrate: error: (?P<message>.*?)(?: \|\| (?P<hint>.*))?$")
IDLE_TIMEOUT = 600.0
MTP_NOTE = "MTP block: llama.cpp's decode graph does not run it; scored by the weights rule"
# captures a batched criterion (razor) holds across micro-batches, over all blocks: its refill
# experts are evaluated for more tokens per product (on 2 cores a 512-token micro-batch of 32
# experts took 1.9 s of products per 8,192 tokens, the 2,048 tokens of one decode call 0.9 s)
HELD_BYTES = 256 << 20
EXIT_BAD_INPUT, EXIT_LOAD, EXIT_DECODE, EXIT_CALLBACK = 2, 3, 5, 7


@dataclass
class CalibrationRun:
    """What one calibration child returns: the criterion's statistics (when a method was given)
    and the written imatrix (when an output was given)."""

    calibration: list[CalibrationFile]
    file_tokens: list[int]
    tokens: int
    chunks: int
    batching: Batching
    statistic: str | None = None
    blocks: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    imatrix: Collected | None = None


def run_calibration(
    model: GGUFModel,
    files: Sequence[Path],
    *,
    method: str | None,
    ctx: int = DEFAULT_CTX,
    max_tokens: int | None = None,
    threads: int | None = None,
    imatrix_out: Path | None = None,
    force: bool = False,
    on_event: Sink = ignore,
    stage: str = "calibrate",
) -> CalibrationRun:
    """One decode of the calibration files: `method`'s statistics and/or the imatrix to `imatrix_out`."""
    from ggufcarve.fileio import check_outputs
    from ggufcarve.llama import launch

    if ctx < 2:
        raise BadInput(f"--ctx {ctx} is too small", "give a context of at least 2 tokens (llama-imatrix uses 512)")
    if max_tokens is not None and max_tokens < ctx:
        raise BadInput(f"--max-tokens {max_tokens} is less than one --ctx chunk of {ctx}", "raise --max-tokens or lower --ctx")
    if method is None and imatrix_out is None:
        raise BadInput("nothing to collect", "give a calibration method or an imatrix output")
    calibration = read_calibration(files)
    if imatrix_out is not None:
        check_outputs([Path(imatrix_out)], list(model.paths), 0, force)
    batching = Batching.of(ctx)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ggufcarve-calibrate-") as tmp:
        result = Path(tmp) / "statistics.npz"
        request = json.dumps({
            "model": os.fspath(model.path), "method": method, "ctx": ctx, "max_tokens": max_tokens,
            "threads": threads or min(os.cpu_count() or 1, 8), "imatrix": imatrix_out is not None,
            "files": [[d.to_json() for d in f.documents] for f in calibration], "out": str(result),
        }).encode()
        refused: list[BadInput] = []

        def watch(line: str) -> None:
            if m := PROGRESS_LINE.match(line):
                on_event(Event(stage, int(m["done"]), int(m["total"]), "tokens"))
            elif m := ERROR_LINE.match(line):
                refused.append(BadInput(m["message"], m["hint"] or ""))

        finished = launch.run(CHILD_ARGV, started=prestart.adopt(), input=request, on_line=watch, idle_timeout=IDLE_TIMEOUT, env=SINGLE_THREADED_BLAS)
        if refused:
            raise refused[0]
        launch.check(finished, f"calibrating {model.path.name} in llama.cpp", "check that the model loads in llama.cpp (llama.cpp's last lines are above)")
        if not result.exists():
            raise ToolFailed(f"calibrating {model.path.name}: the child exited 0 without writing its statistics", "run again with GGUFCARVE_DEBUG=1")
        seconds = time.monotonic() - started
        with np.load(result) as data:
            run = CalibrationRun(calibration, [int(n) for n in data["file_tokens"]], int(data["tokens"]), int(data["chunks"]), batching,
                                 str(data["statistic"]) if "statistic" in data.files else None)
            for key in data.files:
                name, _, block = key.partition(":")
                if name in ("counts", "sums", "sums_sq", "maxima") and block.isdigit():
                    run.blocks.setdefault(int(block), {})[name] = data[key].copy()
            if imatrix_out is not None:
                from ggufcarve.imatrix.collect import COUNTS_PREFIX, SUMS_PREFIX, write_collected

                arrays = {k: data[k] for k in data.files if k.startswith((SUMS_PREFIX, COUNTS_PREFIX))}
                run.imatrix = write_collected(arrays, [f.path.name for f in calibration], ctx, Path(imatrix_out), tokens=run.tokens,
                                              seconds=seconds, force=force, sources=list(model.paths), on_event=on_event)
    return run


def calibrate(
    model: GGUFModel,
    layout: MoeLayout,
    method: str,
    files: Sequence[Path],
    *,
    ctx: int = DEFAULT_CTX,
    max_tokens: int | None = None,
    threads: int | None = None,
    imatrix_out: Path | None = None,
    force: bool = False,
    on_event: Sink = ignore,
) -> ExpertScores:
    """Trace the calibration files through llama.cpp and score every expert with `method`.

    With `imatrix_out`, the same decode also collects the model's importance matrix, written
    there as llama-imatrix would write it from the same text and --ctx (refused if it exists,
    unless `force`)."""
    from ggufcarve.select.prestart import TRACE_METHODS
    from ggufcarve.select.zero_shot import weights_stats

    if method not in TRACE_METHODS:
        raise BadInput(f"{method} is not a calibration method", f"one of {', '.join(TRACE_METHODS)}")
    if method == "razor" and layout.expert_used_count < 2:
        raise BadInput("razor needs at least 2 experts per token (top-k >= 2)", "use reap or ean for top-1 routing")
    if method == "razor":
        from ggufcarve.select.experts import activation_of

        activation_of(layout.architecture)
    run = run_calibration(model, files, method=method, ctx=ctx, max_tokens=max_tokens, threads=threads, imatrix_out=imatrix_out, force=force, on_event=on_event)
    blocks = {block: BlockStats(method, str(run.statistic), **run.blocks[block]) for block in layout.blocks if block in run.blocks}
    untraced = [b for b in layout.blocks if b not in blocks]
    missing = [b for b in untraced if not layout.is_mtp(b)]
    if missing:
        raise ToolFailed(f"the trace of {model.path.name} has no MoE nodes for block(s) {missing}", "the llama.cpp graph of this architecture does not go through build_moe_ffn")
    parameters: dict[str, Any] = {"ctx": ctx, "max_tokens": max_tokens, "micro_batch": run.batching.micro_batch, "sequences": run.batching.sequences, "chunks": run.chunks}
    if untraced:
        extra, rules = weights_stats(model, layout, untraced, on_event, note=MTP_NOTE)
        blocks.update(extra)
        parameters["scale_rules"] = rules
    inputs = tuple(f.record(n) for f, n in zip(run.calibration, run.file_tokens))
    scores = ExpertScores(method, ModelFacts.of(model, layout), blocks, parameters, inputs, run.tokens)
    scores.check()
    return scores


# ---------------------------------------------------------------------------------------------
# the child process



def _refuse(message: str, hint: str) -> int:
    print(f"ggufcarve-calibrate: error: {message} || {hint}", file=sys.stderr, flush=True)
    return EXIT_BAD_INPUT



class BlockFolder:
    """The eval callback: GraphTracer's copies, folded into TraceStatistics block by block.

    A block's captures are folded once the graph has moved on to another block: micro-batch by
    micro-batch, or, for a criterion that evaluates experts in batches (`statistics.batched`),
    once the block holds `hold_bytes` of captures or the decode call ends (`flush()`), so that its
    products see as many tokens at once as that memory allows."""

    def __init__(self, tracer: Any, statistics: Any, parse: Any, hold_bytes: int = 0) -> None:
        self.tracer, self.statistics, self.parse = tracer, statistics, parse
        self.hold_bytes = hold_bytes if statistics.batched else 0
        self.block: int | None = None
        self.errors: list[str] = []

    def __call__(self, address: int, ask: bool, user_data: object) -> bool:
        answer = self.tracer(address, ask, user_data)
        if ask:
            return answer
        try:
            parsed = self.parse(tensor_at(address).label)
            if parsed is not None and parsed[0] in self.tracer.nodes | {"ffn_moe_logits"} and parsed[1] != self.block:
                self.flush(keep=parsed[1], held=True)
                self.block = parsed[1]
        except BaseException as err:  # an exception escaping into ctypes would read as False
            if len(self.errors) < 20:
                self.errors.append(f"{type(err).__name__}: {err}")
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
            parts = {node: per_block.pop(block) for node, per_block in self.tracer.captured.items() if block in per_block}
            if self.statistics.batched or len({len(p) for p in parts.values()}) != 1:
                self.statistics.add(block, {node: np.concatenate(p, axis=0) for node, p in parts.items()})
            else:  # one micro-batch at a time: every node holds one part per micro-batch
                for i in range(len(next(iter(parts.values())))):
                    self.statistics.add(block, {node: p[i] for node, p in parts.items()})


def _child(request: dict[str, Any], out: Path) -> int:
    import llama_cpp

    from ggufcarve.imatrix.collect import EvalDispatch, ImatrixAccumulator
    from ggufcarve.select.calibration import chunks, tokenize_files

    method, ctx_size = request["method"], int(request["ctx"])
    model_path = request["model"]
    forward_warnings(llama_cpp)
    lmodel = load_model(llama_cpp, model_path)
    if not lmodel:
        print(f"ggufcarve-calibrate: llama.cpp could not load {model_path}", file=sys.stderr)
        return EXIT_LOAD
    vocab = llama_cpp.llama_model_get_vocab(lmodel)
    bos = int(llama_cpp.llama_vocab_bos(vocab)) if llama_cpp.llama_vocab_get_add_bos(vocab) else None
    try:
        tokens, file_tokens = tokenize_files(llama_cpp, lmodel, Path(model_path).name, request["files"])
    except BadInput as err:
        return _refuse(err.message, err.hint)
    work = chunks(tokens, ctx_size, bos, request["max_tokens"])
    if not work:
        return _refuse(f"the calibration input tokenizes to {len(tokens)} tokens, fewer than one --ctx chunk of {ctx_size}", "give more text or a smaller --ctx")

    consumers: list[Any] = []
    folder, statistics, tracer = None, None, None
    if method is not None:
        from ggufcarve.gguf.container import read_model
        from ggufcarve.llama.trace import GraphTracer, parse_node_name
        from ggufcarve.moe.layout import inspect_layout
        from ggufcarve.select.experts import ExpertEvaluator
        from ggufcarve.select.from_trace import TraceStatistics, nodes_for

        layout = inspect_layout(read_model(model_path))
        evaluator = ExpertEvaluator(read_model(model_path), layout, threads=int(request["threads"])) if method in ("razor", "ean", "reap") else None
        statistics = TraceStatistics(method, layout.expert_count, evaluator)
        tracer = GraphTracer(frozenset(nodes_for(method)))
        folder = BlockFolder(tracer, statistics, parse_node_name, hold_bytes=HELD_BYTES // max(1, len(layout.blocks)))
        consumers.append(folder)
    accumulator = ImatrixAccumulator() if request.get("imatrix") else None
    if accumulator is not None:
        consumers.append(accumulator)
    callback = consumers[0] if len(consumers) == 1 else EvalDispatch(*consumers)
    batching = Batching.of(ctx_size)
    ctx = traced_context(llama_cpp, lmodel, n_ctx=batching.kv_cells, n_batch=batching.batch, n_ubatch=batching.micro_batch, threads=int(request["threads"]),
                         eval_callback=callback, sequences=batching.sequences, swa_full=False)
    if not ctx:
        print("ggufcarve-calibrate: llama.cpp could not create a context", file=sys.stderr)
        return EXIT_LOAD
    memory = llama_cpp.llama_get_memory(ctx)
    batch = llama_cpp.llama_batch_init(batching.batch, 0, 1)
    total, done = len(work) * ctx_size, 0
    for clear, entries in batching.batches(work):
        if clear:
            llama_cpp.llama_memory_clear(memory, True)
        fill_batch(batch, entries)
        rc = llama_cpp.llama_decode(ctx, batch)
        if rc != 0:
            print(f"ggufcarve-calibrate: llama_decode returned {rc} at token {done} of the chunks", file=sys.stderr)
            return EXIT_DECODE
        if folder is not None:
            try:
                folder.flush()
                folder.block = None
            except BadInput as err:
                return _refuse(err.message, err.hint)
        errors = (tracer.errors if tracer else []) + (folder.errors if folder else []) + (accumulator.errors if accumulator else [])
        if errors:
            print("ggufcarve-calibrate: the eval callback failed: " + "; ".join(errors[:5]), file=sys.stderr)
            return EXIT_CALLBACK
        done += len(entries)
        print(f"ggufcarve-calibrate: traced {done}/{total} tokens", file=sys.stderr, flush=True)
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(lmodel)
    arrays: dict[str, np.ndarray] = {"file_tokens": np.asarray(file_tokens), "tokens": np.asarray(total), "chunks": np.asarray(len(work))}
    if statistics is not None:
        from ggufcarve.select.from_trace import STATISTIC

        arrays["statistic"] = np.asarray(STATISTIC[method])
        for block, stats in statistics.blocks().items():
            for name, values in stats.arrays().items():
                arrays[f"{name}:{block}"] = values
    if accumulator is not None:
        arrays.update(accumulator.arrays())
    write_results(out, arrays)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ggufcarve.select.calibrate", description="Trace calibration text through llama.cpp and accumulate expert statistics.")
    parser.add_argument("--request", required=True, help="JSON request written by run_calibration, or - to read it from stdin")
    parser.add_argument("--out", type=Path, help=".npz file to write (default: the request's \"out\")")
    args = parser.parse_args(argv)
    if args.request == "-":
        import llama_cpp  # noqa: F401 - imported before the request arrives: see ggufcarve.select.prestart

        import ggufcarve.imatrix.collect
        import ggufcarve.llama.trace
        import ggufcarve.select.from_trace  # noqa: F401

        text = sys.stdin.read()
        if not text:
            return 0  # a child started ahead that its parent never needed
        request = json.loads(text)
    else:
        request = json.loads(Path(args.request).read_text())
    out = args.out or Path(request["out"])
    return _child(request, out)


if __name__ == "__main__":
    sys.exit(main())
