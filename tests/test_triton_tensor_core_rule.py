"""The triton ragged_dot's rule against k steps that lose the tensor cores (a step longer than a scale block
is dequantized to float32 and its dot runs in scalar FMAs; evidence in the rule's comment, from the PTX of
benchmarks/gpu_quant_proxy.py): on a GPU the search space keeps block_k within the scale block, in interpret
mode on the CPU every config stays."""

from __future__ import annotations

import pytest

from moe_tune.core import devices
from moe_tune.kernels import get_op

SHAPE = dict(m=4096, k=7168, n=2048, groups=32, dtype="bfloat16")
H100 = devices.Device("gpu", "nvidia_h100_80gb_hbm3")


def _problem(**quant):
    return get_op("ragged_dot").problem(**SHAPE, **quant)


@pytest.mark.parametrize("quant", [dict(rhs_quant="mxfp4"), dict(rhs_quant="int4", quant_block=32),
                                   dict(rhs_quant="float8_e4m3fn", quant_block=32)])
def test_a_gpu_refuses_steps_past_a_scale_block_of_32(quant):
    backend = get_op("ragged_dot").backends.get("triton")
    problem = _problem(**quant)
    config = backend.default_config(problem)
    longer = backend.config_cls(block_m=64, block_k=64, block_n=64, num_warps=4, num_stages=2)
    with devices.judging(H100):
        assert backend.config_error(config, problem) is None and config.block_k == 32
        assert "loses the tensor cores" in backend.config_error(longer, problem)
        assert {c.block_k for c in backend.search_space(problem)} == {32}
    with devices.judging(devices.Device("cpu", "cpu")):
        assert backend.config_error(longer, problem) is None


@pytest.mark.parametrize("quant", [{}, dict(rhs_quant="int8"), dict(rhs_quant="int4", quant_block=128),
                                   dict(rhs_quant="float8_e4m3fn", quant_block=128)])
def test_steps_within_a_scale_block_stay(quant):
    """bf16, int8 per channel and 128-wide blocks: every block_k of the grid keeps its step whole."""
    backend = get_op("ragged_dot").backends.get("triton")
    with devices.judging(H100):
        assert {c.block_k for c in backend.search_space(_problem(**quant))} == {32, 64, 128}


def test_where_no_valid_step_keeps_the_scale_block_the_rule_refuses_nothing():
    """Activations quantized in the kernel in blocks of 128 need a step of 128, which dequantizes mxfp4's
    32-wide blocks whatever it is: the GPU keeps the default (and the space) it had."""
    backend = get_op("ragged_dot").backends.get("triton")
    from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem

    problem = RaggedDotProblem(4096, 7168, 2048, 32, lhs_dtype="bfloat16", out_dtype="bfloat16",
                               lhs_qdtype="float8_e4m3fn", lhs_qblock=128, lhs_qdynamic=True,
                               rhs_qdtype="float4_e2m1fn", rhs_qblock=32)
    with devices.judging(H100):
        config = backend.default_config(problem)
        assert config.block_k == 128 and backend.config_error(config, problem) is None
        assert len(backend.search_space(problem)) > 1
