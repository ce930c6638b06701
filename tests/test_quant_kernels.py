"""Quantized operands (`moe_tune.QArray`) in the ragged_dot kernels: what is not the same for every backend.

Every backend's quantized modes (int8 per channel, int8 / fp8 sub-channel blocks, w8a8), in every direction,
with expert-parallel shards, through the public op and lowered for its chip, are tests it inherits from
`ragged_dot_base.RaggedDotBackendTests` (tests/test_ragged_dot_kernels.py runs them for each
backend). Here: the layouts and key fields of quantized problems, vmap, each backend's config rules for
them, and the tiled kernel's own choices (dot dtypes, dequantized blocks, the fp8 convert).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# the shapes (an empty group, rows past sum(group_sizes)) and float32 tolerance of the quantized kernel tests
# (tests/test_quant_op.py imports these names from here)
from ragged_dot_base.quantized import QK as K  # noqa: F401
from ragged_dot_base.quantized import QM as M
from ragged_dot_base.quantized import QN as N
from ragged_dot_base.quantized import QSIZES as SIZES
from ragged_dot_base.quantized import QuantMode, make_quant_case
from ragged_dot_base.quantized import assert_quant_close as assert_close
from ragged_dot_base.quantized import direction_reference as reference

from moe_tune.core.errors import UsageError
from moe_tune.core.quant import QArray, quantize
from moe_tune.kernels.base import KernelConfig
from moe_tune.kernels.pallas_util import e4m3fn_to_float32
from moe_tune.kernels.ragged_dot import BACKENDS, RaggedDotProblem
from moe_tune.kernels.ragged_dot.megablox import MegabloxConfig, vmem_bytes
from moe_tune.kernels.ragged_dot.tiled import TiledConfig
from moe_tune.kernels.ragged_dot.triton import TritonConfig

WEIGHT_SUB_CHANNEL = QuantMode("fwd", None, 8)  # float activations, rhs scale blocks of 8 along k


def make_case(mode: QuantMode, qdtype: str = "int8"):
    """(problem, a, b) of `mode` with both quantized operands stored as `qdtype`."""
    return make_quant_case(QuantMode(mode.direction, mode.lhs_block, mode.rhs_block, qdtype))


def run_tiled(problem: RaggedDotProblem, config: KernelConfig, a, b, sizes=SIZES) -> jax.Array:
    """One direction through the tiled backend's kernel, jitted."""
    impl = BACKENDS.get("tiled")
    assert impl.config_error(config, problem) is None, config
    return jax.jit(lambda a, b, s: impl.run(problem, config, a, b, s))(a, b, jnp.asarray(sizes, jnp.int32))


def test_vmap_over_batches_with_their_own_quantized_weights():
    """vmap over a batch of independent calls (e.g. microbatches or layers), each with its own lhs, group
    sizes and QArray weights: the QArray pytree is batched like any array."""
    problem, lhs, rhs = make_case(WEIGHT_SUB_CHANNEL)
    impl = BACKENDS.get("tiled")
    config = impl.default_config(problem)
    batch_sizes = jnp.asarray([SIZES, [40, 0, 0, 0], [0, 10, 10, 10]], jnp.int32)
    lhs_b = jnp.stack([lhs, -lhs, 2 * lhs])
    rhs_b = jax.tree.map(lambda x: jnp.stack([x, x[::-1], x]), rhs)  # group order reversed in the second
    out = jax.jit(jax.vmap(lambda x, w, s: impl.run(problem, config, x, w, s)))(lhs_b, rhs_b, batch_sizes)
    for i in range(3):
        rhs_i = jax.tree.map(lambda x: x[i], rhs_b)
        assert_close(out[i], reference(problem, lhs_b[i], rhs_i, batch_sizes[i]), f"batch {i}")


