"""KL divergence against a reference model: the reference's log-probabilities on disk, per-token comparisons,
statistics.

Two on-disk forms of the reference, both streamed chunk by chunk (never all in memory):

* **llama-perplexity's `--kl-divergence-base` file** (ggufcarve's default): `_logits_`, u32 n_ctx,
  i32 n_vocab, i32 n_chunk, int32 tokens[n_chunk * n_ctx], then per chunk `n_ctx - 1 - n_ctx/2`
  records of `nv = 2*((n_vocab + 1)/2) + 4` uint16: float32 scale and float32 min_log_prob in the
  first four, then one uint16 per vocabulary entry, log p = scale * value + min_log_prob; logits
  more than 16 below the maximum are stored as 0 (log p = min_log_prob). KLD from it
  (`compare_base`) is computed as llama-perplexity's `--kl-divergence` computes it, with its float32
  arithmetic and its floor (reference log-probs at or below -16 are left out of the sum).
* **Top-k cache** (`*.reflogp`, asked for with a top-k): per scored token the reference's `top_k`
  largest log-probabilities with their token ids, the log-probability of the token that follows,
  the exact probability mass R of every other token (the tail), and `tail_samples` tail tokens
  drawn from the reference's tail distribution p_tail/R with their log-probabilities. Layout: magic
  `GGUFCARVE-REFLOGP1`, u32 length of a JSON header (reference_sha256, text_sha256, n_ctx, n_vocab,
  n_chunk, top_k, tail_samples, add_bos, bos, text_chunks; a header without tail_samples has none),
  the header, int32 tokens[n_chunk * n_ctx], then `reference_record(top_k, tail_samples)` records
  in chunk order.

KLD from the top-k cache. With T the stored tokens, R the reference's tail mass and Q = 1 - sum_T q
the model's,
    KLD = sum_T p_i (log p_i - log q_i) + R log(R / Q) + R * KL(p_tail/R || q_tail/Q).
The first two terms are exact from the cache. The last is estimated from the m sampled tail tokens
s_1..s_m (independent draws from a = p_tail/R; b = q_tail/Q; r_j = b(s_j) / a(s_j)):
    R * (1/m) sum_j [r_j - 1 - log r_j].
Both a and b sum to 1 over the tail, so E[r_j] = 1 and E[-log r_j] = KL(a || b): the expectation is
the last term, and each summand is >= 0 and near (r_j - 1)^2 / 2 when the model is close to the
reference (then a far smaller variance than log(a/b) alone). The per-token KLD estimate is unbiased, and its
variance R^2 * var_j / m (`TAIL_VARIANCE`) is measured from the same draws; the standard error of
the mean KLD that the sampling adds is sqrt(sum of those variances) / count. Without samples (a
cache written before they were, or fewer than two draws) only the first two terms are known: a
lower bound of the KLD (grouping the tail into one outcome never increases a KL divergence). With
top_k equal to the vocabulary size the cache is exact. PPL, Δp and "same top p" are exact from the cache.

The statistics are those llama-perplexity's `kl_divergence()` prints, computed as it computes them.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ggufcarve.evaluate.perplexity import Chunking, log_softmax

CACHE_MAGIC = b"GGUFCARVE-REFLOGP1"
BASE_MAGIC = b"_logits_"
BASE_FLOOR = -16.0  # llama-perplexity ignores reference log-probs at or below this
TAIL_SEED = 0x6B6C64  # the draws of a top-k cache's tail samples: numpy's default_rng([TAIL_SEED, chunk index])

# columns of the per-token table a model's pass produces; TAIL_VARIANCE: variance of the KLD estimate (0 when exact)
NLL, NLL_BASE, KLD, P_DIFF, SAME_TOP, TAIL_VARIANCE = range(6)
TOKEN_COLUMNS = 6


def reference_record(top_k: int, tail_samples: int = 0) -> np.dtype:
    """One scored token of the top-k cache."""
    fields = [("ids", "<i4", (top_k,)), ("logp", "<f8", (top_k,)), ("token_logp", "<f8"), ("tail", "<f8")]
    if tail_samples:
        fields += [("sample_ids", "<i4", (tail_samples,)), ("sample_logp", "<f8", (tail_samples,))]
    return np.dtype(fields)


def base_values_per_token(n_vocab: int) -> int:
    """`nv` of perplexity.cpp: uint16 values per scored token in a base file."""
    return 2 * ((n_vocab + 1) // 2) + 4


# ---------------------------------------------------------------------------------------------
# encoding the reference


def topk_records(
    logprobs: np.ndarray, targets: np.ndarray, top_k: int, tail_samples: int = 0, rng: np.random.Generator | None = None
) -> np.ndarray:
    """Top-k cache records of rows of reference log-probabilities (float64 [n, n_vocab]), with `tail_samples` draws
    from each tail (rng)."""
    n, n_vocab = logprobs.shape
    k = min(top_k, n_vocab)
    records = np.zeros(n, dtype=reference_record(top_k, tail_samples))
    part = np.argpartition(-logprobs, k - 1, axis=1)[:, :k]
    values = np.take_along_axis(logprobs, part, axis=1)
    order = np.lexsort((part, -values), axis=1)  # most likely first, lower id first on ties
    ids = np.take_along_axis(part, order, axis=1)
    records["ids"][:, :k] = ids
    records["logp"][:, :k] = np.take_along_axis(values, order, axis=1)
    if k < top_k:
        records["ids"][:, k:] = ids[:, -1:]
        records["logp"][:, k:] = -np.inf
    records["token_logp"] = logprobs[np.arange(n), targets]
    tail = np.exp(logprobs)
    np.put_along_axis(tail, ids, 0.0, axis=1)
    records["tail"] = tail.sum(axis=1)
    if tail_samples:
        rng = rng if rng is not None else np.random.default_rng(TAIL_SEED)
        cumulative = np.cumsum(tail, axis=1)
        for row in range(n):
            total = cumulative[row, -1]
            if total <= 0:
                records["sample_ids"][row] = ids[row, 0]
                records["sample_logp"][row] = logprobs[row, ids[row, 0]]
                continue
            # inverse CDF: index i has cumulative[i-1] <= u < cumulative[i], so p_i > 0 (never a stored token)
            drawn = np.minimum(
                np.searchsorted(cumulative[row], rng.random(tail_samples) * total, side="right"), n_vocab - 1
            )
            records["sample_ids"][row] = drawn
            records["sample_logp"][row] = logprobs[row, drawn]
    return records


def _nearest_int(values: np.ndarray) -> np.ndarray:
    """perplexity.cpp's nearest_int: float32 rounding to nearest, ties to even."""
    return np.rint(values.astype(np.float32)).astype(np.int64)


