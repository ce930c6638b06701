"""Dispatch and combine kernels of the CPU backends (`jax`, `tiled`) against the float64 references."""

from __future__ import annotations

from gather_backend_tests import GatherBackendTests, GatherReduceBackendTests


class TestPlainGather(GatherBackendTests):
    backend = "jax"


class TestTiledGather(GatherBackendTests):
    backend = "tiled"
    max_configs = 5

    def invalid_configs(self, problem):
        return [*super().invalid_configs(problem), {"rows_per_chunk": 0}, {"rows_per_chunk": problem.rows + 1}]


class TestTiledGatherSinglePass(GatherBackendTests):
    """The one-pass variant of the tiled dispatch (the last config of its search space)."""

    backend = "tiled"

    def configs(self, problem):
        single = [c for c in self.impl.search_space(problem) if c.single_pass]
        assert len(single) == 1
        return single

    def invalid_configs(self, problem):
        return [*super().invalid_configs(problem), {"rows_per_chunk": 8, "single_pass": "yes"}]


class TestPlainGatherReduce(GatherReduceBackendTests):
    backend = "jax"


class TestTiledGatherReduce(GatherReduceBackendTests):
    backend = "tiled"
    max_configs = 5

    def invalid_configs(self, problem):
        return [*super().invalid_configs(problem), {"rows_per_chunk": -1}, {"rows_per_chunk": problem.rows * 2}]
