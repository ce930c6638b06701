"""`BackendHooks`: what every mixin of the suite builds on. The class attributes and hooks a backend's test
class overrides (dtypes, shapes, example counts, configs to try or reject), the registration of a
`backend_instance` for each test, and the calls through the public op and the backend's kernel."""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import pytest

import moe_tune
from moe_tune.kernels.base import KernelConfig
from moe_tune.kernels.ragged_dot import BACKENDS, RaggedDotProblem
from moe_tune.kernels.ragged_dot.base import RaggedDotBackend

from .helpers import DIRECTIONS, assert_matches_reference, make_operands


class BackendHooks:
    """The backend under test and its knobs. Subclasses set `backend` (and `backend_instance` for a backend
    not in the registry) and may override the class attributes and hooks below."""

    backend: ClassVar[str]
    backend_instance: ClassVar[RaggedDotBackend | None] = None  # registered for each test when given
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")  # input dtypes of the parametrized tests
    extra_dtypes: ClassVar[tuple[str, ...]] = ()  # further input dtypes: the random, mixed and lowering tests
    out_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")  # preferred_element_type values it takes
    k: ClassVar[int] = 24  # dims of the fixed cases
    n: ClassVar[int] = 40
    max_m: ClassVar[int] = 200  # hypothesis shapes
    max_k: ClassVar[int] = 96
    max_n: ClassVar[int] = 96
    max_groups: ClassVar[int] = 8
    max_examples: ClassVar[int] = 20
    # Draws the random test leaves out (fixed to these values): the slow backends' few examples go to shapes,
    # group patterns, dtypes and configs, not to the seed or jit.
    fixed_draws: ClassVar[dict[str, Any]] = {}
    sampled_configs: ClassVar[int] = 2  # non-default configs from the search space per fixed case
    fixed_case_extras: ClassVar[int] = 2  # how many `extra_configs` the fixed cases run (the random test: all)
    # Directions of the quantized expert-parallel shard test (the interpret-mode backends drop fwd, whose
    # shard code the float shard cases run).
    quant_shard_directions: ClassVar[tuple[str, ...]] = DIRECTIONS
    # devices.platform() name -> the custom call the backend's compiled kernel lowers to there (Pallas
    # backends: MOSAIC_CALL on tpu, TRITON_CALL on gpu); a chip not named here lowers to plain HLO.
    kernel_calls: ClassVar[Mapping[str, str]] = {}

    @pytest.fixture(autouse=True)
    def _registered(self) -> Iterator[None]:
        """A `backend_instance` is in the op's registry for the duration of each test."""
        if self.backend_instance is None:
            yield
            return
        BACKENDS.register(self.backend_instance)
        try:
            yield
        finally:
            BACKENDS.unregister(self.backend_instance.name)

    # ---- hooks

    @property
    def impl(self) -> RaggedDotBackend:
        """The backend under test, from the op's registry."""
        return BACKENDS.get(self.backend)

    def problem(self, m: int, k: int, n: int, groups: int, dtype: str, out_dtype: str | None = None,
                total_groups: int | None = None) -> RaggedDotProblem:
        """The forward problem of float operands in `dtype` (both), out_dtype defaulting to it."""
        return RaggedDotProblem(
            m=m, k=k, n=n, groups=groups, lhs_dtype=dtype, rhs_dtype=dtype, out_dtype=out_dtype or dtype,
            total_groups=total_groups if total_groups != groups else None,
        )

    def extra_configs(self, problem: RaggedDotProblem) -> list[KernelConfig]:
        """Hand-picked configs outside the search space (still valid) worth running."""
        return []

    def configs(self, problem: RaggedDotProblem) -> list[KernelConfig]:
        """The default plus a deterministic sample of other search-space configs, plus `extra_configs`."""
        space = self.impl.search_space(problem)
        others = space[1:]
        rng = random.Random(str(problem.key_fields()))
        picked = rng.sample(others, min(self.sampled_configs, len(others)))
        return [space[0], *picked, *self.extra_configs(problem)[: self.fixed_case_extras]]

    def invalid_configs(self, problem: RaggedDotProblem) -> list[dict[str, Any]]:
        """Configs (as dicts) this backend must reject for `problem` with InvalidConfigError."""
        return []

    def quantized_configs(self, problem: RaggedDotProblem) -> list[KernelConfig]:
        """Configs the quantized kernel tests run (default: the default config)."""
        return [self.impl.default_config(problem)]

    def unsupported(self, problem: RaggedDotProblem) -> str | None:
        """Why the backend cannot run `problem` (its default config's `config_error`: the op then falls back
        to its plain-JAX backend), else None."""
        return self.impl.config_error(self.impl.default_config(problem), problem)

    def lowering_chips(self) -> list[str]:
        """The chips the backend compiles for natively (devices.platform() names); cpu only when it has no
        other (every other test runs it on this CPU)."""
        return [p for p in self.impl.platforms if p != "cpu"] or ["cpu"]

    # ---- calling

    def call(self, lhs: jax.Array, rhs: jax.Array, sizes: list[int], *, config: Any,
             shard: tuple[int, int] | None = None, out_dtype: str | None = None, jit: bool = False) -> jax.Array:
        """The public op's forward with this backend and `config`; `shard` = (group_offset, local groups)."""
        offset = None if shard is None else jnp.int32(shard[0])
        group_sizes = jnp.asarray(sizes, jnp.int32)

        def f(lhs, rhs, group_sizes, offset):
            return moe_tune.ragged_dot(
                lhs, rhs, group_sizes, preferred_element_type=out_dtype, group_offset=offset,
                backend=self.backend, config=config,
            )

        if jit:
            f = jax.jit(f)
        return f(lhs, rhs, group_sizes, offset)

    def run_case(self, m: int, sizes: list[int], shard: tuple[int, int] | None, dtype: str, *,
                 out_dtype: str | None = None, configs: list[Any] | None = None, jit: bool = False, seed: int = 0,
                 k: int | None = None, n: int | None = None) -> None:
        """Forward of one case through the public op with each config, against the reference."""
        k, n = k or self.k, n or self.n
        groups = len(sizes) if shard is None else shard[1]
        offset = None if shard is None else shard[0]
        lhs, rhs = make_operands(m, k, n, groups, dtype, seed)
        result_dtype = out_dtype or dtype
        problem = self.problem(m, k, n, groups, dtype, result_dtype, total_groups=len(sizes))
        for config in configs if configs is not None else self.configs(problem):
            out = self.call(lhs, rhs, sizes, config=config, shard=shard, out_dtype=out_dtype, jit=jit)
            assert_matches_reference(
                out, lhs, rhs, sizes, offset=offset, out_dtype=result_dtype,
                what=f"[{self.backend} {config} m={m} sizes={sizes} shard={shard} {dtype}->{result_dtype}]",
            )

    def run_quantized(self, problem: RaggedDotProblem, config: KernelConfig, a: Any, b: Any, sizes: Any,
                      offset: jax.Array | None = None) -> jax.Array:
        """One direction of a (quantized) problem through the backend's kernel (`Backend.run`), jitted."""
        assert self.impl.config_error(config, problem) is None, config
        f = jax.jit(lambda a, b, s, o: self.impl.run(problem, config, a, b, s, o))
        return f(a, b, jnp.asarray(sizes, jnp.int32), offset)
