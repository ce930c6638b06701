"""The `mosaic_gpu_quant` ragged_dot backend (quantized weights dequantized in registers into wgmma, swap-AB):
its kernel in Mosaic GPU's interpreter on this CPU against the float64 reference of the dequantized weights
(each weight format, an empty group, rows past the sum of group_sizes, an expert-parallel shard), its
placement of the groups' rows on whole token blocks, and its rules. The real sm_90 compiler is in
tests/test_real_compilers_mosaic_gpu_quant.py.

In the interpreter the dequantized weight tile reaches wgmma through a shared-memory ref (the interpreter's
wgmma reads refs only); compiled, it is the register operand. Interpreter calls cost 1-3 s each: few cases."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ragged_dot_base.helpers import assert_matches_reference, make_operands

import moe_tune
from moe_tune.core.quant import dequantize_host, quantize, relayout
from moe_tune.kernels.ragged_dot import RaggedDotProblem
from moe_tune.kernels.ragged_dot import mosaic_gpu_quant_kernel as qkernel
from moe_tune.kernels.ragged_dot.mosaic_gpu_quant import (
    MosaicGpuQuantConfig,
    MosaicGpuQuantRaggedDot,
    placement,
)
from moe_tune.targets import get_target
from moe_tune.targets.compile import acting_as

SMALL = MosaicGpuQuantConfig(block_m=16, block_n=64, block_k=128, max_concurrent_steps=2)
FORMATS = {"int8": ("int8", None), "fp8/128": ("float8_e4m3fn", 128), "int4/128": ("int4", 128),
           "mxfp4": ("mxfp4", 32)}


@pytest.fixture
def kernel_calls(monkeypatch):
    """The calls of the swap-AB kernel made through the op (so that a test fails if the op fell back)."""
    calls = []
    real = qkernel.swap_ab_gmm

    def counted(*args, **kwargs):
        calls.append(kwargs["scale_at"])
        return real(*args, **kwargs)

    monkeypatch.setattr(qkernel, "swap_ab_gmm", counted)
    return calls


def _weights(fmt: str, k: int, n: int, groups: int, layout: str = "kn"):
    dtype, block = FORMATS[fmt]
    _, rhs = make_operands(8, k, n, groups, "float32", 3)
    return relayout(quantize(rhs, dtype, axis=1, block_size=block), layout)


@pytest.mark.parametrize("fmt,layout", [("int8", "kn"), ("fp8/128", "nk"), ("int4/128", "kn"), ("mxfp4", "kn")])
def test_forward_in_the_interpreter(fmt, layout, kernel_calls):
    """Uneven groups with an empty one and rows past their sum (zero), k of two scale blocks (mxfp4: four
    32-blocks a 128-wide k step, its e2m1 codes decoded in registers), n of two output tiles: the public op
    on the backend matches the float64 reference of the dequantized weights."""
    sizes = [9, 0, 14, 8]  # 31 of 40 rows
    lhs, _ = make_operands(40, 256, 128, 4, "bfloat16", 1)
    q = _weights(fmt, 256, 128, 4, layout)
    out = moe_tune.ragged_dot(lhs, q, jnp.asarray(sizes, jnp.int32), backend="mosaic_gpu_quant", config=SMALL)
    assert_matches_reference(out, lhs, dequantize_host(q), sizes, offset=None, out_dtype="bfloat16", what=fmt)
    # quant_plan's placements: one scale per channel after the k loop, block scales on the weight tiles
    assert kernel_calls == [qkernel.SCALE_OUTPUT if fmt == "int8" else qkernel.SCALE_DEQUANTIZE]


def test_expert_parallel_shard_in_the_interpreter(kernel_calls):
    """group_offset: groups 3 and 4 of 5 are local; every other row, and the rows past the sum, are zero."""
    sizes = [6, 9, 0, 12, 10]
    lhs, _ = make_operands(40, 128, 64, 2, "bfloat16", 2)
    q = _weights("int8", 128, 64, 2)
    out = moe_tune.ragged_dot(lhs, q, jnp.asarray(sizes, jnp.int32), group_offset=jnp.int32(3),
                              backend="mosaic_gpu_quant", config=SMALL)
    assert_matches_reference(out, lhs, dequantize_host(q), sizes, offset=3, out_dtype="bfloat16")
    assert len(kernel_calls) == 1


@pytest.mark.parametrize("fmt", ["int8", "int4/128"])
def test_dlhs_in_the_interpreter(fmt, kernel_calls):
    """dx = dout @ W^T per group on the weights as stored: int8's per-channel scale folded into dout
    (quant_plan: FOLD, the kernel applies none), int4's 128-blocks along the output k dequantizing each
    weight tile's columns (DEQUANTIZE); an empty group and rows past the sum."""
    sizes = [10, 0, 17, 9]  # 36 of 40 rows
    dout, _ = make_operands(40, 128, 256, 4, "bfloat16", 4)  # dout [m, n=128]
    q = _weights(fmt, 256, 128, 4)  # W [g, k=256, n=128]
    impl = MosaicGpuQuantRaggedDot()
    dtype, block = FORMATS[fmt]
    problem = RaggedDotProblem(40, 256, 128, 4, "bfloat16", "float32", "bfloat16", direction="dlhs",
                               rhs_qdtype=dtype, rhs_qblock=block or 256)
    config = MosaicGpuQuantConfig(block_m=16, block_n=64, block_k=128, max_concurrent_steps=2)
    assert impl.config_error(config, problem) is None
    out = impl.run(problem, config, dout, q, jnp.asarray(sizes, jnp.int32))
    weights_t = np.swapaxes(dequantize_host(q), 1, 2)  # [g, n, k]: the reference's rhs of dx
    assert_matches_reference(out, dout, weights_t, sizes, offset=None, out_dtype="bfloat16", what=fmt)
    assert kernel_calls == [qkernel.SCALE_NONE if fmt == "int8" else qkernel.SCALE_DEQUANTIZE]


