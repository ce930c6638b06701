"""Quantized operands (`moe_tune.QArray`) in every ragged_dot backend's kernels, against a float64 reference
of the dequantized operands.

Each direction takes its quantized operand as the op will pass it: fwd = gmm(lhs, rhs_q) (weight-only, or
lhs_q x rhs_q), dlhs = gmm(dout, rhs_q, transpose_rhs=True), drhs = tgmm(lhs_q, dout). The integer (or
float8) products are exact and accumulation is float32, so the tolerance is float32's. Pallas kernels run in
interpret mode here, so shapes are tiny; their lowering for TPU / GPU is checked with `jax.export`.
"""

from __future__ import annotations

import dataclasses

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_tune.errors import UsageError
from moe_tune.kernels.loop_dtypes import e4m3fn_to_float32
from moe_tune.kernels.ragged_dot import BACKENDS, RaggedDotProblem
from moe_tune.kernels.ragged_dot.megablox import MegabloxConfig, vmem_bytes
from moe_tune.kernels.ragged_dot.reference import (
    ragged_dot_dlhs_reference,
    ragged_dot_drhs_reference,
    ragged_dot_reference,
)
from moe_tune.kernels.ragged_dot.tiled import TiledConfig
from moe_tune.kernels.ragged_dot.triton import TritonConfig
from moe_tune.quant import QArray, dequantize, quantize

M, K, N = 40, 32, 24
SIZES = [9, 0, 23, 3]  # an empty group; rows 35..39 are past sum(group_sizes)
TOLERANCE = 2e-6  # relative to max|reference|: float32 accumulation of exact products

# (direction, lhs block, rhs block): None = float operand, "k" = one scale per row / channel, an int =
# sub-channel block along k.
MODES = {
    "fwd_weight_per_channel": ("fwd", None, "k"),
    "fwd_weight_sub_channel": ("fwd", None, 8),
    "fwd_w8a8_rows_x_sub_channel": ("fwd", "k", 8),
    "fwd_w8a8_sub_channel": ("fwd", 8, 16),
    "dlhs_weight_per_channel": ("dlhs", None, "k"),
    "dlhs_weight_sub_channel": ("dlhs", None, 8),
    "drhs_lhs_per_row": ("drhs", "k", None),
    "drhs_lhs_sub_channel": ("drhs", 8, None),
}


def _quantized(x: np.ndarray, block, qdtype: str):
    if block is None:
        return jnp.asarray(x)
    return quantize(jnp.asarray(x), qdtype, axis=1, block_size=None if block == "k" else block)


def _as_f64(x) -> np.ndarray:
    return np.asarray(dequantize(x) if isinstance(x, QArray) else x, np.float64)


def make_case(mode: str, qdtype: str, *, sizes=SIZES, groups=None, seed=0):
    """(problem, a, b): the direction's two operands, quantized as `mode` says, and its problem."""
    direction, lhs_block, rhs_block = MODES[mode]
    groups = len(sizes) if groups is None else groups
    rng = np.random.default_rng(seed)
    lhs = _quantized(rng.standard_normal((M, K), np.float32), lhs_block, qdtype)
    rhs = _quantized(rng.standard_normal((groups, K, N), np.float32) / np.sqrt(K), rhs_block, qdtype)
    dout = jnp.asarray(rng.standard_normal((M, N), np.float32))
    sizes = jnp.asarray(sizes, jnp.int32)
    offset = None if groups == sizes.shape[0] else jnp.int32(0)
    problem = RaggedDotProblem.from_arrays(lhs, rhs, sizes, group_offset=offset, direction=direction)
    a, b = {"fwd": (lhs, rhs), "dlhs": (dout, rhs), "drhs": (lhs, dout)}[direction]
    return problem, a, b


def reference(problem: RaggedDotProblem, a, b, sizes, offset: int = 0) -> np.ndarray:
    a, b, sizes = _as_f64(a), _as_f64(b), np.asarray(sizes)
    if problem.direction == "dlhs":
        return ragged_dot_dlhs_reference(a, b, sizes, group_offset=offset)
    if problem.direction == "drhs":
        return ragged_dot_drhs_reference(a, b, sizes, groups=problem.groups, group_offset=offset)
    return ragged_dot_reference(a, b, sizes, group_offset=offset)


def assert_close(got, ref, what=""):
    got = np.asarray(got, np.float64)
    assert got.shape == ref.shape, what
    scale = max(np.abs(ref).max(), 1e-30)
    err = np.abs(got - ref).max() / scale
    assert err <= TOLERANCE, f"max error {err:.3g} x max|ref| {what}"


