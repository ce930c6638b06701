"""`moe_tune.ragged_dot`: the public grouped matmul. Picks a backend and, for each direction (fwd, and the
dlhs / drhs gradients of its custom VJP), a tuned config at trace time."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from moe_tune.errors import UsageError
from moe_tune.kernels.base import KernelConfig
from moe_tune.kernels.ragged_dot.problem import DIRECTIONS, RaggedDotProblem
from moe_tune.kernels.ragged_dot.spec import SPEC
from moe_tune.kernels.spec import freeze_config


@dataclasses.dataclass(frozen=True)
class _Call:
    """Static (hashable) part of one call: backend, forward problem, configs the caller fixed per direction."""

    backend: str
    problem: RaggedDotProblem
    given: tuple[tuple[str, Any], ...]  # (direction, config or `freeze_config` tuple)

    def run(self, direction: str, a, b, group_sizes, group_offset):
        """One direction's kernel, its config resolved now (at trace time) by `SPEC.resolve_config`."""
        problem = self.problem.with_direction(direction)
        resolved = SPEC.resolve_config(self.backend, problem, dict(self.given).get(direction))
        return resolved.backend.run(problem, resolved.config, a, b, group_sizes, group_offset)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ragged_dot(lhs, rhs, group_sizes, group_offset, call: _Call):
    return call.run("fwd", lhs, rhs, group_sizes, group_offset)


def _ragged_dot_fwd(lhs, rhs, group_sizes, group_offset, call: _Call):
    return call.run("fwd", lhs, rhs, group_sizes, group_offset), (lhs, rhs, group_sizes, group_offset)


def _ragged_dot_bwd(call: _Call, residuals, dout):
    lhs, rhs, group_sizes, group_offset = residuals
    dlhs = call.run("dlhs", dout, rhs, group_sizes, group_offset)  # dout @ rhs[g]^T per group
    drhs = call.run("drhs", lhs, dout, group_sizes, group_offset)  # lhs[rows]^T @ dout[rows] per group
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
    return tuple((d, freeze_config(c)) for d, c in items if c is not None)


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
    impl = SPEC.backend(backend)
    if group_offset is not None:
        group_offset = jnp.asarray(group_offset, jnp.int32)
        if group_offset.shape != ():
            raise UsageError(f"group_offset must be a scalar, got shape {group_offset.shape}")
    call = _Call(impl.name, problem, _given_configs(config))
    return _ragged_dot(lhs, rhs, group_sizes, group_offset, call)
