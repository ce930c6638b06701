"""Float64 NumPy references for dispatch and combine (what every backend is checked against)."""

from __future__ import annotations

import numpy as np


def ragged_gather_reference(x, indices, start: int, end: int, weights=None) -> np.ndarray:
    """x [tokens, hidden], indices [rows] -> [rows, hidden] float64; rows outside [start, end) are zero."""
    x, indices = np.asarray(x, np.float64), np.asarray(indices)
    rows = indices.shape[0]
    out = np.zeros((rows, x.shape[1]), np.float64)
    start, end = max(0, int(start)), min(rows, int(end))
    if end > start:
        out[start:end] = x[indices[start:end]]
        if weights is not None:
            out[start:end] *= np.asarray(weights, np.float64)[start:end, None]
    return out


def gather_reduce_reference(x, indices, weights, valid, reduce_group_size: int) -> np.ndarray:
    """x [rows, hidden], indices / weights / valid [rows] (valid None: all) -> [rows // r, hidden] float64.

    Invalid entries contribute nothing and are not read (their rows may be NaN); valid entries multiply,
    so a zero weight times NaN is NaN."""
    x, indices = np.asarray(x, np.float64), np.asarray(indices)
    weights = np.asarray(weights, np.float64)
    rows, hidden = indices.shape[0], x.shape[1]
    valid = np.ones(rows, bool) if valid is None else np.asarray(valid, bool)
    out = np.zeros((rows // reduce_group_size, hidden), np.float64)
    for i in np.flatnonzero(valid):
        out[i // reduce_group_size] += weights[i] * x[indices[i]]
    return out
