"""`jax` backend: the unfused composition (gather, XLA's ragged dot, segment sum), the fallback.

It writes the [m, k] gathered rows and the [m, n] products that the fused kernels avoid; it has nothing to
tune. The version guard, the can't-run fallback and a backend's `config_error` select it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_tune.kernels.base import KernelConfig
from moe_tune.kernels.fused_moe.activations import apply
from moe_tune.kernels.fused_moe.base import FusedMoeBackend
from moe_tune.kernels.fused_moe.problem import FusedMoeProblem
from moe_tune.kernels.ragged_dot.metadata import group_bounds
from moe_tune.kernels.ragged_dot.xla import XlaConfig, XlaRaggedDot

_XLA = XlaRaggedDot()


@dataclasses.dataclass(frozen=True)
class PlainFusedConfig(KernelConfig):
    """XLA picks its own loops; nothing to tune."""


def local_rows(group_sizes, m: int, groups: int, group_offset) -> jax.Array:
    """bool [m]: the rows of the local groups, [start, end) of `group_bounds`."""
    starts, ends = group_bounds(group_sizes, m=m, groups=groups, group_offset=0 if group_offset is None else group_offset)
    i = jnp.arange(m, dtype=jnp.int32)
    return (i >= starts[0]) & (i < ends[groups - 1])


class PlainFusedMoe(FusedMoeBackend):
    name = "jax"
    revision = 1  # bump on changes that can change the fastest or a valid config (Backend.revision)
    config_cls = PlainFusedConfig
    platforms = ("cpu", "gpu", "tpu")
    description = "plain JAX: gather, lax.ragged_dot, segment sum (unfused; the fallback)"

    def default_config(self, problem: FusedMoeProblem) -> PlainFusedConfig:
        return PlainFusedConfig()

    def gather_gmm(self, x, rows, rhs, group_sizes, *, config, out_dtype, group_offset=None, glu=None,
                   transpose_rhs=False):
        m = rows.shape[0]
        valid = local_rows(group_sizes, m, rhs.shape[0], group_offset)
        gathered = jnp.take(x, jnp.where(valid, rows, 0), axis=0, mode="clip")
        h = _XLA.gmm(gathered, rhs, group_sizes, config=XlaConfig(), out_dtype=jnp.float32,
                     group_offset=group_offset, transpose_rhs=transpose_rhs)
        out = apply(glu, h) if glu else h
        return jnp.where(valid[:, None], out, 0.0).astype(out_dtype)

    def gmm_combine(self, h, rhs, group_sizes, rows, row_weights, *, tokens, config, out_dtype, group_offset=None,
                    skip_zero_weights=False, transpose_rhs=False):
        m = h.shape[0]
        valid = local_rows(group_sizes, m, rhs.shape[0], group_offset)
        if skip_zero_weights:
            valid = valid & (row_weights != 0)
        safe = jnp.where(valid[:, None], h, jnp.zeros((), h.dtype))  # rows outside may hold NaN
        product = _XLA.gmm(safe, rhs, group_sizes, config=XlaConfig(), out_dtype=jnp.float32,
                           group_offset=group_offset, transpose_rhs=transpose_rhs)
        contribution = jnp.where(valid[:, None], product * row_weights.astype(jnp.float32)[:, None], 0.0)
        target = jnp.where(valid, rows, tokens)
        out = jax.ops.segment_sum(contribution, target, num_segments=tokens + 1)[:tokens]
        return out.astype(out_dtype)
