"""The decode pass: token ids or calibration text decoded by llama.cpp in a child process, with
consumers observing the graph through its eval callback.

    from ggufcarve.llama.calibration import Batching
    from ggufcarve.llama.decode import ConsumerSpec, DecodeRequest, decode
    request = DecodeRequest("model.gguf", (ConsumerSpec("imatrix", "ggufcarve.imatrix.collect:accumulator"),),
                            Batching.of(512), documents=(documents,))
    result = decode(request, what="collecting the imatrix of model.gguf")
    result.outputs["imatrix"]         # the arrays that consumer returned, by name
    result.tokens, result.chunks      # tokens decoded, in that many chunks

Input, one of:
  * `documents`: calibration text (`llama.calibration.Document`s, one tuple per file), tokenized by
    the model's vocabulary and cut into whole chunks as llama-imatrix cuts them (`max_tokens`
    keeps the first whole chunks within it);
  * `tokens`: token ids, cut into chunks of `batching.ctx` (the last one may be shorter).
Every chunk is decoded from an empty KV cache, laid into batches by `batching`, with logits
requested for every token and warm-up off (a warm-up decode routes every token to every expert).
With `logits`, the logits of every token are returned in decode order.

Consumers: a `ConsumerSpec` names a factory "module:attribute" of the ggufcarve package, which
the child imports and calls as `factory(request, **options)`. The factories live with their
callers (the imatrix accumulator in imatrix/collect, the trace statistics in select/from_trace,
the node capture in llama/trace): this module imports none of them. What a factory returns is a
`Consumer`; `EvalDispatch` hands every node the graph computes to all of them.

The child (`python -m ggufcarve.llama.decode`) speaks the child-task protocol of
`ggufcarve.llama.child` (llama.cpp aborts the whole process on a failed assert): the request is one
DecodeRequest, progress is in tokens (task "decode"), input it refuses is an "input" error
(BadInput in the parent), and its one result file (.npz) holds "tokens", "chunks", "file_tokens",
"logits" when asked, and "<consumer name>/<array name>" for the arrays of each consumer.
`prestart` starts the child ahead, with the consumers' modules imported, so that its interpreter
start and imports (numpy, gguf-py, llama-cpp-python's low-level bindings (`libllama.bindings`):
about 0.15 s) overlap the caller's own work; `decode` adopts it. The child exits without the
interpreter's teardown once its result is written (`child.exit_now`).
"""

from __future__ import annotations

import importlib
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from ggufcarve.errors import BadInput, ToolFailed
from ggufcarve.events import Sink, ignore
from ggufcarve.llama import child
from ggufcarve.llama.devices import CPU, Compute

if TYPE_CHECKING:  # imported where used: `prestart` runs before anything else a command imports
    from ggufcarve.llama.calibration import Batching, Document

CHILD_MODULE = "ggufcarve.llama.decode"
TASK = "decode"
IDLE_TIMEOUT = 600.0  # one micro-batch of a large model on a slow CPU takes minutes, not ten
# The decode child's environment:
#  * numpy's matrix products (greedy's rerouted experts) run on ExpertEvaluator's own thread pool:
#    a BLAS thread pool under each oversubscribes the cores (measured: 30x slower products on 2 cores);
#  * glibc's malloc maps an allocation above M_MMAP_THRESHOLD (adjusted between 128 KiB and 32 MiB)
#    afresh and unmaps it when freed, and trims the heap's top above M_TRIM_THRESHOLD: the eval
#    callback's copies and temporaries of every block and micro-batch (MiBs each) then fault their
#    pages in again each time. Fixed thresholds of 256 MiB keep them in the heap (measured on the
#    demo model's calibration text: the statistics consumer's cost from about 0.4 s to 0.2 s of a
#    1.6 s decode).
DECODE_ENV = {
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MALLOC_MMAP_THRESHOLD_": str(256 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(256 << 20),
}
LLAMA_HINT = "the lines after it are llama.cpp's own; check that the model loads (ggufcarve inspect MODEL)"


