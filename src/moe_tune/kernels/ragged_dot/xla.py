"""`xla` backend: `jax.lax.ragged_dot_general`, no tunables; the baseline every other backend is measured against.

Quantized operands (QArray, 4-bit included) are dequantized first, and activations to be quantized in the
kernel (`DynamicQuant`) are quantized whole and dequantized: the reference path, not a fast one."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from moe_tune.kernels.base import KernelConfig
from moe_tune.kernels.ragged_dot.base import RaggedDotBackend
from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem
from moe_tune.core.quant import DynamicQuant, QArray, dequantize

# lhs [m, k] x rhs [g, k, n] (or [g, n, k]): ragged rows of lhs select a group of rhs.
_GMM = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0],
                                     rhs_group_dimensions=[0])
_GMM_T = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
                                       rhs_group_dimensions=[0])
# lhs [m, k] x dout [m, n], ragged contracting dim m -> [g, k, n].
_TGMM = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
                                      rhs_group_dimensions=[])


@dataclasses.dataclass(frozen=True)
class XlaConfig(KernelConfig):
    """XLA picks its own tiling; nothing to tune."""


def _shard_sizes(group_sizes: jax.Array, groups: int, group_offset: jax.Array) -> jax.Array:
    """lax.ragged_dot has no group offset: [rows before the shard, sizes of the shard's groups...]. The
    extra leading group owns the rows before the shard; rows after it are past the sum."""
    sizes = group_sizes.astype(jnp.int32)
    offset = jnp.asarray(group_offset, jnp.int32)
    local = lax.dynamic_slice_in_dim(sizes, offset, groups)
    before = jnp.sum(jnp.where(jnp.arange(sizes.shape[0]) < offset, sizes, 0))
    return jnp.concatenate([before[None], local])


def _ragged_dot_general(lhs, rhs, sizes, dims: lax.RaggedDotDimensionNumbers, out_dtype) -> jax.Array:
    """lax.ragged_dot_general, vmappable over its group sizes too (XLA's batching rule is not: under vmap the
    batch is run as a sequential map, one ragged dot per element)."""

    def call(lhs, rhs, sizes):
        return lax.ragged_dot_general(lhs, rhs, sizes, dims, preferred_element_type=out_dtype)

    batched_call = jax.custom_batching.custom_vmap(call)

    @batched_call.def_vmap
    def _rule(axis_size, in_batched, lhs, rhs, sizes):
        args = [x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
                for x, batched in zip((lhs, rhs, sizes), in_batched)]
        return lax.map(lambda xs: batched_call(*xs), tuple(args)), True

    return batched_call(lhs, rhs, sizes)


def _floats(*operands: jax.Array | QArray) -> list[jax.Array]:
    """The operands as floats of one dtype: QArrays dequantized (float32), the others promoted to match."""
    operands = [x.quantize() if isinstance(x, DynamicQuant) else x for x in operands]
    if not any(isinstance(x, QArray) for x in operands):
        return list(operands)
    values = [dequantize(x) if isinstance(x, QArray) else x for x in operands]
    dtype = jnp.result_type(*values)
    return [x.astype(dtype) for x in values]


class XlaRaggedDot(RaggedDotBackend):
    name = "xla"
    revision = 1  # bump on changes that can change the fastest or a valid config (Backend.revision)
    config_cls = XlaConfig
    platforms = ("cpu", "gpu", "tpu")
    description = "jax.lax.ragged_dot_general (XLA's own lowering); the baseline"

    def default_config(self, problem: RaggedDotProblem) -> XlaConfig:
        return XlaConfig()

    def gmm(self, lhs, rhs, group_sizes, *, config, out_dtype, group_offset=None, transpose_rhs=False):
        lhs, rhs = _floats(lhs, rhs)
        sizes = group_sizes.astype(jnp.int32)
        if group_offset is not None:  # the leading group multiplies zeros
            sizes = _shard_sizes(sizes, rhs.shape[0], group_offset)
            rhs = jnp.concatenate([jnp.zeros((1, *rhs.shape[1:]), rhs.dtype), rhs])
        return _ragged_dot_general(lhs, rhs, sizes, _GMM_T if transpose_rhs else _GMM, out_dtype)

    def tgmm(self, lhs, dout, group_sizes, *, config, out_dtype, num_groups, group_offset=None):
        lhs, dout = _floats(lhs, dout)
        sizes = group_sizes.astype(jnp.int32)
        if group_offset is not None:  # drop the leading group's result
            sizes = _shard_sizes(sizes, num_groups, group_offset)
        out = _ragged_dot_general(lhs, dout, sizes, _TGMM, out_dtype)
        return out[1:] if group_offset is not None else out
