"""Dispatch and combine kernels of the CPU backends (`jax`, `tiled`) against the float64 references."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gather_backend_tests import (GARBAGE_INDEX, TOLERANCE, GatherBackendTests, GatherReduceBackendTests,
                                  relative_error, routing)

from moe_tune.kernels.gather.reference import gather_reduce_reference
from moe_tune.kernels.gather.tiled import accumulator_sizes, tiled_gather, tiled_gather_reduce


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
    the bf16 combine a pass over all of x at any valid fraction; FINDINGS.md: bf16 gathers on CPU): the loop
    reads x itself."""
    kernel, x_shape, rest = TILED_KERNELS[name]
    hlo = jax.jit(kernel).lower(S(x_shape, jnp.bfloat16), *rest).compile().as_text()
    entry = hlo[hlo.index("\nENTRY"):]
    whole_x = [line for line in entry.splitlines()
               if "=" in line and f"[{x_shape[0]},{x_shape[1]}]" in line.split("=")[1].split("(")[0]]
    assert [line for line in whole_x if "parameter(" not in line] == []


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("weighted", [False, True])
def test_tiled_dispatch_runs_in_its_output_buffer(dtype, weighted):
    """The dispatch loop carries its output in its own dtype: compiled, its temp memory is smaller than one
    [rows, hidden] output. (Carried as uint16 bits, a bf16 output was copied once more after the loop: temp
    = the output's size, and 52 ms of deepseek-v2-lite's bf16 prefill training step; FINDINGS.md: gather loop carry.)"""
    kernel = lambda x, i, s, e, w: tiled_gather(x, i, s, e, w, rows_per_chunk=16)  # noqa: E731
    memory = jax.jit(kernel).lower(S((TOKENS, HIDDEN), dtype), INT_ROWS, S((), jnp.int32), S((), jnp.int32),
                                   F32_ROWS if weighted else None).compile().memory_analysis()
    assert memory.temp_size_in_bytes < memory.output_size_in_bytes == ROWS * HIDDEN * jnp.dtype(dtype).itemsize, (
        memory.temp_size_in_bytes, memory.output_size_in_bytes)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("tokens", [TOKENS, 64])  # one accumulator size; two, chosen by a switch
def test_two_byte_combine_writes_its_output_in_the_pass_that_reads_x(dtype, tokens):
    """Every fusion that makes the bf16 / f16 [tokens, hidden] output also reads x (the tokens' first
    entries): none converts a float32 accumulator of the whole output alone, the pass over all tokens
    that made the 2-byte combine slower than float32 at low valid fractions (FINDINGS.md: bf16 gathers on CPU)."""
    rows = tokens * TOP_K
    kernel = lambda x, i, w, v: tiled_gather_reduce(x, i, w, v, TOP_K, rows_per_chunk=16)  # noqa: E731
    hlo = jax.jit(kernel).lower(S((rows, HIDDEN), dtype), S((rows,), jnp.int32), S((rows,), jnp.float32),
                                S((rows,), bool)).compile().as_text()
    short = {"bfloat16": "bf16", "float16": "f16"}[dtype]
    writers = re.findall(rf"^%\S+ \((.*)\) -> {short}\[{tokens},{HIDDEN}\] {{$", hlo, flags=re.M)
    assert writers and all(f"{short}[{rows},{HIDDEN}]" in params for params in writers), writers


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_two_byte_combine_at_each_accumulator_size(dtype):
    """Tokens with more than one valid entry filling each accumulator size of the switch, and one more,
    against the float64 reference; the other tokens have one valid entry or none."""
    tokens, top_k, hidden = 128, 4, 64
    rows = tokens * top_k
    sizes = accumulator_sizes(tokens)
    assert len(sizes) == 3
    rng = np.random.default_rng(0)
    _, indices = routing(tokens, top_k, 0)
    x = rng.standard_normal((rows, hidden))
    weights = rng.random(rows).astype(np.float32)
    kernel = jax.jit(lambda x, i, w, v: tiled_gather_reduce(x, i, w, v, top_k, rows_per_chunk=16))
    for several in sorted({n + extra for n in sizes[:-1] for extra in (0, 1)} | {tokens}):
        valid = np.zeros((tokens, top_k), bool)
        valid[:several, rng.integers(1, top_k)] = True  # a later entry of the first `several` tokens
        valid[: tokens - 10, 0] = True  # a first entry of most tokens; the last 10 have none
        valid = valid.reshape(rows)
        unread = np.ones(rows, bool)
        unread[indices[valid]] = False
        x_shard = jnp.asarray(np.where(unread[:, None], np.nan, x), dtype)  # rows no valid entry reads: NaN
        garbage = np.where(valid, indices, GARBAGE_INDEX).astype(np.int32)
        expected = gather_reduce_reference(np.asarray(x_shard, np.float64), indices, weights, valid, top_k)
        out = kernel(x_shard, jnp.asarray(garbage), jnp.asarray(weights), jnp.asarray(valid))
        assert relative_error(out, expected) <= TOLERANCE[dtype], several
