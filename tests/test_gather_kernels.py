"""Dispatch and combine kernels of the CPU backends (`jax`, `tiled`) against the float64 references."""

from __future__ import annotations

from gather_backend_tests import GatherBackendTests, GatherReduceBackendTests


class TestPlainGather(GatherBackendTests):
    backend = "jax"


def chunk_reasons(problem):
    """Invalid `rows_per_chunk` values of the tiled kernels and the words their rejection must give."""
    return [({"rows_per_chunk": 0}, "positive"), ({"rows_per_chunk": -1}, "positive"),
            ({"rows_per_chunk": problem.rows + 1}, f"> rows {problem.rows}")]


class TestTiledGather(GatherBackendTests):
    backend = "tiled"
    max_configs = 5

    def invalid_with_reasons(self, problem):
        return [*chunk_reasons(problem), ({"single_pass": "yes"}, "single_pass must be a bool")]


class TestTiledGatherSinglePass(GatherBackendTests):
    """The one-pass variant of the tiled dispatch (the last config of its search space)."""

    backend = "tiled"

    def configs(self, problem):
        single = [c for c in self.impl.search_space(problem) if c.single_pass]
        assert len(single) == 1
        return single

    def invalid_with_reasons(self, problem):
        return [({**fields, "single_pass": True}, reason) for fields, reason in chunk_reasons(problem)]



class TestPlainGatherReduce(GatherReduceBackendTests):
    backend = "jax"


class TestTiledGatherReduce(GatherReduceBackendTests):
    backend = "tiled"
    max_configs = 5

    def invalid_with_reasons(self, problem):
        return chunk_reasons(problem)