def test_bad_layouts_are_one_line_usage_errors():
    # only shapes matter: NumPy arrays, nothing to compile
    lhs, sizes = np.ones((M, K), np.float32), np.asarray(SIZES, np.int32)
    rhs = np.ones((4, K, N), np.float32)
    q = lambda shape, scale_shape: QArray(np.ones(shape, np.int8), np.ones(scale_shape, np.float32))
    bad_rhs = [q((4, K, N), (4, K, 1)),  # scaled along n
               q((4, K, N), (1, K, N)),  # along the groups
               q((4, K, N), (4, 5, N)),  # 5 scales do not divide k = 32
               q((4, K, N), (4, 1, 1))]  # along two axes
    for rhs_q in bad_rhs:
        with pytest.raises(UsageError, match=r"rhs QArray must be \[g, k, n\] scaled along axis 1") as err:
            RaggedDotProblem.from_arrays(lhs, rhs_q, sizes)
        assert "\n" not in str(err.value)
    with pytest.raises(UsageError, match=r"lhs QArray must be \[m, k\] scaled along axis 1"):
        RaggedDotProblem.from_arrays(q((M, K), (1, K)), rhs, sizes)
    with pytest.raises(UsageError, match="does not divide"):
        quantize(rhs, "int8", axis=1, block_size=5)
    with pytest.raises(UsageError, match="rhs_qblock"):
        RaggedDotProblem(m=M, k=K, n=N, groups=4, rhs_qdtype="int8", rhs_qblock=5)
    with pytest.raises(UsageError, match="rhs_qdtype"):
        RaggedDotProblem(m=M, k=K, n=N, groups=4, rhs_qdtype="int16")


def test_quantization_enters_the_key_only_for_quantized_operands():
    plain = RaggedDotProblem(m=M, k=K, n=N, groups=4, lhs_dtype="bfloat16", rhs_dtype="bfloat16",
                             out_dtype="bfloat16")
    assert list(plain.key_fields()) == ["direction", "m", "k", "n", "groups", "lhs_dtype", "rhs_dtype", "out_dtype"]
    lhs = jnp.ones((M, K), jnp.bfloat16)
    rhs_q = quantize(jnp.ones((4, K, N)), "int8", axis=1, block_size=8)
    problem = RaggedDotProblem.from_arrays(lhs, rhs_q, jnp.asarray(SIZES, jnp.int32))
    assert problem.key_fields() == {**plain.key_fields(), "rhs_dtype": "float32", "rhs_qdtype": "int8",
                                    "rhs_qblock": 8}
    assert problem.out_dtype == "bfloat16"  # the float operand's dtype
    assert RaggedDotProblem.from_key_fields(problem.key_fields()) == problem
    both = RaggedDotProblem.from_arrays(quantize(lhs, "float8_e4m3fn", axis=1), rhs_q, jnp.asarray(SIZES, jnp.int32))
    assert (both.lhs_qdtype, both.lhs_qblock, both.out_dtype) == ("float8_e4m3fn", K, "float32")
    assert both.with_direction("drhs").key_fields()["lhs_qblock"] == K
    # the memory roof counts 1-byte values and their float32 scales
    assert problem.min_bytes == M * K * 2 + 4 * K * N * (1 + 4 / 8) + M * N * 2


def test_config_rules_for_quantized_problems():
    problem, _, _ = make_case(WEIGHT_SUB_CHANNEL)  # rhs scale blocks of 8 along k=32
    tiled, megablox = BACKENDS.get("tiled"), BACKENDS.get("megablox")
    assert "scale block 8" in tiled.config_error(TiledConfig(tm=8, tk=12, tn=N, tail=8), problem)
    assert tiled.config_error(TiledConfig(tm=8, tk=16, tn=N, tail=8), problem) is None
    assert tiled.config_error(TiledConfig(tm=8, tk=4, tn=N, tail=8), problem) is None
    for impl in (tiled, megablox, BACKENDS.get("triton")):
        space = impl.search_space(problem)
        assert space and all(impl.config_error(c, problem) is None for c in space), impl.name
    triton = BACKENDS.get("triton")
    w8a8 = RaggedDotProblem(m=M, k=K, n=N, groups=4, lhs_qdtype="int8", rhs_qdtype="int8", rhs_qblock=16)
    assert "int8 x int8 dots need a k of at least 32" in triton.config_error(TritonConfig(block_k=16, block_n=32), w8a8)
    assert triton.config_error(TritonConfig(block_k=32, block_n=32), w8a8) is None  # steps dequantized: f32 dots
    short_k = RaggedDotProblem(m=M, k=16, n=N, groups=4, lhs_qdtype="int8", rhs_qdtype="int8")
    assert triton.default_config(short_k).block_k == 32  # past k=16 (padded), as int8 dots need
    ragged_k = RaggedDotProblem(m=256, k=384, n=128, groups=4, rhs_qdtype="int8", rhs_qblock=128)
    assert "must divide" in megablox.config_error(MegabloxConfig(8, 256, 128), ragged_k)
    w8a8 = RaggedDotProblem(m=256, k=512, n=256, groups=4, lhs_qdtype="int8", rhs_qdtype="int8", rhs_qblock=128)
    assert "multiple of 32" in megablox.config_error(MegabloxConfig(16, 256, 256), w8a8)  # int8 packs 32 rows
    assert megablox.config_error(MegabloxConfig(32, 256, 256), w8a8) is None
    # 1-byte blocks take less VMEM than bfloat16 ones
    bf16 = RaggedDotProblem(m=256, k=512, n=256, groups=4, lhs_dtype="bfloat16", rhs_dtype="bfloat16")
    config = MegabloxConfig(128, 512, 256)
    assert vmem_bytes(config, w8a8) < vmem_bytes(config, bf16)


