"""The Pallas ragged_dot kernels (megablox: Mosaic TPU, triton) with 4-bit weights (int4 in blocks, mxfp4) and
activations quantized in the kernel (dynamic w8a8), in interpret mode against the float64 reference of the
quantized-then-dequantized operands; the in-kernel quantization arithmetic (`tile_quant`) against
`moe_tune.quantize` bit for bit; and the refusals, each a one-line reason.

The shapes are tiny (interpret mode), chosen so that the kernels take several k steps, several scale blocks
per step or several steps per block, and a ragged row tile. The test base (tests/ragged_dot_base/) runs its own
4-bit and dynamic cases on every backend; these add configs and directions aimed at the kernels' block loops.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_tune.core.quant import DynamicQuant, QArray, dequantize_host, quantize
from moe_tune.kernels.ragged_dot import BACKENDS, RaggedDotProblem
from moe_tune.kernels.ragged_dot.megablox import MegabloxConfig
from moe_tune.kernels.ragged_dot.tile_quant import block_scale, decode_e2m1, quantize_with
from moe_tune.kernels.ragged_dot.triton import TritonConfig

SIZES = [21, 0, 30, 9]  # an empty group; rows 60..63 past sum(group_sizes)
M, K, N = 64, 256, 64


def _operands(rhs_qdtype: str, rhs_block: int | None, lhs_dtype: str, dynamic: tuple[str, int]):
    """lhs [M, K] float activations the kernel quantizes (`DynamicQuant`), rhs [groups, K, N] quantized."""
    rng = np.random.default_rng(0)
    lhs = DynamicQuant(jnp.asarray(rng.standard_normal((M, K), np.float32), lhs_dtype), *dynamic)
    rhs = quantize(jnp.asarray(rng.standard_normal((len(SIZES), K, N), np.float32)), rhs_qdtype, axis=1,
                   block_size=rhs_block)
    return lhs, rhs


def _reference(lhs: DynamicQuant, rhs: QArray) -> np.ndarray:
    """float64 forward of the quantized-then-dequantized operands; rows past sum(SIZES) zero."""
    x, w = dequantize_host(lhs.quantize()), dequantize_host(rhs)
    out = np.zeros((M, N))
    for i, g in enumerate(np.repeat(np.arange(len(SIZES)), SIZES)):
        out[i] = x[i] @ w[g]
    return out


# (rhs qdtype, rhs block, lhs dtype, activations quantized in the kernel to (qdtype, block)). The test base runs
# mxfp4 fwd / dlhs, int4 through the op (fwd and dlhs), dynamic per row and in blocks of 16, at one k step;
# these take several k steps and scale blocks per tile, and activation blocks longer than the weights' (fp8
# activations in blocks of 128 x mxfp4's 32).
CASES = {
    "fwd_dynamic_int8_x_int4_block64": ("int4", 64, "bfloat16", ("int8", 64)),
    "fwd_dynamic_fp8_x_mxfp4": ("mxfp4", None, "float32", ("float8_e4m3fn", 128)),
}
# two k steps of 128 (tk / block_k), several row tiles over the groups, whole activation blocks in a step
CONFIGS = {"megablox": MegabloxConfig(16, 128, N), "triton": TritonConfig(32, 128, 64)}


@pytest.mark.parametrize("backend", ["megablox", "triton"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_the_dequantized_reference(backend, case):
    qdtype, block, dtype, dynamic = CASES[case]
    lhs, rhs = _operands(qdtype, block, dtype, dynamic)
    sizes = jnp.asarray(SIZES, jnp.int32)
    # float32 out: the products are exact, accumulation float32 (a bfloat16 out would round them)
    problem = RaggedDotProblem.from_arrays(lhs, rhs, sizes, preferred_element_type="float32")
    impl, config = BACKENDS.get(backend), CONFIGS[backend]
    assert impl.config_error(config, problem) is None
    got = np.asarray(jax.jit(lambda a, b, s: impl.run(problem, config, a, b, s))(lhs, rhs, sizes), np.float64)
    ref = _reference(lhs, rhs)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err <= 2e-6, f"{backend} {case}: max error {err:.3g} x max|ref|"
    assert not np.any(got[sum(SIZES):]), "rows past sum(group_sizes) are not zero"


def test_decode_e2m1_is_the_float4_values():
    codes = jnp.arange(-8, 8, dtype=jnp.int8).astype(jnp.int4)
    want = np.asarray(jax.lax.bitcast_convert_type(codes, jnp.float4_e2m1fn).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(decode_e2m1(codes)), want)


@pytest.mark.parametrize("qdtype", ["int8", "float8_e4m3fn"])
def test_tile_quantization_is_quantize_bit_for_bit(qdtype):
    """A [rows, block] tile quantized as the kernels do equals `quantize` of the whole array's block (values
    and scales), ties and an all-zero row included."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, 64)).astype(np.float32) * 3
    x[3] = 0.0
    x[5, :8] = np.arange(8) + 0.5  # exact ties of the rounding, once scaled by 127 / max
    x[5, 8] = 127.0
    q = quantize(jnp.asarray(x), qdtype, axis=1, block_size=32)
    tile_quant = jax.jit(lambda tile: (lambda s: (quantize_with(tile, s, qdtype), s))(block_scale(tile, qdtype)))
    for j in range(2):
        values, scale = tile_quant(jnp.asarray(x[:, 32 * j:32 * (j + 1)]))
        np.testing.assert_array_equal(np.asarray(scale[:, 0]), np.asarray(q.scale[:, j]))
        np.testing.assert_array_equal(np.asarray(values.astype(jnp.float32)),
                                      np.asarray(q.qvalue[:, 32 * j:32 * (j + 1)].astype(jnp.float32)))