@dataclass(frozen=True)
class ConsumerSpec:
    """A consumer of the decode: its `name` (the prefix of its arrays in the result), the factory
    "ggufcarve.module:attribute" the child calls with the request and `options`."""

    name: str
    factory: str
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        module, _, attribute = self.factory.partition(":")
        if not module.startswith("ggufcarve.") or not attribute.isidentifier() or not self.name or "/" in self.name:
            raise BadInput(
                f"consumer {self.name!r}: factory {self.factory!r} is not a ggufcarve module:attribute",
                "name a factory such as ggufcarve.imatrix.collect:accumulator",
            )

    def load(self) -> Callable[..., Consumer]:
        module, _, attribute = self.factory.partition(":")
        return getattr(importlib.import_module(module), attribute)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class DecodeRequest:
    """What one decode child does (see the module docstring)."""

    TASK: ClassVar[str] = TASK

    model: str
    consumers: tuple[ConsumerSpec, ...]
    batching: Batching
    documents: tuple[tuple[Document, ...], ...] = ()
    tokens: tuple[int, ...] = ()
    max_tokens: int | None = None
    logits: bool = False
    compute: Compute = CPU  # devices, offloaded layers, threads (0: min(cores, 8))
    verbose: bool = False  # forward llama.cpp's info and debug logs too

    def __post_init__(self) -> None:
        if bool(self.documents) == bool(self.tokens):
            raise BadInput("a decode takes either calibration documents or token ids", "give one of them")
        names = [c.name for c in self.consumers]
        if len(set(names)) != len(names):
            raise BadInput(f"consumers {names}: a name is given twice", "name every consumer once")

    @property
    def thread_count(self) -> int:
        return default_threads(self.compute.threads)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "consumers": [{"name": c.name, "factory": c.factory, "options": c.options} for c in self.consumers],
            "batching": self.batching.to_json(),
            "documents": [[d.to_json() for d in f] for f in self.documents],
            "tokens": list(self.tokens),
            "max_tokens": self.max_tokens,
            "logits": self.logits,
            "compute": self.compute.to_json(),
            "verbose": self.verbose,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> DecodeRequest:
        from ggufcarve.llama.calibration import Batching, Document

        return cls(
            doc["model"],
            tuple(ConsumerSpec(c["name"], c["factory"], dict(c["options"])) for c in doc["consumers"]),
            Batching(**doc["batching"]),
            tuple(tuple(Document.from_json(d) for d in f) for f in doc["documents"]),
            tuple(int(t) for t in doc["tokens"]),
            doc["max_tokens"],
            bool(doc["logits"]),
            Compute.from_json(doc["compute"]),
            bool(doc["verbose"]),
        )


def default_threads(threads: int | None) -> int:
    """`threads`, or when not given (None or 0) the decode's default: min(physical cores, 8)."""
    from ggufcarve.llama.tools import physical_cores

    return threads or min(physical_cores(), 8)


class Consumer(Protocol):
    """What a factory returns: the eval callback of one consumer.

    Called twice per graph node by the scheduler (ggml_backend_sched_eval_callback): with ask=True
    ("observe this node?") and, for nodes some consumer observes, with ask=False once computed; it
    never raises (an exception escaping into ctypes reads as False, which stops the graph split)
    and keeps what went wrong in `errors` instead. `decoded()` runs after every llama_decode call
    (a BadInput raised there refuses the input); `arrays()` is its result."""

    errors: list[str]

    def __call__(self, address: int, ask: bool, user_data: object) -> bool: ...

    def decoded(self) -> None: ...

    def arrays(self) -> dict[str, Any]: ...


class EvalDispatch:
    """One eval callback for several consumers: observes the union of the nodes they ask for and
    hands every computed node to each of them (each decides again whether it is one of its own)."""

    def __init__(self, *consumers: Callable[[int, bool, object], bool]) -> None:
        self.consumers = consumers

    def __call__(self, address: int, ask: bool, user_data: object) -> bool:
        if ask:
            wanted = False
            for consumer in self.consumers:
                wanted = consumer(address, True, user_data) or wanted
            return wanted
        for consumer in self.consumers:
            consumer(address, False, user_data)
        return True


@dataclass
class DecodeResult:
    tokens: int  # tokens decoded
    chunks: int
    file_tokens: list[int]  # tokens of each calibration file (documents input)
    logits: Any  # [tokens, n_vocab] float32 in decode order, or None
    outputs: dict[str, dict[str, Any]]  # consumer name -> its arrays
    seconds: float


# ---------------------------------------------------------------------------------------------
# the parent


def prestart(preload: Sequence[str] = ()) -> None:
    """Start a decode child now, importing the modules `preload` names, unless one waits already."""
    child.start(CHILD_MODULE, preload, env=DECODE_ENV)


def decode(
    request: DecodeRequest,
    *,
    what: str,
    stage: str = "decode",
    on_event: Sink = ignore,
    on_line: Callable[[str], None] | None = None,
    timeout: float | None = None,
    idle_timeout: float | None = IDLE_TIMEOUT,
) -> DecodeResult:
    """Run `request` in a decode child (the one `prestart` started, or a new one) and read its result.

    `what` names the work in an error ("calibrating model.gguf"). Progress: events of `stage` in
    tokens; the child's other lines go to `on_line`. Raises BadInput for input the child refuses,
    ToolFailed (with the child's last lines) when it fails."""
    started = time.monotonic()

    def read(path: Path) -> DecodeResult:
        import numpy as np

        outputs: dict[str, dict[str, Any]] = {c.name: {} for c in request.consumers}
        with np.load(path) as data:
            for key in data.files:
                name, _, array = key.partition("/")
                if array:
                    outputs[name][array] = data[key].copy()
            logits = data["logits"].copy() if "logits" in data.files else None
            return DecodeResult(
                int(data["tokens"]),
                int(data["chunks"]),
                [int(n) for n in data["file_tokens"]],
                logits,
                outputs,
                time.monotonic() - started,
            )

    with tempfile.TemporaryDirectory(prefix="ggufcarve-decode-") as tmp:
        return child.run(
            CHILD_MODULE,
            request,
            Path(tmp) / "result.npz",
            read,
            what=f"{what}: the decode child",
            hint="its last lines are quoted; GGUFCARVE_DEBUG=1 keeps the traceback of an error in ggufcarve itself",
            sink=on_event,
            stages={TASK: stage},
            on_line=on_line,
            timeout=timeout,
            idle_timeout=idle_timeout,
            env=DECODE_ENV,
        )