def test_grad_through_the_op_runs_both_directions_on_the_kernel(kernel_calls):
    """jax.grad of the public op with respect to the activations: the forward and dlhs both on this kernel
    (dlhs with its default config: int4/128's output tiles within a scale block), against float64."""
    sizes = [15, 0, 20]
    x, _ = make_operands(40, 256, 64, 3, "bfloat16", 5)
    q = _weights("int4/128", 256, 64, 3)
    loss = lambda x: moe_tune.ragged_dot(x, q, jnp.asarray(sizes, jnp.int32), backend="mosaic_gpu_quant",
                                         config=SMALL).astype(jnp.float32).sum()
    grad = np.asarray(jax.grad(loss)(x), np.float64)
    weights = dequantize_host(q)  # d loss / dx[row] = the row's group's weights summed over n
    rows = np.repeat(np.arange(3), sizes)
    expected = np.zeros((40, 256))
    expected[: len(rows)] = weights.sum(axis=2)[rows]
    assert np.abs(grad - expected).max() <= 0.01 * np.abs(expected).max()
    assert kernel_calls == [qkernel.SCALE_DEQUANTIZE, qkernel.SCALE_DEQUANTIZE]  # fwd, then dlhs


def test_placement_puts_each_group_on_whole_blocks():
    """Each group's rows start on a block boundary, in order, no column twice; the blocks' groups and the
    count of used blocks follow; rows no local group owns point past the end."""
    sizes, start, m, bm = jnp.asarray([3, 0, 17, 1], jnp.int32), jnp.int32(2), 30, 8
    p = placement(sizes, start, m, bm)
    column, valid = np.asarray(p.column), np.asarray(p.valid)
    assert p.tiles == 4 + 3 and int(p.used[0]) == 1 + 0 + 3 + 1
    assert valid.tolist() == [False] * 2 + [True] * 21 + [False] * 7
    assert column[2:5].tolist() == [0, 1, 2]  # group 0: block 0
    assert column[5:22].tolist() == list(range(8, 25))  # group 2: blocks 1-3
    assert column[22] == 32  # group 3: block 4
    assert np.all(column[~valid] == p.tiles * bm)
    assert np.asarray(p.tile_groups)[:5].tolist() == [0, 2, 2, 2, 3]


