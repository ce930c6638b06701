"""4-bit QArrays (int4 in blocks, mxfp4 by the OCP MX rule), QArrays from a checkpoint's own values and
scales, and the in-kernel activation quantization marker (`DynamicQuant`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_tune.core.errors import UsageError
from moe_tune.core.quant import DynamicQuant, dequantize, dequantize_host, from_checkpoint, quantize, quantize_tile

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)  # e2m1's non-negative values, in code order


def test_int4_is_symmetric_absmax_with_qmax_7_in_blocks():
    x = np.random.default_rng(0).standard_normal((2, 256, 3)).astype(np.float32)
    q = quantize(x, "int4", axis=1, block_size=128)
    assert q.qvalue.dtype == jnp.int4 and q.scale.dtype == jnp.float32 and q.scale.shape == (2, 2, 3)
    runs = x.reshape(2, 2, 128, 3)
    np.testing.assert_allclose(np.asarray(q.scale), np.abs(runs).max(axis=2) / 7, rtol=3e-7)  # XLA: x * (1/7)
    values = np.asarray(q.qvalue).astype(np.int64)
    assert values.min() >= -7 and values.max() <= 7
    expected = np.clip(np.round(runs / (np.abs(runs).max(axis=2, keepdims=True) / 7)), -7, 7).reshape(x.shape)
    assert np.abs(values - expected).max() <= 1  # float32 division at a rounding tie may differ by one
    # dequantize is exact: the float64 product of the stored values and scales
    np.testing.assert_array_equal(dequantize_host(q), values * np.repeat(np.asarray(q.scale, np.float64), 128, 1))
    assert np.abs(dequantize_host(q) - x).max() <= np.asarray(q.scale).max() / 2 * (1 + 1e-6)


def test_mxfp4_scales_are_powers_of_two_and_values_round_to_nearest_e2m1():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((3, 64, 4)) * np.exp2(rng.integers(-8, 8, (3, 1, 4)))).astype(np.float32)
    x[0, :32, 0] = 0  # an all-zero block: scale 1
    q = quantize(x, "mxfp4", axis=1)  # blocks of 32
    assert q.qvalue.dtype == jnp.float4_e2m1fn and q.scale.shape == (3, 2, 4)
    scale = np.asarray(q.scale, np.float64)
    absmax = np.abs(x.reshape(3, 2, 32, 4)).max(axis=2)
    expected = np.where(absmax > 0, np.exp2(np.floor(np.log2(np.where(absmax > 0, absmax, 1))) - 2), 1)
    np.testing.assert_array_equal(scale, expected)
    values = np.asarray(q.qvalue.astype(jnp.float32), np.float64)
    scaled = x / np.repeat(scale, 32, axis=1)
    # nearest e2m1 value, clamped to +-6: no other representable value is closer
    nearest = np.abs(np.abs(np.clip(scaled, -6, 6))[..., None] - E2M1).min(axis=-1)
    np.testing.assert_allclose(np.abs(np.abs(values) - np.abs(np.clip(scaled, -6, 6))), nearest, atol=1e-12)
    assert np.all(np.sign(values) * np.sign(scaled) >= 0)
    np.testing.assert_array_equal(dequantize_host(q), values * np.repeat(scale, 32, axis=1))
    np.testing.assert_array_equal(np.asarray(dequantize(q), np.float64), dequantize_host(q))  # exact in f32 too


@pytest.mark.parametrize("dtype, block, match", [
    ("mxfp4", None, "mxfp4 quantizes blocks of 32 along axis 1: block_size 32 does not divide its length 100"),
    ("int4", 128, "int4 quantizes blocks of 128 along axis 1: block_size 128 does not divide its length 100"),
    ("mxfp4", 64, r"mxfp4 \(float4_e2m1fn\) takes blocks of 32 along k"),
])
def test_a_block_that_does_not_fit_is_a_one_line_error_naming_the_rule(dtype, block, match):
    with pytest.raises(UsageError, match=match) as err:
        quantize(jnp.ones((2, 100)), dtype, axis=1, block_size=block)
    assert "\n" not in str(err.value)


def _pack(codes: np.ndarray) -> np.ndarray:
    """uint8 nibble codes [..., 2s] -> uint8 [..., s], the low nibble first."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def test_a_checkpoints_own_values_and_scales_make_a_qarray_without_requantizing():
    x = np.random.default_rng(2).standard_normal((2, 64, 128)).astype(np.float32)
    # int4 values packed two a byte along n, as AWQ does
    q = quantize(x, "int4", axis=1, block_size=32)
    codes = np.asarray(q.qvalue).astype(np.int8).astype(np.uint8) & 0xF
    loaded = from_checkpoint(_pack(codes), q.scale, "int4", packed_axis=2)
    np.testing.assert_array_equal(np.asarray(loaded.qvalue), np.asarray(q.qvalue))
    # mxfp4 as gpt-oss ships it: e2m1 codes packed along k, uint8 e8m0 scales (the biased exponent)
    m = quantize(x, "mxfp4", axis=1)
    values = np.asarray(m.qvalue.astype(jnp.float32))
    codes = np.abs(values)[..., None] == E2M1
    codes = (codes.argmax(-1) + 8 * np.signbit(values)).astype(np.uint8)
    codes = np.swapaxes(codes, 1, 2)  # packed along the last axis, k, then moved back
    e8m0 = (np.log2(np.asarray(m.scale)) + 127).astype(np.uint8)
    loaded = from_checkpoint(np.swapaxes(_pack(codes), 1, 2), e8m0, "mxfp4", packed_axis=1)
    assert loaded.scale.dtype == jnp.float8_e8m0fnu
    np.testing.assert_array_equal(dequantize_host(loaded), dequantize_host(m))
    with pytest.raises(UsageError, match="pass packed_axis"):
        from_checkpoint(np.zeros((2, 4), np.uint8), np.ones((2, 1), np.float32), "int4")
    with pytest.raises(UsageError, match="float32 scales"):
        from_checkpoint(q.qvalue, q.scale.astype(jnp.bfloat16), "int4")


