"""`moe_tune.ragged_dot`: the public grouped matmul; picks a backend and a tuned config at trace time."""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp

from moe_tune import devices
from moe_tune.kernels.base import KernelConfig
from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem
from moe_tune.kernels.ragged_dot.registry import BACKENDS
from moe_tune.profiles.lookup import lookup

logger = logging.getLogger("moe_tune")


def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type: Any = None,
    group_offset: jax.Array | None = None,
    backend: str | None = None,
    config: KernelConfig | dict | None = None,
) -> jax.Array:
    """Grouped matmul: `out[rows of group i] = lhs[rows] @ rhs[i]`.

    Args:
      lhs: [m, k], rows sorted by group (float32, bfloat16 or float16).
      rhs: [groups, k, n].
      group_sizes: int [total_groups]; rows past `sum(group_sizes)` come out zero.
      preferred_element_type: output dtype (default: the promoted input dtype); low-precision inputs are
        accumulated in float32.
      group_offset: int32 scalar; with it, `group_sizes` covers all groups and this call computes only
        groups `[group_offset, group_offset + groups)` (an expert-parallel shard); other rows are zero.
      backend: `xla`, `tiled`, `megablox`; None picks by platform (cpu: tiled, gpu: xla, tpu: megablox).
      config: the backend's config (or a dict of its fields); None looks the tables up (see
        `moe_tune.profiles.lookup`), falling back to the backend's heuristic default.

    Returns:
      [m, n] in `preferred_element_type`.
    """
    problem = RaggedDotProblem.from_arrays(
        lhs, rhs, group_sizes, preferred_element_type=preferred_element_type, group_offset=group_offset
    )
    impl = BACKENDS.resolve(backend, devices.platform())
    if config is None:
        found = lookup("ragged_dot", problem, backend=impl.name)
        config, source = found.config, f"{found.source}: {found.reason}"
    else:
        source = "given by the caller"
    config = impl.coerce_config(config, problem)
    # Runs once per trace under jit, so this costs nothing per call.
    logger.info("ragged_dot %s: backend %s, config %s (%s)", problem.key_fields(), impl.name, config.label(), source)
    return impl(lhs, rhs, group_sizes, config=config, out_dtype=jnp.dtype(problem.out_dtype), group_offset=group_offset)
