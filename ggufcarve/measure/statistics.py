"""Paired comparisons of two candidates scored on the same tokens, and the rules that decide between them.

Two candidates scored against the same reference on the same tokens give per-token values x_t and
y_t of the metric's column (KLD for the KLD metrics, the token's negative log-likelihood for PPL).
Their difference d_t = x_t - y_t has mean m and standard error s = sd(d) / sqrt(n) (sd with n - 1).
x is worse than y beyond noise when m > z * s; within noise (a tie) when |m| <= z * s. The
standard error counts tokens as independent, as llama-perplexity's statistics do; tokens of one
chunk are correlated, so s is a lower bound and z = 2 a lenient threshold for a tie.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

DEFAULT_Z = 2.0
METRICS = ("kld_mean", "kld_p999", "ppl")  # lower is better
PREFERENCES = ("smaller", "faster", "metric")  # which of the candidates tied with the leader is the answer


def metric_column(metric: str) -> int:
    """The per-token column (evaluate.kld.TOKEN_COLUMNS) whose paired difference decides `metric`."""
    from ggufcarve.evaluate import kld

    return kld.NLL if metric == "ppl" else kld.KLD


@dataclass(frozen=True)
class PairedDifference:
    mean: float  # mean over tokens of (candidate - other)
    stderr: float
    tokens: int

    def worse_beyond(self, z: float) -> bool:
        return self.mean > z * self.stderr

    def within(self, z: float) -> bool:
        return abs(self.mean) <= z * self.stderr

    def to_json(self) -> dict[str, Any]:
        return {"mean": self.mean, "stderr": self.stderr, "tokens": self.tokens}


def paired_difference(values: np.ndarray, other: np.ndarray) -> PairedDifference:
    """The paired difference of two per-token series on the same tokens (module docstring)."""
    if values.shape != other.shape:
        raise ValueError(f"paired series of {values.shape[0]} and {other.shape[0]} tokens: not the same tokens")
    d = np.asarray(values, dtype=np.float64) - np.asarray(other, dtype=np.float64)
    n = int(d.shape[0])
    if n == 0:
        return PairedDifference(0.0, math.inf, 0)
    mean = float(d.mean())
    stderr = float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else math.inf
    return PairedDifference(mean, stderr, n)


@dataclass(frozen=True)
class Choice:
    """A finalist as the decision sees it."""

    id: str
    value: float  # the metric (lower is better)
    file_bytes: int = 0
    read_bytes: int = 0  # bytes one token reads (the speed proxy of `prefer = "faster"`)


def choose_answer(finalists: Sequence[Choice], ties: Sequence[str], prefer: str) -> str:
    """The answer among the leader (lowest metric) and the finalists tied with it: the smaller file,
    the fewer bytes read per token, or the lower metric; ties of that broken by the metric, then the id."""
    if prefer not in PREFERENCES:
        raise ValueError(f"prefer {prefer!r}: not one of {', '.join(PREFERENCES)}")
    leader = min(finalists, key=lambda c: (c.value, c.id))
    pool = [c for c in finalists if c.id == leader.id or c.id in ties]
    if prefer == "smaller":
        return min(pool, key=lambda c: (c.file_bytes, c.value, c.id)).id
    if prefer == "faster":
        return min(pool, key=lambda c: (c.read_bytes, c.value, c.id)).id
    return leader.id
