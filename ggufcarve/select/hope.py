"""HOPE's keep-set of one block (arXiv 2609.18916): the experts to drop minimise the pairwise form.

F is the block's E x E matrix of co-selection (`BlockStats.pair_matrix`): F_ij the mean over tokens
routing to both i and j of v_i v_j, v = g ||f|| (the weight llama.cpp applied times the expert's
output norm), 0 for a pair never routed together; F_ii the mean of v_i^2 over i's own tokens.
Dropping the set D loses, summed over pairs, b^T F b with b the indicator of D. Minimised over
b in [0, 1]^E with sum(b) = P (the count dropped), from the uniform start b = P / E, by projected
gradient descent (step 1 / L, L = 2 max |eigenvalue of F|; the projection onto the capped simplex by
bisection on its shift); the P largest entries of b are then dropped (equal entries: the smaller
diagonal first, then the lower id). Protected experts have the bound b = 0: never dropped.

The diagonal alone is a REAP-like score: F_ii is the second moment of g ||f|| over e's tokens, where
REAP ranks by its first moment, mean g ||f||. The off-diagonal terms make HOPE drop experts that are
rarely chosen together: two experts that serve the same tokens are not both dropped, since their
product adds to the loss, while REAP ranks each expert alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ITERATIONS = 400
BISECTION_STEPS = 60


def project(y: np.ndarray, total: float, upper: np.ndarray) -> np.ndarray:
    """The point of {0 <= b <= upper, sum(b) = total} nearest `y`: clip(y - tau, 0, upper) for the tau that sums
    to `total` (found by bisection; sum is non-increasing in tau)."""
    low, high = float(y.min() - upper.max()) - 1.0, float(y.max()) + 1.0
    for _ in range(BISECTION_STEPS):
        tau = 0.5 * (low + high)
        if np.clip(y - tau, 0.0, upper).sum() > total:
            low = tau
        else:
            high = tau
    return np.clip(y - 0.5 * (low + high), 0.0, upper)


def relaxed(matrix: np.ndarray, dropped: int, upper: np.ndarray) -> np.ndarray:
    """The relaxation's local minimum of b^T F b from the uniform start (module docstring)."""
    n = matrix.shape[0]
    free = float(upper.sum())
    b = project(np.full(n, dropped / max(free, 1.0)) * upper, dropped, upper)
    scale = 2.0 * float(np.abs(np.linalg.eigvalsh(matrix)).max()) if n else 0.0
    if scale <= 0.0:
        return b
    for _ in range(ITERATIONS):
        b = project(b - (2.0 * matrix @ b) / scale, dropped, upper)
    return b


def hope_keep(pairs: np.ndarray, members: Sequence[int], quota: int, protected: set[int] = frozenset()) -> list[int]:
    """The `quota` experts of `members` HOPE keeps from the block's F (`pairs`, indexed by expert id), protected
    ones included; best first (protected, then by F's diagonal, descending)."""
    ids = list(members)
    dropped = len(ids) - quota
    diagonal = np.diag(pairs)
    if dropped <= 0:
        return sorted(ids, key=lambda e: (e not in protected, -float(diagonal[e]), e))
    matrix = pairs[np.ix_(ids, ids)]
    matrix = 0.5 * (matrix + matrix.T)
    upper = np.array([0.0 if e in protected else 1.0 for e in ids])
    b = relaxed(matrix, dropped, upper)
    order = sorted(range(len(ids)), key=lambda i: (-round(float(b[i]), 9), float(diagonal[ids[i]]), ids[i]))
    drop = {ids[i] for i in order[:dropped]}
    return sorted((e for e in ids if e not in drop), key=lambda e: (e not in protected, -float(diagonal[e]), e))


def dropped_loss(pairs: np.ndarray, members: Sequence[int], kept: Sequence[int]) -> float:
    """b^T F b of the experts of `members` not in `kept`: what HOPE minimises."""
    drop = [e for e in members if e not in set(kept)]
    return float(pairs[np.ix_(drop, drop)].sum()) if drop else 0.0
