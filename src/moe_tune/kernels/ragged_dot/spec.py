"""Tuner-facing description of ragged_dot: problems from options, seeded inputs, the reference."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moe_tune import distributions
from moe_tune.kernels.base import Backend, KernelConfig
from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem
from moe_tune.kernels.ragged_dot.reference import ragged_dot_reference
from moe_tune.kernels.ragged_dot.registry import BACKENDS
from moe_tune.kernels.spec import OpSpec

# The default sweep: the up projection of one Qwen3-30B-A3B MoE layer (hidden 2048 -> expert width 768,
# 128 experts, top-8) for 256 tokens on an expert-parallel shard of 16 experts: m = 256 * 8 * 16/128 rows.
# It is a real expert shape that a 2-core CPU sweeps in about a minute.
DEFAULT_OPTIONS = {"m": 2048, "k": 2048, "n": 768, "groups": 16, "dtype": "float32"}


class RaggedDotSpec(OpSpec):
    name = "ragged_dot"
    backends = BACKENDS
    description = "grouped matmul lhs[m,k] x rhs[g,k,n] -> [m,n] (Megablox gmm)"

    def problem(
        self, *, m: int, k: int, n: int, groups: int, dtype: str = "float32", out_dtype: str | None = None,
        direction: str = "fwd", **_: Any,
    ) -> RaggedDotProblem:
        return RaggedDotProblem(
            m=m, k=k, n=n, groups=groups, lhs_dtype=dtype, rhs_dtype=dtype, out_dtype=out_dtype or dtype,
            direction=direction,
        )

    def default_problem_options(self) -> dict[str, Any]:
        return dict(DEFAULT_OPTIONS)

    def make_inputs(self, problem: RaggedDotProblem, distribution: str, seed: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        scale = 1.0 / np.sqrt(problem.k)  # keeps outputs O(1) whatever k is
        lhs = rng.standard_normal((problem.m, problem.k), np.float32)
        rhs = rng.standard_normal((problem.groups, problem.k, problem.n), np.float32) * scale
        sizes = distributions.group_sizes(distribution, problem.m, problem.num_group_sizes, seed)
        return {
            "lhs": lhs.astype(jnp.dtype(problem.lhs_dtype)),
            "rhs": rhs.astype(jnp.dtype(problem.rhs_dtype)),
            "group_sizes": sizes,
        }

    def reference(self, problem: RaggedDotProblem, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        return ragged_dot_reference(inputs["lhs"], inputs["rhs"], inputs["group_sizes"])

    def run(self, backend: Backend, config: KernelConfig, problem: RaggedDotProblem,
            inputs: Mapping[str, jax.Array]) -> jax.Array:
        return backend(
            inputs["lhs"], inputs["rhs"], inputs["group_sizes"], config=config,
            out_dtype=jnp.dtype(problem.out_dtype),
        )

    def describe(self, problem: RaggedDotProblem) -> str:
        dt = problem.lhs_dtype if problem.lhs_dtype == problem.out_dtype else f"{problem.lhs_dtype}->{problem.out_dtype}"
        return f"ragged_dot {problem.direction} m={problem.m} k={problem.k} n={problem.n} g={problem.groups} {dt}"


SPEC = RaggedDotSpec()
