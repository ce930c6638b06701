"""Float64 NumPy references for the three ragged_dot directions: what every backend and every tuning
candidate is checked against.

Each group's operand rows are converted to float64 as that group is multiplied (`_f64`), not whole operands
first: the same values and products, without a float64 copy of the whole rhs (200 MB at the default sweep
shape, and groups with no rows are never converted; FINDINGS.md: sweep memory).
"""

from __future__ import annotations

import numpy as np


def _local_row_ranges(group_sizes: np.ndarray, m: int, groups: int, group_offset: int) -> list[tuple[int, int]]:
    sizes = np.maximum(np.asarray(group_sizes, np.int64), 0)
    ends = np.minimum(np.cumsum(sizes), m)
    starts = np.concatenate([[0], ends[:-1]])
    return [(int(starts[group_offset + i]), int(ends[group_offset + i])) for i in range(groups)]


def ragged_dot_reference(
    lhs: np.ndarray, rhs: np.ndarray, group_sizes: np.ndarray, *, group_offset: int = 0
) -> np.ndarray:
    """fwd: out[rows of local group i] = lhs[rows] @ rhs[i]; every other row is zero. float64 [m, n].

    lhs [m, k], rhs [groups, k, n], group_sizes [total_groups] (concrete values), local groups are
    `group_offset .. group_offset + groups - 1`.
    """
    lhs, rhs = np.asarray(lhs), np.asarray(rhs)
    out = np.zeros((lhs.shape[0], rhs.shape[2]), np.float64)
    for i, (s, e) in enumerate(_local_row_ranges(group_sizes, lhs.shape[0], rhs.shape[0], group_offset)):
        if e > s:
            out[s:e] = _f64(lhs[s:e]) @ _f64(rhs[i])
    return out


def ragged_dot_dlhs_reference(
    dout: np.ndarray, rhs: np.ndarray, group_sizes: np.ndarray, *, group_offset: int = 0
) -> np.ndarray:
    """dlhs: dlhs[rows of local group i] = dout[rows] @ rhs[i]^T; other rows zero. float64 [m, k]."""
    dout, rhs = np.asarray(dout), np.asarray(rhs)
    out = np.zeros((dout.shape[0], rhs.shape[1]), np.float64)
    for i, (s, e) in enumerate(_local_row_ranges(group_sizes, dout.shape[0], rhs.shape[0], group_offset)):
        if e > s:
            out[s:e] = _f64(dout[s:e]) @ _f64(rhs[i]).T
    return out


def ragged_dot_drhs_reference(
    lhs: np.ndarray, dout: np.ndarray, group_sizes: np.ndarray, *, groups: int, group_offset: int = 0
) -> np.ndarray:
    """drhs (tgmm): drhs[i] = lhs[rows of local group i]^T @ dout[same rows]. float64 [groups, k, n]."""
    lhs, dout = np.asarray(lhs), np.asarray(dout)
    out = np.zeros((groups, lhs.shape[1], dout.shape[1]), np.float64)
    for i, (s, e) in enumerate(_local_row_ranges(group_sizes, lhs.shape[0], groups, group_offset)):
        if e > s:
            out[i] = _f64(lhs[s:e]).T @ _f64(dout[s:e])
    return out


def _f64(x: np.ndarray) -> np.ndarray:
    """A float64 copy of `x` (exact for every float and integer dtype the operands have)."""
    return np.asarray(x, np.float64)
