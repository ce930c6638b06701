"""`FloatTests`: float operands through the public op against the float64 reference. The fixed cases
(empty groups, rows past sum(group_sizes), sum(group_sizes) > m, expert-parallel shards), mixed input /
output dtypes, configs as dicts and from the search space, jit (traced sizes and offsets), vmap, dimension
edge cases and random problems (hypothesis)."""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moe_tune
from moe_tune.kernels.ragged_dot.definition import ragged_dot_dlhs_reference

from .helpers import CASES, EDGE_CASES, assert_matches_reference, make_operands, sizes_from_cuts
from .hooks import BackendHooks


class FloatTests(BackendHooks):
    """Forward of float operands in every dtype the backend takes, eager, under jit and under vmap."""

    # ---- fixed cases

    @pytest.mark.parametrize("case", list(CASES), ids=str)
    def test_fixed_case(self, case, dtype):
        """Each fixed case (empty groups, rows past the sum, shards) with the sampled configs; sizes summing
        past m only under jit (traced), as known ones are a UsageError."""
        m, sizes, shard = CASES[case]
        self.run_case(m, sizes, shard, dtype, jit=sum(sizes) > m)

    def test_low_precision_in_float32_out(self):
        """Low-precision inputs with preferred_element_type=float32."""
        low = [d for d in (*self.dtypes, *self.extra_dtypes) if d != "float32"]
        assert low, "every backend takes some low-precision input"
        for dtype in low:
            self.run_case(37, [3, 20, 1, 13], None, dtype, out_dtype="float32")

    def test_float32_in_bfloat16_out(self):
        """float32 inputs with a bfloat16 output, whole and as a shard."""
        if "bfloat16" not in self.out_dtypes:
            pytest.skip(f"{self.backend} has no bfloat16 output")
        self.run_case(37, [3, 20, 1, 13], None, "float32", out_dtype="bfloat16")
        self.run_case(40, [6, 9, 0, 12, 13], (1, 3), "float32", out_dtype="bfloat16")

    def test_default_output_dtype_is_the_promoted_input_dtype(self, dtype):
        """Without preferred_element_type the output has the inputs' dtype."""
        lhs, rhs = make_operands(16, self.k, self.n, 2, dtype, 0)
        out = moe_tune.ragged_dot(lhs, rhs, jnp.asarray([9, 7], jnp.int32), backend=self.backend)
        assert out.dtype == jnp.dtype(dtype)

    def test_default_config_via_lookup(self, dtype):
        """config=None resolves a config (table or heuristic default) and still computes the right thing."""
        sizes = [3, 20, 1, 13]
        lhs, rhs = make_operands(37, self.k, self.n, 4, dtype, 3)
        out = moe_tune.ragged_dot(lhs, rhs, jnp.asarray(sizes, jnp.int32), backend=self.backend)
        assert_matches_reference(out, lhs, rhs, sizes, offset=None, out_dtype=dtype)

    def test_config_as_dict(self):
        """A config given as a dict of its fields."""
        problem = self.problem(37, self.k, self.n, 4, "float32")
        config = self.configs(problem)[-1]
        self.run_case(37, [3, 20, 1, 13], None, "float32", configs=[config.to_dict()])

    def test_search_space_configs(self, dtype):
        """The search space is valid, default first, no duplicates; a sample of it gives the right answer."""
        m, sizes = 45, [11, 0, 17, 9]
        problem = self.problem(m, self.k, self.n, len(sizes), dtype)
        space = self.impl.search_space(problem)
        assert space[0] == self.impl.default_config(problem)
        assert len(set(space)) == len(space)
        for config in space:
            assert self.impl.config_error(config, problem) is None, config
        sample = [space[0], *random.Random(1).sample(space[1:], min(3, len(space) - 1))]
        self.run_case(m, sizes, None, dtype, configs=sample)

    # ---- jit

    def test_under_jit(self, dtype):
        """A shard and a case with empty first and last groups under jit."""
        m, sizes, shard = CASES["shard_middle"]
        self.run_case(m, sizes, shard, dtype, jit=True)
        m, sizes, shard = CASES["empty_first_and_last"]
        self.run_case(m, sizes, shard, dtype, jit=True)

    def test_jit_traces_once_for_new_sizes_and_offsets(self):
        """group_sizes and group_offset are traced: new values reuse the compiled function and stay right."""
        m, k, n, groups = 40, self.k, self.n, 2
        lhs, rhs = make_operands(m, k, n, groups, "float32", 7)
        config = self.configs(self.problem(m, k, n, groups, "float32", total_groups=5))[0]
        traces = []

        @jax.jit
        def f(lhs, rhs, group_sizes, offset):
            traces.append(1)
            return moe_tune.ragged_dot(
                lhs, rhs, group_sizes, group_offset=offset, backend=self.backend, config=config
            )

        shards = [([6, 9, 0, 12, 13], 1), ([0, 0, 20, 20, 0], 2), ([40, 0, 0, 0, 0], 3), ([1, 2, 3, 4, 5], 0)]
        for sizes, offset in shards:
            out = f(lhs, rhs, jnp.asarray(sizes, jnp.int32), jnp.int32(offset))
            assert_matches_reference(
                out, lhs, rhs, sizes, offset=offset, out_dtype="float32", what=f"{sizes} @ {offset}"
            )
        assert len(traces) == 1

    # ---- vmap

    def test_vmap_forward_and_grad(self):
        """A batch of independent ragged dots (e.g. per microbatch), each with its own group sizes."""
        m, k, n, groups = 32, self.k, self.n, 3
        batch_sizes = [[10, 0, 22], [32, 0, 0], [5, 5, 5]]
        lhs, rhs = make_operands(m, k, n, groups, "float32", 11)
        lhs_b = jnp.stack([lhs, 2 * lhs, -lhs])
        sizes_b = jnp.asarray(batch_sizes, jnp.int32)
        f = lambda x, s: moe_tune.ragged_dot(x, rhs, s, backend=self.backend)
        out = jax.jit(jax.vmap(f))(lhs_b, sizes_b)
        for i, sizes in enumerate(batch_sizes):
            assert_matches_reference(out[i], lhs_b[i], rhs, sizes, offset=None, out_dtype="float32", what=f"vmap {i}")
        grads = jax.jit(jax.vmap(jax.grad(lambda x, s: f(x, s).sum())))(lhs_b, sizes_b)
        for i, sizes in enumerate(batch_sizes):
            ref = ragged_dot_dlhs_reference(np.ones((m, n)), np.asarray(rhs), np.asarray(sizes))
            assert np.abs(np.asarray(grads[i]) - ref).max() <= 1e-4 * max(np.abs(ref).max(), 1.0), f"vmap grad {i}"

    # ---- dimension edge cases

    @pytest.mark.parametrize("case", list(EDGE_CASES), ids=str)
    def test_dimension_edge_cases(self, case):
        """Dims of 1, odd dims, a one-row shard, with the default config under jit."""
        m, k, n, sizes, shard, dtype, out_dtype = EDGE_CASES[case]
        groups = len(sizes) if shard is None else shard[1]
        problem = self.problem(m, k, n, groups, dtype, out_dtype, total_groups=len(sizes))
        self.run_case(m, sizes, shard, dtype, out_dtype=out_dtype, configs=[self.impl.default_config(problem)],
                      jit=True, k=k, n=n)

    # ---- random problems

    def test_random_problems(self):
        """Hypothesis: shapes, group patterns, shards, dtypes, output dtypes and configs at random."""
        @settings(
            max_examples=self.max_examples, deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(st.data())
        def check(data):
            m = data.draw(st.integers(1, self.max_m), label="m")
            k = data.draw(st.integers(1, self.max_k), label="k")
            n = data.draw(st.integers(1, self.max_n), label="n")
            groups = data.draw(st.integers(1, self.max_groups), label="groups")
            extra = data.draw(st.sampled_from([0, 0, 1, 3]), label="groups of other shards")
            total = groups + extra
            pattern = data.draw(st.sampled_from(["cuts", "cuts", "cuts", "one_group", "all_empty"]), label="pattern")
            if pattern == "all_empty":
                sizes = [0] * total
            elif pattern == "one_group":
                sizes = [0] * total
                sizes[data.draw(st.integers(0, total - 1))] = data.draw(st.integers(1, m))
            else:
                used = data.draw(st.integers(0, m), label="rows used")
                cuts = data.draw(st.lists(st.integers(0, used), min_size=total - 1, max_size=total - 1), label="cuts")
                sizes = sizes_from_cuts(used, cuts)
            sharded = extra > 0 or data.draw(st.booleans(), label="pass group_offset=0")
            shard = (data.draw(st.integers(0, extra), label="offset"), groups) if sharded else None
            dtype = data.draw(st.sampled_from((*self.dtypes, *self.extra_dtypes)), label="dtype")
            out_dtype = data.draw(st.sampled_from([None, *self.out_dtypes]), label="preferred_element_type")
            problem = self.problem(m, k, n, groups, dtype, out_dtype, total_groups=total)
            space = self.impl.search_space(problem) + self.extra_configs(problem)
            config = data.draw(st.sampled_from(space), label="config")
            jit = self.fixed_draws.get("jit", None)
            jit = data.draw(st.booleans(), label="jit") if jit is None else jit
            seed = self.fixed_draws.get("seed", None)
            seed = data.draw(st.integers(0, 2**31 - 1), label="seed") if seed is None else seed
            self.run_case(m, sizes, shard, dtype, out_dtype=out_dtype, configs=[config], jit=jit, seed=seed, k=k, n=n)

        check()
