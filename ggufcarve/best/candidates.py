"""Which (K, rung) pairs compete for a memory budget, from `fit`'s exact sizes.

For every rung of the ladder: the largest K of fit's grid that runs in the asked tier
(placement.offload.TIERS: on the GPU whole, on the GPU with --n-cpu-moe N, in system memory, or paging
from disk), and the next smaller K of the grid; a K equal to the source's expert count is the
unpruned model at that rung. Every rung of the unpruned model that runs in the tier is a candidate too.
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
    measured: dict[str, Any] | None = (
        None  # llama.cpp's dry load (llama.memory.DeviceMemory.to_json) of the K's header, weights from fit's sizes
    )
    tiers: tuple[str, ...] = ("ram", "disk")  # the tiers it runs in, fastest first (fit's row)
    asked: str = "ram"  # the tier the search ranks in
    devices: tuple[dict[str, Any], ...] = ()  # per device running in the asked tier (fit's row.devices_in)

    @property
    def family(self) -> str:
        return UNPRUNED if self.kept == self.expert_count else PRUNED

    @property
    def id(self) -> str:
        return f"unpruned-{self.quant}" if self.family == UNPRUNED else f"K{self.kept}-{self.quant}"

    @property
    def total(self) -> int:
        """Host bytes: llama.cpp's measured total when measured, else the file and the cache."""
        return self.measured["total"] if self.measured else self.file_bytes + self.cache_bytes

    @property
    def estimated_total(self) -> int:
        """The estimate of the first device's total in the asked tier (the host's without a GPU)."""
        return self.devices[0]["total"] if self.devices else self.total

    @property
    def fits(self) -> bool:
        """Runs in the asked tier: every device's total within its budget there."""
        return self.asked in self.tiers

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kept_experts": self.kept,
            "expert_count": self.expert_count,
            "quant": self.quant,
            "family": self.family,
            "file_bytes": self.file_bytes,
            "cache_bytes": self.cache_bytes,
            "fits": self.fits,
            "tier": self.tiers[0],
            "tiers": list(self.tiers),
            **(
                {
                    "memory": list(self.devices) or [self.measured],
                    "memory_source": "estimated: llama.cpp's dry load of the K's "
                    "header, the rung's weights from fit's sizes",
                }
                if self.measured
                else {}
            ),
        }


def choose_candidates(report: FitReport, tier: str = "ram") -> list[Candidate]:
    """The candidates of a fit report running in `tier` (module docstring), smallest file first."""
    n = report.layout.expert_count
    chosen: dict[tuple[int, str], Candidate] = {}
    for rung in report.spec.rungs:
        rows = [r for r in report.rows if r.rung.rung == rung.name]
        fitting = sorted((r for r in rows if tier in r.tiers), key=lambda r: r.kept, reverse=True)
        for r in fitting[:2]:  # the unpruned row, when it fits, is the first (the largest K)
            measured = r.memory_measured.to_json() if r.memory_measured is not None else None
            chosen[(r.kept, rung.name)] = Candidate(
                r.kept,
                n,
                rung.name,
                r.rung.bytes,
                r.cache_bytes,
                report.memory,
                measured,
                r.tiers,
                tier,
                tuple(d.to_json() for d in r.devices_in(tier)),
            )
    return sorted(chosen.values(), key=lambda c: (c.file_bytes, -c.kept, c.quant))
