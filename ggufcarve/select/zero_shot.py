"""Criteria without a forward pass: `weights`, `aimer`, `router-norm` and `random`.

weights:      I_e = ||router_row_e||_2 x scale_energy_e
aimer:        RMS(W_e) / mean |W_e|, W_e every value of the expert's weight tensors together
router-norm:  ||router_row_e||_2 (row e of `ffn_gate_inp.weight`, dequantized)
random:       uniform [0, 1) per expert from numpy's default generator seeded with (seed, block)

scale_energy_e is the mean, over the expert's weight tensors (ffn_gate/up/down/gate_up_exps), of
the mean magnitude of the scales in its slab, times |ffn_*_exps.scale[e]| where the file has such a
per-expert scale. The scale of a block is the factor that multiplies its integer quants (its E2M1
values for MXFP4 and NVFP4, so without the 0.5 that ggml and gguf-py fold into their doubled kvalues):
    Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 IQ4_NL        |d| (f16 at byte 0 of each 32-value block); the Q4_1/Q5_1
                                           offset m is not a scale and is left out
    Q2_K   |d * (scales[j] & 0xF)|         per 16-value sub-block; the dmin * (scales[j] >> 4) offset left out
    Q3_K   |d * (sc_j - 32)|               6-bit sub-block scales (16 per 256-value super-block)
    Q4_K Q5_K  |d * sc_j|                  6-bit sub-block scales (8 per super-block); dmin * m_j left out
    Q6_K   |d * scales[j]|                 int8 sub-block scales (16 per super-block)
    MXFP4  2^(e - 127)                     e8m0 exponent byte of each 32-value block
    NVFP4  ue4m3 sub-block scale           4 per 64-value block; codes 0x00 and 0x7F read as 0
    F32 F16 BF16 and every other type      RMS of the dequantized slab (gguf-py's dequantizer)
Q8_1 has no rule: it is only a dot-product operand (llama-quantize cannot write it), and gguf-py 0.19
sizes its block 40 bytes (f32 d and s) where ggml's block_q8_1 is 36 (f16 d and s), so a slab cannot
be cut into blocks reliably; gguf-py has no dequantizer for it either, so such a tensor is refused.
Scores are comparable within a block (every expert of a tensor has the same type), which is all a
per-block top-K needs.

AIMER (arXiv 2603.18492; the authors' calib_free_prune.py) scores expert e by
    A_e = (sum |w| / N) / sqrt(sum w^2 / N)
over the N values of its gate, up and down weight matrices pooled (one sum over the three, not a
score per matrix), and prunes the experts of the highest A_e, keeping the lowest. The values here
are gguf-py's dequantized ones of every ffn_{gate,up,down,gate_up}_exps.weight slab (a fused
gate_up slab holds the gate and up values, which pool the same), times |ffn_*_exps.scale[e]|
where the file has such a per-expert scale; biases are not weights and are left out. The score
recorded is 1 / A_e = RMS(w) / mean |w| (at least 1), so that the top K kept are AIMER's lowest;
an expert whose weights are all zero scores 0 (the paper's A_e of such an expert is 0 as well,
which it would keep first; here it is pruned first, as its output is zero).

The model is read once, in file order, in pieces of at most READ_BYTES (as many whole expert slabs as
fit, or one slab cut between blocks; RMS_VALUES values where the values are dequantized: the RMS rule
and aimer), each read with pread into the buffer of one of READ_THREADS threads and decoded there
while it is in cache. A piece gives, per expert it holds, the sum of its scales (squared values for
the RMS rule; absolute and squared values for aimer) and their number; an expert's sums over its
pieces make its mean.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import NVFP4, Q4_K

from ggufcarve.errors import BadInput
from ggufcarve.events import Counter, Sink, ignore
from ggufcarve.gguf.container import GGUFModel
from ggufcarve.gguf.tensors import dequantize, tensor_values
from ggufcarve.moe.layout import EXPERT_WEIGHTS, ROUTER, ExpertTensor, MoeLayout, block_tensor
from ggufcarve.select.scores import BlockStats

Q = GGMLQuantizationType
READ_BYTES = 4 << 20  # bytes of one read, decoded by the thread that read it while they are in its cache
RMS_VALUES = 1 << 20  # values dequantized at a time for the RMS rule (float32 values, float64 squares)
READ_THREADS = 2  # threads reading and decoding pieces, the calling thread one of them
PROGRESS_BYTES = 64 << 20  # a progress event per this many bytes a thread decoded, and at the end of each tensor
SCALE_RULES: dict[str, str] = {
    **{t: "|d| per 32-value block" for t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL")},
    "Q2_K": "|d * (scales[j] & 0xF)| per 16-value sub-block",
    "Q3_K": "|d * (sc_j - 32)| per 16-value sub-block",
    "Q4_K": "|d * sc_j| per 32-value sub-block",
    "Q5_K": "|d * sc_j| per 32-value sub-block",
    "Q6_K": "|d * scales[j]| per 16-value sub-block",
    "MXFP4": "2^(e - 127) per 32-value block",
    "NVFP4": "ue4m3 scale per 16-value sub-block",
}
RMS_RULE = "RMS of the dequantized slab"
WEIGHT_SUFFIXES = tuple(f"{base}.weight" for base in EXPERT_WEIGHTS)


F16_AT_ZERO = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL")  # |d|: the f16 at byte 0 of every block


def _f16_at(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The f16 field at byte `offset` of every block (uint8 [..., type_size]) as float32 [..., 1]."""
    return blocks[..., offset : offset + 2].view(np.float16).astype(np.float32)


