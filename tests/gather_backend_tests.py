"""The tests every dispatch (`GatherBackendTests`) and combine (`GatherReduceBackendTests`) backend passes.

A backend's test module subclasses each base once and says which backend it is, which dtypes it takes and
which configs to try; Pallas backends run in interpret mode off their platform, so their shapes are small.
The semantics checked are those of `moe_tune.kernels.gather.base`: only the valid range / valid entries
are read (the rest of x may be NaN and the rest of indices out of range), outputs outside the range are
zero, weighting and accumulation are in float32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_tune.core.errors import InvalidConfigError
from moe_tune.kernels.gather.problem import GatherProblem
from moe_tune.kernels.gather.reference import gather_reduce_reference, ragged_gather_reference
from moe_tune.kernels.gather.registry import GATHER_BACKENDS, GATHER_REDUCE_BACKENDS

# Error allowed relative to max|reference|, by dtype: only the output's rounding is forgiven.
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}
GARBAGE_INDEX = 1 << 20  # far out of range: a kernel that reads it would fault or read garbage


def routing(tokens: int, top_k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A dispatch permutation like an MoE router's: (gather indices [rows] = token of each expert-sorted
    row, combine indices [rows] = where each (token, k) entry went in that order)."""
    rows = tokens * top_k
    perm = np.random.default_rng(seed).permutation(rows).astype(np.int32)  # sorted row -> entry
    inverse = np.empty(rows, np.int32)
    inverse[perm] = np.arange(rows, dtype=np.int32)
    return perm // top_k, inverse


def relative_error(out, expected) -> float:
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    scale = max(float(np.max(np.abs(expected), initial=0.0)), 1e-30)
    return float(np.max(np.abs(out - expected), initial=0.0)) / scale


@functools.cache
def _jitted_gather(impl, config):
    """One jitted dispatch per (backend, config): start and end are traced, so every range a test tries
    reuses one compile (what interpret-mode backends spend their test time on)."""
    return jax.jit(lambda x, i, s, e, w: impl.gather(x, i, s, e, w, config=config))


class _BackendCase:
    backend: ClassVar[str]
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16", "float16")
    registry: ClassVar[Any]
    # (tokens, top_k, hidden) of the shapes tried; keep them small for interpret-mode backends.
    shapes: ClassVar[tuple[tuple[int, int, int], ...]] = ((24, 4, 128), (7, 3, 256))
    max_configs: ClassVar[int] = 3  # configs of the search space run per shape (default first)

    @property
    def impl(self):
        return self.registry.get(self.backend)

    def problem(self, tokens, top_k, hidden, dtype="float32", weighted=True) -> GatherProblem:
        return GatherProblem(tokens=tokens, rows=tokens * top_k, hidden=hidden, dtype=dtype, weighted=weighted)

    def configs(self, problem: GatherProblem) -> list:
        space = self.impl.search_space(problem)
        return space[: self.max_configs]

    def test_search_space_is_valid_and_default_first(self):
        for shape in self.shapes:
            problem = self.problem(*shape)
            space = self.impl.search_space(problem)
            assert space[0] == self.impl.default_config(problem)
            assert len(space) == len(set(space))
            assert all(self.impl.config_error(c, problem) is None for c in space)

    def test_invalid_config_is_rejected(self):
        problem = self.problem(*self.shapes[0])
        for fields in self.invalid_configs(problem):
            with pytest.raises(InvalidConfigError):
                self.impl.coerce_config(fields, problem)

    def invalid_configs(self, problem: GatherProblem) -> list[dict[str, Any]]:
        """Config field dicts `coerce_config` must reject for `problem`."""
        return [{"no_such_field": 1}, *(fields for fields, _ in self.invalid_with_reasons(problem))]

    def invalid_with_reasons(self, problem: GatherProblem) -> list[tuple[dict[str, Any], str]]:
        """(fields replacing the default's, a word of the reason `config_error` must give)."""
        return []

    def test_invalid_configs_name_their_reason(self):
        problem = self.problem(*self.shapes[0])
        default = self.impl.default_config(problem)
        cases = self.invalid_with_reasons(problem)
        if not cases:  # only a backend without tunables has no config to get wrong
            assert self.impl.tunables() == [], f"{self.backend} has tunables: list invalid configs and their reasons"
            assert self.impl.search_space(problem) == [default]
        for fields, reason in cases:
            assert reason in self.impl.config_error(dataclasses.replace(default, **fields), problem), fields


