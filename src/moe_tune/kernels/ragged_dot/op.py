"""`moe_tune.ragged_dot`: the public grouped matmul. Picks a backend and, for each direction (fwd, and the
dlhs / drhs gradients of its custom VJP), a tuned config at trace time."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from moe_tune import devices
from moe_tune.errors import UsageError
from moe_tune.kernels.base import KernelConfig
from moe_tune.kernels.ragged_dot.problem import DIRECTIONS, RaggedDotProblem
from moe_tune.kernels.ragged_dot.registry import BACKENDS
from moe_tune.profiles.lookup import lookup

logger = logging.getLogger("moe_tune")


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static (hashable) part of one call: backend, forward problem, configs the caller fixed."""

    backend: str
    problem: RaggedDotProblem
    given: tuple[tuple[str, Any], ...]  # (direction, config or field dict as a sorted tuple)

    def config(self, direction: str) -> KernelConfig:
        """The config for `direction`: the caller's, else the tables' (looked up now, at trace time)."""
        impl = BACKENDS.get(self.backend)
        problem = self.problem.with_direction(direction)
        given = dict(self.given).get(direction)
        if given is None:
            found = lookup("ragged_dot", problem, backend=impl.name)
            config, source = found.config, f"{found.source}: {found.reason}"
        else:
            config, source = (dict(given) if isinstance(given, tuple) else given), "given by the caller"
        config = impl.coerce_config(config, problem)
        # Runs once per trace under jit, so this costs nothing per call.
        logger.info("ragged_dot %s: backend %s, config %s (%s)", problem.key_fields(), impl.name, config.label(),
                    source)
        return config

    def run(self, direction: str, a, b, group_sizes, group_offset):
        impl = BACKENDS.get(self.backend)
        problem = self.problem.with_direction(direction)
        return impl.run(problem, self.config(direction), a, b, group_sizes, group_offset)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ragged_dot(lhs, rhs, group_sizes, group_offset, plan: _Plan):
    return plan.run("fwd", lhs, rhs, group_sizes, group_offset)


def _ragged_dot_fwd(lhs, rhs, group_sizes, group_offset, plan: _Plan):
    return plan.run("fwd", lhs, rhs, group_sizes, group_offset), (lhs, rhs, group_sizes, group_offset)


def _ragged_dot_bwd(plan: _Plan, residuals, dout):
    lhs, rhs, group_sizes, group_offset = residuals
    dlhs = plan.run("dlhs", dout, rhs, group_sizes, group_offset)  # dout @ rhs[g]^T per group
    drhs = plan.run("drhs", lhs, dout, group_sizes, group_offset)  # lhs[rows]^T @ dout[rows] per group
    return dlhs, drhs, None, None


_ragged_dot.defvjp(_ragged_dot_fwd, _ragged_dot_bwd)


def _given_configs(config: Any) -> tuple[tuple[str, Any], ...]:
    """`config` is one config (or field dict) for fwd, or a mapping direction -> config."""
    if config is None:
        return ()
    if isinstance(config, Mapping) and config and set(config) <= set(DIRECTIONS):
        items = config.items()
    else:
        items = [("fwd", config)]
    freeze = lambda c: tuple(sorted(c.items())) if isinstance(c, Mapping) else c
    return tuple((d, freeze(c)) for d, c in items if c is not None)


def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type: Any = None,
    group_offset: jax.Array | None = None,
    backend: str | None = None,
    config: KernelConfig | Mapping[str, Any] | None = None,
) -> jax.Array:
    """Grouped matmul: `out[rows of group i] = lhs[rows] @ rhs[i]`; differentiable in lhs and rhs.

    Args:
      lhs: [m, k], rows sorted by group (float32, bfloat16 or float16).
      rhs: [groups, k, n].
      group_sizes: int [total_groups]; rows past `sum(group_sizes)` come out zero.
      preferred_element_type: output dtype (default: the promoted input dtype); low-precision inputs are
        accumulated in float32. Gradients come back in lhs's and rhs's dtypes.
      group_offset: int32 scalar; with it, `group_sizes` covers all groups and this call computes only the
        local groups `[group_offset, group_offset + groups)` (an expert-parallel shard); other rows are zero.
      backend: `xla`, `tiled`, `megablox`, `triton`; None picks by platform (cpu: tiled, gpu: xla, tpu:
        megablox).
      config: the backend's config (or a dict of its fields) for the forward pass, or a mapping
        `{"fwd": ..., "dlhs": ..., "drhs": ...}`; directions left out are looked up in the tables (exact,
        nearest m, else the backend's heuristic default) when they are traced.

    Returns:
      [m, n] in `preferred_element_type`.
    """
    problem = RaggedDotProblem.from_arrays(
        lhs, rhs, group_sizes, preferred_element_type=preferred_element_type, group_offset=group_offset
    )
    impl = BACKENDS.resolve(backend, devices.platform())
    if group_offset is not None:
        group_offset = jnp.asarray(group_offset, jnp.int32)
        if group_offset.shape != ():
            raise UsageError(f"group_offset must be a scalar, got shape {group_offset.shape}")
    plan = _Plan(impl.name, problem, _given_configs(config))
    return _ragged_dot(lhs, rhs, group_sizes, group_offset, plan)
