"""`GradientTests`: the gradients through the public op's custom VJP (dlhs, drhs) against their float64
references, with looked-up and per-direction configs, under jit and eager, and the per-direction configs
the caller gives being the ones that run."""

from __future__ import annotations

import logging
import random
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_tune
from moe_tune.core.errors import InvalidConfigError
from moe_tune.kernels.base import KernelConfig
from moe_tune.kernels.ragged_dot import RaggedDotProblem
from moe_tune.kernels.ragged_dot.definition import ragged_dot_dlhs_reference, ragged_dot_drhs_reference

from .helpers import CASES, DIRECTIONS, GRAD_CASES, GRAD_TOLERANCE, local_rows, make_operands
from .hooks import BackendHooks


class GradientTests(BackendHooks):
    """dlhs and drhs of float operands through the op's custom VJP."""

    # ---- gradients (the custom VJP: dlhs and drhs directions)

    def direction_configs(self, problem: RaggedDotProblem) -> list[dict[str, KernelConfig] | None]:
        """Config mappings to differentiate with: all looked up (None), and one sampled per direction."""
        rng = random.Random(str(problem.key_fields()))
        sampled = {d: rng.choice(self.impl.search_space(problem.with_direction(d))) for d in DIRECTIONS}
        return [None, sampled]

    def check_grads(self, m: int, sizes: list[int], shard: tuple[int, int] | None, dtype: str, *, seed: int = 0,
                    jit: bool = True, k: int | None = None, n: int | None = None,
                    configs: list[Any] | None = None) -> None:
        """Both gradients through the public op (its custom VJP) with each config mapping, against the
        float64 dlhs / drhs references; rows outside the local groups get no gradient."""
        k, n = k or self.k, n or self.n
        groups = len(sizes) if shard is None else shard[1]
        offset = None if shard is None else shard[0]
        lhs, rhs = make_operands(m, k, n, groups, dtype, seed)
        cot = jnp.asarray(np.random.default_rng(seed + 1).standard_normal((m, n)) / np.sqrt(n), dtype)
        problem = self.problem(m, k, n, groups, dtype, total_groups=len(sizes))
        a32 = lambda x: np.asarray(x.astype(jnp.float32))
        ref_dlhs = ragged_dot_dlhs_reference(a32(cot), a32(rhs), np.asarray(sizes), group_offset=offset or 0)
        ref_drhs = ragged_dot_drhs_reference(a32(lhs), a32(cot), np.asarray(sizes), groups=groups,
                                             group_offset=offset or 0)
        for config in self.direction_configs(problem) if configs is None else configs:
            def loss(x, w):
                out = moe_tune.ragged_dot(x, w, jnp.asarray(sizes, jnp.int32), backend=self.backend, config=config,
                                          group_offset=None if offset is None else jnp.int32(offset))
                return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32))

            grad = jax.grad(loss, argnums=(0, 1))
            dlhs, drhs = (jax.jit(grad) if jit else grad)(lhs, rhs)
            what = f"[{self.backend} {config} m={m} sizes={sizes} shard={shard} {dtype}]"
            assert dlhs.shape == lhs.shape and dlhs.dtype == lhs.dtype, what
            assert drhs.shape == rhs.shape and drhs.dtype == rhs.dtype, what
            for name, got, ref in (("dlhs", dlhs, ref_dlhs), ("drhs", drhs, ref_drhs)):
                got = np.asarray(got.astype(jnp.float32), np.float64)
                scale = max(np.abs(ref).max(), 1e-30)
                err = np.abs(got - ref).max() / scale if np.abs(ref).max() > 0 else np.abs(got).max()
                assert err <= GRAD_TOLERANCE[dtype], f"{name} error {err:.3g} > {GRAD_TOLERANCE[dtype]} {what}"
            # rows outside the local groups get no gradient
            assert np.all(np.asarray(dlhs)[~local_rows(sizes, m, groups, offset or 0)] == 0), what

    @pytest.mark.parametrize("case", GRAD_CASES, ids=str)
    def test_grad_matches_reference(self, case, dtype):
        """dlhs and drhs through the op's custom VJP, looked up and sampled per direction."""
        m, sizes, shard = CASES[case]
        self.check_grads(m, sizes, shard, dtype)

    def test_per_direction_configs_are_the_ones_that_run(self, caplog):
        """config={"fwd", "dlhs", "drhs"}: each direction's trace logs its own entry, given by the caller (not
        the lookup's), and an invalid dlhs or drhs entry is an InvalidConfigError once the backward is traced
        (the forward alone does not read it). Traced only (make_jaxpr): nothing runs."""
        m, sizes = 37, [3, 20, 1, 13]
        lhs, rhs = make_operands(m, self.k, self.n, len(sizes), "float32", 0)
        group_sizes = jnp.asarray(sizes, jnp.int32)
        problem = self.problem(m, self.k, self.n, len(sizes), "float32")

        def trace(config, grad=True):
            loss = lambda x, w: moe_tune.ragged_dot(x, w, group_sizes, backend=self.backend, config=config).sum()
            jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)) if grad else loss)(lhs, rhs)

        # the last config of each direction's space: not the default, where the space has another one
        given = {d: self.impl.search_space(problem.with_direction(d))[-1] for d in DIRECTIONS}
        caplog.set_level(logging.INFO, logger="moe_tune")
        trace(given)
        logged = {}
        for record in caplog.records:
            message = record.getMessage()
            if message.startswith("ragged_dot {'direction': "):
                logged[message.split("'")[3]] = message
        assert set(logged) == set(DIRECTIONS), logged
        for direction, config in given.items():
            assert f"backend {self.backend}, config {config.label()} (given by the caller)" in logged[direction], (
                direction, logged[direction])

        for direction in ("dlhs", "drhs"):
            bad = self.invalid_configs(problem.with_direction(direction))
            if self.impl.tunables():
                assert bad, "a backend with tunables lists invalid configs"
            for fields in bad[:2]:
                trace({direction: fields}, grad=False)  # the forward does not use it
                with pytest.raises(InvalidConfigError):
                    trace({direction: fields})

    def test_grad_without_jit(self):
        """The gradients outside jit (eager custom VJP)."""
        m, sizes, shard = CASES["uneven"]
        self.check_grads(m, sizes, shard, "float32", jit=False)