def test_tiled_tries_small_tails_in_small_groups():
    """Decode (no more rows a group than the smallest tail of TAIL_SIZES): the search space adds tails of 4
    and 8 rows, for quantized and float weights, and each of those configs is valid; bigger groups keep
    TAIL_SIZES."""
    tiled = BACKENDS.get("tiled")
    for decode in (RaggedDotProblem(m=256, k=64, n=32, groups=64, rhs_qdtype="int8"),
                   RaggedDotProblem(m=256, k=64, n=32, groups=64)):
        assert tiled.candidate_values(decode)["tail"] == [4, 8, 16, 32, 64]
        assert {4, 8} <= {c.tail for c in tiled.search_space(decode)}
        assert all(tiled.config_error(c, decode) is None for c in tiled.search_space(decode))
    for problem in (RaggedDotProblem(m=256, k=64, n=32, groups=8),  # 32 rows a group
                    RaggedDotProblem(m=256, k=64, n=32, groups=8, rhs_qdtype="int8")):
        assert tiled.candidate_values(problem)["tail"] == [16, 32, 64]


def test_tiled_default_tail_fits_small_groups():
    """The default tail is about an average group's size when groups hold a few rows (4 rows: tail 4, 5-8
    rows: tail 8), so that a sweep starts where the decode time was measured to be (FINDINGS.md: small
    tails at decode); bigger groups
    keep the 1/8-of-tm rule (at least 16)."""
    tiled = BACKENDS.get("tiled")
    tail = lambda groups, m=256: tiled.default_config(RaggedDotProblem(m=m, k=64, n=32, groups=groups)).tail
    assert [tail(64), tail(40), tail(32), tail(16), tail(8), tail(2, m=4096)] == [4, 8, 8, 16, 16, 64]


@pytest.mark.parametrize("tail, dot_dtype", [(4, "f32"), (8, "bf16")])
def test_tiled_bfloat16_activations_dot_in_float32_when_tails_hold_at_most_4_rows(tail, dot_dtype):
    """int8 weights with bf16 activations (w8a16 at decode): a kernel whose tail tiles hold at most 4 rows
    converts each group's weights to f32 only, for f32 dots (a bf16 dot of a few rows costs more than an f32
    one on XLA CPU; FINDINGS.md: small tails at decode); bigger tails keep bf16 dots. Both match the reference to
    bf16's rounding."""
    rng = np.random.default_rng(5)
    lhs = jnp.asarray(rng.standard_normal((M, K), np.float32)).astype(jnp.bfloat16)
    rhs = quantize(jnp.asarray(rng.standard_normal((4, K, N), np.float32)), "int8", axis=1)
    problem = RaggedDotProblem.from_arrays(lhs, rhs, jnp.asarray(SIZES, jnp.int32))
    config = TiledConfig(tm=16, tail=tail, tk=K, tn=N)
    out = run_tiled(problem, config, lhs, rhs)
    ref = reference(problem, lhs, rhs, SIZES)
    assert out.dtype == jnp.bfloat16
    assert np.abs(np.asarray(out, np.float64) - ref).max() <= 2 ** -8 * np.abs(ref).max()
    impl = BACKENDS.get("tiled")
    hlo = jax.jit(lambda a, b, s: impl.run(problem, config, a, b, s)).lower(
        lhs, rhs, jnp.asarray(SIZES, jnp.int32)).compile().as_text()
    weight_blocks = {d: f"{d}[{K},{N}]" in hlo for d in ("f32", "bf16")}  # a group's converted weights
    assert weight_blocks == {"f32": dot_dtype == "f32", "bf16": dot_dtype == "bf16"}