def run(backend: str, problem, a, b, sizes, offset=None, config=None, jit=True):
    impl = BACKENDS.get(backend)
    config = impl.default_config(problem) if config is None else config
    assert impl.config_error(config, problem) is None, config
    f = lambda a, b, s, o: impl.run(problem, config, a, b, s, o)
    return (jax.jit(f) if jit else f)(a, b, jnp.asarray(sizes, jnp.int32), offset)


def kernel_configs(backend: str, problem: RaggedDotProblem) -> list:
    """Pallas backends: the search space's config with the smallest row tile (several tiles and visits at
    these tiny shapes); triton also blocks of 16, so that a 16-wide scale block covers a whole k step (the
    raw-dot path) while an 8-wide one does not (the in-kernel dequantization). Others: the default; tiled drhs
    also its other schedule (`batched`), whose windows slice the lhs scales instead of gathering them, and
    tiled fwd every `dequantize` value it searches (a dot per scale block, or dequantized weights)."""
    impl = BACKENDS.get(backend)
    if backend == "tiled" and problem.direction == "drhs":
        default = impl.default_config(problem)
        return [default, dataclasses.replace(default, batched=not default.batched)]
    if backend == "tiled":
        default = impl.default_config(problem)
        values = impl.candidate_values(problem).get("dequantize", [default.dequantize])
        return [dataclasses.replace(default, dequantize=v) for v in values]
    if backend == "xla":
        return [impl.default_config(problem)]
    space = impl.search_space(problem)
    smallest = min(space, key=lambda c: (getattr(c, "tm", 0) or getattr(c, "block_m", 0)))
    if backend == "triton" and problem.direction == "fwd" and problem.lhs_qblock == 8:
        return [smallest, TritonConfig(block_m=16, block_k=16, block_n=16)]
    return [smallest]


# float8_e4m3fn for weight-only sub-channel (a float lhs meets fp8 weights) and for per-row x sub-channel
# (fp8 x fp8, which meets in bfloat16); int8 elsewhere (int8 x int8 accumulates in int32). The conversions
# are the same code for every mode, so each dtype path runs once per backend.
QDTYPE = {mode: "float8_e4m3fn" if mode in ("fwd_weight_sub_channel", "fwd_w8a8_rows_x_sub_channel") else "int8"
          for mode in MODES}
# xla only dequantizes (the reference path): one mode per direction.
XLA_MODES = ("fwd_w8a8_sub_channel", "dlhs_weight_per_channel", "drhs_lhs_sub_channel")
CASES = [(b, mode) for b in ("xla", "tiled", "megablox", "triton") for mode in MODES if b != "xla" or mode in XLA_MODES]


@pytest.mark.parametrize("backend, mode", CASES, ids=[f"{b}-{m}" for b, m in CASES])
def test_quantized_kernels_match_the_dequantized_reference(backend, mode):
    qdtype = QDTYPE[mode]
    problem, a, b = make_case(mode, qdtype)
    ref = reference(problem, a, b, SIZES)
    for config in kernel_configs(backend, problem):
        out = run(backend, problem, a, b, SIZES, config=config)
        what = f"[{backend} {mode} {qdtype} {config}]"
        assert out.dtype == jnp.float32, what
        assert_close(out, ref, what)
        if problem.direction == "drhs":
            assert not np.any(np.asarray(out[1])), f"the empty group's result is not zero {what}"
        else:
            assert not np.any(np.asarray(out[sum(SIZES):])), f"rows past sum(group_sizes) are not zero {what}"


@pytest.mark.parametrize("backend", ["tiled", "megablox", "triton"])  # xla: the dequantized reference path
def test_expert_parallel_shard_with_weights_sliced_by_group(backend):
    """group_offset: the shard's groups [1, 4) of 5; the QArray weights are the full ones sliced by group.
    dlhs folds the per-channel scale into dout by each row's (local) group, so the offset must reach it.
    The Pallas backends (slow in interpret mode) run the two directions with code of their own for shards."""
    sizes = [6, 9, 0, 14, 8]
    rng = np.random.default_rng(3)
    lhs = jnp.asarray(rng.standard_normal((M, K), np.float32))
    dout = jnp.asarray(rng.standard_normal((M, N), np.float32))
    full = quantize(jnp.asarray(rng.standard_normal((5, K, N), np.float32)), "int8", axis=1)
    shard = full[1:4]
    lhs_q = quantize(lhs, "int8", axis=1, block_size=8)
    offset = jnp.int32(1)
    directions = (("fwd", lhs, shard), ("dlhs", dout, shard), ("drhs", lhs_q, dout))
    for direction, a, b in directions[1:] if backend in ("megablox", "triton") else directions:
        problem = RaggedDotProblem.from_arrays(lhs_q if direction == "drhs" else lhs, shard,
                                               jnp.asarray(sizes, jnp.int32), group_offset=offset,
                                               direction=direction)
        out = run(backend, problem, a, b, sizes, offset=offset)
        ref = reference(problem, a, b, sizes, offset=1)
        assert_close(out, ref, f"[{backend} {direction}]")
        if direction != "drhs":  # rows of other shards' groups are zero
            assert not np.any(np.asarray(out[:6])) and not np.any(np.asarray(out[6 + 9 + 14:]))


