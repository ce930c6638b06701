"""`moe_tune.core.quant`: QArray, quantize, dequantize and the layout helpers the kernels use."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import moe_tune
from moe_tune.core.errors import UsageError
from moe_tune.core.quant import QMAX, QArray, check_operand, dequantize, quantize, scale_layout

DTYPES = ("int8", "float8_e4m3fn")
# Worst rounding error of one value: int8, half a step (absmax / 127) of its run; float8_e4m3fn, half an ulp
# (3 mantissa bits: at most 2^-4 of the value), or half the smallest subnormal step below the normal range.
REL_STEP = {"int8": 0.5 / 127, "float8_e4m3fn": 2.0**-4}


@settings(max_examples=10, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.sampled_from([(8,), (4, 12), (3, 6, 5)]),
    block=st.sampled_from([None, 1, 2, 3]),
    seed=st.integers(0, 2**16),
)
@example(dtype="int8", shape=(4, 12), block=2, seed=255)  # a tie at x / scale = 63.5 (the float32 slack below)
def test_round_trip_error_is_within_half_a_step(dtype, shape, block, seed):
    axis = len(shape) - 2 if len(shape) > 1 else 0
    if block is not None and shape[axis] % block:
        block = None
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 10.0 ** (seed % 5 - 2)
    q = quantize(jnp.asarray(x), dtype, axis=axis, block_size=block)
    bs = shape[axis] if block is None else block
    expected_scale_shape = list(shape)
    expected_scale_shape[axis] = shape[axis] // bs
    assert q.qvalue.dtype == jnp.dtype(dtype) and q.scale.dtype == jnp.float32
    assert q.scale.shape == tuple(expected_scale_shape)
    back = np.asarray(dequantize(q), np.float64)
    runs = np.moveaxis(np.abs(x), axis, -1).reshape(*np.moveaxis(x, axis, -1).shape[:-1], -1, bs)
    absmax = np.moveaxis(np.repeat(runs.max(-1), bs, axis=-1), -1, axis)  # each element's run absmax
    if dtype == "int8":  # half a step of the run's scale
        bound = absmax * REL_STEP[dtype]
    else:  # half an ulp of the value (3 mantissa bits), or half the smallest subnormal (2^-9) of the scale
        bound = REL_STEP[dtype] * np.abs(x) + 2.0**-10 * absmax / QMAX[dtype]
    # slack for float32: the scale is rounded, and a value at a tie (x / scale = 63.5) then lands half a step
    # and an ulp of x away (int8, (4, 12), block 2, seed 255: 1.00001 x the bound)
    assert np.all(np.abs(back - x) <= bound * (1 + 1e-5) + np.abs(x) * 2.0**-22 + 1e-30)
    # the run's largest magnitude is hit exactly (up to float32 rounding of the scale)
    np.testing.assert_allclose(np.abs(back).max(), np.abs(x).max(), rtol=1e-6)


def test_all_zero_runs_get_scale_one_and_zero_values():
    x = jnp.asarray([[0.0, 0.0, 1.0, -2.0], [0.0, 0.0, 0.0, 0.0]])
    q = quantize(x, jnp.int8, axis=1, block_size=2)
    np.testing.assert_allclose(q.scale, [[1.0, 2.0 / 127], [1.0, 1.0]], rtol=1e-7)
    np.testing.assert_array_equal(dequantize(q)[1], 0.0)
    assert not np.any(np.asarray(q.qvalue[1]))


def test_int8_values_are_rounded_and_clipped_to_127():
    x = jnp.asarray([[-3.0, 3.0, 1.0, 0.02]])
    q = quantize(x, jnp.int8, axis=1)
    np.testing.assert_array_equal(q.qvalue, [[-127, 127, 42, 1]])  # 1*127/3 = 42.33, 0.02*127/3 = 0.85
    assert int(jnp.min(q.qvalue.astype(jnp.int32))) >= -127  # never -128
    big = quantize(jnp.asarray([[1e30, -1e30, 1.0]]), jnp.int8, axis=1)
    np.testing.assert_array_equal(big.qvalue, [[127, -127, 0]])


def test_float8_values_and_largest_magnitude():
    x = jnp.asarray([[1.0, -4.0, 0.5, 0.0]])
    q = quantize(x, jnp.float8_e4m3fn, axis=1)
    assert q.qvalue.dtype == jnp.float8_e4m3fn
    np.testing.assert_allclose(q.scale, [[4.0 / 448]])
    np.testing.assert_allclose(dequantize(q), x, rtol=2.0**-4)
    assert float(q.qvalue[0, 1].astype(jnp.float32)) == -448.0


def test_layout_is_read_off_the_shapes():
    q = lambda scale_shape: QArray(np.ones((2, 8, 3), np.int8), np.ones(scale_shape, np.float32))
    assert scale_layout(q((2, 2, 3))) == (1, 4)
    assert scale_layout(q((2, 1, 3))) == (1, 8)
    assert scale_layout(q((2, 8, 1))) == (2, 3)
    # a block of 1 gives one scale per element: valid along any axis, block 1
    assert scale_layout(q((2, 8, 3))) == (None, 1)
    assert quantize(np.ones((2, 8, 3), np.float32), jnp.int8, axis=-1).scale.shape == (2, 8, 1)


def test_check_operand_names_the_expected_layout_in_one_line():
    layout = "[g, k, n] scaled along axis 1 (k) with scale [g, k/bs, n]"
    rhs = np.ones((2, 8, 4), np.float32)
    assert check_operand(quantize(rhs, jnp.int8, axis=1, block_size=2), name="rhs", layout=layout) == 2
    assert check_operand(quantize(rhs, jnp.int8, axis=1), name="rhs", layout=layout) == 8
    q = lambda scale_shape: QArray(np.ones((2, 8, 4), np.int8), np.ones(scale_shape, np.float32))
    for bad in (q((2, 8, 1)), q((1, 8, 4)),  # scaled along n, along the groups
                q((2, 3, 4)),  # 3 does not divide 8
                q((2, 1, 1))):  # two scaled axes
        with pytest.raises(UsageError, match=r"rhs QArray must be \[g, k, n\]") as err:
            check_operand(bad, name="rhs", layout=layout)
        assert "\n" not in str(err.value)
    with pytest.raises(UsageError, match="float32 scales"):
        check_operand(QArray(np.ones((2, 8, 4), np.int32), np.ones((2, 1, 4), np.float32)), name="rhs", layout=layout)


@pytest.mark.parametrize("kwargs, match", [
    ({"dtype": jnp.int8, "axis": 1, "block_size": 3}, "does not divide"),
    ({"dtype": jnp.int8, "axis": 1, "block_size": 0}, "does not divide"),
    ({"dtype": jnp.int8, "axis": 2}, "out of range"),
    ({"dtype": jnp.int16, "axis": 1}, "cannot quantize to int16"),
])
def test_bad_arguments_are_usage_errors(kwargs, match):
    with pytest.raises(UsageError, match=match):
        quantize(jnp.ones((4, 8)), **kwargs)


def test_qarray_is_a_pytree_through_jit_vmap_and_slicing():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 8, 4)), jnp.float32)
    q = moe_tune.quantize(x, jnp.int8, axis=1, block_size=4)
    leaves, tree = jax.tree_util.tree_flatten(q)
    assert len(leaves) == 2 and isinstance(jax.tree_util.tree_unflatten(tree, leaves), QArray)
    jitted = jax.jit(lambda q: moe_tune.dequantize(q) * 2)(q)
    np.testing.assert_array_equal(jitted, 2 * moe_tune.dequantize(q))
    # vmap over the groups: each element is a [k, n] QArray scaled along its axis 0
    mapped = jax.vmap(moe_tune.dequantize)(q)
    np.testing.assert_array_equal(mapped, moe_tune.dequantize(q))
    made = jax.jit(jax.vmap(lambda x: quantize(x, jnp.int8, axis=0, block_size=4)))(x)
    np.testing.assert_array_equal(made.qvalue, q.qvalue)
    np.testing.assert_allclose(made.scale, q.scale, rtol=1e-7)
    part = q[1:]
    assert part.shape == (2, 8, 4) and part.scale.shape == (2, 2, 4)