def base_records(logits: np.ndarray) -> np.ndarray:
    """llama-perplexity's base-file records (uint16 [n, nv]) of rows of raw logits, with its float32 arithmetic."""
    x = np.asarray(logits, dtype=np.float32)
    n, n_vocab = x.shape
    out = np.zeros((n, base_values_per_token(n_vocab)), dtype=np.uint16)
    max_logit = x.max(axis=1)
    min_logit = np.maximum(x.min(axis=1), max_logit - np.float32(16))
    sum_exp = np.exp(x - max_logit[:, None]).astype(np.float64).sum(axis=1)
    log_sum_exp = np.log(sum_exp).astype(np.float32)
    min_log_prob = (min_logit - max_logit) - log_sum_exp
    scale = (max_logit - min_logit) / np.float32(65535)
    out[:, :4] = np.stack([scale, min_log_prob], axis=1).astype(np.float32).view(np.uint16)
    with np.errstate(divide="ignore"):
        inv_scale = np.where(scale > 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
    values = _nearest_int(inv_scale[:, None] * (x - min_logit[:, None]))
    out[:, 4 : 4 + n_vocab] = np.where(x > min_logit[:, None], values, 0).astype(np.uint16)
    return out


# ---------------------------------------------------------------------------------------------
# comparing a model's rows with the reference's


def compare_topk(logits: np.ndarray, targets: np.ndarray, records: np.ndarray) -> np.ndarray:
    """The per-token table (TOKEN_COLUMNS) of a model's raw logits [n, n_vocab] against top-k cache records (module
    docstring)."""
    logq = log_softmax(logits)
    n = logq.shape[0]
    rows = np.arange(n)
    table = np.zeros((n, TOKEN_COLUMNS), dtype=np.float64)
    ids = records["ids"]
    logp = records["logp"]
    finite = np.isfinite(logp)
    p = np.where(finite, np.exp(np.where(finite, logp, 0.0)), 0.0)
    logq_top = np.take_along_axis(logq, ids, axis=1)
    kld_top = np.where(finite, p * (np.where(finite, logp, 0.0) - logq_top), 0.0).sum(axis=1)
    q_tail_terms = np.exp(logq)
    np.put_along_axis(q_tail_terms, ids, 0.0, axis=1)
    q_tail = np.maximum(q_tail_terms.sum(axis=1), np.finfo(np.float64).tiny)
    tail = records["tail"]
    has_tail = tail > 0
    safe_tail = np.where(has_tail, tail, 1.0)
    kld_tail = np.where(has_tail, tail * (np.log(safe_tail) - np.log(q_tail)), 0.0)
    m = records["sample_ids"].shape[1] if "sample_ids" in (records.dtype.names or ()) else 0
    if m > 1:  # one draw gives no measure of its error: left out
        # x = log(a_s / b_s) of every draw, a = p_tail/R, b = q_tail/Q; the term r - 1 + x, r = b_s/a_s = e^-x
        x = (records["sample_logp"] - np.log(safe_tail)[:, None]) - (
            np.take_along_axis(logq, records["sample_ids"], axis=1) - np.log(q_tail)[:, None]
        )
        x[~has_tail] = 0.0  # no tail: the draws are placeholders
        terms = np.expm1(-x) + x
        kld_tail = kld_tail + np.where(has_tail, tail * terms.mean(axis=1), 0.0)
        table[:, TAIL_VARIANCE] = np.where(has_tail, tail * tail * terms.var(axis=1, ddof=1) / m, 0.0)
    table[:, NLL] = -logq[rows, targets]
    table[:, NLL_BASE] = -records["token_logp"]
    table[:, KLD] = kld_top + kld_tail
    table[:, P_DIFF] = np.exp(-table[:, NLL]) - np.exp(-table[:, NLL_BASE])
    table[:, SAME_TOP] = np.argmax(logits, axis=1) == ids[:, 0]
    return table


def compare_full(logits: np.ndarray, targets: np.ndarray, reference_logits: np.ndarray) -> np.ndarray:
    """The exact per-token table from both models' full logits (the yardstick of the top-k cache)."""
    logq = log_softmax(logits)
    logp = log_softmax(reference_logits)
    rows = np.arange(logq.shape[0])
    table = np.zeros((logq.shape[0], TOKEN_COLUMNS), dtype=np.float64)
    table[:, NLL] = -logq[rows, targets]
    table[:, NLL_BASE] = -logp[rows, targets]
    table[:, KLD] = (np.exp(logp) * (logp - logq)).sum(axis=1)
    table[:, P_DIFF] = np.exp(-table[:, NLL]) - np.exp(-table[:, NLL_BASE])
    table[:, SAME_TOP] = np.argmax(logits, axis=1) == np.argmax(reference_logits, axis=1)
    return table


def compare_base(logits: np.ndarray, targets: np.ndarray, base: np.ndarray) -> np.ndarray:
    """The per-token table against llama-perplexity base records, with its float32 arithmetic (perplexity.cpp
    `log_softmax` of the KLD pass)."""
    x = np.asarray(logits, dtype=np.float32)
    n, n_vocab = x.shape
    rows = np.arange(n)
    targets = np.asarray(targets, dtype=np.int64)
    header = np.ascontiguousarray(base[:, :4]).view(np.float32)
    scale, min_log_prob = header[:, 0], header[:, 1]
    imax = np.argmax(x, axis=1)
    max_logit = x[rows, imax]
    sum_exp = np.exp(x - max_logit[:, None]).astype(np.float64).sum(axis=1)
    shift = max_logit + np.log(sum_exp).astype(np.float32)  # max_logit + log_sum_exp, in float32
    nll = shift - x[rows, targets]
    log_p_base = scale[:, None] * base[:, 4 : 4 + n_vocab].astype(np.float32) + min_log_prob[:, None]
    nll_base = -log_p_base[rows, targets]
    keep = log_p_base > np.float32(BASE_FLOOR)
    terms = np.where(keep, np.exp(log_p_base) * (log_p_base - x + shift[:, None]), np.float32(0))
    table = np.zeros((n, TOKEN_COLUMNS), dtype=np.float64)
    table[:, NLL] = nll
    table[:, NLL_BASE] = nll_base
    table[:, KLD] = terms.astype(np.float64).sum(axis=1)
    table[:, P_DIFF] = np.exp(-nll) - np.exp(-nll_base)
    table[:, SAME_TOP] = imax == np.argmax(log_p_base, axis=1)
    return table


# ---------------------------------------------------------------------------------------------
# files


@dataclass(frozen=True)
class ReferenceHeader:
    reference_sha256: str
    text_sha256: str
    n_ctx: int
    n_vocab: int
    n_chunk: int
    top_k: int
    add_bos: bool
    bos: int
    text_chunks: int  # chunks the whole text holds (n_tokens // n_ctx); the cache may hold fewer
    tail_samples: int = 0  # tail tokens drawn per scored token; 0 in caches written before the draws

    @property
    def chunking(self) -> Chunking:
        return Chunking(self.n_ctx, self.n_chunk)

    def encoded(self) -> bytes:
        """The cache's magic, header length and JSON header."""
        meta = json.dumps(asdict(self), sort_keys=True).encode()
        return CACHE_MAGIC + struct.pack("<I", len(meta)) + meta

    @property
    def file_bytes(self) -> int:
        """The size of the complete top-k cache this header describes."""
        return len(self.encoded()) + 4 * self.chunking.n_tokens + self.chunking.n_scored * self.record.itemsize

    @property
    def record(self) -> np.dtype:
        return reference_record(self.top_k, self.tail_samples)

    @classmethod
    def parse(cls, meta: bytes) -> ReferenceHeader:
        """The header of a cache file; ValueError when it is not one ggufcarve writes."""
        try:
            fields = json.loads(meta)
            header = cls(**fields)
        except (ValueError, TypeError) as err:
            raise ValueError(f"unreadable top-k cache header ({err})") from None
        counts = (
            header.n_ctx,
            header.n_vocab,
            header.n_chunk,
            header.top_k,
            header.text_chunks,
            header.bos,
            header.tail_samples,
        )
        if (
            not all(isinstance(v, int) and not isinstance(v, bool) for v in counts)
            or not isinstance(header.add_bos, bool)
            or not all(isinstance(v, str) for v in (header.reference_sha256, header.text_sha256))
        ):
            raise ValueError("top-k cache header has fields of the wrong type")
        if (
            header.n_ctx < 4
            or header.n_vocab <= 0
            or header.n_chunk <= 0
            or header.top_k <= 0
            or header.text_chunks < header.n_chunk
            or header.tail_samples < 0
        ):
            raise ValueError(
                f"top-k cache header says n_ctx={header.n_ctx}, n_vocab={header.n_vocab}, "
                f"n_chunk={header.n_chunk}, top_k={header.top_k}"
            )
        return header


class DurableWriter:
    """A reference file written in order; every OSError names the file; `close` makes it durable (fsync)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.file = open(self.path, "wb")

    def write_bytes(self, data: bytes) -> None:
        try:
            self.file.write(data)
        except OSError as err:
            raise OSError(err.errno, err.strerror, str(self.path)) from None

    def close(self) -> None:
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
        except OSError as err:
            raise OSError(err.errno, err.strerror, str(self.path)) from None
        finally:
            try:
                self.file.close()
            except OSError:
                pass  # the flush above reported the error


class CacheWriter(DurableWriter):
    """Writes a top-k cache: header and tokens first, then the records chunk by chunk."""

    def __init__(self, path: Path, header: ReferenceHeader, tokens: np.ndarray) -> None:
        super().__init__(path)
        self.header = header
        self.write_bytes(header.encoded())
        self.write_bytes(np.ascontiguousarray(tokens[: header.chunking.n_tokens], dtype="<i4").tobytes())

    def write(self, records: np.ndarray) -> None:
        self.write_bytes(records.tobytes())


@dataclass
class ReferenceFile:
    """An open reference (top-k cache or llama-perplexity base file): its header, tokens and a chunk reader."""

    kind: str  # "topk" or "base"
    path: Path
    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray
    header: ReferenceHeader | None  # the top-k cache's header
    data_offset: int

    @property
    def chunking(self) -> Chunking:
        return Chunking(self.n_ctx, self.n_chunk)

    def chunks(self, n_chunk: int | None = None) -> Iterator[np.ndarray]:
        """The records of each chunk in order: structured top-k records or uint16 base rows."""
        per_chunk = self.chunking.scored_per_chunk
        with open(self.path, "rb") as f:
            f.seek(self.data_offset)
            for index in range(self.n_chunk if n_chunk is None else min(n_chunk, self.n_chunk)):
                yield _read_chunk(f, self, per_chunk, index)

    def chunk(self, f: BinaryIO, index: int) -> np.ndarray:
        """The records of chunk `index` read from `f`, this file opened for reading."""
        per_chunk = self.chunking.scored_per_chunk
        size = self.header.record.itemsize if self.header is not None else base_values_per_token(self.n_vocab) * 2
        f.seek(self.data_offset + index * per_chunk * size)
        return _read_chunk(f, self, per_chunk, index)


def _read_chunk(f: BinaryIO, ref: ReferenceFile, per_chunk: int, index: int) -> np.ndarray:
    if ref.header is not None:
        dtype = ref.header.record
        data = f.read(per_chunk * dtype.itemsize)
        if len(data) != per_chunk * dtype.itemsize:
            raise ValueError(f"{ref.path.name}: chunk {index + 1} of {ref.n_chunk} is truncated")
        return np.frombuffer(data, dtype=dtype)
    nv = base_values_per_token(ref.n_vocab)
    data = f.read(per_chunk * nv * 2)
    if len(data) != per_chunk * nv * 2:
        raise ValueError(f"{ref.path.name}: log-probs of chunk {index + 1} of {ref.n_chunk} are truncated")
    return np.frombuffer(data, dtype="<u2").reshape(per_chunk, nv)


def open_reference(path: Path) -> ReferenceFile:
    """Read the header and tokens of a top-k cache or a llama-perplexity base file; ValueError names what is wrong."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(len(CACHE_MAGIC))
        if magic == CACHE_MAGIC:
            field = f.read(4)
            if len(field) != 4:
                raise ValueError(f"{path.name}: top-k cache header is truncated")
            (length,) = struct.unpack("<I", field)
            if length > size:
                raise ValueError(f"{path.name}: top-k cache header of {length} bytes in a file of {size}")
            try:
                header = ReferenceHeader.parse(f.read(length))
            except ValueError as err:
                raise ValueError(f"{path.name}: {err}") from None
            count = header.n_chunk * header.n_ctx
            tokens = np.frombuffer(f.read(4 * count), dtype="<i4")
            offset = len(CACHE_MAGIC) + 4 + length + 4 * count
            expected = offset + header.chunking.n_scored * header.record.itemsize
            if tokens.size != count or size != expected:
                raise ValueError(f"{path.name}: top-k cache is {size} bytes, its header describes {expected}")
            return ReferenceFile(
                "topk", path, header.n_ctx, header.n_vocab, header.n_chunk, tokens.astype(np.int32), header, offset
            )
        if magic[: len(BASE_MAGIC)] != BASE_MAGIC:
            raise ValueError(
                f"{path.name} is neither a ggufcarve top-k cache nor a llama-perplexity --kl-divergence-base file"
            )
        f.seek(len(BASE_MAGIC))
        fixed = f.read(12)
        if len(fixed) != 12:
            raise ValueError(f"{path.name}: base file header is truncated")
        n_ctx, n_vocab, n_chunk = struct.unpack("<Iii", fixed)
        if n_ctx < 4 or n_vocab <= 0 or n_chunk <= 0:
            raise ValueError(f"{path.name}: base file header says n_ctx={n_ctx}, n_vocab={n_vocab}, n_chunk={n_chunk}")
        count = n_chunk * n_ctx
        tokens = np.frombuffer(f.read(4 * count), dtype="<i4")
        if tokens.size != count:
            raise ValueError(f"{path.name}: base file holds fewer than the {count} tokens its header names")
        offset = len(BASE_MAGIC) + 12 + 4 * count
        chunking = Chunking(n_ctx, n_chunk)
        expected = offset + chunking.n_scored * base_values_per_token(n_vocab) * 2
        if size < expected:
            raise ValueError(f"{path.name}: base file is {size} bytes, its header describes {expected}")
        return ReferenceFile("base", path, n_ctx, n_vocab, n_chunk, tokens.astype(np.int32), None, offset)


def base_file_bytes(n_ctx: int, n_vocab: int, n_chunk: int) -> int:
    """The size of a complete llama-perplexity base file."""
    return (
        len(BASE_MAGIC)
        + 12
        + 4 * n_ctx * n_chunk
        + Chunking(n_ctx, n_chunk).n_scored * base_values_per_token(n_vocab) * 2
    )


class BaseWriter(DurableWriter):
    """Writes llama-perplexity's --kl-divergence-base file, chunk by chunk."""

    def __init__(self, path: Path, n_ctx: int, n_vocab: int, n_chunk: int, tokens: np.ndarray) -> None:
        super().__init__(path)
        self.write_bytes(BASE_MAGIC + struct.pack("<Iii", n_ctx, n_vocab, n_chunk))
        self.write_bytes(np.ascontiguousarray(tokens[: n_ctx * n_chunk], dtype="<i4").tobytes())

    def write(self, logits: np.ndarray) -> None:
        self.write_bytes(base_records(logits).tobytes())


def copy_base(reference: ReferenceFile, path: Path, n_chunk: int) -> None:
    """Write the first n_chunk chunks of a base file as a base file of its own (durable: fsynced)."""
    if reference.kind != "base":
        raise ValueError(f"{reference.path.name} is not a llama-perplexity base file")
    n_chunk = min(n_chunk, reference.n_chunk)
    writer = DurableWriter(path)
    try:
        writer.write_bytes(BASE_MAGIC + struct.pack("<Iii", reference.n_ctx, reference.n_vocab, n_chunk))
        writer.write_bytes(np.ascontiguousarray(reference.tokens[: reference.n_ctx * n_chunk], dtype="<i4").tobytes())
        for records in reference.chunks(n_chunk):
            writer.write_bytes(records.tobytes())
    finally:
        writer.close()


# ---------------------------------------------------------------------------------------------
# statistics


def _mean_and_uncertainty(total: float, total2: float, count: int) -> tuple[float, float]:
    if count < 1:
        return 0.0, 0.0
    mean = total / count
    variance = total2 / count - mean * mean
    return mean, (math.sqrt(variance / (count - 1)) if variance > 0 and count > 10 else 0.0)


def _covariance(a: float, b: float, ab: float, count: int) -> float:
    if count < 10:
        return 0.0
    return (ab / count - (a / count) * (b / count)) / (count - 1)


def sorted_percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """perplexity.cpp's percentile: linear interpolation in float32 over sorted values."""
    fraction = np.float32(fraction)
    if fraction <= 0:
        return float(sorted_values[0])
    if fraction >= 1:
        return float(sorted_values[-1])
    p = np.float32(fraction * np.float32(sorted_values.size - 1))
    ip = int(p)
    p = np.float32(p - np.float32(ip))
    upper = sorted_values[min(ip + 1, sorted_values.size - 1)]
    return float(np.float32((np.float32(1) - p) * sorted_values[ip] + p * upper))


def _median(sorted_values: np.ndarray) -> float:
    n = sorted_values.size
    return (
        float(np.float32(0.5) * (sorted_values[n // 2] + sorted_values[n // 2 - 1]))
        if n % 2 == 0
        else float(sorted_values[n // 2])
    )


KLD_PERCENTILES = (
    ("p999", 0.999),
    ("p99", 0.990),
    ("p95", 0.950),
    ("p90", 0.900),
    ("p10", 0.100),
    ("p5", 0.050),
    ("p1", 0.010),
    ("p01", 0.001),
)
DP_PERCENTILES = (
    ("p999", 0.999),
    ("p99", 0.990),
    ("p95", 0.950),
    ("p90", 0.900),
    ("p75", 0.750),
    ("p25", 0.250),
    ("p10", 0.100),
    ("p5", 0.050),
    ("p1", 0.010),
    ("p01", 0.001),
)


@dataclass(frozen=True)
class KldStatistics:
    count: int
    ppl: float
    ppl_stderr: float
    ppl_base: float
    ppl_base_stderr: float
    ln_ppl_ratio: float
    ln_ppl_ratio_stderr: float
    ppl_ratio: float
    ppl_ratio_stderr: float
    ppl_diff: float
    ppl_diff_stderr: float
    ln_ppl_correlation: float
    kld_mean: float
    kld_mean_stderr: float
    kld: dict[str, float]  # max, p999 .. p01, median, min
    dp_mean: float
    dp_mean_stderr: float
    dp: dict[str, float]  # max, p999 .. p01, median, min (probabilities, not %)
    rms_dp: float
    rms_dp_stderr: float
    same_top_p: float
    same_top_p_stderr: float
    kld_tail_stderr: float  # standard error the tail sampling of a top-k cache adds to kld_mean; 0 for exact references

    def to_json(self) -> dict:
        return asdict(self)


def kld_statistics(table: np.ndarray) -> KldStatistics:
    """llama-perplexity's final KLD statistics of a per-token table (TOKEN_COLUMNS)."""
    count = int(table.shape[0])
    if count < 2:
        raise ValueError("KL statistics need at least two scored tokens")
    nll, nll_base = (
        table[:, NLL].astype(np.float32).astype(np.float64),
        table[:, NLL_BASE].astype(np.float32).astype(np.float64),
    )
    kld_values = table[:, KLD]
    p_diff = table[:, P_DIFF].astype(np.float32).astype(np.float64)
    log_ppl = _mean_and_uncertainty(nll.sum(), (nll * nll).sum(), count)
    ppl = math.exp(log_ppl[0])
    log_ppl_base = _mean_and_uncertainty(nll_base.sum(), (nll_base * nll_base).sum(), count)
    ppl_base = math.exp(log_ppl_base[0])
    cov = _covariance(nll.sum(), nll_base.sum(), (nll * nll_base).sum(), count)
    denominator = log_ppl[1] * log_ppl_base[1]
    correlation = cov / denominator if denominator else 0.0
    ratio = log_ppl[0] - log_ppl_base[0]
    ratio_unc = math.sqrt(max(0.0, log_ppl[1] ** 2 + log_ppl_base[1] ** 2 - 2.0 * cov))
    ppl_unc, ppl_base_unc = ppl * log_ppl[1], ppl_base * log_ppl_base[1]
    ppl_cov = ppl * ppl_base * cov
    kl_mean = _mean_and_uncertainty(kld_values.sum(), (kld_values * kld_values).sum(), count)
    dp_mean = _mean_and_uncertainty(p_diff.sum(), (p_diff * p_diff).sum(), count)
    p_diff2 = p_diff * p_diff
    mse = _mean_and_uncertainty(p_diff2.sum(), (p_diff2 * p_diff2).sum(), count)
    rms = math.sqrt(mse[0])
    same = float(table[:, SAME_TOP].sum()) / count
    sorted_kld = np.sort(kld_values.astype(np.float32))
    sorted_dp = np.sort(p_diff.astype(np.float32))
    kld = {
        "max": float(sorted_kld[-1]),
        **{name: sorted_percentile(sorted_kld, f) for name, f in KLD_PERCENTILES[:4]},
        "median": _median(sorted_kld),
        **{name: sorted_percentile(sorted_kld, f) for name, f in KLD_PERCENTILES[4:]},
        "min": float(sorted_kld[0]),
    }
    dp = {
        "max": float(sorted_dp[-1]),
        **{name: sorted_percentile(sorted_dp, f) for name, f in DP_PERCENTILES[:5]},
        "median": _median(sorted_dp),
        **{name: sorted_percentile(sorted_dp, f) for name, f in DP_PERCENTILES[5:]},
        "min": float(sorted_dp[0]),
    }
    return KldStatistics(
        count=count,
        ppl=ppl,
        ppl_stderr=ppl_unc,
        ppl_base=ppl_base,
        ppl_base_stderr=ppl_base_unc,
        ln_ppl_ratio=ratio,
        ln_ppl_ratio_stderr=ratio_unc,
        ppl_ratio=math.exp(ratio),
        ppl_ratio_stderr=math.exp(ratio) * ratio_unc,
        ppl_diff=ppl - ppl_base,
        ppl_diff_stderr=math.sqrt(max(0.0, ppl_unc**2 + ppl_base_unc**2 - 2.0 * ppl_cov)),
        ln_ppl_correlation=correlation,
        kld_mean=kl_mean[0],
        kld_mean_stderr=kl_mean[1],
        kld=kld,
        dp_mean=dp_mean[0],
        dp_mean_stderr=dp_mean[1],
        dp=dp,
        rms_dp=rms,
        rms_dp_stderr=(0.5 / rms * mse[1]) if rms else 0.0,
        same_top_p=same,
        same_top_p_stderr=math.sqrt(same * (1 - same) / (count - 1)),
        kld_tail_stderr=math.sqrt(float(table[:, TAIL_VARIANCE].sum())) / count,
    )


SEGMENT_KEYS = (
    "kld_mean",
    "kld_mean_stderr",
    "kld_p999",
    "same_top_p",
    "ppl",
    "tokens",
)  # a segment record's figures besides its name


def segment_statistics(name: str, table: np.ndarray) -> dict:
    """One held-out file's record as eval, tune and best report it (its `name` and SEGMENT_KEYS) from
    its per-token table: kld_statistics' figures, ppl as `perplexity.perplexity` of the NLL column
    (eval's PPL); the figures are None below two scored tokens."""
    from ggufcarve.evaluate.perplexity import perplexity

    if table.shape[0] < 2:
        return {"name": name, **{key: None for key in SEGMENT_KEYS}, "tokens": int(table.shape[0])}
    stats = kld_statistics(table)
    return {
        "name": name,
        "kld_mean": stats.kld_mean,
        "kld_mean_stderr": stats.kld_mean_stderr,
        "kld_p999": stats.kld["p999"],
        "same_top_p": stats.same_top_p,
        "ppl": perplexity(table[:, NLL]).ppl,
        "tokens": stats.count,
    }
