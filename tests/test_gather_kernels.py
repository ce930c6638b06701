"""Dispatch and combine kernels of the CPU backends (`jax`, `tiled`) against the float64 references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from gather_backend_tests import GatherBackendTests, GatherReduceBackendTests

from moe_tune.kernels.gather.tiled import tiled_gather, tiled_gather_reduce


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


TOKENS, TOP_K, HIDDEN = 24, 4, 128  # x's shape differs from the output's, so the HLO check below can tell them apart
ROWS = TOKENS * TOP_K
S = jax.ShapeDtypeStruct
INT_ROWS, F32_ROWS, BOOL_ROWS = S((ROWS,), jnp.int32), S((ROWS,), jnp.float32), S((ROWS,), bool)
TILED_KERNELS = {  # name: (kernel, bfloat16 x's shape, the other arguments)
    "dispatch": (lambda x, i, s, e: tiled_gather(x, i, s, e, None, rows_per_chunk=16), (TOKENS, HIDDEN),
                 (INT_ROWS, S((), jnp.int32), S((), jnp.int32))),
    "combine": (lambda x, i, w, v: tiled_gather_reduce(x, i, w, v, TOP_K, rows_per_chunk=16), (ROWS, HIDDEN),
                (INT_ROWS, F32_ROWS, BOOL_ROWS)),
    "dense combine": (lambda x, i, w: tiled_gather_reduce(x, i, w, None, TOP_K, rows_per_chunk=16), (ROWS, HIDDEN),
                      (INT_ROWS, F32_ROWS)),
}


@pytest.mark.parametrize("name", TILED_KERNELS)
def test_tiled_kernels_convert_only_the_rows_they_gather(name):
    """No op on the whole bfloat16 x outside the loop (XLA CPU's f32 convert, or a uint16 copy of it, made
    the bf16 combine a pass over all of x at any valid fraction: NOTES 15): the loop reads x itself."""
    kernel, x_shape, rest = TILED_KERNELS[name]
    hlo = jax.jit(kernel).lower(S(x_shape, jnp.bfloat16), *rest).compile().as_text()
    entry = hlo[hlo.index("\nENTRY"):]
    whole_x = [line for line in entry.splitlines()
               if "=" in line and f"[{x_shape[0]},{x_shape[1]}]" in line.split("=")[1].split("(")[0]]
    assert [line for line in whole_x if "parameter(" not in line] == []