def test_refusals_name_the_rule():
    base = dict(m=256, k=256, n=128, groups=4, lhs_dtype="bfloat16", out_dtype="bfloat16")
    per_row = RaggedDotProblem(**base, rhs_qdtype="int8", lhs_qdtype="int8", lhs_qdynamic=True)
    reason = BACKENDS.get("megablox").config_error(MegabloxConfig(16, 128, 128), per_row)
    assert reason and "one scale per row" in reason
    reason = BACKENDS.get("triton").config_error(TritonConfig(32, 64, 64), per_row)
    assert reason and "scale blocks" in reason


@pytest.mark.parametrize("direction", ["fwd", "dlhs"])
@pytest.mark.parametrize("k,n", [(2880, 2880), (768, 2048)])  # gpt-oss (no multiple of 128), qwen3-30b's down
def test_megablox_default_config_divides_k_for_quantized_problems(direction, k, n):
    """The quantized gmm needs tk | k: the default takes the largest aligned divisor up to 512, else k itself
    (compiled for v5e at gpt-oss's k = 2880 with mxfp4 weights, fwd and dlhs). Nothing runs."""
    impl = BACKENDS.get("megablox")
    for quant in (dict(rhs_qdtype="float4_e2m1fn", rhs_qblock=32),
                  dict(rhs_qdtype="int8", rhs_qblock=32, lhs_qdtype="int8", lhs_qblock=32, lhs_qdynamic=True)):
        if direction == "dlhs" and "lhs_qdynamic" in quant:
            continue
        problem = RaggedDotProblem(m=2048, k=k, n=n, groups=32, lhs_dtype="bfloat16", out_dtype="bfloat16",
                                   direction=direction, **quant)
        config = impl.default_config(problem)
        assert impl.config_error(config, problem) is None, (problem, config)


@pytest.mark.parametrize("backend,chip", [("megablox", "tpu"), ("triton", "gpu")])
def test_lowering_reads_the_4bit_values_and_the_float_activations(backend, chip, on_chip):
    """jax.export for the chip (nothing runs): one kernel call, whose operands are the 4-bit weights (mxfp4 as
    float4 into Mosaic, as its int4 bits into Triton) and, for activations quantized in the kernel, the float
    activations themselves (no quantized copy of x before the kernel)."""
    from ragged_dot_base.lowering import KERNEL_CALLS, export_for, kernel_call_lines

    on_chip(chip)
    impl = BACKENDS.get(backend)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((128, 256)), jnp.bfloat16)
    w = rng.standard_normal((4, 256, 128)).astype(np.float32)
    sizes = jnp.asarray([32, 0, 50, 46], jnp.int32)
    mx_bits = "xf4E2M1FN>" if chip == "tpu" else "xi4>"
    cases = [("fwd", DynamicQuant(x, "int8", 128), quantize(w, "int4", axis=1, block_size=128), "xi4>"),
             ("dlhs", jnp.asarray(rng.standard_normal((128, 128)), jnp.bfloat16), quantize(w, "mxfp4", axis=1),
              mx_bits)]
    for direction, a, b, bits in cases:
        lhs = x if direction == "dlhs" else a
        problem = RaggedDotProblem.from_arrays(lhs, b, sizes, direction=direction)
        config = impl.default_config(problem)
        exported = export_for(chip, lambda a, b, s: impl.run(problem, config, a, b, s), a, b, sizes)
        call = kernel_call_lines(exported, chip, KERNEL_CALLS[0 if chip == "tpu" else 1], direction)[0]
        operands = call.split(" : (")[-1]
        assert f"4x256x128{bits}" in operands, (direction, operands[:300])
        if direction == "fwd":
            assert "128x256xbf16>" in operands, operands[:300]
