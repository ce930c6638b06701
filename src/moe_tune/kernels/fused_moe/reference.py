"""Float64 NumPy references for the fused dispatch and combine (what every backend and every tuning
candidate is checked against). Concrete inputs only; a QArray is dequantized by the caller
(`moe_tune.core.quant.dequantize_host`)."""

from __future__ import annotations

import numpy as np

from moe_tune.kernels.fused_moe.activations import apply_reference


def local_row_range(group_sizes, m: int, groups: int, group_offset: int = 0) -> tuple[list[tuple[int, int]], int, int]:
    """([(start, end) of each local group], start, end): rows sorted by group, negative sizes count as 0, rows
    past m dropped, an offset outside [0, total - groups] selects nothing (`metadata.select_shard`)."""
    sizes = np.maximum(np.asarray(group_sizes, np.int64), 0)
    total = sizes.shape[0]
    if not 0 <= group_offset <= total - groups:
        return [(0, 0)] * groups, 0, 0
    ends = np.minimum(np.cumsum(sizes), m)
    starts = np.concatenate([[0], ends[:-1]])
    ranges = [(int(starts[group_offset + i]), int(ends[group_offset + i])) for i in range(groups)]
    return ranges, ranges[0][0], ranges[-1][1]


def _weights(rhs, transpose_rhs: bool) -> np.ndarray:
    rhs = np.asarray(rhs, np.float64)
    return np.swapaxes(rhs, 1, 2) if transpose_rhs else rhs


def gather_gmm_reference(x, rows, rhs, group_sizes, *, group_offset: int = 0, glu: str | None = None,
                         transpose_rhs: bool = False) -> np.ndarray:
    """out[i] = x[rows[i]] @ rhs[group(i)] (rhs[g].T with transpose_rhs) on local rows, 0 elsewhere; with glu,
    act(out[:, :n/2]) * out[:, n/2:]. float64 [m, n] ([m, n/2] with glu)."""
    x, rows, w = np.asarray(x, np.float64), np.asarray(rows), _weights(rhs, transpose_rhs)
    m, n = rows.shape[0], w.shape[2]
    out = np.zeros((m, n), np.float64)
    ranges, _, _ = local_row_range(group_sizes, m, w.shape[0], group_offset)
    for g, (s, e) in enumerate(ranges):
        if e > s:
            out[s:e] = x[rows[s:e]] @ w[g]
    if glu is None:
        return out
    result = apply_reference(glu, out)
    start, end = local_row_range(group_sizes, m, w.shape[0], group_offset)[1:]
    result[:start] = result[end:] = 0.0
    return result


def gmm_combine_reference(h, rhs, group_sizes, rows, row_weights, *, tokens: int, group_offset: int = 0,
                          skip_zero_weights: bool = False, transpose_rhs: bool = False) -> np.ndarray:
    """out[t] = sum over valid local rows i with rows[i] == t of w[i] * (h[i] @ rhs[group(i)]); rows outside
    the local groups (and, with skip_zero_weights, rows of weight 0) are never read. float64 [tokens, n]."""
    h, rows, w = np.asarray(h, np.float64), np.asarray(rows), _weights(rhs, transpose_rhs)
    weights = np.asarray(row_weights, np.float64)
    out = np.zeros((tokens, w.shape[2]), np.float64)
    ranges, _, _ = local_row_range(group_sizes, h.shape[0], w.shape[0], group_offset)
    for g, (s, e) in enumerate(ranges):
        keep = np.arange(s, e)
        if skip_zero_weights:
            keep = keep[weights[keep] != 0]
        if keep.size:
            np.add.at(out, rows[keep], weights[keep, None] * (h[keep] @ w[g]))
    return out