def test_dynamic_quant_marker_quantizes_as_the_whole_array_rule():
    x = jnp.asarray(np.random.default_rng(3).standard_normal((5, 64)), jnp.bfloat16)
    marker = DynamicQuant(x, "int8", block_size=16)
    whole = marker.quantize()
    tile = quantize_tile(x[1:3].astype(jnp.float32), "int8", 1, 16)  # a kernel's tile: the same bits
    np.testing.assert_array_equal(np.asarray(tile.qvalue), np.asarray(whole.qvalue[1:3]))
    np.testing.assert_array_equal(np.asarray(tile.scale), np.asarray(whole.scale[1:3]))
    assert jax.tree.leaves(marker) == [x]
    with pytest.raises(UsageError, match="lhs_quant: int8 quantizes blocks of 24"):
        DynamicQuant(x, "int8", block_size=24).block()
    with pytest.raises(UsageError, match="not int4"):
        DynamicQuant(x, "int4")


def test_packed_nibbles_unpack_to_every_4bit_value():
    """`pallas_util.packed_bytes` / `load_nibbles`: all 16 codes of int4 and float4_e2m1fn, even and odd."""
    from moe_tune.kernels.pallas_util import load_nibbles, packed_bytes
    for dtype, values in (("int4", np.arange(-8, 8)), ("float4_e2m1fn", np.concatenate([E2M1, -E2M1]))):
        x = jnp.asarray(values.reshape(2, 8), jnp.dtype(dtype))
        packed = jax.jit(packed_bytes)(x)
        assert packed.dtype == jnp.uint8 and packed.shape == (2, 4)
        for odd in (False, True):
            got = np.asarray(jax.jit(load_nibbles, static_argnums=(1, 2, 3))(packed, odd, dtype, jnp.float32), np.float64)
            np.testing.assert_array_equal(got, np.asarray(x.astype(jnp.float32), np.float64)[:, int(odd)::2])


