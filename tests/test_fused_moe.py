"""The fused_moe backends (the base's tests) and the public fused ops: gradients, bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fused_moe_base import FusedMoeBackendTests

from moe_tune.kernels.fused_moe.op import gmm_combine
from moe_tune.kernels.fused_moe.tiled import TiledFusedConfig


class TestTiled(FusedMoeBackendTests):
    backend = "tiled"
    dtypes = ("bfloat16", "float16")

    def invalid_configs(self, problem):
        return [TiledFusedConfig(tm=16, tail=32), TiledFusedConfig(tm=0, tail=4), TiledFusedConfig(tm=2048, tail=4)]


class TestPlain(FusedMoeBackendTests):
    backend = "jax"
    dtypes = ()


def test_the_cli_names_a_dispatch_without_activation_none():
    """`--glu none` (a training layer's forward dispatch, gate and up kept concatenated) is a problem with no
    activation; the combine never has one; an unknown activation is refused by the CLI's choices."""
    from moe_tune.kernels import get_op
    from moe_tune.kernels.fused_moe.definition import GLU, NO_GLU

    op = get_op("fused_moe")
    shape = dict(tokens=16, top_k=2, k=32, n=64, groups=4)
    assert op.problem(**shape, glu=NO_GLU).glu is None
    assert op.problem(**shape, glu="silu").glu == "silu"
    assert op.problem(**shape, stage="combine", glu="silu").glu is None
    assert NO_GLU in GLU.type and "bogus" not in GLU.type


def test_the_tiled_default_is_one_for_the_sweep_and_for_the_layer_at_every_ep():
    """The tiled default (tiles of half an average group on the shard) is the same for the problem a sweep
    builds (`ep` set, total_groups = groups x ep) and for the one the op builds in an expert-parallel layer
    (total_groups from group_sizes, `ep` left at 1). Dividing by the shard's groups alone gave the layer a whole
    average group's tiles at ep > 1 (qwen3-30b-a3b prefill ep 4: tm 256 / tail 64 against the sweep's 128 / 32)."""
    from moe_tune.kernels import get_op
    from moe_tune.kernels.fused_moe.problem import FusedMoeProblem
    from moe_tune.kernels.fused_moe.tiled import TiledFusedMoe

    backend, op = TiledFusedMoe(), get_op("fused_moe")
    # prefill (256 rows a group): half a group; decode (deepseek-v2-lite, 24 rows a group): one tile a group
    for tokens, top_k, experts, expected in ((4096, 8, 128, TiledFusedConfig(tm=128, tail=32)),
                                             (256, 6, 64, TiledFusedConfig(tm=32, tail=32))):
        for ep in (1, 4):
            swept = op.problem(tokens=tokens, top_k=top_k, k=2048, n=1536, groups=experts // ep, ep=ep)
            layer = FusedMoeProblem(tokens=tokens, m=tokens * top_k, k=2048, n=1536, groups=experts // ep,
                                    dtype="float32", stage="dispatch", total_groups=experts if ep > 1 else None)
            assert backend.default_config(swept) == backend.default_config(layer) == expected, (tokens, ep)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiled_dispatch_rows_near_the_end_and_outside_the_groups(dtype):
    """The tiled dispatch writes its output without reading it back: tail rows past a group are written 0
    (rewritten by the next group) and the tiles that would be shifted back over earlier rows are skipped,
    the last `tail` rows then written from every group they hold. Checked against the float64 reference on
    group sizes that put tiny and empty groups in those last rows, leave rows outside every group (0, and
    x rows out of range there), and on an expert-parallel shard, for two tilings and contraction sizes."""
    from moe_tune.kernels.fused_moe.reference import gather_gmm_reference
    from moe_tune.kernels.fused_moe.tiled import tiled_gather_gmm

    rng = np.random.default_rng(0)
    m, tokens, n = 40, 24, 24
    rows = rng.integers(0, tokens, m).astype(np.int32)
    rows[-2:] = 10**6  # out of range, outside every group: must never be read
    cases = [([9, 12, 0, 15, 1], 0), ([20, 0, 11, 6, 0], 0), ([3, 14, 2, 18, 1], 0), ([13, 7, 8, 5, 4], 2)]
    for k, tm, tail in ((16, 8, 8), (64, 32, 16)):
        x = rng.standard_normal((tokens, k)).astype(np.float32)
        gate, up = (rng.standard_normal((5, k, n)).astype(np.float32) for _ in range(2))
        for sizes, offset in cases:
            groups = 5 - offset
            expected = gather_gmm_reference(x, rows, np.concatenate([gate, up], 2)[offset:], np.array(sizes),
                                            group_offset=offset, glu="silu")
            out = jax.jit(lambda *a, tm=tm, tail=tail: tiled_gather_gmm(
                *a, tm=tm, tail=tail, out_dtype=dtype, group_offset=offset, glu="silu"))(
                jnp.asarray(x, dtype), jnp.asarray(rows), (jnp.asarray(gate[offset:offset + groups], dtype),
                                                           jnp.asarray(up[offset:offset + groups], dtype)),
                jnp.asarray(sizes, jnp.int32))
            out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
            scale = np.abs(expected).max()
            assert np.abs(out - expected).max() <= (2e-2 if dtype == "bfloat16" else 1e-5) * scale, (sizes, k, tm)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiled_dispatch_temp_holds_no_second_output(dtype):
    """XLA CPU runs the tiled dispatch in its output buffer: its compiled temp memory is smaller than one
    [m, n] output. (Carried as uint16 bits, a bf16 output was copied once more after the loop: temp 0.35 MiB
    for this 0.25 MiB output; FINDINGS.md: fused layer memory.)"""
    from moe_tune.kernels.fused_moe.tiled import tiled_gather_gmm

    tokens, top_k, k, n, groups = 128, 4, 64, 256, 8
    s = lambda shape, dt=dtype: jax.ShapeDtypeStruct(shape, jnp.dtype(dt))
    args = (s((tokens, k)), s((tokens * top_k,), "int32"), (s((groups, k, n)), s((groups, k, n))), s((groups,), "int32"))
    run = jax.jit(lambda *a: tiled_gather_gmm(*a, tm=32, tail=8, out_dtype=dtype, glu="silu"))
    memory = run.lower(*args).compile().memory_analysis()
    assert memory.temp_size_in_bytes < memory.output_size_in_bytes == tokens * top_k * n * jnp.dtype(dtype).itemsize, (
        memory.temp_size_in_bytes, memory.output_size_in_bytes)


def test_combine_backward_holds_one_float32_product_buffer():
    """The bf16 combine's backward computes d(row_weights) from h and g = d(out) rows @ rhs^T as masked
    products summed per row: one float32 [m, k] buffer. (As a row dot, `einsum("rf,rf->r")`, XLA CPU's dot
    read float32 copies of both: two; 1444 -> 929 KiB temp at this shape.)"""
    tokens, top_k, k, n, groups = 128, 4, 256, 64, 8
    m, s = tokens * top_k, jax.ShapeDtypeStruct
    config = {"fwd": TiledFusedConfig(tm=32, tail=8), "bwd": TiledFusedConfig(tm=32, tail=8)}
    loss = lambda h, rhs, w, sizes, rows: jnp.sum(gmm_combine(h, rhs, sizes, rows, w, tokens, backend="tiled",
                                                              config=config).astype(jnp.float32))
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(
        s((m, k), jnp.bfloat16), s((groups, k, n), jnp.bfloat16), s((m,), jnp.float32), s((groups,), jnp.int32),
        s((m,), jnp.int32)).compile().as_text()
    entry = hlo[hlo.index("\nENTRY"):]
    made = [line for line in entry.splitlines() if "=" in line and f"f32[{m},{k}]" in line.split("=")[1].split("(")[0]]
    assert len(made) == 1, made


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiled_dispatch_holds_one_weight_part_at_decode(dtype):
    """Where an average group fits one tile (decode), the dispatch reads the gate and up weights of a group
    one after the other, each right before its dot: its temp holds one part's [k, n] slice (the dot's
    operand is a copy on XLA CPU), not both. (Read once per group, both were live across the group's tiles:
    temp over 2 slices here; FINDINGS.md: fused layer decode.) Outputs as with the weights read per group."""
    from moe_tune.kernels.fused_moe.tiled import sequenced_weights, tiled_gather_gmm

    tokens, top_k, k, n, groups, tm = 16, 2, 256, 256, 4, 16
    assert sequenced_weights(tokens * top_k, groups, tm)
    s = lambda shape, dt=dtype: jax.ShapeDtypeStruct(shape, jnp.dtype(dt))
    args = (s((tokens, k)), s((tokens * top_k,), "int32"), (s((groups, k, n)), s((groups, k, n))), s((groups,), "int32"))
    run = lambda per_tile: jax.jit(lambda *a: tiled_gather_gmm(*a, tm=tm, tail=8, out_dtype=dtype, glu="silu",
                                                                weights_per_tile=per_tile))
    slice_bytes = k * n * jnp.dtype(dtype).itemsize
    temp = run(None).lower(*args).compile().memory_analysis().temp_size_in_bytes
    assert temp < 1.5 * slice_bytes, (temp, slice_bytes)
    rng = np.random.default_rng(0)
    inputs = (jnp.asarray(rng.standard_normal((tokens, k)), dtype), jnp.asarray(rng.integers(0, tokens, tokens * top_k), jnp.int32),
              tuple(jnp.asarray(rng.standard_normal((groups, k, n)) * k ** -0.5, dtype) for _ in range(2)),
              jnp.asarray([5, 0, 17, 9], jnp.int32))
    np.testing.assert_array_equal(np.asarray(run(None)(*inputs).astype(jnp.float32)),
                                  np.asarray(run(False)(*inputs).astype(jnp.float32)))
