"""Per-token tables cached by content, shared by `ggufcarve eval` and the measurement layer.

A table (float64 rows of evaluate.kld.TOKEN_COLUMNS) is a model's comparison with the unpruned
model's log-probs on one unit of a held-out file: chunks first..first+count-1, decoded side by side
as llama-perplexity decodes them (n_seq = 2048 // n_ctx chunks per group, the unit being one group),
so a unit's table does not depend on which other units were decoded. Its key is the sha256 of
what it depends on: the model file's sha256, the keep-set masked into routing (none for a file
scored whole), the reference's identity (the unpruned model's sha256 and the name of its cached
log-probs, which holds the text's sha256 and the chunk size), the chunk size, the unit, the
llama.cpp version and where it computed (`Compute.key`: the backend, the placement, the RPC
servers' devices, the thread count). A re-run, and a `best` after an `eval` of the same files,
reads the tables instead of decoding again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ggufcarve.llama.devices import Compute

PERPLEXITY_BATCH = 2048  # llama-perplexity's default -b: n_batch // n_ctx chunks are decoded side by side


def chunks_per_unit(n_ctx: int) -> int:
    return max(1, PERPLEXITY_BATCH // n_ctx)


def table_cache() -> Path:
    """The cache directory of every run's tables."""
    from ggufcarve.fileio import cache_root

    return cache_root() / "measure-tables"


def unit_key(
    model_sha256: str,
    keep: Mapping[int, Sequence[int]] | None,
    reference: str,
    n_ctx: int,
    first: int,
    count: int,
    compute: Compute,
) -> str:
    """The cache key of one unit's table: everything its numbers depend on, the llama.cpp that
    computes it and where (`Compute.key`: an accelerator's kernels round differently from the
    CPU's, so the backend, the offloaded layers and the RPC servers' devices are part of the key).
    `compute` has its threads resolved."""
    from ggufcarve.llama.tools import llama_cpp_version

    doc = {
        **compute.key(),
        "model": model_sha256,
        "keep": None if keep is None else {str(b): sorted(int(i) for i in ids) for b, ids in sorted(keep.items())},
        "reference": reference,
        "n_ctx": n_ctx,
        "first": first,
        "count": count,
        "llama_cpp": llama_cpp_version(),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def reference_identity(sha256: str, file: Path) -> str:
    """What a reference's records depend on: the unpruned model's sha256 and its cached log-probs' name."""
    return f"{sha256}/{Path(file).name}"


DEFAULT_LIMIT = 2 * 2**30  # bytes the table cache keeps; GGUFCARVE_TABLE_CACHE_BYTES sets another
LIMIT_ENV = "GGUFCARVE_TABLE_CACHE_BYTES"


def cache_limit() -> int:
    import os

    text = os.environ.get(LIMIT_ENV, "")
    return int(text) if text.isdigit() else DEFAULT_LIMIT


def load(directory: Path, key: str) -> np.ndarray | None:
    """A cached table; its use renews its place among the newest (the oldest are dropped first)."""
    import os

    path = directory / f"{key}.npy"
    try:
        table = np.load(path)
    except (OSError, ValueError):
        return None
    try:
        os.utime(path)
    except OSError:
        pass  # a read-only cache: used as it is
    return table


def store(directory: Path, key: str, table: np.ndarray) -> None:
    from ggufcarve.fileio import atomic_file

    directory.mkdir(parents=True, exist_ok=True)
    with atomic_file(directory / f"{key}.npy", sync=False) as temp, open(temp, "wb") as f:
        np.save(f, table)
    bound(directory, cache_limit())


def bound(directory: Path, limit: int) -> int:
    """Drop the least recently used tables until the cache holds at most `limit` bytes; returns
    the bytes dropped."""
    import os

    try:
        entries = [
            (e.stat().st_mtime_ns, e.stat().st_size, e.path) for e in os.scandir(directory) if e.name.endswith(".npy")
        ]
    except OSError:
        return 0
    total = sum(size for _, size, _ in entries)
    dropped = 0
    for _, size, path in sorted(entries):
        if total - dropped <= limit:
            break
        try:
            os.unlink(path)
            dropped += size
        except OSError:
            continue
    return dropped


def store_file_tables(
    directory: Path,
    model_sha256: str,
    reference: str,
    n_ctx: int,
    table: np.ndarray,
    n_chunk: int,
    compute: Compute,
) -> None:
    """Cache a file's table over chunks 0..n_chunk-1 of one held-out file (eval's order) unit by unit."""
    per_chunk = len(table) // n_chunk if n_chunk else 0
    step = chunks_per_unit(n_ctx)
    for first in range(0, n_chunk, step):
        count = min(step, n_chunk - first)
        store(
            directory,
            unit_key(model_sha256, None, reference, n_ctx, first, count, compute),
            table[first * per_chunk : (first + count) * per_chunk],
        )
