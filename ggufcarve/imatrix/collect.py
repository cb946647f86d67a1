"""Collecting an importance matrix in llama.cpp's graph eval callback, as llama-imatrix does.

    from ggufcarve.imatrix.collect import collect_imatrix
    result = collect_imatrix(model, [Path("calibration.txt")], Path("model.imatrix.gguf"), ctx=512)

`ImatrixAccumulator` is an eval callback that keeps exactly the statistics of llama-imatrix's
collector (`tools/imatrix/imatrix.cpp`, IMatrixCollector::collect_imatrix):
  * observed nodes: every MUL_MAT_ID; a MUL_MAT whose src1 is F32 with at least 16 rows
    (src1->ne[1] >= 16) and whose src0 is named "blk.*" (output.weight is not collected);
    the entry is named after src0, without a backend prefix ("CUDA0#name#0" -> name);
  * MUL_MAT_ID (expert weights, src0 [ne0, rows, n_expert]; ids = src2 [n_used, T] I32, src1
    [ne0, ne11, T] with ne11 1 for gate/up, n_used for down): for every slot s and token t, in
    that order (slots outermost), the row src1[t, s % ne11] is squared into the sums of expert
    ids[t, s] and that expert's count grows by one: `counts[e]` is the (token, slot) pairs routed
    to e;
  * MUL_MAT (2-D src0: one matrix): every row of src1 in order is squared into the sums, and the
    count grows by the rows (ggml_nrows(src1) / n_mat);
  * a non-finite sum is an error (llama-imatrix exits 1).
Sums are float32 and every square is added one row at a time in llama-imatrix's order, so the
result is the same float32 arithmetic (`acc[j] += x[j] * x[j]`). chunk_count is what llama-imatrix
records, floor(max count / chunk_size) over all entries, and chunk_size is the --ctx.

`collect_imatrix` runs a decode pass (`ggufcarve.llama.decode`, tokenizing and chunking as
llama-imatrix, see `ggufcarve.llama.calibration`) with this accumulator (`IMATRIX_CONSUMER`) and
writes the GGUF imatrix (names sorted; in_sum2 F32 [ne0, n_mat], counts F32 [1, n_mat], 1-D when
n_mat is 1; keys general.type, imatrix.datasets = the calibration files' bare names,
imatrix.chunk_count, imatrix.chunk_size) under a temp name, renamed into place
(`write_collected`). `select.calibrate.calibrate(..., imatrix_out=...)` names the same consumer
beside a selection criterion's in one decode.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGMLQuantizationType, GGUFValueType

from ggufcarve.errors import BadInput
from ggufcarve.events import Sink, ignore
from ggufcarve.fileio import check_outputs
from ggufcarve.llama.calibration import Batching, check_chunking, read_calibration
from ggufcarve.llama.decode import ConsumerSpec, DecodeRequest, decode
from ggufcarve.llama.devices import CPU, Compute
from ggufcarve.llama.ggml import GgmlTensor, op_name, read_tensor, tensor_at

F32 = int(GGMLQuantizationType.F32)
OP_OFFSET = GgmlTensor.op.offset
MIN_DENSE_ROWS = 16  # llama-imatrix ignores MUL_MAT with fewer src1 rows
MIN_REDUCE_WIDTH = 16
SUMS_PREFIX, COUNTS_PREFIX = "imatrix_sums:", "imatrix_counts:"


def weight_name(name: str) -> str:
    """A src0 name without a backend prefix/suffix: "CUDA0#blk.0.attn_k.weight#0" -> "blk.0.attn_k.weight"."""
    if "#" not in name:
        return name
    rest = name.split("#", 1)[1]
    return rest.split("#", 1)[0]


def squares_in_order(rows: np.ndarray, start: np.ndarray) -> np.ndarray:
    """start + rows[0]**2 + rows[1]**2 + ..., in float32, added one row at a time (llama-imatrix's order).

    numpy reduces the outer axis of a 2-D array row by row, elementwise; a single column would be
    coalesced into one contiguous run and summed pairwise, so narrow rows go through a loop."""
    stacked = np.empty((len(rows) + 1, rows.shape[1]), dtype=np.float32)
    stacked[0] = start
    np.multiply(rows, rows, out=stacked[1:])
    if rows.shape[1] >= MIN_REDUCE_WIDTH:
        return np.add.reduce(stacked, axis=0, dtype=np.float32)
    acc = stacked[0].copy()
    for row in stacked[1:]:
        acc += row
    return acc


class ImatrixAccumulator:
    """The eval callback of llama-imatrix's collector (see the module docstring).

    `sums[name]` float32 [n_mat, ne0], `counts[name]` int64 [n_mat]. `errors` collects what went
    wrong inside the callback (which must not raise into ctypes).
    """

    def __init__(self) -> None:
        self.sums: dict[str, np.ndarray] = {}
        self.counts: dict[str, np.ndarray] = {}
        self.errors: list[str] = []

    def wants(self, address: int) -> bool:
        op = op_name(ctypes.c_int.from_address(address + OP_OFFSET).value)  # most nodes stop here
        if op == "MUL_MAT_ID":
            return True
        if op != "MUL_MAT":
            return False
        t = tensor_at(address)
        if not t.src[0] or not t.src[1]:
            return False
        src1 = tensor_at(int(t.src[1]))
        if src1.ne[1] < MIN_DENSE_ROWS or int(src1.type) != F32:
            return False
        return weight_name(tensor_at(int(t.src[0])).label).startswith("blk.")

    def __call__(self, address: int, ask: bool, _user_data: object = None) -> bool:
        try:
            if ask:
                return self.wants(address)
            if self.wants(address):
                self.take(address)
        except BaseException as err:
            if len(self.errors) < 20:
                self.errors.append(f"{type(err).__name__}: {err}")
        return True

    def take(self, address: int) -> None:
        """Fold one computed MUL_MAT / MUL_MAT_ID node into the statistics."""
        t = tensor_at(address)
        src0 = tensor_at(int(t.src[0]))
        name = weight_name(src0.label)
        x = read_tensor(int(t.src[1]))  # (ne3, ne2, ne1, ne0)
        if op_name(int(t.op)) == "MUL_MAT_ID":
            self._take_experts(name, int(src0.ne[2]), x, read_tensor(int(t.src[2])))
        else:
            self._take_dense(name, int(src0.ne[2]), int(src0.ne[3]), x)

    def _entry(self, name: str, n_mat: int, ne0: int) -> tuple[np.ndarray, np.ndarray]:
        if name not in self.sums:
            self.sums[name] = np.zeros((n_mat, ne0), dtype=np.float32)
            self.counts[name] = np.zeros(n_mat, dtype=np.int64)
        sums = self.sums[name]
        if sums.shape != (n_mat, ne0):
            raise ValueError(f"inconsistent size for {name} ({sums.size} vs {n_mat * ne0})")
        return sums, self.counts[name]

    def _take_experts(self, name: str, n_expert: int, x: np.ndarray, ids: np.ndarray) -> None:
        if x.shape[0] != 1:
            raise ValueError(f"{name}: src1 has more than 3 dimensions")
        n_tokens, ne11, ne0 = x.shape[1], x.shape[2], x.shape[3]
        slots = ids.reshape(ids.shape[-2], ids.shape[-1])  # [T, n_used]
        if slots.shape[0] != n_tokens:
            raise ValueError(f"{name}: ids hold {slots.shape[0]} tokens, src1 {n_tokens}")
        if name in self.counts and self.counts[name].size == 1 and n_expert > 1:
            self.counts[name] = np.repeat(self.counts[name], n_expert)
        sums, counts = self._entry(name, n_expert, ne0)
        if counts.size != n_expert:
            raise ValueError(f"inconsistent expert count for {name} ({counts.size} vs {n_expert})")
        n_used = slots.shape[1]
        # the (slot, token) pairs in llama-imatrix's order: slots outermost, tokens within
        experts = slots.T.reshape(-1)
        if experts.size and (experts.min() < 0 or experts.max() >= n_expert):
            raise ValueError(f"{name}: expert id out of range 0..{n_expert - 1}")
        slot_of = np.repeat(np.arange(n_used), n_tokens)
        token_of = np.tile(np.arange(n_tokens), n_used)
        order = np.argsort(experts, kind="stable")
        bounds = np.searchsorted(experts[order], np.arange(n_expert + 1))
        for e in range(n_expert):
            picked = order[bounds[e] : bounds[e + 1]]
            if picked.size == 0:
                continue
            rows = x[0, token_of[picked], slot_of[picked] % ne11]
            sums[e] = squares_in_order(rows, sums[e])
            counts[e] += picked.size
            if not np.isfinite(sums[e]).all():
                raise ValueError(f"non-finite values detected in {name}")

    def _take_dense(self, name: str, src0_ne2: int, src0_ne3: int, x: np.ndarray) -> None:
        n_mat = src0_ne2 * src0_ne3
        ne0 = x.shape[3]
        counts = self.counts.get(name)
        if counts is not None and counts.size > 1 and (counts == counts[0]).all():
            self.counts[name] = counts[:1].copy()
        if name not in self.sums:
            self.sums[name] = np.zeros((n_mat, ne0), dtype=np.float32)
            self.counts[name] = np.zeros(1, dtype=np.int64)
        sums = self.sums[name]
        if sums.size != n_mat * ne0:
            raise ValueError(f"inconsistent size for {name} ({sums.size} vs {n_mat * ne0})")
        sums = sums.reshape(n_mat, ne0)
        if n_mat == 1:
            sums[0] = squares_in_order(x.reshape(-1, ne0), sums[0])
        else:
            for i3 in range(x.shape[0]):
                for i2 in range(x.shape[1]):
                    mat = (i3 % src0_ne3) * src0_ne2 + (i2 % src0_ne2)
                    sums[mat] = squares_in_order(x[i3, i2], sums[mat])
        if not np.isfinite(sums).all():
            raise ValueError(f"non-finite values detected in {name}")
        rows = x.shape[0] * x.shape[1] * x.shape[2]
        self.counts[name] += rows // n_mat

    def decoded(self) -> None:
        """Nothing to do between decode calls: every node is folded when it is computed."""

    def arrays(self) -> dict[str, np.ndarray]:
        """The statistics as named arrays (for the decode result)."""
        out: dict[str, np.ndarray] = {}
        for name in sorted(self.sums):
            out[SUMS_PREFIX + name] = self.sums[name]
            out[COUNTS_PREFIX + name] = self.counts[name]
        return out


def accumulator(_request: DecodeRequest) -> ImatrixAccumulator:
    """The decode consumer that collects the imatrix (`IMATRIX_CONSUMER`)."""
    return ImatrixAccumulator()


IMATRIX_CONSUMER = ConsumerSpec("imatrix", "ggufcarve.imatrix.collect:accumulator")


# ---------------------------------------------------------------------------------------------
# The imatrix file


def imatrix_from_arrays(arrays: Mapping[str, np.ndarray], datasets: Sequence[str], chunk_size: int) -> Any:
    """The GGUF `Imatrix` llama-imatrix's save_imatrix writes from the same statistics."""
    from ggufcarve.gguf.container import make_kv
    from ggufcarve.imatrix_format import (
        KEY_CHUNK_COUNT,
        KEY_CHUNK_SIZE,
        KEY_DATASETS,
        KEY_TYPE,
        Imatrix,
        ImatrixEntry,
    )

    entries = []
    chunk_count = 0
    for key in sorted(k for k in arrays if k.startswith(SUMS_PREFIX)):
        name = key[len(SUMS_PREFIX) :]
        sums = np.ascontiguousarray(arrays[key], dtype=np.float32)
        counts = np.asarray(arrays[COUNTS_PREFIX + name], dtype=np.int64)
        n_mat = counts.size
        sums = sums.reshape(n_mat, -1)
        chunk_count = max(chunk_count, int(counts.max()) // chunk_size)
        entries.append(ImatrixEntry(name, n_mat, sums.shape[1], counts.astype(np.float32), None, lambda s=sums: s))
    if not entries:
        raise BadInput(
            "llama.cpp's graph ran no MUL_MAT / MUL_MAT_ID of a blk.* weight: nothing to collect",
            "check that the model is a transformer llama.cpp runs",
        )
    kvs = (
        make_kv(KEY_TYPE, GGUFValueType.STRING, "imatrix"),
        make_kv(KEY_DATASETS, GGUFValueType.ARRAY, list(datasets), GGUFValueType.STRING),
        make_kv(KEY_CHUNK_COUNT, GGUFValueType.UINT32, chunk_count),
        make_kv(KEY_CHUNK_SIZE, GGUFValueType.UINT32, int(chunk_size)),
    )
    order = tuple((e.name, part) for e in entries for part in ("in_sum2", "counts"))
    return Imatrix(
        "gguf", None, tuple(entries), tuple(datasets), chunk_count, int(chunk_size), kvs=kvs, tensor_order=order
    )


@dataclass(frozen=True)
class Collected:
    output_path: Path
    output_bytes: int
    entries: int
    expert_entries: int
    chunk_count: int
    chunk_size: int
    tokens: int
    datasets: tuple[str, ...]
    seconds: float


def write_collected(
    arrays: Mapping[str, np.ndarray],
    datasets: Sequence[str],
    chunk_size: int,
    output: Path,
    *,
    tokens: int,
    seconds: float,
    force: bool = False,
    sources: Sequence[Path] = (),
    on_event: Sink = ignore,
) -> Collected:
    """Write the statistics of a calibration child as a GGUF imatrix (temp name, fsync, rename)."""
    from ggufcarve.imatrix_format import write_imatrix

    imatrix = imatrix_from_arrays(arrays, datasets, chunk_size)
    path = write_imatrix(imatrix, output, force=force, sources=sources, on_event=on_event)
    return Collected(
        path,
        os.path.getsize(path),
        len(imatrix.entries),
        sum(1 for e in imatrix.entries if e.per_expert_counts),
        int(imatrix.chunk_count),
        chunk_size,
        tokens,
        tuple(datasets),
        seconds,
    )


def collect_imatrix(
    model: Any,
    files: Sequence[Path],
    output: Path,
    *,
    ctx: int = 512,
    chunks: int | None = None,
    compute: Compute = CPU,
    force: bool = False,
    on_event: Sink = ignore,
) -> Collected:
    """Tokenize and chunk `files` as llama-imatrix does, decode them in llama.cpp (llama-cpp-python)
    with `ImatrixAccumulator` as the eval callback, and write the GGUF imatrix to `output`.

    `model` is a GGUFModel (ggufcarve.gguf.container.read_model). Progress: events of stage
    "imatrix" in tokens. Raises BadInput for input llama-imatrix would refuse or that gives no
    whole chunk, OutputError for an output that exists (without `force`) or is the model."""
    if chunks is not None and chunks < 1:
        raise BadInput(
            f"--chunks {chunks} must be at least 1", "give the number of --ctx chunks to use, or omit it for all"
        )
    from ggufcarve.placement.auto import resolve

    compute = resolve(compute, Path(model.path), ctx)
    max_tokens = None if chunks is None else chunks * ctx
    check_chunking(ctx, max_tokens)
    calibration = read_calibration(files)
    check_outputs([Path(output)], list(model.paths), 0, force)
    request = DecodeRequest(
        os.fspath(model.path),
        (IMATRIX_CONSUMER,),
        Batching.of(ctx),
        documents=tuple(f.documents for f in calibration),
        max_tokens=max_tokens,
        compute=compute,
    )
    result = decode(request, what=f"collecting the imatrix of {model.path.name}", stage="imatrix", on_event=on_event)
    return write_collected(
        result.outputs[IMATRIX_CONSUMER.name],
        [f.path.name for f in calibration],
        ctx,
        Path(output),
        tokens=result.tokens,
        seconds=result.seconds,
        force=force,
        sources=list(model.paths),
        on_event=on_event,
    )
