"""Criteria read from an imatrix that llama-imatrix collected: `imatrix-counts` and `imatrix-energy`.

In a GGUF imatrix every expert weight W has `W.counts` (F32, one per expert: the (token, slot)
pairs routed to it, exactly the routing frequency) and `W.in_sum2` (per expert, per input column,
the sum of x^2 over those tokens). For `ffn_down_exps` the input is the expert's intermediate
activation h, so sum_j in_sum2[e, j] / counts[e] is the mean of ||h||^2 over the tokens routed to e.

imatrix-counts:  counts of the block's ffn_down_exps (gate/up carry the same counts)
imatrix-energy:  sum_j in_sum2[e, j] / counts[e] of ffn_down_exps (0 for never-routed experts)
imatrix-msan:    sum_j in_sum2[e, j] / counts[e] x ||W_down[e][:, j]||^2, W_down dequantized by
                 gguf-py (x the per-expert down scale where the file has one): the mean of
                 ||W_down h||^2 = ||f_e||^2 if the channels of h were uncorrelated, i.e. msan
                 without the off-diagonal terms of E[h h^T] (and without a down bias)

A legacy .dat imatrix stores (sum / count_e) * ncall per value (1 * ncall for a never-routed
expert) and no per-expert counts, so imatrix-counts refuses it; imatrix-energy reads it as
sum_j value[e, j] / ncall, with the placeholder rows scored 0. llama-imatrix 0.3.36 never runs MTP blocks; a block
without entries
that is an MTP block is scored by the weights rule instead, and the record says so.
"""

from __future__ import annotations

import numpy as np

from ggufcarve.errors import BadInput
from ggufcarve.events import Sink, ignore
from ggufcarve.gguf.container import GGUFModel
from ggufcarve.gguf.tensors import expert_values, tensor_values
from ggufcarve.imatrix.check import check_against_model, raise_problems
from ggufcarve.imatrix_format import Imatrix, lround
from ggufcarve.moe.layout import DOWN_EXPS, MoeLayout, block_tensor
from ggufcarve.select.scores import BlockStats
from ggufcarve.select.zero_shot import weights_stats

MTP_NOTE = (
    "MTP block: the imatrix has no entries for it (llama-imatrix never runs MTP blocks); scored by the weights rule"
)


def imatrix_stats(
    model: GGUFModel, layout: MoeLayout, imatrix: Imatrix, method: str, on_event: Sink = ignore
) -> tuple[dict[int, BlockStats], dict[str, str]]:
    """Per block statistics of `method` ("imatrix-counts", "imatrix-energy" or "imatrix-msan"); rules of any weights
    fallback."""
    name = imatrix.path.name if imatrix.path else "the imatrix"
    if imatrix.format == "dat" and method == "imatrix-counts":
        raise BadInput(
            f"{name} is a legacy .dat imatrix: it stores (sum/count)*ncall per value and no per-expert routing counts",
            "give the GGUF imatrix llama-imatrix writes by default, or use --method imatrix-energy",
        )
    check = check_against_model(imatrix, model)
    raise_problems(
        check.problems,
        f"{name} is not an imatrix of {model.path.name}",
        "give the imatrix collected on this model (before pruning)",
    )
    entries = imatrix.entry_index
    stats: dict[int, BlockStats] = {}
    fallback: list[int] = []
    for block in layout.blocks:
        entry = entries.get(block_tensor(block, DOWN_EXPS))
        if entry is None:
            if layout.is_mtp(block):
                fallback.append(block)
                continue
            raise BadInput(
                f"{name} has no entry for {block_tensor(block, DOWN_EXPS)}",
                "the imatrix is incomplete or belongs to another model",
            )
        if imatrix.format == "dat":
            stored = entry.sums().reshape(layout.expert_count, -1).astype(np.float64)
            ncall = max(entry.ncall or 1, 1)
            never_routed = (stored == ncall).all(axis=1)  # llama-imatrix's placeholder: 1.0 * ncall per value
            if method == "imatrix-msan":
                energy = np.where(never_routed, 0.0, (stored * column_norms(model, layout, block)).sum(axis=1) / ncall)
                stats[block] = BlockStats(
                    method,
                    "value",
                    sums=energy,
                    note="legacy .dat: sum_j (value / ncall) ||W_down[:, j]||^2; "
                    "experts holding only the never-routed placeholder score 0",
                )
                continue
            energy = np.where(never_routed, 0.0, stored.sum(axis=1) / ncall)
            stats[block] = BlockStats(
                method,
                "value",
                sums=energy,
                note="legacy .dat: sum_j (value / ncall); experts holding only the never-routed placeholder score 0",
            )
            continue
        if not entry.per_expert_counts:
            raise BadInput(
                f"{name}: {entry.name} has one count for all experts "
                "(a .dat converted to GGUF keeps no per-expert counts)",
                "recompute the imatrix with llama-imatrix",
            )
        counts = lround(entry.counts)
        if method == "imatrix-counts":
            stats[block] = BlockStats(method, "count", counts=counts)
        elif method == "imatrix-msan":
            sums = entry.sums().reshape(layout.expert_count, -1).astype(np.float64)
            stats[block] = BlockStats(
                method, "mean_square", counts=counts, sums_sq=(sums * column_norms(model, layout, block)).sum(axis=1)
            )
        else:
            stats[block] = BlockStats(
                method, "mean_square", counts=counts, sums_sq=entry.sums().astype(np.float64).sum(axis=1)
            )
    rules: dict[str, str] = {}
    if fallback:
        extra, rules = weights_stats(model, layout, fallback, on_event, note=MTP_NOTE)
        stats.update(extra)
    return stats, rules


def column_norms(model: GGUFModel, layout: MoeLayout, block: int) -> np.ndarray:
    """float64 [n_expert, n_ff]: ||W_down[e][:, j]||^2, the squared norm of the output each unit of
    h adds, times the square of the expert's down scale where the file has one."""
    name = block_tensor(block, DOWN_EXPS)
    scale_name = block_tensor(block, DOWN_EXPS, "scale")
    scales = (
        tensor_values(model, scale_name).astype(np.float64).reshape(layout.expert_count, -1)
        if scale_name in model.tensor_index
        else None
    )
    out = []
    for expert in range(layout.expert_count):
        w = expert_values(model, name, expert).astype(np.float64)  # [n_embd, n_ff]
        if scales is not None:
            s = scales[expert]
            w = w * (s[:, None] if s.size == w.shape[0] else s[0])
        out.append(np.einsum("ij,ij->j", w, w))
    return np.asarray(out)
