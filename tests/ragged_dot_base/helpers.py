"""Shared by the suite's mixins: the directions, tolerances, float operands, the float64 forward reference
check and the fixed and edge cases (m, group_sizes, shard) the float and gradient tests run."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moe_tune.kernels.ragged_dot.definition import ragged_dot_reference

DIRECTIONS = ("fwd", "dlhs", "drhs")  # gmm, gmm(transpose_rhs=True), tgmm

# Error allowed relative to max|reference|, by the output dtype (inputs are exact in the reference, and
# low-precision inputs are promised float32 accumulation, so only the output's rounding is forgiven).
TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 2e-2}
# Gradients (dlhs, drhs; returned in the input dtype): with float32 accumulation only the output's rounding
# is left (2**-9 of a value for bfloat16), ~0.002-0.003 of max|ref| at the fixed cases' sizes, so 5e-3 leaves
# a margin and still fails a kernel that sums its partial products in bfloat16
# (`TestTiled.test_bfloat16_gradients_accumulate_in_float32` shows the two errors it separates).
GRAD_TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 5e-3}


# --------------------------------------------------------------------------------------------------------
# Float operands


def make_operands(m: int, k: int, n: int, groups: int, dtype: str, seed: int) -> tuple[jax.Array, jax.Array]:
    """lhs [m, k] and rhs [groups, k, n] in `dtype`, normal, rhs scaled so that outputs are O(1)."""
    rng = np.random.default_rng(seed)
    lhs = rng.standard_normal((m, k), np.float32)
    rhs = rng.standard_normal((groups, k, n), np.float32) / np.sqrt(k)
    return jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype)


def local_rows(sizes: Any, m: int, groups: int, offset: int) -> np.ndarray:
    """bool [m]: rows that belong to local groups [offset, offset + groups) (plain Python, ends clipped)."""
    ends = np.minimum(np.cumsum(np.maximum(np.asarray(sizes, np.int64), 0)), m)
    starts = np.concatenate([[0], ends[:-1]])
    mask = np.zeros(m, bool)
    for g in range(offset, offset + groups):
        mask[starts[g]:ends[g]] = True
    return mask


def assert_matches_reference(out: jax.Array, lhs: jax.Array, rhs: jax.Array, sizes: Any, *, offset: int | None,
                             out_dtype: str, what: str = "") -> None:
    """`out` has the forward's shape and dtype, is zero on rows of no local group, and is within
    TOLERANCE[out_dtype] x max|reference| of the float64 reference elsewhere."""
    m, n = lhs.shape[0], rhs.shape[2]
    groups = rhs.shape[0]
    assert out.shape == (m, n), what
    assert out.dtype == jnp.dtype(out_dtype), what
    got = np.asarray(out.astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(got)), f"non-finite output {what}"
    ref = ragged_dot_reference(
        np.asarray(lhs.astype(jnp.float32)), np.asarray(rhs.astype(jnp.float32)), np.asarray(sizes),
        group_offset=offset or 0,
    )
    mine = local_rows(sizes, m, groups, offset or 0)
    # Rows outside the local groups (other shards' rows, rows past sum(group_sizes)) are exactly zero.
    outside = got[~mine]
    assert np.all(outside == 0), f"{np.count_nonzero(outside)} non-zero values in rows of no local group {what}"
    scale = np.abs(ref).max()
    if scale == 0:
        assert np.all(got == 0), what
        return
    err = np.abs(got - ref).max() / scale
    assert err <= TOLERANCE[out_dtype], f"max error {err:.3g} x max|ref| > {TOLERANCE[out_dtype]} {what}"


def sizes_from_cuts(used: int, cuts: list[int]) -> list[int]:
    """Group sizes of `used` rows cut at `cuts` (one more group than cuts; empty groups where cuts repeat)."""
    bounds = [0, *sorted(cuts), used]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


# Fixed cases: (m, group_sizes, shard) where shard is None or (group_offset, local groups).
CASES = {
    "uneven": (37, [3, 20, 1, 13], None),
    "empty_first_and_last": (40, [0, 15, 25, 0], None),
    "empty_middle": (40, [10, 0, 0, 30], None),
    "one_group_holds_all_rows": (40, [0, 40, 0], None),
    "single_group": (29, [29], None),
    "sum_below_m": (48, [5, 7, 3], None),
    "all_groups_empty": (24, [0, 0, 0], None),
    "m_not_tile_multiple": (45, [11, 17, 17], None),
    "shard_middle": (40, [6, 9, 0, 12, 13], (1, 3)),
    "shard_first": (40, [6, 9, 0, 12, 13], (0, 2)),
    "shard_last_sum_below_m": (40, [6, 9, 0, 12, 10], (3, 2)),
    "shard_of_empty_groups": (40, [20, 0, 0, 20], (1, 2)),
    # sum(group_sizes) > m: a UsageError when the sizes are known; traced (under jit), group ends are clipped at
    # m, as in the reference
    "sum_above_m_is_clipped": (40, [30, 30, 5], None),
}
GRAD_CASES = ("uneven", "empty_first_and_last", "sum_below_m", "shard_middle", "one_group_holds_all_rows")
# (m, k, n, group_sizes, shard, dtype, preferred_element_type): what the few hypothesis examples of the slow
# backends would have to find
EDGE_CASES = {
    "all_dims_1": (1, 1, 1, [1], None, "float32", None),
    "k_is_1": (6, 1, 5, [2, 0, 4], None, "float32", None),
    "n_is_1": (9, 7, 1, [0, 9], None, "bfloat16", "float32"),
    "m_is_1_of_a_shard": (1, 3, 2, [0, 1, 0], (1, 2), "float32", "bfloat16"),
    "odd_dims_shard_with_rows_past_the_sum": (33, 131, 129, [4, 10, 0, 11], (1, 2), "bfloat16", None),
}

