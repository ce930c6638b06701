"""Float64 NumPy reference for ragged_dot: what every backend and every tuning candidate is checked against."""

from __future__ import annotations

import numpy as np


def ragged_dot_reference(
    lhs: np.ndarray, rhs: np.ndarray, group_sizes: np.ndarray, *, group_offset: int = 0
) -> np.ndarray:
    """out[rows of local group i] = lhs[rows] @ rhs[i]; every other row is zero. Returns float64 [m, n].

    lhs [m, k], rhs [groups, k, n], group_sizes [total_groups] (concrete values), local groups are
    `group_offset .. group_offset + groups - 1`.
    """
    lhs = np.asarray(lhs, np.float64)
    rhs = np.asarray(rhs, np.float64)
    sizes = np.maximum(np.asarray(group_sizes, np.int64), 0)
    m = lhs.shape[0]
    ends = np.minimum(np.cumsum(sizes), m)
    starts = np.concatenate([[0], ends[:-1]])
    out = np.zeros((m, rhs.shape[2]), np.float64)
    for local in range(rhs.shape[0]):
        s, e = starts[group_offset + local], ends[group_offset + local]
        if e > s:
            out[s:e] = lhs[s:e] @ rhs[local]
    return out