@pytest.mark.parametrize("qdtype", ["int8", "float8_e4m3fn"])
def test_tiled_dequantizes_sub_channel_weights_before_full_k_dots(qdtype):
    """Float activations with sub-channel weights (fwd): `dequantize` converts a group's weight block to f32
    with its scales once ([K, N] in the HLO, then dots over all of k) instead of a dot per scale block
    ([rows, 8] x [8, N] dots, scaled after). The sweep tries both, the default dequantizes; a problem it
    does not apply to (per-channel weights, quantized activations) rejects it in one line."""
    impl = BACKENDS.get("tiled")
    problem, lhs, rhs = make_case(WEIGHT_SUB_CHANNEL, qdtype)
    assert impl.candidate_values(problem)["dequantize"] == [True, False] and impl.default_config(problem).dequantize
    ref = reference(problem, lhs, rhs, SIZES)
    hlo = {}
    for dequantize in (True, False):
        config = TiledConfig(tm=16, tail=8, tk=K, tn=N, dequantize=dequantize)
        assert_close(run_tiled(problem, config, lhs, rhs), ref, f"dequantize={dequantize}")
        hlo[dequantize] = jax.jit(lambda a, b, s, c=config: impl.run(problem, c, a, b, s)).lower(
            lhs, rhs, jnp.asarray(SIZES, jnp.int32)).compile().as_text()
    assert f"f32[{K},{N}]" in hlo[True] and f"f32[{K},{N}]" not in hlo[False]
    # tk=12 neither divides the scale block of 8 nor is a multiple of it: valid only for dequantized blocks,
    # whose chunks (k 0-12, 12-24, 24-32) span scale blocks and take their scales from the middle of one
    chunked = TiledConfig(tm=16, tail=8, tk=12, tn=N, dequantize=True)
    assert impl.config_error(chunked, problem) is None
    assert_close(run_tiled(problem, chunked, lhs, rhs), ref, "dequantize, tk=12")
    assert "multiple of the scale block" in impl.config_error(TiledConfig(tk=12), problem)
    for mode in (QuantMode("fwd", None, "k"), QuantMode("fwd", "k", 8), QuantMode("dlhs", None, 8)):
        other, *_ = make_case(mode)
        assert "dequantize" not in impl.candidate_values(other) and not impl.default_config(other).dequantize
        assert "dequantize applies only to fwd" in impl.config_error(TiledConfig(dequantize=True), other)


@pytest.mark.parametrize("tail, dot_dtype", [(4, "f32"), (8, "bf16")])
def test_tiled_dequantizes_to_the_dtype_of_its_dots(tail, dot_dtype):
    """bf16 activations with sub-channel fp8 weights: the dequantized weights take the dtype of the kernel's
    dots (bf16, or f32 in a kernel whose tails hold at most 4 rows), so bf16 dots keep bf16's speed. Rounding
    the dequantized weights to bf16 costs an error at bf16's level, inside the bf16 tolerance."""
    impl = BACKENDS.get("tiled")
    rng = np.random.default_rng(6)
    lhs = jnp.asarray(rng.standard_normal((M, K), np.float32)).astype(jnp.bfloat16)
    rhs = quantize(jnp.asarray(rng.standard_normal((4, K, N), np.float32)), "float8_e4m3fn", axis=1, block_size=8)
    problem = RaggedDotProblem.from_arrays(lhs, rhs, jnp.asarray(SIZES, jnp.int32))
    config = TiledConfig(tm=16, tail=tail, tk=K, tn=N, dequantize=True)
    out = run_tiled(problem, config, lhs, rhs)
    ref = reference(problem, lhs, rhs, SIZES)
    assert out.dtype == jnp.bfloat16
    assert np.abs(np.asarray(out, np.float64) - ref).max() <= 2 ** -6 * np.abs(ref).max()
    hlo = jax.jit(lambda a, b, s: impl.run(problem, config, a, b, s)).lower(
        lhs, rhs, jnp.asarray(SIZES, jnp.int32)).compile().as_text()
    # the group's dequantized block, hoisted: bf16 where the dots run in bf16 (its f32 product with the scales
    # is an intermediate of the same fusion), f32 only otherwise
    assert (f"bf16[{K},{N}]" in hlo) == (dot_dtype == "bf16") and f"f32[{K},{N}]" in hlo


def test_e4m3fn_to_float32_is_exact_for_every_bit_pattern():
    """The bit-built fp8 convert that the CPU kernels load fp8 blocks with agrees with JAX's own convert on
    all 256 values: normals, subnormals, both zeros and NaN."""
    every = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn)
    got = np.asarray(jax.jit(e4m3fn_to_float32)(jnp.asarray(every)))
    expected = every.astype(np.float32)
    numbers = ~np.isnan(expected)  # a NaN's sign bit carries nothing
    assert np.array_equal(got, expected, equal_nan=True)
    assert np.array_equal(np.signbit(got[numbers]), np.signbit(expected[numbers]))
