"""The pallas_tpu fused_moe backend reads gate and up as two operands (`split_weights`,
kernels/fused_moe/pallas_tpu_weights.py), in interpret mode against float64 at small shapes with two blocks
per part (f = 256, tiles of 128), so that the index maps' ranges, offsets and idle holds are all exercised:
the gradients through the op's custom VJPs on a shard (the training forward without glu on parts, dx
contracting over both parts), bfloat16 rows gathered as uint32 pairs, int8 / float8 scales split with their
values, the contraction over parts in both kernels, parts no block fits (concatenated by the backend), the
DMA count of the idle-part holds, the no-straddle rule, and the program lowered for a TPU holding no
concatenated weights. The base's test_weight_parts_stand_for_their_concatenation runs each kernel direction
on parts at f = 128; tests/test_fused_moe_compile.py and benchmarks/fused_weights_parts_compile.py the v5e
compiler."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from fused_moe_base import assert_lowered_without_concatenated_weights, assert_parts_vjp_matches_float64
from ragged_dot_base.lowering import MOSAIC_CALL
from test_fused_moe_pallas import TOTAL, K, M, T, close, rounded, routing, shard

from moe_tune.core.quant import QArray, dequantize_host, quantize
from moe_tune.kernels.fused_moe.pallas_tpu import FusedPallasTpuConfig, PallasTpuFusedMoe
from moe_tune.kernels.fused_moe.pallas_tpu_weights import rhs_specs, weight_views
from moe_tune.kernels.fused_moe.problem import FusedMoeProblem
from moe_tune.kernels.fused_moe.reference import gather_gmm_reference, gmm_combine_reference

F = 256  # each of gate and up: two column blocks of 128
H = 128  # a hidden size of one block where the test is about f (interpret mode's time)
LOCAL = 2  # local groups 1..2 of TOTAL
CONFIG = FusedPallasTpuConfig(tm=16, tk=128, tn=128, dmas_in_flight=4)
BACKEND = PallasTpuFusedMoe()


def _halves(w):
    """(gate, up): the halves along n of w [g, k, 2f] (a QArray's values and scales alike)."""
    if isinstance(w, QArray):
        return tuple(QArray(w.qvalue[:, :, s], w.scale[:, :, s]) for s in (slice(0, F), slice(F, None)))
    return w[:, :, :F], w[:, :, F:]


def _shard_routing(seed: int):
    """rows (outside the shard: tokens never read) and group sizes, local groups 1..2 of 4 with group 3 empty;
    the normalized sizes, offset and local row range as the op hands them over."""
    rows, sizes = routing(seed, experts=(0, 1, 2))
    norm, offset, start, end = shard(sizes, 1, LOCAL)
    rows[:start], rows[end:] = T + 7, -3
    return rows, sizes, norm, offset, start, end


def test_gradients_through_the_custom_vjp_on_parts_match_float64():
    """d/d(x, gate, up) of sum(cot * gather_gmm(x, rows, (gate, up), glu=silu)) on a shard (group_offset 1):
    the forward runs the dispatch without glu on the parts (column blocks 0-1 in gate, 2-3 in up), the
    backward's dx the combine over [gate | up]^T (k steps 0-1 in gate, 2-3 in up), each weight's gradient."""
    rows, sizes, *_ = _shard_routing(11)
    rng = np.random.default_rng(12)
    x = rng.standard_normal((T, H)).astype(np.float32)
    gate, up = (rng.standard_normal((LOCAL, H, F)).astype(np.float32) / 16 for _ in range(2))
    cot = rng.standard_normal((M, F)).astype(np.float32)
    assert_parts_vjp_matches_float64("pallas_tpu", CONFIG, rows, sizes, x, gate, up, cot, local=LOCAL)


def test_gated_dispatch_on_parts_bfloat16_rows_and_int8_scales():
    """gather_gmm with glu on (gate, up) int8 parts (per-channel scales split with the values), each feeding
    its own accumulator, on a shard, bfloat16 x gathered as uint32 pairs of its halves (k = 2 x 128, a half
    per k step). (Without glu: the VJP test above, and the base's int8 case.)"""
    glu = "silu"
    rows, sizes, norm, offset, start, end = _shard_routing(21)
    rng = np.random.default_rng(22)
    x, x64 = rounded(rng.standard_normal((T, K)), "bfloat16")
    q = quantize(jnp.asarray(rng.standard_normal((LOCAL, K, 2 * F)) / 16, jnp.float32), "int8", axis=1)
    out = BACKEND.gather_gmm(x, jnp.asarray(rows), _halves(q), norm, config=CONFIG, out_dtype=jnp.bfloat16,
                             group_offset=offset, glu=glu)
    ref = gather_gmm_reference(x64, np.clip(rows, 0, T - 1), dequantize_host(q), sizes, group_offset=1, glu=glu)
    assert out.shape == ref.shape
    close(out, ref, "bfloat16")
    assert not np.asarray(out, np.float32)[:start].any() and not np.asarray(out, np.float32)[end:].any()


def test_contraction_over_parts_in_both_kernels_float8_blocks():
    """The parts split the contraction (transpose_rhs): gmm_combine (the dispatch's backward, dh [m, 2f] @
    [gate | up]^T into the tokens) and gather_gmm (bfloat16 rows [tokens, 2f] gathered as uint32 pairs, times
    [a | b]^T), float8_e4m3fn weights in 128-row scale blocks along k, on a shard."""
    rows, sizes, norm, offset, start, end = _shard_routing(31)
    rng = np.random.default_rng(32)
    q = quantize(jnp.asarray(rng.standard_normal((LOCAL, K, 2 * F)) / 16, jnp.float32), "float8_e4m3fn", axis=1,
                 block_size=128)
    w64 = dequantize_host(q)
    h = rng.standard_normal((M, 2 * F))
    h[:start] = h[end:] = np.nan  # outside the shard: never read
    h, h64 = rounded(h, "bfloat16")
    weights = rng.random(M).astype(np.float32)
    out = BACKEND.gmm_combine(h, _halves(q), norm, jnp.asarray(rows), jnp.asarray(weights), tokens=T, config=CONFIG,
                              out_dtype=jnp.float32, group_offset=offset, transpose_rhs=True)
    close(out, gmm_combine_reference(h64, w64, sizes, rows, weights, tokens=T, group_offset=1, transpose_rhs=True),
          "bfloat16")
    x, x64 = rounded(rng.standard_normal((T, 2 * F)), "bfloat16")
    out = BACKEND.gather_gmm(x, jnp.asarray(rows), _halves(q), norm, config=CONFIG, out_dtype=jnp.float32,
                             group_offset=offset, transpose_rhs=True)
    close(out, gather_gmm_reference(x64, np.clip(rows, 0, T - 1), w64, sizes, group_offset=1, transpose_rhs=True),
          "bfloat16")


def test_parts_no_block_fits_are_concatenated_by_the_backend():
    """h @ [a | b] combined into the tokens, a of 192 and b of 320 columns: no block of 128 fits the parts, so
    the backend concatenates them (one view; 128 | 384 would be two) and the result is still right."""
    widths = (192, 320)
    rows, sizes = routing(41)
    norm, offset, _, _ = shard(sizes, 0, TOTAL)
    rng = np.random.default_rng(42)
    h, h64 = rounded(rng.standard_normal((M, H)), "float32")
    weights = rng.random(M).astype(np.float32)
    w = (rng.standard_normal((TOTAL, H, sum(widths))) / 16).astype(np.float32)
    parts = (jnp.asarray(w[:, :, :widths[0]]), jnp.asarray(w[:, :, widths[0]:]))
    assert len(weight_views(parts, glu=None, transpose_rhs=False, tk=128, tn=128)[1]) == 1
    aligned = (parts[0][:, :, :128], jnp.concatenate([parts[0][:, :, 128:], parts[1]], axis=2))
    assert len(weight_views(aligned, glu=None, transpose_rhs=False, tk=128, tn=128)[1]) == 2
    out = BACKEND.gmm_combine(h, parts, norm, jnp.asarray(rows), jnp.asarray(weights), tokens=T, config=CONFIG,
                              out_dtype=jnp.float32, group_offset=offset)
    close(out, gmm_combine_reference(h64, w, sizes, rows, weights, tokens=T), "float32")


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_idle_parts_cost_no_block_fetch(transpose_rhs):
    """The pipeline fetches an operand's block when its index changes between grid steps: over a whole grid
    (4 blocks along the split axis, 2 per part; visits with repeated and changing groups), gate and up as two
    operands fetch as many blocks as the one concatenated array, and each part only ever holds its own."""
    # n = 512 (4 blocks of 128) runs along j, or transposed along kk; k = 256 along the other axis
    grid, gid = ((2, 5, 4) if transpose_rhs else (4, 5, 2)), np.array([0, 0, 1, 1, 1])
    split = 2 if transpose_rhs else 0
    one, parts = jnp.zeros((2, 256, 512)), (jnp.zeros((2, 256, 256)), jnp.zeros((2, 256, 256)))
    last = tuple(size - 1 for size in grid)
    points = [(j, v, kk) for j in range(grid[0]) for v in range(grid[1]) for kk in range(grid[2])]

    def fetches(rhs):
        _, views = weight_views(rhs, glu=None, transpose_rhs=transpose_rhs, tk=128, tn=128)
        specs = rhs_specs(views, tk=128, tn=128, transpose_rhs=transpose_rhs, scale_rows=None, last=last)
        total = 0
        for view, spec in zip(views, specs):
            blocks = [tuple(int(i) for i in spec.index_map(*p, gid)) for p in points]
            total += 1 + sum(a != b for a, b in zip(blocks, blocks[1:]))
            if view.axis is not None:  # a part's column block index stays inside the part
                assert {b[2] for b in blocks} == set(range(view.hi - view.lo))
                for p, b in zip(points, blocks):  # and where it serves, the one array's block, counted from lo
                    if view.lo <= p[split] < view.hi:
                        assert b[2] == p[split] - view.lo
        return total

    assert fetches(parts) == fetches(one)


def test_a_block_never_straddles_gate_and_up():
    """n = 512 is gate | up of 256 each: a tile of 512 spans both, refused for the output columns of the
    forward without glu (tn) and the backward's contraction (tk); the defaults and tiles of 256 fit. Where f is
    not lane-aligned (192) no block fits a part: the whole 2f stays valid (the backend concatenates)."""
    for direction, field in (("fwd", "tn"), ("bwd", "tk")):
        problem = FusedMoeProblem(tokens=16, m=32, k=128, n=512, groups=4, dtype="float32", stage="dispatch",
                                  direction=direction)
        reason = BACKEND.config_error(FusedPallasTpuConfig(**{"tm": 16, "tk": 128, "tn": 128, field: 512}), problem)
        assert f"{field}=512 must divide the 256 columns of each of gate and up" in reason, reason
        fits = FusedPallasTpuConfig(**{"tm": 16, "tk": 128, "tn": 128, field: 256})
        assert BACKEND.config_error(fits, problem) is None
        assert BACKEND.config_error(BACKEND.default_config(problem), problem) is None
        assert all(BACKEND.config_error(c, problem) is None for c in BACKEND.search_space(problem))
        odd = FusedMoeProblem(tokens=16, m=32, k=128, n=384, groups=4, dtype="float32", stage="dispatch",
                              direction=direction)
        assert BACKEND.config_error(FusedPallasTpuConfig(**{"tm": 16, "tk": 128, "tn": 128, field: 384}), odd) is None
    glu = FusedMoeProblem(tokens=16, m=32, k=128, n=512, groups=4, dtype="float32", stage="dispatch", glu="silu")
    assert BACKEND.config_error(FusedPallasTpuConfig(tm=16, tk=128, tn=256), glu) is None


def test_the_tpu_program_holds_no_concatenated_weights(on_chip):
    """Forward and backward of the dispatch on (gate, up), lowered for a TPU (the Mosaic kernels, not interpret
    mode): no [groups, k, 2f] concatenate, and the parts go to the kernels as they are."""
    on_chip("tpu")
    assert_lowered_without_concatenated_weights("tpu", "pallas_tpu", CONFIG, MOSAIC_CALL, f=F, local=LOCAL, tokens=T,
                                                m=M, total=TOTAL, k=K)