def test_vmap_over_batches_with_their_own_quantized_weights():
    """vmap over a batch of independent calls (e.g. microbatches or layers), each with its own lhs, group
    sizes and QArray weights: the QArray pytree is batched like any array."""
    problem, lhs, rhs = make_case("fwd_weight_sub_channel", "int8")
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
        RaggedDotProblem(m=M, k=K, n=N, groups=4, rhs_qdtype="int4")


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
    problem, _, _ = make_case("fwd_weight_sub_channel", "int8")  # rhs scale blocks of 8 along k=32
    tiled, megablox = BACKENDS.get("tiled"), BACKENDS.get("megablox")
    assert "scale block 8" in tiled.config_error(TiledConfig(tm=8, tk=12, tn=N, tail=8), problem)
    assert tiled.config_error(TiledConfig(tm=8, tk=16, tn=N, tail=8), problem) is None
    assert tiled.config_error(TiledConfig(tm=8, tk=4, tn=N, tail=8), problem) is None
    for impl in (tiled, megablox, BACKENDS.get("triton")):
        space = impl.search_space(problem)
        assert space and all(impl.config_error(c, problem) is None for c in space), impl.name
    triton = BACKENDS.get("triton")
    w8a8 = RaggedDotProblem(m=M, k=K, n=N, groups=4, lhs_qdtype="int8", rhs_qdtype="int8", rhs_qblock=16)
    assert "block_k >= 32" in triton.config_error(TritonConfig(block_k=16, block_n=32), w8a8)  # int8 x int8 dots
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
    rows: tail 8), so that a sweep starts where NOTES 14.1 measured the decode time to be; bigger groups
    keep the 1/8-of-tm rule (at least 16)."""
    tiled = BACKENDS.get("tiled")
    tail = lambda groups, m=256: tiled.default_config(RaggedDotProblem(m=m, k=64, n=32, groups=groups)).tail
    assert [tail(64), tail(40), tail(32), tail(16), tail(8), tail(2, m=4096)] == [4, 8, 8, 16, 16, 64]


@pytest.mark.parametrize("tail, dot_dtype", [(4, "f32"), (8, "bf16")])
def test_tiled_bfloat16_activations_dot_in_float32_when_tails_hold_at_most_4_rows(tail, dot_dtype):
    """int8 weights with bf16 activations (w8a16 at decode): a kernel whose tail tiles hold at most 4 rows
    converts each group's weights to f32 only, for f32 dots (a bf16 dot of a few rows costs more than an f32
    one on XLA CPU: NOTES 14.4); bigger tails keep bf16 dots. Both match the reference to bf16's rounding."""
    rng = np.random.default_rng(5)
    lhs = jnp.asarray(rng.standard_normal((M, K), np.float32)).astype(jnp.bfloat16)
    rhs = quantize(jnp.asarray(rng.standard_normal((4, K, N), np.float32)), "int8", axis=1)
    problem = RaggedDotProblem.from_arrays(lhs, rhs, jnp.asarray(SIZES, jnp.int32))
    config = TiledConfig(tm=16, tail=tail, tk=K, tn=N)
    out = run("tiled", problem, lhs, rhs, SIZES, config=config)
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
    problem, lhs, rhs = make_case("fwd_weight_sub_channel", qdtype)
    assert impl.candidate_values(problem)["dequantize"] == [True, False] and impl.default_config(problem).dequantize
    ref = reference(problem, lhs, rhs, SIZES)
    hlo = {}
    for dequantize in (True, False):
        config = TiledConfig(tm=16, tail=8, tk=K, tn=N, dequantize=dequantize)
        assert_close(run("tiled", problem, lhs, rhs, SIZES, config=config), ref, f"dequantize={dequantize}")
        hlo[dequantize] = jax.jit(lambda a, b, s, c=config: impl.run(problem, c, a, b, s)).lower(
            lhs, rhs, jnp.asarray(SIZES, jnp.int32)).compile().as_text()
    assert f"f32[{K},{N}]" in hlo[True] and f"f32[{K},{N}]" not in hlo[False]
    # tk=12 neither divides the scale block of 8 nor is a multiple of it: valid only for dequantized blocks,
    # whose chunks (k 0-12, 12-24, 24-32) span scale blocks and take their scales from the middle of one
    chunked = TiledConfig(tm=16, tail=8, tk=12, tn=N, dequantize=True)
    assert impl.config_error(chunked, problem) is None
    assert_close(run("tiled", problem, lhs, rhs, SIZES, config=chunked), ref, "dequantize, tk=12")
    assert "multiple of the scale block" in impl.config_error(TiledConfig(tk=12), problem)
    for mode in ("fwd_weight_per_channel", "fwd_w8a8_rows_x_sub_channel", "dlhs_weight_sub_channel"):
        other, *_ = make_case(mode, "int8")
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
    out = run("tiled", problem, lhs, rhs, SIZES, config=config)
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


