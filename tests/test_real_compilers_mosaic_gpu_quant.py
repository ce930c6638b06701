"""The `mosaic_gpu_quant` ragged_dot forward compiled by the real Mosaic GPU compiler (the CUDA plugin's, ptxas
included) for an H100 on this CPU-only machine (`moe_tune.targets`' compile workers), at the DeepSeek-sized
expert shapes (k 7168, n 2048, 32 groups) of a prefill (m 4096) and a decode step (m 256): the default config
of each weight format's prefill forward, int4's decode forward and prefill dlhs, and the space's largest
config (in shared memory) of the int8 prefill forward.
benchmarks/gpu_quant_proxy.py compiles more of the space and reads the k loop's instructions from the PTX."""

from __future__ import annotations

import pytest

from moe_tune.kernels import get_op
from moe_tune.kernels.ragged_dot.mosaic_gpu_quant import MosaicGpuQuantRaggedDot
from moe_tune.targets import get_target, wheels
from moe_tune.targets.compile import acting_as
from moe_tune.targets.jobs import CompileJob, CompilePool, search_space

pytestmark = pytest.mark.skipif(not wheels.available("gpu"),
                                reason="the CUDA plugin is missing: pip install 'moe-tune[gpu-compile]'")

SHAPES = {"m4096": {"m": 4096, "k": 7168, "n": 2048, "groups": 32}, "m256": {"m": 256, "k": 7168, "n": 2048, "groups": 32}}
FORMATS = {"int8": {"rhs_quant": "int8"}, "fp8/128": {"rhs_quant": "float8_e4m3fn", "quant_block": 128},
           "int4/128": {"rhs_quant": "int4", "quant_block": 128}, "mxfp4": {"rhs_quant": "mxfp4"}}


def test_compiles_for_h100():
    target = get_target("h100")
    spec, impl = get_op("ragged_dot"), MosaicGpuQuantRaggedDot()
    jobs = []
    # int4 at the decode shape and in dlhs: the 4-bit unpacking, the narrowest token block, the scales along
    # the output (every format compiles at both shapes and in both directions: gpu_quant_proxy.py)
    cases = [(f, "m4096", "fwd") for f in FORMATS] + [("int4/128", "m256", "fwd"), ("int4/128", "m4096", "dlhs")]
    for fmt, shape, direction in cases:
        problem = spec.problem(**SHAPES[shape], **FORMATS[fmt], dtype="bfloat16", direction=direction)
        with acting_as(target):
            configs = [impl.default_config(problem)]
            if (fmt, shape, direction) == ("int8", "m4096", "fwd"):
                space = search_space(target, "ragged_dot", impl.name, problem)
                configs.append(max(space, key=lambda c: impl.shared_memory_bytes(c, problem)))
            # the kernel itself, not a fallback, is what compiles
            assert all(impl.config_error(c, problem) is None for c in configs), (fmt, shape)
        jobs += [CompileJob(target.name, "ragged_dot", impl.name, problem, c) for c in configs]
    with CompilePool(workers=1, timeout=300) as pool:
        results = pool.compile(jobs)
    failed = [f"{j.problem.direction} {j.problem.m} {j.problem.rhs_qdtype} {j.config.label()}: {r.status} {r.message}"
              for j, r in zip(jobs, results) if not r.ok]
    assert not failed, "\n".join(failed)
    assert all(r.compile_s > 0 for r in results)
