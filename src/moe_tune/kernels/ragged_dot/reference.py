"""Float64 NumPy references for the three ragged_dot directions: what every backend and every tuning
candidate is checked against."""

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
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]), np.float64)
    for i, (s, e) in enumerate(_local_row_ranges(group_sizes, lhs.shape[0], rhs.shape[0], group_offset)):
        out[s:e] = lhs[s:e] @ rhs[i]
    return out


def ragged_dot_dlhs_reference(
    dout: np.ndarray, rhs: np.ndarray, group_sizes: np.ndarray, *, group_offset: int = 0
) -> np.ndarray:
    """dlhs: dlhs[rows of local group i] = dout[rows] @ rhs[i]^T; other rows zero. float64 [m, k]."""
    dout, rhs = np.asarray(dout, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((dout.shape[0], rhs.shape[1]), np.float64)
    for i, (s, e) in enumerate(_local_row_ranges(group_sizes, dout.shape[0], rhs.shape[0], group_offset)):
        out[s:e] = dout[s:e] @ rhs[i].T
    return out


def ragged_dot_drhs_reference(
    lhs: np.ndarray, dout: np.ndarray, group_sizes: np.ndarray, *, groups: int, group_offset: int = 0
) -> np.ndarray:
    """drhs (tgmm): drhs[i] = lhs[rows of local group i]^T @ dout[same rows]. float64 [groups, k, n]."""
    lhs, dout = np.asarray(lhs, np.float64), np.asarray(dout, np.float64)
    out = np.zeros((groups, lhs.shape[1], dout.shape[1]), np.float64)
    for i, (s, e) in enumerate(_local_row_ranges(group_sizes, lhs.shape[0], groups, group_offset)):
        out[i] = lhs[s:e].T @ dout[s:e]
    return out
