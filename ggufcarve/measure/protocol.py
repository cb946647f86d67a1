"""The measurement child's request, shared by both sides.

One request loads one model file and scores jobs: a job is a candidate (an optional keep-set, the
experts it drops taken out of routing) and the units it is scored on. A unit is a group of
consecutive chunks of one held-out file that `ggufcarve eval` decodes side by side (n_seq =
2048 // n_ctx chunks, llama-perplexity's batching), so that every micro-batch holds the tokens it
holds there. The reference of each held-out file is a llama-perplexity base file or a top-k cache
(its tokens are the ones scored). A job's per-token table (float64 rows of evaluate.kld.TOKEN_COLUMNS,
unit after unit, chunk order within a unit) is written to its `table_out`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from ggufcarve.llama.devices import Compute

CHILD_MODULE = "ggufcarve.measure.child"
CHUNK_TASK = "chunk"  # progress: chunks decoded


@dataclass
class Job:
    id: str
    units: list[list[int]]  # [segment, first chunk, chunk count]
    table_out: str
    keep: dict[str, list[int]] | None = None  # block -> kept expert ids; None: every expert routed


@dataclass
class Request:
    TASK: ClassVar[str] = "measure"

    model: str
    compute: Compute  # devices, offloaded layers, threads (resolved)
    references: list[str]  # per held-out file: its reference log-probs (base file or top-k cache)
    result_out: str
    jobs: list[Job] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Request:
        return cls(
            **{**doc, "compute": Compute.from_json(doc["compute"]), "jobs": [Job(**j) for j in doc.get("jobs", [])]}
        )
