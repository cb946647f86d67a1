"""Which (K, rung) pairs compete for a memory budget, from `fit`'s exact sizes.

For every rung of the ladder: the largest K of fit's grid whose file plus the context's cache fits
the budget, and the next smaller K of the grid; a K equal to the source's expert count is the
unpruned model at that rung. Every rung of the unpruned model that fits is a candidate too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ggufcarve.quant.fit import FitReport

PRUNED, UNPRUNED = "pruned", "unpruned"


@dataclass(frozen=True)
class Candidate:
    kept: int
    expert_count: int
    quant: str  # the rung's name
    file_bytes: int  # predicted by fit (llama.cpp's quantizer dry run); the built file's size replaces it
    cache_bytes: int
    memory: int

    @property
    def family(self) -> str:
        return UNPRUNED if self.kept == self.expert_count else PRUNED

    @property
    def id(self) -> str:
        return f"unpruned-{self.quant}" if self.family == UNPRUNED else f"K{self.kept}-{self.quant}"

    @property
    def fits(self) -> bool:
        return self.file_bytes + self.cache_bytes <= self.memory

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "kept_experts": self.kept, "expert_count": self.expert_count, "quant": self.quant, "family": self.family,
                "file_bytes": self.file_bytes, "cache_bytes": self.cache_bytes, "fits": self.fits}


def choose_candidates(report: FitReport) -> list[Candidate]:
    """The candidates of a fit report (module docstring), smallest file first."""
    n = report.layout.expert_count
    chosen: dict[tuple[int, str], Candidate] = {}
    for rung in report.spec.rungs:
        rows = [r for r in report.rows if r.rung.rung == rung.name]
        fitting = sorted((r for r in rows if r.fits), key=lambda r: r.kept, reverse=True)
        for r in fitting[:2]:  # the unpruned row, when it fits, is the first (the largest K)
            chosen[(r.kept, rung.name)] = Candidate(r.kept, n, rung.name, r.rung.bytes, r.cache_bytes, report.memory)
    return sorted(chosen.values(), key=lambda c: (c.file_bytes, -c.kept, c.quant))
