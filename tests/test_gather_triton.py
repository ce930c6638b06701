"""Dispatch and combine kernels of the `triton` backend (Pallas Triton; compiled on GPU, in interpret mode
here) against the float64 references, plus its validity rules."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from gather_backend_tests import GatherBackendTests, GatherReduceBackendTests

from moe_tune.core import devices
from moe_tune.kernels.gather.problem import GatherProblem
from moe_tune.kernels.gather.triton import TritonGatherConfig, TritonGatherReduce, TritonGatherReduceConfig

# Interpret mode runs every program of the grid as a loop iteration: shapes stay small. Rows 21 and
# tokens 7 are not multiples of any block (padding), and the first grid configs (block_cols=64) split
# hidden into several column blocks.
SHAPES = ((24, 4, 128), (7, 3, 256))


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


class TestTritonGather(GatherBackendTests):
    backend = "triton"
    shapes = SHAPES
    max_configs = 2

    def invalid_with_reasons(self, problem):
        return [
            ({"block_rows": 24}, "power of two"),
            ({"block_rows": 2 * _next_pow2(problem.rows)}, "larger than"),
            ({"block_cols": 3 * problem.hidden}, "power of two"),
            ({"block_cols": 2 * problem.hidden}, "divide hidden"),
            ({"num_warps": 3}, "num_warps"),
            ({"block_rows": 64, "block_cols": 128, "num_warps": 1}, "register"),
        ]

    def test_boundary_blocks_and_zero_fill(self):
        """Small blocks: ranges that start and end inside blocks, with whole blocks on either side."""
        tokens, top_k, hidden = 24, 4, 128
        rows = tokens * top_k
        x = jnp.asarray(np.random.default_rng(5).standard_normal((tokens, hidden)), jnp.float32)
        indices = np.asarray(jnp.arange(rows) % tokens, np.int32)
        config = TritonGatherConfig(block_rows=8, block_cols=32, num_warps=1)
        for start, end in [(13, 50), (16, 40), (0, 1), (95, 96)]:
            garbage = indices.copy()
            garbage[:start], garbage[end:] = -1, 1 << 20
            out = np.asarray(self.run(x, jnp.asarray(garbage), start, end, None, config))
            expected = np.zeros((rows, hidden), np.float32)
            expected[start:end] = np.asarray(x)[indices[start:end]]
            np.testing.assert_array_equal(out, expected)

    def test_shared_memory_prunes_the_search_space(self):
        problem = GatherProblem(tokens=8192, rows=65536, hidden=4096, dtype="float32")
        impl = self.impl
        space = impl.search_space(problem)
        assert all(impl.shared_memory_bytes(c, problem) <= devices.gpu_shared_memory_bytes() for c in space)
        big = TritonGatherConfig(block_rows=64, block_cols=1024, num_warps=16)  # 256 KiB: over every budget
        assert "shared memory" in impl.config_error(big, problem)
        values = impl.candidate_values(problem)
        assert len(space) < np.prod([len(v) for v in values.values()])

    def test_odd_hidden_keeps_a_valid_default(self):
        problem = GatherProblem(tokens=5, rows=10, hidden=100, dtype="bfloat16")
        default = self.impl.default_config(problem)
        assert default.block_cols == 4 and self.impl.config_error(default, problem) is None


class TestTritonGatherReduce(GatherReduceBackendTests):
    backend = "triton"
    shapes = SHAPES
    max_configs = 2

    def invalid_with_reasons(self, problem):
        return [
            ({"block_tokens": 12}, "power of two"),
            ({"block_tokens": 2 * _next_pow2(problem.tokens)}, "larger than"),
            ({"block_cols": 2 * problem.hidden}, "divide hidden"),
            ({"block_cols": 0}, "power of two"),
            ({"num_warps": 32}, "num_warps"),
            ({"block_tokens": 32, "block_cols": 128, "num_warps": 1}, "register"),  # two live tiles
        ]

    def test_op_name_is_kept(self):
        assert TritonGatherReduce(op="dense_gather_reduce").op == "dense_gather_reduce"
        assert TritonGatherReduce().op == "ragged_gather_reduce"

    def test_config_round_trips(self):
        config = TritonGatherReduceConfig(block_tokens=8, block_cols=64, num_warps=2)
        problem = self.problem(*self.shapes[0])
        assert self.impl.coerce_config(config.to_dict(), problem) == config