def test_tiled_4bit_weights_with_an_odd_width_take_the_unpacked_path():
    """Weights whose last axis cannot be cut into bytes (n = 5) are converted element by element: the same
    result as the packed path's, fwd and dlhs."""
    import moe_tune
    from moe_tune.kernels.ragged_dot.definition import ragged_dot_dlhs_reference, ragged_dot_reference
    rng = np.random.default_rng(4)
    x, dout = rng.standard_normal((12, 32)).astype(np.float32), rng.standard_normal((12, 5)).astype(np.float32)
    w = quantize(rng.standard_normal((2, 32, 5)).astype(np.float32), "int4", axis=1, block_size=16)
    sizes = [7, 5]
    f = lambda x: moe_tune.ragged_dot(x, w, jnp.asarray(sizes, jnp.int32), backend="tiled")
    out, vjp = jax.vjp(f, jnp.asarray(x))
    ref = ragged_dot_reference(x, dequantize_host(w), sizes)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=0, atol=2e-6 * np.abs(ref).max())
    ref = ragged_dot_dlhs_reference(dout, dequantize_host(w), sizes)
    np.testing.assert_allclose(np.asarray(vjp(jnp.asarray(dout))[0]), ref, rtol=0, atol=2e-6 * np.abs(ref).max())


def test_a_4bit_dynamic_w8a8_sweep_through_the_cli_is_found_by_the_runtime(isolated_profiles):
    """`sweep --rhs-quant int4 --quant-block 16 --lhs-quant int8 --lhs-dynamic`: the key gains the fields
    (lhs_qdynamic only here), the entry records the quantization error, the report names the mode, and the op
    called with `lhs_quant="int8"` on int4/16 weights finds the entry; mxfp4 on a k that is not a multiple of
    32 is a one-line error naming the rule."""
    import json

    from click.testing import CliRunner

    import moe_tune
    from moe_tune.cli import cli
    from moe_tune.kernels import get_op
    from moe_tune.kernels.ragged_dot import RaggedDotProblem
    from moe_tune.profiles.entry import Entry

    run = lambda *args: CliRunner().invoke(cli, list(args), catch_exceptions=False)
    shape = ["--m", "32", "--k", "64", "--n", "16", "--groups", "4"]
    quant = ["--rhs-quant", "int4", "--quant-block", "16", "--lhs-quant", "int8", "--lhs-dynamic"]
    result = run("sweep", *shape, *quant, "--direction", "fwd", "--backend", "tiled", "--max-candidates", "1", "--samples", "1",
                 "--workers", "1")
    assert result.exit_code == 0, result.output
    (key, data), = json.loads((isolated_profiles / "cpu" / "ragged_dot.json").read_text())["entries"].items()
    entry = Entry.from_json(data)
    assert {k: entry.fields[k] for k in ("lhs_qdtype", "lhs_qblock", "lhs_qdynamic", "rhs_qdtype", "rhs_qblock")} == {
        "lhs_qdtype": "int8", "lhs_qblock": 16, "lhs_qdynamic": True, "rhs_qdtype": "int4", "rhs_qblock": 16}
    assert entry.fields["lhs_dtype"] == "float32" and 0 < entry.quantization_error < 0.2
    assert "lhs int8/16 dynamic rhs int4/16" in run("report", "--format", "csv").output
    rng = np.random.default_rng(0)
    x, sizes = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32), jnp.asarray([8] * 4, jnp.int32)
    w = quantize(jnp.asarray(rng.standard_normal((4, 64, 16)), jnp.float32), "int4", axis=1, block_size=16)
    problem = RaggedDotProblem.from_arrays(DynamicQuant(x, "int8", 16), w, sizes)
    assert get_op("ragged_dot").lookup(problem, backend="tiled").source == "exact"
    assert moe_tune.ragged_dot(x, w, sizes, lhs_quant="int8").shape == (32, 16)
    bad = run("sweep", "--m", "32", "--k", "48", "--n", "16", "--groups", "4", "--rhs-quant", "mxfp4")
    assert bad.exit_code != 0 and "mxfp4 quantizes blocks of 32 along k" in bad.output
    assert len(bad.output.strip().splitlines()) == 1, bad.output