def block_scales(blocks: np.ndarray, qtype: Q) -> np.ndarray | None:
    """|scale| of every (sub-)block of `blocks` (uint8 [n_blocks, type_size]) as float32 [n_blocks, k]
    (float16 for |d|, exact); None: the type has no scale rule."""
    if qtype.name in F16_AT_ZERO:  # the f16 bits with the sign bit cleared
        return (blocks[:, 0:2].view(np.uint16) & np.uint16(0x7FFF)).view(np.float16)
    if qtype == Q.Q2_K:  # scales[16] | qs[64] | d | dmin
        return np.abs(_f16_at(blocks, 80) * (blocks[:, :16] & 0xF).astype(np.float32))
    if qtype == Q.Q3_K:  # hmask[32] | qs[64] | scales[12] | d
        packed = blocks[:, 96:108]
        low = (packed[:, None, :8] >> np.array([0, 4], dtype=np.uint8)[:, None]).reshape(-1, 16) & 0x0F
        high = (packed[:, None, 8:12] >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]).reshape(-1, 16) & 0x03
        sc = (low | (high << 4)).astype(np.int8).astype(np.float32) - 32
        return np.abs(_f16_at(blocks, 108) * sc)
    if qtype in (Q.Q4_K, Q.Q5_K):  # d | dmin | scales[12] | ...
        sc, _ = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
        return np.abs(_f16_at(blocks, 0) * sc.astype(np.float32))
    if qtype == Q.Q6_K:  # ql[128] | qh[64] | scales[16] (int8) | d
        return np.abs(_f16_at(blocks, 208) * np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32))
    if qtype == Q.MXFP4:  # e (e8m0) | qs[16]
        return np.exp2(blocks[:, :1].astype(np.float32) - 127)
    if qtype == Q.NVFP4:  # 4 x ue4m3 | qs[32]; gguf-py's decoder halves the scale for its doubled kvalues
        return np.asarray(NVFP4.ue4m3_to_fp32(blocks[:, :4]), dtype=np.float32) * 2
    return None


def has_scale_rule(qtype: Q) -> bool:
    return GGML_QUANT_SIZES[qtype][0] > 1 and qtype.name in SCALE_RULES


