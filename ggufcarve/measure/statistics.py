"""Paired comparisons of two candidates scored on the same tokens, and the rules that decide between them.

Two candidates scored against the same reference on the same tokens give per-token values x_t and
y_t of the metric's column (KLD for the KLD metrics, the token's negative log-likelihood for PPL).
Tokens of one chunk share their context, so their values are correlated; chunks are decoded
independently (the cache cleared between them). The standard errors here therefore count chunks,
not tokens, as the independent units:
  * a mean (kld_mean; ppl through the mean negative log-likelihood, which orders as ppl does): the
    chunk means D_c of d_t = x_t - y_t (every chunk scores the same number of tokens, so their mean
    is the token mean m), s = sd(D) / sqrt(C) with C chunks (sd with C - 1);
  * a percentile (kld_p999): the difference of the two percentiles, s from a block bootstrap over
    chunks (the same resampled chunks for both, BOOTSTRAP_RESAMPLES of them, seeded).
x is worse than y beyond noise when m > z * s; within noise (a tie) when |m| <= z * s. The per-token
formula sd(d) / sqrt(n), llama-perplexity's, is too small by up to sqrt(tokens per chunk) when the
chunks differ (`token_stderr`, kept beside for comparison).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

DEFAULT_Z = 2.0
METRICS = ("kld_mean", "kld_p999", "ppl")  # lower is better
BOOTSTRAP_RESAMPLES = 200
BOOTSTRAP_SEED = 20261204
PERCENTILES = {"kld_p999": 0.999}  # metric -> the fraction of its percentile
PREFERENCES = ("smaller", "faster", "metric")  # which of the candidates tied with the leader is the answer


def check_z(z: float) -> None:
    """A decision threshold in standard errors must be positive (0 makes every difference beyond noise)."""
    from ggufcarve.errors import BadInput

    if not z > 0:
        raise BadInput(f"--z {z:g} must be > 0", "the standard errors a difference must exceed; 2 is usual")


def metric_column(metric: str) -> int:
    """The per-token column (evaluate.kld.TOKEN_COLUMNS) whose paired difference decides `metric`."""
    from ggufcarve.evaluate import kld

    return kld.NLL if metric == "ppl" else kld.KLD


@dataclass(frozen=True)
class PairedDifference:
    mean: float  # the metric's statistic of the candidate minus the other's (for a mean: mean over tokens)
    stderr: float  # over chunks (module docstring)
    tokens: int
    chunks: int = 0

    def worse_beyond(self, z: float) -> bool:
        return self.mean > z * self.stderr

    def within(self, z: float) -> bool:
        return abs(self.mean) <= z * self.stderr

    def to_json(self) -> dict[str, Any]:
        """JSON has no infinity: a difference over fewer than two chunks has the standard error None."""
        stderr = self.stderr if math.isfinite(self.stderr) else None
        return {"mean": self.mean, "stderr": stderr, "tokens": self.tokens, "chunks": self.chunks}


def _chunks(values: np.ndarray, per_chunk: int) -> np.ndarray:
    """A per-token series as [chunks, per_chunk] (the tables hold whole chunks, in order)."""
    n = int(values.shape[0])
    if per_chunk < 1 or n % per_chunk:
        raise ValueError(f"{n} tokens are not whole chunks of {per_chunk}")
    return np.asarray(values, dtype=np.float64).reshape(n // per_chunk, per_chunk)


def chunk_stderr(values: np.ndarray, per_chunk: int) -> float:
    """The standard error of the token mean of a series of whole chunks, from its chunk means."""
    means = _chunks(values, per_chunk).mean(axis=1)
    return float(means.std(ddof=1) / math.sqrt(len(means))) if len(means) > 1 else math.inf


def token_stderr(values: np.ndarray) -> float:
    """sd / sqrt(n) over tokens, as if every token were independent (llama-perplexity's formula)."""
    n = int(values.shape[0])
    return float(np.asarray(values, dtype=np.float64).std(ddof=1) / math.sqrt(n)) if n > 1 else math.inf


def percentile(values: np.ndarray, fraction: float) -> float:
    """perplexity.cpp's percentile of a series (evaluate.kld's rule)."""
    from ggufcarve.evaluate.kld import sorted_percentile

    return sorted_percentile(np.sort(np.asarray(values, dtype=np.float32)), fraction)


def paired_difference(
    values: np.ndarray, other: np.ndarray, per_chunk: int | None = None, metric: str = "kld_mean"
) -> PairedDifference:
    """The paired difference of two per-token series on the same tokens, chunks of `per_chunk` tokens each
    (module docstring); None: every token its own chunk. A percentile `metric` compares percentiles."""
    if values.shape != other.shape:
        raise ValueError(f"paired series of {values.shape[0]} and {other.shape[0]} tokens: not the same tokens")
    n = int(values.shape[0])
    per_chunk = per_chunk or 1
    if n == 0:
        return PairedDifference(0.0, math.inf, 0, 0)
    chunks = n // per_chunk
    if metric in PERCENTILES:
        fraction = PERCENTILES[metric]
        a, b = _chunks(values, per_chunk), _chunks(other, per_chunk)
        difference = percentile(a.reshape(-1), fraction) - percentile(b.reshape(-1), fraction)
        if chunks < 2:
            return PairedDifference(difference, math.inf, n, chunks)
        rng = np.random.default_rng(BOOTSTRAP_SEED)
        draws = [
            percentile(a[pick].reshape(-1), fraction) - percentile(b[pick].reshape(-1), fraction)
            for pick in rng.integers(0, chunks, size=(BOOTSTRAP_RESAMPLES, chunks))
        ]
        return PairedDifference(difference, float(np.std(draws, ddof=1)), n, chunks)
    d = np.asarray(values, dtype=np.float64) - np.asarray(other, dtype=np.float64)
    return PairedDifference(float(d.mean()), chunk_stderr(d, per_chunk), n, chunks)


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
