"""`moe_tune.ragged_dot` and `moe_mlp` with quantized operands: forward and gradients of every mode against a
float64 reference of the dequantized operands, QArrays as autodiff constants, the quantization-aware
(straight-through) `AsQArray`, jit / vmap / expert-parallel shards, and the layout errors."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ragged_dot_base.quantized import assert_quantized_vjp  # noqa: E402

# the shapes (an empty group, rows past sum(group_sizes)) and float32 tolerance of the kernel tests
from test_quant_kernels import SIZES, K, M, N, assert_close  # noqa: E402

import moe_tune
from moe_tune.core.errors import UsageError
from moe_tune.core.quant import AsQArray, QArray, dequantize, dequantize_host, quantize
from moe_tune.kernels.ragged_dot.definition import (ragged_dot_dlhs_reference, ragged_dot_drhs_reference,
                                                   ragged_dot_reference)

# name: (lhs quantization, rhs quantization), each None (float) or (qdtype, block_size; None = per row/channel)
MODES = {
    "weight_int8_per_channel": (None, ("int8", None)),
    "weight_fp8_sub_channel": (None, ("float8_e4m3fn", 8)),
    "w8a8_int8": (("int8", None), ("int8", 8)),
    "activation_int8_sub_channel": (("int8", 8), None),
}


def operands(seed: int = 0, groups: int = len(SIZES)):
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.standard_normal((M, K), np.float32))
    rhs = jnp.asarray(rng.standard_normal((groups, K, N), np.float32) / np.sqrt(K))
    dout = jnp.asarray(rng.standard_normal((M, N), np.float32))
    return lhs, rhs, dout, jnp.asarray(SIZES, jnp.int32)


def quantized(x, how):
    return x if how is None else quantize(x, how[0], axis=1, block_size=how[1])


def f64(x) -> np.ndarray:
    return dequantize_host(x) if isinstance(x, QArray) else np.asarray(x, np.float64)


def check_mode(mode: str, backend: str, jit: bool = True):
    """Forward and the float operands' gradients (a QArray's is zero) vs the dequantized float64 reference."""
    lhs, rhs, dout, sizes = operands()
    a, b = (quantized(x, how) for x, how in zip((lhs, rhs), MODES[mode]))
    f = lambda a, b: moe_tune.ragged_dot(a, b, sizes, backend=backend)
    out, vjp = jax.vjp(jax.jit(f) if jit else f, a, b)
    da, db = vjp(dout)
    assert_quantized_vjp(a, b, dout, SIZES, out, (da, db), f"[{backend} {mode}]", close=assert_close)


# weight_int8_per_channel and activation_int8_sub_channel through the op and its VJP (jitted) are every
# backend's `test_quantized_operands_through_the_op_and_its_vjp` (tests/ragged_dot_base/quantized.py);
# the op's other modes, fp8 sub-channel weights and w8a8, are only here.
@pytest.mark.parametrize("mode", ["weight_fp8_sub_channel", "w8a8_int8"])
@pytest.mark.parametrize("backend", ["tiled", "xla"])
def test_forward_and_gradients_match_the_dequantized_reference(backend, mode):
    check_mode(mode, backend)


@pytest.mark.parametrize("backend", ["megablox", "triton"])  # interpret mode on CPU: one tiny case each
def test_pallas_backends_weight_only(backend):
    check_mode("weight_int8_per_channel", backend, jit=False)


def test_output_dtype_follows_the_float_operand():
    lhs, rhs, _, sizes = operands()
    q = quantize(rhs, "int8", axis=1)
    assert moe_tune.ragged_dot(lhs.astype(jnp.bfloat16), q, sizes).dtype == jnp.bfloat16
    assert moe_tune.ragged_dot(quantize(lhs, "int8", axis=1), q, sizes).dtype == jnp.float32
    assert moe_tune.ragged_dot(lhs, q, sizes, preferred_element_type=jnp.bfloat16).dtype == jnp.bfloat16


def test_jit_of_grad_and_vmap_over_a_batch_of_activations():
    lhs, rhs, _, sizes = operands()
    q = quantize(rhs, "float8_e4m3fn", axis=1, block_size=8)
    loss = lambda x: jnp.sum(moe_tune.ragged_dot(x, q, sizes) ** 2)
    grad = jax.jit(jax.grad(loss))(lhs)
    out = moe_tune.ragged_dot(lhs, dequantize(q), sizes, backend="xla")
    assert_close(grad, ragged_dot_dlhs_reference(2 * f64(out), f64(q), SIZES))
    batch = jnp.stack([lhs, -2 * lhs])
    outs = jax.vmap(lambda x: moe_tune.ragged_dot(x, q, sizes))(batch)
    for i in range(2):
        assert_close(outs[i], ragged_dot_reference(f64(batch[i]), f64(q), SIZES), f"batch {i}")


def test_expert_parallel_shard_with_qarray_weights_sliced_by_group():
    """group_sizes covers 5 groups; this shard holds groups [1, 4) of the full QArray."""
    sizes = [6, 9, 0, 14, 8]
    lhs, rhs, dout, _ = operands(seed=1, groups=5)
    shard = quantize(rhs, "int8", axis=1)[1:4]
    f = lambda x: moe_tune.ragged_dot(x, shard, jnp.asarray(sizes, jnp.int32), group_offset=1)
    out, vjp = jax.vjp(jax.jit(f), lhs)
    assert_close(out, ragged_dot_reference(f64(lhs), f64(shard), sizes, group_offset=1))
    assert_close(vjp(dout)[0], ragged_dot_dlhs_reference(f64(dout), f64(shard), sizes, group_offset=1))


def test_dlhs_runs_the_quantized_kernel_under_its_own_key(caplog):
    """The backward pass resolves dlhs with the quantized problem's key (the quantization fields in it),
    and never runs drhs for a QArray weight (it gets no gradient)."""
    lhs, rhs, _, sizes = operands()
    q = quantize(rhs, "int8", axis=1)
    with caplog.at_level(logging.INFO, logger="moe_tune"):
        jax.grad(lambda x: moe_tune.ragged_dot(x, q, sizes, backend="tiled").sum())(lhs)
    resolved = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ragged_dot {")]
    dlhs = [m for m in resolved if "'direction': 'dlhs'" in m]
    assert len(dlhs) == 1 and "'rhs_qdtype': 'int8', 'rhs_qblock': 32" in dlhs[0], resolved
    assert "backend tiled" in dlhs[0]
    assert not any("'direction': 'drhs'" in m for m in resolved), resolved


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_straight_through_gradient_is_that_of_the_dequantized_weights(dtype):
    """AsQArray: the op quantizes inside; the weights' gradient is the dequantized product's gradient with
    respect to the dequantized weights (in the weights' dtype), and lhs's is the dlhs of those weights."""
    lhs, rhs, dout, sizes = operands()
    rhs = rhs.astype(dtype)
    deq = dequantize(quantize(rhs, "int8", axis=1, block_size=8))
    f = lambda x, w: moe_tune.ragged_dot(x, AsQArray(w, "int8", axis=1, block_size=8), sizes)
    out, vjp = jax.vjp(f, lhs, rhs)
    dx, dw = vjp(dout)
    assert_close(out, ragged_dot_reference(f64(lhs), f64(deq), SIZES))
    assert dw.dtype == jnp.dtype(dtype)
    tol = 2e-6 if dtype == "float32" else 1e-2  # the gradient is rounded to bfloat16
    ref = ragged_dot_drhs_reference(f64(lhs), f64(dout), SIZES, groups=len(SIZES))
    assert np.abs(np.asarray(dw, np.float64) - ref).max() <= tol * np.abs(ref).max()
    assert_close(dx, ragged_dot_dlhs_reference(f64(dout), f64(deq), SIZES))


def test_straight_through_activations():
    """An AsQArray lhs (quantized activations, w8a8 training): its gradient is the dlhs of the weights."""
    lhs, rhs, dout, sizes = operands()
    q = quantize(rhs, "int8", axis=1)
    f = lambda x: moe_tune.ragged_dot(AsQArray(x, "int8"), q, sizes)
    out, vjp = jax.vjp(f, lhs)
    assert_close(out, ragged_dot_reference(f64(quantize(lhs, "int8", axis=1)), f64(q), SIZES))
    assert_close(vjp(dout)[0], ragged_dot_dlhs_reference(f64(dout), f64(q), SIZES))


TOKENS, HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 16, 32, 16, 4, 2


def test_moe_mlp_with_quantized_weights_matches_the_dequantized_layer():
    """One expert-parallel shard (experts [1, 3) of 4) with QArray weights vs the same shard dequantized,
    output and gradient of x; then quantization-aware training of the whole layer (AsQArray weights): the
    straight-through gradients are those of the dequantized weights."""
    rng = np.random.default_rng(0)
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[-2]), jnp.float32)
    x, logits = f32(TOKENS, HIDDEN), f32(TOKENS, EXPERTS)
    weights = [f32(EXPERTS, HIDDEN, INTERMEDIATE), f32(EXPERTS, HIDDEN, INTERMEDIATE),
               f32(EXPERTS, INTERMEDIATE, HIDDEN)]
    qs = [quantize(w, "int8", axis=1, block_size=8) for w in weights]
    deq = [dequantize(q) for q in qs]

    @jax.jit
    @jax.value_and_grad
    def shard_loss(x, ws):
        return jnp.sum(moe_tune.moe_mlp(x, logits, *[w[1:3] for w in ws], TOP_K, expert_offset=1) ** 2)

    (got, got_dx), (want, want_dx) = shard_loss(x, qs), shard_loss(x, deq)
    assert_close(got, want)
    assert_close(got_dx, want_dx)
    layer = jax.jit(jax.grad(lambda ws, quant: jnp.sum(moe_tune.moe_mlp(x, logits, *map(quant, ws), TOP_K))),
                    static_argnums=1)
    ste = layer(weights, lambda w: AsQArray(w, "int8", block_size=8))
    for got, want in zip(ste, layer(deq, lambda w: w)):
        assert_close(got, want)


def test_bad_layouts_are_one_line_usage_errors():
    lhs, rhs, _, sizes = operands()
    along_n = QArray(jnp.ones((4, K, N), jnp.int8), jnp.ones((4, K, 1), jnp.float32))
    with pytest.raises(UsageError, match=r"rhs QArray must be \[g, k, n\] scaled along axis 1") as err:
        moe_tune.ragged_dot(lhs, along_n, sizes)
    assert "\n" not in str(err.value)
    with pytest.raises(UsageError, match=r"rhs QArray must be \[g, k, n\] scaled along axis 1"):
        moe_tune.ragged_dot(lhs, AsQArray(rhs, "int8", axis=2), sizes)
    with pytest.raises(UsageError, match=r"lhs QArray must be \[m, k\] scaled along axis 1"):
        moe_tune.ragged_dot(quantize(lhs, "int8", axis=0), rhs, sizes)
    with pytest.raises(UsageError, match="does not divide"):
        moe_tune.ragged_dot(lhs, AsQArray(rhs, "int8", block_size=5), sizes)
