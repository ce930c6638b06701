"""`xla` backend: `jax.lax.ragged_dot`, no tunables; the baseline every other backend is measured against."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_tune.kernels.base import KernelConfig
from moe_tune.kernels.ragged_dot.base import RaggedDotBackend
from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem


@dataclasses.dataclass(frozen=True)
class XlaConfig(KernelConfig):
    """XLA picks its own tiling; nothing to tune."""


class XlaRaggedDot(RaggedDotBackend):
    name = "xla"
    config_cls = XlaConfig
    platforms = ("cpu", "gpu", "tpu")
    description = "jax.lax.ragged_dot (XLA's own lowering); the baseline"

    def default_config(self, problem: RaggedDotProblem) -> XlaConfig:
        return XlaConfig()

    def __call__(self, lhs, rhs, group_sizes, *, config, out_dtype, group_offset=None):
        group_sizes = group_sizes.astype(jnp.int32)
        if group_offset is not None:
            # lax.ragged_dot has no group offset: prepend a zero "group" that owns the rows before the shard,
            # so they multiply zeros; rows after the shard's groups are past the sum and come out zero.
            groups = rhs.shape[0]
            local = jax.lax.dynamic_slice_in_dim(group_sizes, jnp.asarray(group_offset, jnp.int32), groups)
            before = jnp.sum(jnp.where(jnp.arange(group_sizes.shape[0]) < group_offset, group_sizes, 0))
            group_sizes = jnp.concatenate([before[None].astype(jnp.int32), local])
            rhs = jnp.concatenate([jnp.zeros((1, *rhs.shape[1:]), rhs.dtype), rhs])
        return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=out_dtype)