# ---------------------------------------------------------------------------------------------
# the child


def _child(request: DecodeRequest, out: Path) -> None:
    """Decode `request`, write its result to `out`; ToolFailed when llama.cpp fails, BadInput for input it refuses."""
    import numpy as np

    from ggufcarve.llama.calibration import chunks, cut, tokenize_files
    from ggufcarve.llama.libllama import (
        bindings,
        fill_batch,
        forward_warnings,
        load_model,
        traced_context,
        write_results,
    )

    llama_cpp = bindings()

    forward_warnings(llama_cpp, request.verbose)
    lmodel = load_model(llama_cpp, request.model, request.compute, TASK)
    if not lmodel:
        raise ToolFailed(f"llama.cpp could not load {request.model}", LLAMA_HINT)
    batching = request.batching
    file_tokens: list[int] = []
    if request.documents:
        vocab = llama_cpp.llama_model_get_vocab(lmodel)
        bos = int(llama_cpp.llama_vocab_bos(vocab)) if llama_cpp.llama_vocab_get_add_bos(vocab) else None
        tokens, file_tokens = tokenize_files(llama_cpp, lmodel, Path(request.model).name, request.documents)
        work = chunks(tokens, batching.ctx, bos, request.max_tokens)
        if not work:
            raise BadInput(
                f"the calibration input tokenizes to {len(tokens)} "
                f"tokens, fewer than one --ctx chunk of {batching.ctx}",
                "give more text or a smaller --ctx",
            )
    else:
        work = cut(request.tokens, batching.ctx)
    consumers = [spec.load()(request, **spec.options) for spec in request.consumers]
    callback = consumers[0] if len(consumers) == 1 else EvalDispatch(*consumers)  # no consumer: nothing observed
    ctx = traced_context(
        llama_cpp,
        lmodel,
        n_ctx=batching.kv_cells,
        n_batch=batching.batch,
        n_ubatch=batching.micro_batch,
        threads=request.thread_count,
        eval_callback=callback,
        sequences=batching.sequences,
        swa_full=batching.swa_full,
    )
    if not ctx:
        raise ToolFailed("llama.cpp could not create a context", LLAMA_HINT)
    total = sum(len(chunk) for chunk in work)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(lmodel))
    logits = np.empty((total, n_vocab), dtype=np.float32) if request.logits else None
    memory = llama_cpp.llama_get_memory(ctx)
    batch = llama_cpp.llama_batch_init(batching.batch, 0, 1)
    done = 0
    for clear, entries in batching.batches(work):
        if clear:
            llama_cpp.llama_memory_clear(memory, True)
        fill_batch(batch, entries)
        rc = llama_cpp.llama_decode(ctx, batch)
        if rc != 0:
            raise ToolFailed(f"llama_decode returned {rc} at token {done} of the chunks", LLAMA_HINT)
        if logits is not None:
            for i in range(len(entries)):
                pointer = llama_cpp.llama_get_logits_ith(ctx, i)
                if not pointer:
                    raise ToolFailed(f"llama.cpp gave no logits for token {done + i}", LLAMA_HINT)
                logits[done + i] = np.ctypeslib.as_array(pointer, shape=(n_vocab,))
        for consumer in consumers:
            consumer.decoded()
        errors = [e for consumer in consumers for e in consumer.errors]
        if errors:
            raise ToolFailed(
                "the eval callback failed: " + "; ".join(errors[:5]),
                "a ggufcarve bug in a consumer of the decode; GGUFCARVE_DEBUG=1 shows more",
            )
        done += len(entries)
        child.progress(TASK, done, total, "tokens")
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(lmodel)
    arrays: dict[str, Any] = {
        "tokens": np.asarray(total),
        "chunks": np.asarray(len(work)),
        "file_tokens": np.asarray(file_tokens, dtype=np.int64),
    }
    if logits is not None:
        arrays["logits"] = logits
    for spec, consumer in zip(request.consumers, consumers):
        arrays.update({f"{spec.name}/{name}": value for name, value in consumer.arrays().items()})
    write_results(out, arrays)


def main(argv: list[str] | None = None) -> int:
    from ggufcarve.llama.libllama import bindings

    bindings()  # before the request arrives, for a child started ahead
    return child.serve(DecodeRequest, _child, argv)


if __name__ == "__main__":
    child.exit_now(main())
