"""The call signature every ragged_dot backend implements."""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from moe_tune.kernels.base import Backend, KernelConfig
from moe_tune.kernels.ragged_dot.metadata import group_bounds
from moe_tune.kernels.ragged_dot.problem import OPERANDS, RaggedDotProblem
from moe_tune.core.quant import DEFAULT_QLAYOUT, QArray, in_layout


class RaggedDotBackend(Backend[Any, RaggedDotProblem]):
    """The two kernels every backend implements, `gmm` and `tgmm`; the three directions are built on them:
    fwd = gmm(lhs, rhs), dlhs = gmm(dout, rhs, transpose_rhs=True), drhs = tgmm(lhs, dout).

    Operands marked `Array | QArray` may be quantized (`moe_tune.QArray`, scaled along k: lhs [m, k] with
    scale [m, k/bs], rhs [g, k, n] with scale [g, k/bs, n]); the result is then that of the dequantized
    operands up to float32 accumulation. `quantized.prepare_gmm` / `prepare_tgmm` fold the scales a kernel
    cannot apply cheaply into the float operand.

    `rhs_layouts`: the memory layouts (`QArray.layout`) of quantized weights its kernels read as stored, the
    first the one the others are moved to; `run` hands `gmm` / `tgmm` every other QArray in "kn" (its
    logical view, `core.quant.in_layout`), so a backend that reads "kn" never sees another layout."""

    op = "ragged_dot"
    rhs_layouts: ClassVar[tuple[str, ...]] = (DEFAULT_QLAYOUT,)

    @abc.abstractmethod
    def gmm(
        self,
        lhs: jax.Array | QArray,
        rhs: jax.Array | QArray,
        group_sizes: jax.Array,
        *,
        config: KernelConfig,
        out_dtype: jnp.dtype,
        group_offset: jax.Array | None = None,
        transpose_rhs: bool = False,
    ) -> jax.Array:
        """lhs [m, k], rhs [groups, k, n] ([groups, n, k] with transpose_rhs: the forward rhs of dlhs, its
        scale still [groups, n/bs, k]), group_sizes int [total_groups] -> [m, n] in out_dtype. Rows outside
        the local groups (and past sum(group_sizes)) are zero."""

    @abc.abstractmethod
    def tgmm(
        self,
        lhs: jax.Array | QArray,
        dout: jax.Array,
        group_sizes: jax.Array,
        *,
        config: KernelConfig,
        out_dtype: jnp.dtype,
        num_groups: int,
        group_offset: jax.Array | None = None,
    ) -> jax.Array:
        """lhs [m, k], dout [m, n] -> [num_groups, k, n]: out[i] = lhs[rows of local group i]^T @ dout[same rows].
        Empty groups give zeros; rows outside the local groups do not contribute."""

    def run(self, problem: RaggedDotProblem, config: KernelConfig, a: jax.Array, b: jax.Array,
            group_sizes: jax.Array, group_offset: jax.Array | None = None) -> jax.Array:
        """Run `problem.direction` on its two operands: (lhs, rhs) for fwd, (dout, rhs) for dlhs, (lhs, dout)
        for drhs; the result has the dtype `problem.operand_dtypes()[2]`. A QArray operand arrives in a layout
        the backend reads (`rhs_layouts` for the weights, "kn" for any other)."""
        a, b = (in_layout(x, self.rhs_layouts if name == "rhs" else (DEFAULT_QLAYOUT,))
                for x, name in zip((a, b), OPERANDS[problem.direction]))
        out_dtype = jnp.dtype(problem.operand_dtypes()[2])
        if problem.direction == "drhs":
            return self.tgmm(a, b, group_sizes, config=config, out_dtype=out_dtype, num_groups=problem.groups,
                             group_offset=group_offset)
        return self.gmm(a, b, group_sizes, config=config, out_dtype=out_dtype, group_offset=group_offset,
                        transpose_rhs=problem.direction == "dlhs")


def rows_in_local_groups(
    group_sizes: jax.Array, m: int, groups: int, group_offset: jax.Array | None
) -> jax.Array:
    """bool [m, 1]: which rows belong to the local groups `[group_offset, group_offset + groups)` (none for an
    offset out of range: `metadata.select_shard`)."""
    starts, ends = group_bounds(group_sizes, m=m, groups=groups, group_offset=0 if group_offset is None else group_offset)
    rows = jax.lax.broadcasted_iota(jnp.int32, (m, 1), 0)
    return (rows >= starts[0]) & (rows < ends[groups - 1])