MODEL_SHAPES = {"m4096": (4096, 7168, 2048, 32), "m256": (256, 7168, 2048, 32)}


@pytest.mark.parametrize("fmt", FORMATS)
def test_default_and_space_are_valid_on_h100(fmt):
    """At the DeepSeek-sized shapes, on an H100: the default config passes the rules and fits shared memory,
    and the rules keep a real share of the search space."""
    impl = MosaicGpuQuantRaggedDot()
    dtype, block = FORMATS[fmt]
    with acting_as(get_target("h100")):
        for (m, k, n, g), direction in itertools.product(MODEL_SHAPES.values(), ("fwd", "dlhs")):
            if direction == "dlhs" and fmt == "mxfp4":
                continue  # 32-blocks along dlhs' output: refused (test_what_it_refuses_and_why)
            problem = RaggedDotProblem(m, k, n, g, "bfloat16", "float32", "bfloat16", rhs_qdtype=dtype,
                                       rhs_qblock=block or k, direction=direction)
            default = impl.default_config(problem)
            assert impl.config_error(default, problem) is None, (m, direction, default)
            assert len(impl.search_space(problem)) >= 8
    decode = RaggedDotProblem(256, 7168, 2048, 32, "bfloat16", "float32", "bfloat16", rhs_qdtype="int8",
                              rhs_qblock=7168)
    assert impl.default_config(decode).block_m == 16  # 8 rows a group: the narrowest token block


def test_what_it_refuses_and_why():
    impl = MosaicGpuQuantRaggedDot()
    quant = {"rhs_qdtype": "int8", "rhs_qblock": 256}
    fwd = RaggedDotProblem(64, 256, 128, 2, "bfloat16", "float32", "bfloat16", **quant)
    cases = {
        "float weights": RaggedDotProblem(64, 256, 128, 2, "bfloat16", "bfloat16", "bfloat16"),
        "weights": fwd.with_direction("drhs"),
        "writes the activations' dtype": RaggedDotProblem(64, 256, 128, 2, "bfloat16", "float32", "float32",
                                                          **quant),
        "float32 activations": RaggedDotProblem(64, 256, 128, 2, "float32", "float32", "float32", **quant),
        "tiles along k are multiples": RaggedDotProblem(64, 256, 128, 2, "bfloat16", "float32", "bfloat16",
                                                        rhs_qdtype="float4_e2m1fn", rhs_qblock=32, direction="dlhs"),
    }
    for words, problem in cases.items():
        assert words.split()[-1] in impl.chip_error(problem), (words, impl.chip_error(problem))
    mxfp4 = RaggedDotProblem(64, 256, 128, 2, "bfloat16", "float32", "bfloat16", rhs_qdtype="float4_e2m1fn",
                             rhs_qblock=32)
    assert impl.chip_error(mxfp4) is None  # several 32-blocks a k step (fwd)
    assert impl.chip_error(fwd) is None
    assert "not built" in impl.config_error(MosaicGpuQuantConfig(swap_ab=False), fwd)
    assert "multiple of 64" in impl.config_error(MosaicGpuQuantConfig(block_n=96), fwd)
    assert "without spilling" in impl.config_error(MosaicGpuQuantConfig(block_n=256, block_m=128, block_k=64), fwd)
    fp8 = RaggedDotProblem(64, 384, 128, 2, "bfloat16", "float32", "bfloat16", rhs_qdtype="float8_e4m3fn",
                           rhs_qblock=192)  # a k step of 128 holds neither whole blocks nor a part of one
    assert "divide the scale block" in impl.config_error(MosaicGpuQuantConfig(block_m=16, block_n=64), fp8)
    with acting_as(get_target("b200")):
        assert "sm_90" in impl.chip_error(fwd)
