"""Perplexity with llama-perplexity's convention (tools/perplexity/perplexity.cpp, `perplexity()`).

* The text is tokenized once with the vocab's special tokens (a BOS first when the vocab adds
  one); a file's single trailing newline is dropped first (common/arg.cpp, `-f`).
* It is cut into `n_chunk = n_tokens // n_ctx` chunks (at most `--chunks`); at least
  `2 * n_ctx` tokens are required.
* Each chunk is decoded alone from an empty cache; its first token is replaced by BOS when the
  vocab adds one.
* Only the second half is scored: the logits at positions `first = n_ctx // 2 .. n_ctx - 2`
  predict the tokens at `first + 1 .. n_ctx - 1` (`n_ctx - 1 - first` tokens per chunk).
* PPL = exp(mean NLL); its error is `ppl * sqrt((mean(NLL^2) - mean(NLL)^2) / (count - 1))`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Chunking:
    """How a token sequence is cut into scored chunks."""

    n_ctx: int
    n_chunk: int

    @property
    def first(self) -> int:
        """The first position whose logits are scored."""
        return self.n_ctx // 2

    @property
    def scored_per_chunk(self) -> int:
        return self.n_ctx - 1 - self.first

    @property
    def n_scored(self) -> int:
        return self.n_chunk * self.scored_per_chunk

    @property
    def n_tokens(self) -> int:
        """Tokens the chunks cover (the text may hold more)."""
        return self.n_chunk * self.n_ctx


def min_tokens(n_ctx: int) -> int:
    """llama-perplexity refuses texts that tokenize to fewer tokens than this."""
    return 2 * n_ctx


def plan_chunks(n_tokens: int, n_ctx: int, max_chunks: int | None) -> Chunking:
    """The chunks of a text of `n_tokens` tokens; ValueError when it is shorter than `min_tokens`."""
    if n_ctx < 4:
        raise ValueError(f"a context of {n_ctx} tokens is too small to score (at least 4)")
    if n_tokens < min_tokens(n_ctx):
        raise ValueError(
            f"the text tokenizes to {n_tokens} tokens; a context of {n_ctx} needs at least {min_tokens(n_ctx)}"
        )
    n_chunk = n_tokens // n_ctx
    if max_chunks is not None and max_chunks > 0:
        n_chunk = min(n_chunk, max_chunks)
    return Chunking(n_ctx, n_chunk)


def read_text(data: bytes) -> bytes:
    """The prompt llama-perplexity's `-f` makes of a file's bytes: one trailing newline dropped."""
    return data[:-1] if data.endswith(b"\n") else data


def chunk_tokens(tokens: np.ndarray, chunking: Chunking, index: int, add_bos: bool, bos: int) -> np.ndarray:
    """The tokens decoded for chunk `index`: its n_ctx tokens, the first replaced by BOS when the vocab adds one."""
    start = index * chunking.n_ctx
    chunk = np.array(tokens[start : start + chunking.n_ctx], dtype=np.int32)
    if add_bos:
        chunk[0] = bos
    return chunk


def scored_targets(tokens: np.ndarray, chunking: Chunking, index: int) -> np.ndarray:
    """The tokens predicted by the scored logits of chunk `index` (original tokens, never BOS)."""
    start = index * chunking.n_ctx + chunking.first + 1
    return np.asarray(tokens[start : start + chunking.scored_per_chunk], dtype=np.int64)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-probabilities in float64 (max subtracted first, as llama.cpp does)."""
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


@dataclass(frozen=True)
class Perplexity:
    ppl: float
    ppl_stderr: float
    count: int  # scored tokens
    mean_nll: float


def perplexity(nll: np.ndarray) -> Perplexity:
    """PPL and its standard error from per-token negative log-likelihoods, exactly as perplexity.cpp's `perplexity()`
    ends."""
    nll = np.asarray(nll, dtype=np.float64)
    count = int(nll.size)
    if count < 2:
        raise ValueError("perplexity needs at least two scored tokens")
    mean = float(nll.sum() / count)
    mean2 = float((nll * nll).sum() / count)
    ppl = math.exp(mean)
    variance = mean2 - mean * mean
    stderr = math.sqrt(variance / (count - 1)) * ppl if variance > 0 else 0.0
    return Perplexity(ppl, stderr, count, mean)
