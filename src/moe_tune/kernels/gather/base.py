"""The call signatures every dispatch and combine backend implements.

Each backend module (`plain_jax`, `tiled`, `triton`, `pallas_tpu`, `sparsecore`) defines one `GatherBackend` (dispatch)
and one `GatherReduceBackend` (combine: both `ragged_gather_reduce` and `dense_gather_reduce`, which differ
only in having a validity mask). Zero-weight skipping, fallbacks and gradients live in `op.py`, so kernels
only implement the forward semantics below.
"""

from __future__ import annotations

import abc
from typing import Any

import jax

from moe_tune.kernels.base import Backend, KernelConfig
from moe_tune.kernels.gather.problem import GatherProblem


class GatherBackend(Backend[Any, GatherProblem]):
    """Dispatch: `out[i] = x[indices[i]] * weights[i]` for `start <= i < end`, zero elsewhere."""

    op = "ragged_gather"

    @abc.abstractmethod
    def gather(
        self,
        x: jax.Array,
        indices: jax.Array,
        start: jax.Array,
        end: jax.Array,
        weights: jax.Array | None,
        *,
        config: KernelConfig,
    ) -> jax.Array:
        """x [tokens, hidden] (f32/bf16/f16), indices int32 [rows] (in [0, tokens) inside the range; anything
        outside it), start / end int32 scalars (traced), weights [rows] or None -> [rows, hidden] in x.dtype.

        Only rows in [start, end) are read or computed (the ragged part); the rest of the output is zero.
        Weighting is done in float32 and rounded once."""


class GatherReduceBackend(Backend[Any, GatherProblem]):
    """Combine: `out[t] = sum_j valid[i] * weights[i] * x[indices[i]]`, `i = t * reduce_group_size + j`."""

    op = "ragged_gather_reduce"

    def __init__(self, op: str = "ragged_gather_reduce"):
        self.op = op  # one implementation serves ragged_gather_reduce and dense_gather_reduce

    @abc.abstractmethod
    def gather_reduce(
        self,
        x: jax.Array,
        indices: jax.Array,
        weights: jax.Array,
        valid: jax.Array | None,
        reduce_group_size: int,
        *,
        config: KernelConfig,
    ) -> jax.Array:
        """x [rows, hidden], indices int32 [rows], weights [rows] (any float), valid bool [rows] or None (all
        valid) -> [rows // reduce_group_size, hidden] in x.dtype, accumulated in float32.

        Invalid entries are never read: their x rows may hold garbage (NaN, another shard's data) and their
        indices may be out of range. A valid entry with weight 0 still multiplies (0 * NaN = NaN); callers
        who want such rows dropped fold `weights != 0` into `valid` (op.py's `skip_zero_weights`)."""
