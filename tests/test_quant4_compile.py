"""The 4-bit and dynamic-w8a8 Pallas ragged_dot kernels compiled by the real compilers (TPU v5e: megablox,
H100: triton), on this CPU-only machine (`moe_tune.targets`, as tests/test_real_compilers.py does).

Two calls per chip, small shapes, each with the backend's default config, chosen to reach every new path of
the kernel: the forward with int4 weights in blocks of 128 and activations quantized in the kernel (int4
values loaded and converted to int8, the tile quantized, int8 x int8 dots), and the dlhs with mxfp4 weights
(their float4 bits read as int4 and decoded, each 32-row sub-block dequantized). A sample of model-sized
configs per mode was compiled for both chips with benchmarks/compile_check.py (`--modes`).
"""

from __future__ import annotations

import pytest

from moe_tune.kernels.ragged_dot import RaggedDotProblem
from moe_tune.targets import get_target, wheels
from moe_tune.targets.jobs import CompileJob, CompilePool, config_error, search_space

BASE = dict(m=512, k=512, n=256, groups=8, lhs_dtype="bfloat16", out_dtype="bfloat16")
PROBLEMS = {
    "fwd_int4_128_dynamic_int8_128": RaggedDotProblem(**BASE, rhs_qdtype="int4", rhs_qblock=128, lhs_qdtype="int8",
                                                      lhs_qblock=128, lhs_qdynamic=True),
    "dlhs_mxfp4": RaggedDotProblem(**BASE, rhs_qdtype="float4_e2m1fn", rhs_qblock=32, direction="dlhs"),
}
CHIPS = {"v5e": "megablox", "h100": "triton"}


@pytest.mark.skipif(not (wheels.available("tpu") and wheels.available("gpu")),
                    reason="the compile-only wheels are missing: pip install 'moe-tune[tpu-compile,gpu-compile]'")
def test_new_modes_compile_with_the_default_config():
    jobs = []
    for target, backend in CHIPS.items():
        chip = get_target(target)
        for name, problem in PROBLEMS.items():
            default = search_space(chip, "ragged_dot", backend, problem)[0]
            assert config_error(chip, "ragged_dot", backend, default, problem) is None, name
            jobs.append(CompileJob(target, "ragged_dot", backend, problem, default))
    with CompilePool(workers=1, timeout=300) as pool:  # one worker keeps both topologies
        results = pool.compile(jobs)
    failed = [f"{j.target} {j.problem.direction} {j.config.label()}: {r.status} {r.message}"
              for j, r in zip(jobs, results) if not r.ok]
    assert not failed, "\n".join(failed)
