"""`BadInputTests`: bad operands, group sizes, dtypes, backend names and configs are UsageErrors or
InvalidConfigErrors from the public op (eagerly and, for configs, at trace time under jit)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import moe_tune
from moe_tune.core.errors import InvalidConfigError, UsageError
from moe_tune.kernels.ragged_dot import BACKENDS

from .helpers import make_operands
from .hooks import BackendHooks


class BadInputTests(BackendHooks):
    """What the op must reject for this backend; `invalid_configs` lists the backend's own bad configs."""

    # ---- bad input

    def operands(self, dtype: str = "float32") -> tuple[jax.Array, jax.Array]:
        """Small operands for the bad-input tests: lhs [16, k], rhs [2, k, n]."""
        return make_operands(16, self.k, self.n, 2, dtype, 0)

    def test_lhs_must_be_2d(self):
        """A lhs that is not [m, k] is a UsageError."""
        lhs, rhs = self.operands()
        with pytest.raises(UsageError, match="lhs"):
            moe_tune.ragged_dot(lhs[None], rhs, jnp.asarray([8, 8], jnp.int32), backend=self.backend)
        with pytest.raises(UsageError, match="lhs"):
            moe_tune.ragged_dot(lhs[0], rhs, jnp.asarray([8, 8], jnp.int32), backend=self.backend)

    def test_rhs_must_be_3d(self):
        """A rhs that is not [groups, k, n] is a UsageError."""
        lhs, rhs = self.operands()
        with pytest.raises(UsageError, match="rhs"):
            moe_tune.ragged_dot(lhs, rhs[0], jnp.asarray([8, 8], jnp.int32), backend=self.backend)

    def test_contracting_dims_must_match(self):
        """lhs and rhs of different k are a UsageError."""
        lhs, rhs = self.operands()
        with pytest.raises(UsageError, match="contracting"):
            moe_tune.ragged_dot(lhs[:, :-1], rhs, jnp.asarray([8, 8], jnp.int32), backend=self.backend)

    def test_group_sizes_length_must_match_without_offset(self):
        """Without group_offset, group_sizes has one entry per group."""
        lhs, rhs = self.operands()
        for sizes in ([16], [8, 4, 4]):
            with pytest.raises(UsageError, match="group_sizes"):
                moe_tune.ragged_dot(lhs, rhs, jnp.asarray(sizes, jnp.int32), backend=self.backend)

    def test_group_sizes_must_cover_the_shard(self):
        """With group_offset, group_sizes has at least the local groups."""
        lhs, rhs = self.operands()
        with pytest.raises(UsageError, match="fewer"):
            moe_tune.ragged_dot(
                lhs, rhs, jnp.asarray([16], jnp.int32), group_offset=jnp.int32(0), backend=self.backend
            )

    def test_group_sizes_must_be_1d_integers(self):
        """Float or 2-D group_sizes are a UsageError."""
        lhs, rhs = self.operands()
        with pytest.raises(UsageError, match="group_sizes"):
            moe_tune.ragged_dot(lhs, rhs, jnp.asarray([8.0, 8.0]), backend=self.backend)
        with pytest.raises(UsageError, match="group_sizes"):
            moe_tune.ragged_dot(lhs, rhs, jnp.asarray([[8, 8]], jnp.int32), backend=self.backend)

    def test_unsupported_dtypes(self):
        """Integer operands and an integer output dtype are UsageErrors."""
        lhs, rhs = self.operands()
        with pytest.raises(UsageError):
            moe_tune.ragged_dot(
                lhs.astype(jnp.int32), rhs.astype(jnp.int32), jnp.asarray([8, 8], jnp.int32), backend=self.backend
            )
        with pytest.raises(UsageError):
            moe_tune.ragged_dot(
                lhs, rhs, jnp.asarray([8, 8], jnp.int32), preferred_element_type=jnp.int8, backend=self.backend
            )

    def test_unknown_backend(self):
        """An unknown backend name is a UsageError naming the choices."""
        lhs, rhs = self.operands()
        with pytest.raises(UsageError, match="unknown backend"):
            moe_tune.ragged_dot(lhs, rhs, jnp.asarray([8, 8], jnp.int32), backend=self.backend + "_nope")

    def test_config_with_unknown_field(self):
        """A config dict with a field the backend's config lacks is an InvalidConfigError."""
        lhs, rhs = self.operands()
        with pytest.raises(InvalidConfigError, match="no field"):
            moe_tune.ragged_dot(lhs, rhs, jnp.asarray([8, 8], jnp.int32), backend=self.backend, config={"bogus": 1})

    def test_config_of_another_backend(self):
        """Another backend's config is an InvalidConfigError naming the expected class."""
        lhs, rhs = self.operands()
        problem = self.problem(16, self.k, self.n, 2, "float32")
        others = [BACKENDS.get(name) for name in BACKENDS.names()]
        other = next(b for b in others if b.config_cls is not self.impl.config_cls)
        foreign = other.default_config(problem)
        with pytest.raises(InvalidConfigError, match=self.impl.config_cls.__name__):
            moe_tune.ragged_dot(lhs, rhs, jnp.asarray([8, 8], jnp.int32), backend=self.backend, config=foreign)

    def test_invalid_configs_rejected(self, dtype):
        """`invalid_configs` are rejected by config_error, by the op and under jit (at trace time)."""
        lhs, rhs = self.operands(dtype)
        problem = self.problem(16, self.k, self.n, 2, dtype)
        bad = self.invalid_configs(problem)
        if not bad:  # only a backend without tunables has no config to get wrong
            assert self.impl.tunables() == [] and self.impl.config_cls() == self.impl.default_config(problem)
        for config in bad:
            assert self.impl.config_error(self.impl.config_cls(**config), problem) is not None, config
            with pytest.raises(InvalidConfigError):
                moe_tune.ragged_dot(lhs, rhs, jnp.asarray([8, 8], jnp.int32), backend=self.backend, config=config)
            with pytest.raises(InvalidConfigError):  # raised at trace time under jit too
                traced = jax.jit(
                    lambda a, b, c, config=config: moe_tune.ragged_dot(a, b, c, backend=self.backend, config=config)
                )
                traced(lhs, rhs, jnp.asarray([8, 8], jnp.int32))
