"""`jax` backend: the plain, non-ragged reference implementation, and the fallback.

It gathers every row and then masks, so its work does not shrink with the valid range; it has nothing to
tune. `ragged_gather_fallback` / `ragged_gather_reduce_fallback` and the version guard select it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_tune.kernels.base import KernelConfig
from moe_tune.kernels.gather.base import GatherBackend, GatherReduceBackend
from moe_tune.kernels.gather.problem import GatherProblem


@dataclasses.dataclass(frozen=True)
class PlainConfig(KernelConfig):
    """XLA's gather picks its own loop; nothing to tune."""


def row_range_mask(rows: int, start: jax.Array, end: jax.Array) -> jax.Array:
    """bool [rows]: start <= i < end."""
    i = jnp.arange(rows, dtype=jnp.int32)
    return (i >= start) & (i < end)


class PlainGather(GatherBackend):
    name = "jax"
    revision = 1  # bump on changes that can change the fastest or a valid config (Backend.revision)
    config_cls = PlainConfig
    platforms = ("cpu", "gpu", "tpu")
    description = "plain JAX: gather every row, then mask (the fallback)"

    def default_config(self, problem: GatherProblem) -> PlainConfig:
        return PlainConfig()

    def gather(self, x, indices, start, end, weights, *, config):
        valid = row_range_mask(indices.shape[0], start, end)
        rows = jnp.take(x, indices, axis=0, mode="clip")  # every row, in range or not (clip: garbage is safe)
        if weights is not None:
            rows = rows.astype(jnp.float32) * weights.astype(jnp.float32)[:, None]
        return jnp.where(valid[:, None], rows, 0).astype(x.dtype)


class PlainGatherReduce(GatherReduceBackend):
    name = "jax"
    revision = 1  # bump on changes that can change the fastest or a valid config (Backend.revision)
    config_cls = PlainConfig
    platforms = ("cpu", "gpu", "tpu")
    description = "plain JAX: gather every row, mask, reduce (the fallback)"

    def default_config(self, problem: GatherProblem) -> PlainConfig:
        return PlainConfig()

    def gather_reduce(self, x, indices, weights, valid, reduce_group_size, *, config):
        rows, hidden = indices.shape[0], x.shape[1]
        gathered = jnp.take(x, indices, axis=0, mode="clip").astype(jnp.float32)
        weighted = gathered * weights.astype(jnp.float32)[:, None]
        if valid is not None:  # a select, not a multiply: invalid rows may hold NaN
            weighted = jnp.where(valid[:, None], weighted, 0.0)
        out = weighted.reshape(rows // reduce_group_size, reduce_group_size, hidden).sum(axis=1)
        return out.astype(x.dtype)
