"""The tune child's request and the successive-halving schedule, shared by both sides.

Successive halving over held-out chunks, per group of candidates (one group per K): every
candidate of a group is scored on the first `n` chunks of every held-out file; the better half
(ceil(C/2), by mean KLD over the tokens scored; ties: the earlier candidate) goes on with the chunk
count doubled; when two candidates are left, or the doubled count reaches every chunk, the ones
left (the finalists) are scored on every chunk and the lower mean KLD wins. `n` starts at
max(1, N / 2^(ceil(log2 C) - 1)), N the largest chunk count of the held-out files, so that the two
finalists reach N after ceil(log2 C) - 1 halvings. Each round scores only the chunks a candidate
has not been scored on yet.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

CHILD_MODULE = "ggufcarve.tune.child"
CHUNK_TASK = "chunk"  # progress: chunks decoded (the reference's and the candidates')


@dataclass
class Request:
    """Load `model` once; score the reference (no mask) and every candidate keep-set (masked) on the held-out texts."""

    TASK: ClassVar[str] = "tune"

    model: str
    threads: int
    n_ctx: int
    texts: list[str]
    result_out: str
    work: str  # directory of the per-candidate token tables (<candidate>-<file index>.npy) and the reference's records
    candidates: dict[str, dict[str, list[int]]] = field(default_factory=dict)  # id -> block -> kept ids
    groups: list[list[str]] = field(default_factory=list)  # the candidates that compete with each other
    max_chunks: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Request:
        return cls(**doc)


def first_slice(n_candidates: int, n_chunks: int) -> int:
    """The chunk count of the first round (module docstring)."""
    if n_candidates <= 1:
        return n_chunks
    return max(1, n_chunks >> max(0, math.ceil(math.log2(n_candidates)) - 1))


def schedule(n_candidates: int, n_chunks: int) -> list[tuple[int, int]]:
    """The rounds of one group: (candidates scored, chunks each has been scored on at the round's end)."""
    rounds = []
    alive, n = n_candidates, first_slice(n_candidates, n_chunks)
    while alive > 2 and n < n_chunks:
        rounds.append((alive, n))
        alive, n = math.ceil(alive / 2), min(n_chunks, 2 * n)
    rounds.append((alive, n_chunks))
    return rounds