def part_sums(data: np.ndarray, qtype: Q, parts: int) -> tuple[np.ndarray, int]:
    """Sums over `parts` equal parts of `data` (uint8, whole blocks of `qtype`): of the block scales
    where the type has a scale rule, else of the squared dequantized values; float64 [parts], and
    the number of terms in each part."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    scales = block_scales(data.reshape(-1, type_size), qtype) if has_scale_rule(qtype) else None
    if scales is not None:
        return np.add.reduce(scales.reshape(parts, -1), axis=1, dtype=np.float64), scales.size // parts
    values = dequantize(data, qtype, (len(data) // type_size * block_size,))
    return np.add.reduce(np.square(values, dtype=np.float64).reshape(parts, -1), axis=1), values.size // parts


def absolute_square_sums(data: np.ndarray, qtype: Q, parts: int) -> tuple[np.ndarray, int]:
    """Sums over `parts` equal parts of `data` (uint8, whole blocks of `qtype`) of the dequantized
    values' magnitudes and of their squares: float64 [parts, 2], and the number of values in each part."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    values = dequantize(data, qtype, (len(data) // type_size * block_size,)).reshape(parts, -1)
    sums = np.stack(
        [
            np.add.reduce(np.abs(values), axis=1, dtype=np.float64),
            np.add.reduce(np.square(values, dtype=np.float64), axis=1),
        ],
        axis=1,
    )
    return sums, values.shape[1]


def _pieces(slab: int, qtype: Q, n: int, dequantized: bool = False) -> list[tuple[int, int, int, int]]:
    """(first expert, experts, byte offset in the tensor, bytes) of each read of an expert tensor of
    `n` slabs of `slab` bytes: as many whole slabs as fit in a piece, or one slab cut between blocks
    into equal pieces. A piece is READ_BYTES, or RMS_VALUES values where the values are dequantized
    (`dequantized`, or a type without a scale rule)."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    piece = (
        READ_BYTES
        if has_scale_rule(qtype) and not dequantized
        else max(type_size, min(READ_BYTES, RMS_VALUES // block_size * type_size))
    )
    if slab <= piece:
        step = piece // slab
        return [(first, min(step, n - first), first * slab, min(step, n - first) * slab) for first in range(0, n, step)]
    blocks = slab // type_size
    cuts = -(-slab // piece)
    edges = [blocks * i // cuts * type_size for i in range(cuts + 1)]
    return [(e, 1, e * slab + lo, hi - lo) for e in range(n) for lo, hi in zip(edges, edges[1:])]


def router_norms(model: GGUFModel, layout: MoeLayout, block: int) -> np.ndarray:
    """||row_e||_2 of the block's router, float64 per expert."""
    values = tensor_values(model, block_tensor(block, ROUTER))
    with np.errstate(invalid="ignore", over="ignore"):
        return np.linalg.norm(values.reshape(layout.expert_count, -1).astype(np.float64), axis=1)


def _weight_tensors(layout: MoeLayout, blocks: Iterable[int]) -> list[ExpertTensor]:
    wanted = set(blocks)
    return [
        t
        for layer in layout.layers
        if layer.block in wanted
        for t in layer.tensors
        if t.name.split(".", 2)[2] in WEIGHT_SUFFIXES
    ]


PieceSums = Callable[[np.ndarray, Q, int], tuple[np.ndarray, int]]


