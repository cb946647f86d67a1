"""Local search over keep-sets, scored end to end: masked KLD against the unpruned model on calibration text.

    moves = pairwise_moves(pair_sums, groups=1)         # HOPE's pair sums of the calibration pass: the proxy
    found = local_search(model, start_keep, moves, calibration_segments, settings, SearchSettings(passes=4), work)
    found.keep, found.path                               # the keep-set reached, the moves accepted on the way

A move swaps one kept expert for one dropped expert of the same block (and group, where the model
routes by groups): the block keeps its count. A step ranks every move by a proxy computed from the
one calibration pass, takes the best `SearchSettings.moves` of them (at most `per_block` in one
block), adds their combination (the best move of every block they touch, each block masked
independently in the same decode), and scores the current keep-set and each moved one by masking
(`measure.tournament`: one loaded model, successive halving over the calibration units from a first
round of one unit, so most moves leave after a few chunks). The step's leader replaces the current
keep-set only when the current one is worse than it beyond noise on every calibration unit (the
paired difference, standard errors over chunks, more than z of them); then the next step proposes
moves from the new keep-set. Moves scored and not taken are not proposed again. The search ends when
the budget is spent (chunks scored, decoded or read from the table cache alike, in passes over the
calibration text: `passes`; so the path does not depend on what the cache holds), when `patience`
steps in a row took no move, or when no move is left.

The proxy (`pairwise_moves`): the pairwise form of the dropped experts, J(D) = sum over i, j in D of
S_ij with S HOPE's pair sums (`BlockStats.pair_sums`: S_ij the sum over tokens routing to both i and
j of v_i v_j, v = g ||f||), which is the sum over tokens of (sum of v over the token's dropped
experts)^2: the routed output mass a token loses, squared. (HOPE's own matrix F divides each entry
by its count, which forgets how often a pair is routed.) Restoring d and dropping k changes it by
    dJ = S_kk + S_dd - 2 S_dk + 2 (s_k - s_d),   s_e = sum over j in D of S_ej,
ranked relative to the block's J(D) (blocks' outputs differ in scale). MTP blocks are not run by
llama.cpp's decode graph, so a mask there changes no logit: their keep-sets stay as they start.

Held-out text is never seen here: the caller scores the result beside its other candidates.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ggufcarve.events import Event, Sink, ignore
from ggufcarve.measure.statistics import paired_difference
from ggufcarve.measure.tournament import Candidate, MeasureSettings, Segment, measure

Keep = Mapping[int, Sequence[int]]  # block -> kept expert ids


@dataclass(frozen=True)
class Move:
    block: int
    drop: int  # a kept expert, dropped
    add: int  # a dropped expert, kept
    proxy: float = 0.0  # the proxy's predicted change (lower is better)

    def apply(self, keep: Keep) -> dict[int, tuple[int, ...]]:
        moved = {b: tuple(ids) for b, ids in keep.items()}
        moved[self.block] = tuple(sorted((set(keep[self.block]) - {self.drop}) | {self.add}))
        return moved

    def to_json(self) -> dict[str, Any]:
        return {"block": self.block, "drop": self.drop, "add": self.add, "proxy": self.proxy}


@dataclass(frozen=True)
class SearchSettings:
    passes: float  # the budget: chunks scored (decoded or cached), in passes over the calibration units
    moves: int = 8  # moves scored per step
    per_block: int = 2  # at most this many of a step's moves in one block
    patience: int = 4  # steps in a row without a move taken before the search ends


@dataclass
class SearchResult:
    keep: dict[int, tuple[int, ...]]
    start_kld: float | None  # the starting keep-set's mean KLD on the calibration units
    kld: float | None  # the result's
    path: list[dict[str, Any]] = field(default_factory=list)  # the moves taken, each with the mean KLD after it
    steps: list[dict[str, Any]] = field(default_factory=list)
    passes_used: float = 0.0
    seconds: float = 0.0
    stopped: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "keep": {str(b): list(ids) for b, ids in sorted(self.keep.items())},
            "start_kld_mean": self.start_kld,
            "kld_mean": self.kld,
            "path": self.path,
            "steps": self.steps,
            "passes_used": self.passes_used,
            "seconds": self.seconds,
            "stopped": self.stopped,
        }


# (keep, moves not to propose, most moves per block) -> moves, best first
Propose = Callable[[Keep, set[tuple[int, int, int]], int], list[Move]]


def pairwise_moves(pairs: Mapping[int, np.ndarray], groups: int = 1) -> Propose:
    """The proposer of the pairwise proxy (module docstring): `pairs` block -> S; swaps stay within a routing
    group of E / `groups` experts."""

    def propose(keep: Keep, tried: set[tuple[int, int, int]], per_block: int) -> list[Move]:
        ranked: list[Move] = []
        for block, matrix in pairs.items():
            if block not in keep:
                continue
            n = matrix.shape[0]
            kept = np.zeros(n, bool)
            kept[list(keep[block])] = True
            dropped = ~kept
            if not dropped.any():
                continue
            row = matrix[:, dropped].sum(axis=1)  # s_e
            loss = float(row[dropped].sum())
            scale = loss if loss > 0 else 1.0
            restore, remove = np.flatnonzero(dropped), np.flatnonzero(kept)
            diag = np.diag(matrix)
            change = (
                diag[remove][None, :]
                + diag[restore][:, None]
                - 2 * matrix[np.ix_(restore, remove)]
                + 2 * (row[remove][None, :] - row[restore][:, None])
            ) / scale
            size = n // max(groups, 1)
            for i, j in zip(*np.unravel_index(np.argsort(change, axis=None, kind="stable"), change.shape)):
                d, k = int(restore[i]), int(remove[j])
                if d // size != k // size or (block, k, d) in tried:
                    continue
                ranked.append(Move(block, k, d, float(change[i, j])))
                if sum(1 for m in ranked if m.block == block) >= per_block:
                    break
        return sorted(ranked, key=lambda m: (m.proxy, m.block, m.drop, m.add))

    return propose


def local_search(
    model: Path,
    start: Keep,
    propose: Propose,
    segments: Sequence[Segment],
    measure_settings: MeasureSettings,
    settings: SearchSettings,
    work: Path,
    *,
    required_nodes: Callable[[Keep], tuple[str, ...]] = lambda keep: (),
    on_event: Sink = ignore,
    score_unit: Callable[[Candidate, tuple[int, int, int]], Any] | None = None,
) -> SearchResult:
    """Search from `start` (module docstring); `required_nodes(keep)`: the nodes its mask must reach;
    `score_unit`: tables instead of llama.cpp's (`measure.tournament.measure`)."""
    began = time.perf_counter()
    scoring = replace(measure_settings, prefer="metric", gate=None, first_units=1, never_leave=("current",))
    current = {b: tuple(ids) for b, ids in start.items()}
    result = SearchResult(current, None, None)
    tried: set[tuple[int, int, int]] = set()
    units_chunks = sum(s.n_chunk for s in segments)
    budget = settings.passes * units_chunks
    scored = 0
    idle = 0

    def candidate(cid: str, keep: Keep) -> Candidate:
        return Candidate(cid, model, keep=keep, group="search", required_nodes=required_nodes(keep))

    while True:
        moves = propose(current, tried, settings.per_block)[: settings.moves]
        if not moves:
            result.stopped = "no move left to try"
            break
        steps = {f"move-{i}": (m,) for i, m in enumerate(moves)}
        best_per_block = list({m.block: m for m in reversed(moves)}.values())  # each block's best move
        if len(best_per_block) > 1:
            steps["combined"] = tuple(best_per_block)
        pool = [candidate("current", current), *(candidate(cid, _applied(current, ms)) for cid, ms in steps.items())]
        measured = measure(pool, segments, scoring, work, on_event=on_event, score_unit=score_unit)
        scored += measured.decoded_chunks + measured.cached_chunks
        per_chunk = measured.per_chunk
        leader = measured.groups["search"]["leader"]
        step: dict[str, Any] = {
            "moves": [m.to_json() for m in moves],
            "leader": leader,
            "chunks_decoded": measured.decoded_chunks,
            "taken": None,
        }
        tried.update((m.block, m.drop, m.add) for m in moves)
        if leader not in (None, "current"):
            taken = steps[leader]
            pair = paired_difference(
                measured.table("current")[:, _column(scoring)],
                measured.table(leader)[:, _column(scoring)],
                per_chunk,
                scoring.metric,
            )
            step["difference"] = pair.to_json()
            if pair.worse_beyond(scoring.z):
                current = _applied(current, taken)
                kld = _full_kld(measured, leader)
                result.path.append(
                    {
                        "moves": [m.to_json() for m in taken],
                        "kld_mean": kld,
                        "improvement": pair.mean,
                        "stderr": pair.stderr,
                    }
                )
                step["taken"] = [m.to_json() for m in taken]
                result.kld = kld
        if result.start_kld is None:
            result.start_kld = _full_kld(measured, "current")
        result.steps.append(step)
        idle = 0 if step["taken"] else idle + 1
        on_event(Event("search", len(result.path), 0, "moves", f"step {len(result.steps)}"))
        if scored >= budget:
            result.stopped = f"the budget of {settings.passes:g} passes is spent"
            break
        if idle >= settings.patience:
            result.stopped = f"{settings.patience} steps in a row took no move"
            break
    result.keep = current
    if result.kld is None:
        result.kld = result.start_kld
    result.passes_used = scored / units_chunks if units_chunks else 0.0
    result.seconds = time.perf_counter() - began
    return result


def _applied(keep: Keep, moves: Sequence[Move]) -> dict[int, tuple[int, ...]]:
    """`keep` with every move applied (moves of distinct blocks)."""
    out = {b: tuple(ids) for b, ids in keep.items()}
    for move in moves:
        out = move.apply(out)
    return out


def _column(settings: MeasureSettings) -> int:
    from ggufcarve.measure.statistics import metric_column

    return metric_column(settings.metric)


def _full_kld(measured: Any, cid: str) -> float | None:
    """A candidate's mean KLD when it was scored on every unit."""
    record = measured.records[cid]
    return record.get("kld_mean") if record.get("units_scored") == len(measured.units) else None