class GatherBackendTests(_BackendCase):
    registry = GATHER_BACKENDS

    def run(self, x, indices, start, end, weights, config):
        return _jitted_gather(self.impl, config)(x, indices, jnp.int32(start), jnp.int32(end), weights)

    @pytest.mark.parametrize("weighted", [True, False])
    def test_matches_reference(self, dtype, weighted):
        for tokens, top_k, hidden in self.shapes:
            rows = tokens * top_k
            rng = np.random.default_rng(rows)
            x = jnp.asarray(rng.standard_normal((tokens, hidden)), dtype)
            indices, _ = routing(tokens, top_k, seed=tokens)
            weights = jnp.asarray(rng.random(rows), jnp.float32) if weighted else None
            problem = self.problem(tokens, top_k, hidden, dtype, weighted)
            ranges = [(0, rows), (rows // 3, 2 * rows // 3 + 1), (0, 0), (rows - 1, rows), (5, 5)]
            for config in self.configs(problem):
                for start, end in ranges:
                    # Indices outside the range are garbage: they must not be read.
                    garbage = indices.copy()
                    garbage[:start], garbage[end:] = GARBAGE_INDEX, -GARBAGE_INDEX
                    out = self.run(x, jnp.asarray(garbage), start, end, weights, config)
                    assert out.shape == (rows, hidden) and out.dtype == jnp.dtype(dtype)
                    expected = ragged_gather_reference(np.asarray(x, np.float64), indices, start, end,
                                                       None if weights is None else np.asarray(weights))
                    assert relative_error(out, expected) <= TOLERANCE[dtype], (config, start, end)
                    assert not np.any(np.asarray(out[:start])) and not np.any(np.asarray(out[end:]))

    def test_range_is_clipped_to_rows(self):
        tokens, top_k, hidden = self.shapes[0]
        rows = tokens * top_k
        x = jnp.asarray(np.random.default_rng(1).standard_normal((tokens, hidden)), jnp.float32)
        indices, _ = routing(tokens, top_k, seed=1)
        config = self.impl.default_config(self.problem(tokens, top_k, hidden))
        out = self.run(x, jnp.asarray(indices), -5, rows + 7, None, config)
        np.testing.assert_allclose(np.asarray(out), ragged_gather_reference(x, indices, 0, rows), rtol=1e-6)

    def test_one_compile_serves_every_range(self):
        """start and end are traced: moving the range must not recompile."""
        tokens, top_k, hidden = self.shapes[0]
        rows = tokens * top_k
        x = jnp.ones((tokens, hidden), jnp.float32)
        indices = jnp.asarray(routing(tokens, top_k, seed=2)[0])
        config = self.impl.default_config(self.problem(tokens, top_k, hidden, weighted=False))
        fn = jax.jit(lambda x, i, s, e: self.impl.gather(x, i, s, e, None, config=config))
        for start, end in [(0, rows), (3, 9), (rows // 2, rows)]:
            out = fn(x, indices, jnp.int32(start), jnp.int32(end))
            assert float(out.sum()) == hidden * (end - start)
        assert fn._cache_size() == 1


class GatherReduceBackendTests(_BackendCase):
    registry = GATHER_REDUCE_BACKENDS

    def run(self, x, indices, weights, valid, r, config):
        if valid is None:
            fn = jax.jit(lambda x, i, w: self.impl.gather_reduce(x, i, w, None, r, config=config))
            return fn(x, indices, weights)
        fn = jax.jit(lambda x, i, w, v: self.impl.gather_reduce(x, i, w, v, r, config=config))
        return fn(x, indices, weights, valid)

    def inputs(self, tokens, top_k, hidden, dtype, local_fraction: float, seed: int):
        """Expert outputs x [rows, hidden] of which only the rows of this shard (the first
        `local_fraction` of the expert order) were computed: the others are NaN, and the entries that
        point at them are invalid, with garbage indices."""
        rows = tokens * top_k
        rng = np.random.default_rng(seed)
        _, indices = routing(tokens, top_k, seed)
        local_rows = int(rows * local_fraction)
        valid = indices < local_rows
        x = rng.standard_normal((rows, hidden)).astype(np.float32)
        x[local_rows:] = np.nan
        garbage = np.where(valid, indices, GARBAGE_INDEX).astype(np.int32)
        weights = rng.random(rows).astype(np.float32)
        return jnp.asarray(x, dtype), indices, garbage, weights, valid

    @pytest.mark.parametrize("local_fraction", [1.0, 0.25, 0.0])
    def test_matches_reference(self, dtype, local_fraction):
        for tokens, top_k, hidden in self.shapes:
            x, indices, garbage, weights, valid = self.inputs(tokens, top_k, hidden, dtype, local_fraction, tokens)
            problem = self.problem(tokens, top_k, hidden, dtype)
            expected = gather_reduce_reference(np.asarray(x, np.float64), indices, weights, valid, top_k)
            for config in self.configs(problem):
                out = self.run(x, jnp.asarray(garbage), jnp.asarray(weights), jnp.asarray(valid), top_k, config)
                assert out.shape == (tokens, hidden) and out.dtype == jnp.dtype(dtype)
                assert relative_error(out, expected) <= TOLERANCE[dtype], (config, local_fraction)

    def test_dense_matches_reference(self, dtype):
        for tokens, top_k, hidden in self.shapes:
            x, indices, _, weights, _ = self.inputs(tokens, top_k, hidden, dtype, 1.0, tokens + 1)
            expected = gather_reduce_reference(np.asarray(x, np.float64), indices, weights, None, top_k)
            for config in self.configs(self.problem(tokens, top_k, hidden, dtype)):
                out = self.run(x, jnp.asarray(indices), jnp.asarray(weights), None, top_k, config)
                assert relative_error(out, expected) <= TOLERANCE[dtype], config

    def test_reduce_group_size_one(self):
        tokens, _, hidden = self.shapes[0]
        x, indices, _, weights, _ = self.inputs(tokens, 1, hidden, "float32", 1.0, 3)
        config = self.impl.default_config(self.problem(tokens, 1, hidden))
        out = self.run(x, jnp.asarray(indices), jnp.asarray(weights), None, 1, config)
        np.testing.assert_allclose(np.asarray(out), gather_reduce_reference(x, indices, weights, None, 1),
                                   rtol=1e-5, atol=1e-6)

    def test_zero_weight_times_nan_propagates(self):
        """A valid entry multiplies: 0 * NaN is NaN (dropping it is op.py's `skip_zero_weights`)."""
        tokens, top_k, hidden = self.shapes[0]
        x, indices, _, weights, valid = self.inputs(tokens, top_k, hidden, "float32", 1.0, 4)
        x = np.asarray(x).copy()
        x[indices[0]] = np.nan  # entry 0 belongs to token 0
        weights[0] = 0.0
        config = self.impl.default_config(self.problem(tokens, top_k, hidden))
        out = np.asarray(self.run(jnp.asarray(x), jnp.asarray(indices), jnp.asarray(weights), jnp.asarray(valid),
                                  top_k, config))
        assert np.all(np.isnan(out[0])) and np.all(np.isfinite(out[1:]))
