"""The call signature every ragged_dot backend implements."""

from __future__ import annotations

import abc
from typing import Any

import jax
import jax.numpy as jnp

from moe_tune.kernels.base import Backend, KernelConfig
from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem


class RaggedDotBackend(Backend[Any, RaggedDotProblem]):
    """`backend(lhs, rhs, group_sizes, config=..., out_dtype=..., group_offset=...) -> [m, n]`."""

    op = "ragged_dot"

    @abc.abstractmethod
    def __call__(
        self,
        lhs: jax.Array,
        rhs: jax.Array,
        group_sizes: jax.Array,
        *,
        config: KernelConfig,
        out_dtype: jnp.dtype,
        group_offset: jax.Array | None = None,
    ) -> jax.Array:
        """lhs [m, k], rhs [groups, k, n], group_sizes int32 [total_groups] -> out [m, n] of out_dtype.

        Rows outside the local groups (including rows past sum(group_sizes)) are zero.
        """


def rows_in_local_groups(
    group_sizes: jax.Array, m: int, groups: int, group_offset: jax.Array | None
) -> jax.Array:
    """bool [m, 1]: which rows belong to the local groups `[group_offset, group_offset + groups)`."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    starts = ends - group_sizes.astype(jnp.int32)
    offset = jnp.int32(0) if group_offset is None else jnp.asarray(group_offset, jnp.int32)
    first = starts[offset]
    last = ends[offset + groups - 1]
    rows = jax.lax.broadcasted_iota(jnp.int32, (m, 1), 0)
    return (rows >= first) & (rows < last)