def _expert_sums(
    model: GGUFModel, layout: MoeLayout, blocks: Sequence[int], on_event: Sink, sums_of: PieceSums, dequantized: bool
) -> tuple[list[tuple[tuple[int, Any], ExpertTensor]], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """`sums_of` each piece of every expert weight tensor of `blocks`, added up per expert: the
    tensors (located in the file, in file order), the sums per tensor name ([n] or [n, m], as
    `sums_of` gives per part) and the number of terms per expert.

    Each tensor is read once in file order, in pieces of at most READ_BYTES (whole slabs, or a slab
    cut between blocks; RMS_VALUES values where `dequantized`) read with pread into a per-thread
    buffer and decoded there while they are in cache, by the calling thread and READ_THREADS - 1
    helpers, each taking the next piece in file order (the reads and numpy release the GIL)."""
    n = layout.expert_count
    tensors = _weight_tensors(layout, blocks)
    located = sorted(((model.tensor_index[t.name], t) for t in tensors), key=lambda x: (x[0][0], x[0][1].offset))
    progress = Counter(on_event, "read experts", sum(t.nbytes for t in tensors), "bytes")
    jobs = []
    for (shard, info), t in located:
        start, _ = model.shards[shard].data_range(info)
        qtype = Q(info.type_id)
        pieces = _pieces(t.bytes_per_expert, qtype, n, dequantized)
        jobs += [
            (shard, start + offset, size, t, qtype, first, count, i == len(pieces) - 1)
            for i, (first, count, offset, size) in enumerate(pieces)
        ]
    largest = max((size for _, _, size, *_ in jobs), default=0)
    results: list[tuple[np.ndarray, int] | None] = [None] * len(jobs)
    taken = itertools.count()  # next() on it is atomic: each piece goes to one thread
    stop = threading.Event()
    failed: list[BaseException] = []
    fds: dict[int, int] = {}

    def work() -> None:
        buffer = bytearray(largest)
        pending = 0
        with np.errstate(invalid="ignore", over="ignore"):
            while not stop.is_set():
                i = next(taken)
                if i >= len(jobs):
                    break
                shard, offset, size, t, qtype, _, count, last = jobs[i]
                got = os.preadv(fds[shard], [memoryview(buffer)[:size]], offset)
                if got != size:
                    raise BadInput(
                        f"{model.shards[shard].path}: {t.name} is truncated", "the file is incomplete; re-copy it"
                    )
                results[i] = sums_of(np.frombuffer(buffer, dtype=np.uint8, count=size), qtype, count)
                pending += size
                if last or pending >= PROGRESS_BYTES:
                    progress(pending, t.name)
                    pending = 0
        if pending:
            progress(pending, t.name)

    def helper() -> None:
        try:
            work()
        except BaseException as e:  # handed to the calling thread, which raises it
            failed.append(e)
            stop.set()

    helpers = [
        threading.Thread(target=helper, name="ggufcarve-read-experts", daemon=True) for _ in range(READ_THREADS - 1)
    ]
    try:
        for shard in {shard for (shard, _), _ in located}:
            fds[shard] = os.open(model.shards[shard].path, os.O_RDONLY)
        for h in helpers:
            h.start()
        work()
    finally:
        stop.set()
        for h in helpers:
            if h.ident is not None:
                h.join()
        for fd in fds.values():
            os.close(fd)
    if failed:
        raise failed[0]
    sums: dict[str, np.ndarray] = {}
    terms = {t.name: np.zeros(n, dtype=np.int64) for _, t in located}
    for (_, _, _, t, _, first, count, _), result in zip(jobs, results):
        if result is None:  # every job ran unless a reader failed, which raised above
            raise RuntimeError(f"{t.name}: experts {first}..{first + count - 1} were not read")
        if t.name not in sums:
            sums[t.name] = np.zeros((n, *result[0].shape[1:]), dtype=np.float64)
        sums[t.name][first : first + count] += result[0]
        terms[t.name][first : first + count] += result[1]
    return located, sums, terms


def _expert_scale(model: GGUFModel, t: ExpertTensor, n: int) -> np.ndarray | None:
    """|ffn_*_exps.scale[e]| of the tensor's experts, float64 [n]; None: the file has no such scale."""
    scale_name = t.name.rsplit(".", 1)[0] + ".scale"
    if scale_name not in model.tensor_index:
        return None
    return np.abs(tensor_values(model, scale_name).astype(np.float64).reshape(n))


def weight_energies(
    model: GGUFModel, layout: MoeLayout, blocks: Sequence[int], on_event: Sink = ignore
) -> tuple[dict[int, np.ndarray], dict[str, str]]:
    """Scale energy per block and expert, reading each expert weight tensor once in file order
    (`_expert_sums`). Returns the energies and the rule applied per tensor type."""
    n = layout.expert_count
    located, sums, terms = _expert_sums(model, layout, blocks, on_event, part_sums, dequantized=False)
    rules: dict[str, str] = {}
    per_block: dict[int, list[np.ndarray]] = {b: [] for b in blocks}
    for (_, info), t in located:
        qtype = Q(info.type_id)
        if has_scale_rule(qtype):
            energy, rules[t.type_name] = sums[t.name] / terms[t.name], SCALE_RULES[qtype.name]
        else:
            energy, rules[t.type_name] = np.sqrt(sums[t.name] / terms[t.name]), RMS_RULE
        scale = _expert_scale(model, t, n)
        if scale is not None:
            energy = energy * scale
        per_block[t.block].append(energy)
    return {b: np.mean(per_block[b], axis=0) for b in blocks}, rules


def aimer_stats(model: GGUFModel, layout: MoeLayout, on_event: Sink = ignore) -> dict[int, BlockStats]:
    """RMS(w) / mean |w| per block and expert over its weight tensors pooled (1 / AIMER's score),
    reading each expert weight tensor once in file order (`_expert_sums`)."""
    n = layout.expert_count
    located, sums, terms = _expert_sums(model, layout, layout.blocks, on_event, absolute_square_sums, dequantized=True)
    magnitudes = {b: np.zeros(n) for b in layout.blocks}
    squares = {b: np.zeros(n) for b in layout.blocks}
    counts = {b: np.zeros(n) for b in layout.blocks}
    for _, t in located:
        scale = _expert_scale(model, t, n)
        factor = np.ones(n) if scale is None else scale
        magnitudes[t.block] += sums[t.name][:, 0] * factor
        squares[t.block] += sums[t.name][:, 1] * factor**2
        counts[t.block] += terms[t.name]
    stats = {}
    for b in layout.blocks:
        mean_magnitude = _finite(magnitudes[b] / counts[b], model, b, "weight magnitudes")
        rms = _finite(np.sqrt(squares[b] / counts[b]), model, b, "weight squares")
        with np.errstate(divide="ignore", invalid="ignore"):
            score = np.where(mean_magnitude > 0, rms / mean_magnitude, 0.0)
        stats[b] = BlockStats("aimer", "value", sums=score)
    return stats


def _finite(values: np.ndarray, model: GGUFModel, block: int, what: str) -> np.ndarray:
    if not np.isfinite(values).all():
        bad = [int(e) for e in np.flatnonzero(~np.isfinite(values))]
        raise BadInput(
            f"{model.path.name}: blk.{block} {what} of expert(s) {bad[:8]} are not finite",
            "the file's weights are corrupt (NaN or Inf); re-convert or re-download it",
        )
    return values


def weights_stats(
    model: GGUFModel, layout: MoeLayout, blocks: Sequence[int], on_event: Sink = ignore, note: str = ""
) -> tuple[dict[int, BlockStats], dict[str, str]]:
    energies, rules = weight_energies(model, layout, blocks, on_event)
    stats = {}
    for b in blocks:
        norms = _finite(router_norms(model, layout, b), model, b, "router row norms")
        stats[b] = BlockStats(
            "weights", "value", sums=norms * _finite(energies[b], model, b, "weight scales"), note=note
        )
    return stats, rules


def router_norm_stats(model: GGUFModel, layout: MoeLayout) -> dict[int, BlockStats]:
    return {
        b: BlockStats(
            "router-norm", "value", sums=_finite(router_norms(model, layout, b), model, b, "router row norms")
        )
        for b in layout.blocks
    }


def random_stats(layout: MoeLayout, seed: int) -> dict[int, BlockStats]:
    return {
        b: BlockStats("random", "value", sums=np.random.default_rng([seed, b]).random(layout.expert_count))
        for b in layout.blocks
    }
