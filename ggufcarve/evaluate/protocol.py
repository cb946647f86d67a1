"""The evaluation's shared types: the child's request, the run's settings and its reference.

The bottom of `ggufcarve.evaluate`: the parent side (run, spawn, crosscheck, summary) and the
child (`python -m ggufcarve.evaluate.child`) both import it; it imports no module of the
evaluation that imports it back.

The child speaks the child-task protocol of `ggufcarve.llama.child`: its request is a `Request`
(task "evaluate"), its progress is in chunks (task CHUNK_TASK) and QA steps (task QA_TASK), its
result file is the JSON `Request.result_out`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ggufcarve import settings as S
from ggufcarve.evaluate.speed import SpeedSettings
from ggufcarve.llama.devices import Compute
from ggufcarve.llama.tools import physical_cores
from ggufcarve.settings import key

if TYPE_CHECKING:
    from ggufcarve.evaluate.gate import Gate
    from ggufcarve.evaluate.loops import LoopSettings
    from ggufcarve.evaluate.models import ModelEntry

CHILD_MODULE = "ggufcarve.evaluate.child"
CHUNK_TASK, QA_TASK, LOOP_TASK = (
    "chunk",
    "qa",
    "loops",
)  # the child's progress tasks: chunks scored, QA checks asked, loop prompts continued
DEFAULT_TOP_K = 128  # reference log-probs per token of a top-k cache
DEFAULT_TAIL_SAMPLES = 32  # tail tokens drawn per token of a top-k cache (the unbiased estimate of the tail's KLD)
REFERENCE_FULL = "full"  # llama-perplexity's --kl-divergence-base file: every token's log-prob in 16 bits
REFERENCE_TOPK = "topk"  # ggufcarve's top-k cache: top-k log-probs, the tail mass and sampled tail tokens
REFERENCE_STORES = (REFERENCE_FULL, REFERENCE_TOPK)


@dataclass
class Request:
    """What the evaluation child does: load `model`, score the text or the reference file's tokens, write the named
    files."""

    TASK: ClassVar[str] = "evaluate"

    model: str
    compute: Compute  # devices, offloaded layers, threads (threads given: the parent resolves the default)
    n_ctx: int
    result_out: str
    text: str | None = None  # held-out text file (tokenized by this model)
    reference_in: str | None = None  # a top-k cache or base file: its tokens are scored and compared
    max_chunks: int | None = None
    table_out: str | None = None  # the per-token table (float64 rows of kld.TOKEN_COLUMNS), chunk by chunk
    cache_out: str | None = None  # the top-k cache of this model as a reference
    cache_identity: dict = field(default_factory=dict)  # reference_sha256, text_sha256 for the cache header
    top_k: int = DEFAULT_TOP_K
    tail_samples: int = DEFAULT_TAIL_SAMPLES
    base_out: str | None = None  # this model's llama-perplexity base file
    speed: dict | None = None  # SpeedSettings fields
    qa: list[dict] | None = None  # QA checks as plain dicts (ggufcarve.evaluate.qa)
    segments: list[dict] | None = (
        None  # instead of reference_in/table_out: per held-out file {"reference_in", "table_out"}, scored in order
    )
    loops: dict | None = (
        None  # {"prompts", "tokens"}: greedy continuations for the loop detector (ggufcarve.evaluate.loops)
    )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Request:
        return cls(**{**doc, "compute": Compute.from_json(doc["compute"])})


@dataclass(frozen=True)
class EvalSettings:
    ctx: int = key(S.CTX, 512)
    chunks: int | None = key(S.CHUNKS, None)
    top_k: int = key(S.TOP_K, DEFAULT_TOP_K)  # used with reference_store "topk"
    speed: SpeedSettings | None = SpeedSettings()
    gate: Gate | None = key(S.GATE, None)  # the gate file's rules, loaded (with gate_segments)
    qa_checks: list[dict] | None = key(S.QA, None)  # the QA suite's checks, loaded
    cross_check: bool = False
    kl_base_out: Path | None = None  # also write the reference's log-probs as a llama-perplexity base file
    llama_cpp_dir: Path | None = key(S.LLAMA_CPP, None)
    cache_dir: Path | None = None
    reference_store: str = REFERENCE_FULL  # how a GGUF reference's log-probs are kept (REFERENCE_STORES)
    tail_samples: int = key(S.TAIL_SAMPLES, DEFAULT_TAIL_SAMPLES)  # used with reference_store "topk"
    loops: LoopSettings | None = None  # repetition loops: prompts continued greedily and judged by the detector
    compute: Compute = S.compute_key()  # where every child runs (threads 0: the physical cores)

    @property
    def threads(self) -> int:
        """The CPU threads of every child: the given ones, else the physical cores."""
        return self.compute.threads or physical_cores()

    @property
    def child_compute(self) -> Compute:
        """`compute` with its threads resolved, as every child gets it."""
        return self.compute.with_threads(self.threads)


@dataclass
class Reference:
    """The reference as used: a GGUF model (entry set) or a reference file, and the file the children read."""

    label: str
    kind: str  # "gguf", "topk" or "base"
    sha256: str
    file: Path  # the top-k cache or base file the children compare with
    entry: ModelEntry | None = None
    top_k: int | None = None  # log-probs per token of a top-k cache; None for a base file (full vocabulary)
    tail_samples: int = 0  # sampled tail tokens per token of a top-k cache
    cached: bool = False  # its log-probs came from the cache
    seconds: float = 0.0  # spent computing its log-probs in this run
