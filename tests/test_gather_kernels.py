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


class TestPlainGatherReduce(GatherReduceBackendTests):
    backend = "jax"


class TestTiledGatherReduce(GatherReduceBackendTests):
    backend = "tiled"
    max_configs = 5

    def invalid_configs(self, problem):
        return [*super().invalid_configs(problem), {"rows_per_chunk": -1}, {"rows_per_chunk": problem.rows * 2}]