@pytest.mark.parametrize("direction", ["fwd", "dlhs", "drhs"])
def test_defaults_are_valid_for_model_sized_quantized_problems(direction):
    """Every backend's default config is valid for DeepSeek-sized experts (k = 7168) with weights in
    sub-channel blocks of 128, weight-only and w8a8 (per-row activations)."""
    base = dict(m=4096, k=7168, n=2048, groups=32, lhs_dtype="bfloat16", out_dtype="bfloat16", rhs_qdtype="int8",
                rhs_qblock=128, direction=direction)
    for problem in (RaggedDotProblem(**base), RaggedDotProblem(**{**base, "lhs_qdtype": "float8_e4m3fn"})):
        for backend in BACKENDS.names():
            impl = BACKENDS.get(backend)
            assert impl.config_error(impl.default_config(problem), problem) is None, (backend, problem)


# ---- lowering for the chips (on this CPU machine): the 1-byte weights must be operands of the kernel


def _export(backend: str, platform: str, problem, a, b, sizes):
    impl = BACKENDS.get(backend)
    kwargs = {}
    if platform == "cuda":
        kwargs["disabled_checks"] = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    with mock.patch("moe_tune.devices.platform", lambda: "tpu" if platform == "tpu" else "gpu"):
        config = impl.default_config(problem)
        f = jax.jit(lambda a, b, s: impl.run(problem, config, a, b, s))
        return jax.export.export(f, platforms=[platform], **kwargs)(a, b, sizes).mlir_module()


def _lowering_cases():
    m, k, n, g = 256, 512, 256, 4
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    d = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    w = rng.standard_normal((g, k, n)).astype(np.float32)
    sizes = jnp.asarray([64, 0, 100, 92], jnp.int32)
    w_sub, w_chan = quantize(w, "int8", axis=1, block_size=128), quantize(w, "float8_e4m3fn", axis=1)
    x_row, x_sub = quantize(x, "int8", axis=1), quantize(x, "int8", axis=1, block_size=128)
    x_fp8, w_fp8 = quantize(x, "float8_e4m3fn", axis=1, block_size=128), quantize(w, "float8_e4m3fn", axis=1,
                                                                                   block_size=256)
    cases = {"fwd_weight_sub_channel": ("fwd", x, w_sub), "fwd_w8a8": ("fwd", x_row, w_sub),
             "fwd_w8a8_fp8_sub_channel": ("fwd", x_fp8, w_fp8),
             "dlhs_weight_per_channel_fp8": ("dlhs", d, w_chan), "dlhs_weight_sub_channel": ("dlhs", d, w_sub),
             "drhs_lhs_sub_channel": ("drhs", x_sub, d)}
    for name, (direction, a, b) in cases.items():
        lhs, rhs = (a, b) if direction == "fwd" else (x, b) if direction == "dlhs" else (a, w)
        problem = RaggedDotProblem.from_arrays(lhs, rhs, sizes, direction=direction)
        yield name, problem, a, b, sizes


@pytest.mark.parametrize("backend, platform, call", [("megablox", "tpu", "@tpu_custom_call"),
                                                     ("triton", "cuda", "__gpu$xla.gpu.triton")])
def test_quantized_kernels_lower_with_1_byte_operands(backend, platform, call):
    for name, problem, a, b, sizes in _lowering_cases():
        text = _export(backend, platform, problem, a, b, sizes)
        calls = [line for line in text.splitlines() if call in line]
        assert calls, f"{backend} {name}: no kernel call"
        quantized = a if isinstance(a, QArray) else b
        byte_type = "xi8>" if quantized.dtype == jnp.int8 else "xf8E4M3FN>"
        # megablox's tgmm reads lhs transposed, [k, m] (as JAX's Megablox does), still 1-byte
        shapes = {"x".join(map(str, quantized.shape)), "x".join(map(str, quantized.shape[::-1]))}
        assert any(f"{shape}{byte_type}" in line.split(" : (")[-1] for line in calls for shape in shapes), \
            f"{backend} {name}: the {quantized.shape} 1-byte operand is not an operand of the kernel"
