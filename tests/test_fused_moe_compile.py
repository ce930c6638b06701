"""The fused MoE Pallas kernels compiled by the real compilers on this CPU-only machine (`moe_tune.targets`):
pallas_tpu for a TPU v5e (Mosaic TPU), triton for an H100 (Triton, ptxas), at one Qwen3-30B-A3B layer's
shapes (512 tokens, top-8, 128 experts; bfloat16). Every direction's default compiles (and one with float8
weights); a config the backend's rules refuse for the chip's budget (VMEM, shared memory) is refused by the
compiler as well, with the chip's own message (a rule that let it through would be a false accept;
tests/test_real_compilers.py has the ragged_dot and gather kernels). pallas_tpu's dispatch kernels also compile
given gate and up as two operands (what the op hands a `split_weights` backend).
benchmarks/results/fused_moe_compile_* hold the wider probes.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from moe_tune.kernels.fused_moe.pallas_tpu import FusedPallasTpuConfig
from moe_tune.kernels.fused_moe.problem import FusedMoeProblem
from moe_tune.kernels.fused_moe.triton import FusedTritonConfig
from moe_tune.targets import get_target, wheels
from moe_tune.targets.compile import REJECTED
from moe_tune.targets.jobs import CompileJob, CompilePool, config_error, search_space

needs_tpu = pytest.mark.skipif(not wheels.available("tpu"),
                               reason="libtpu is missing: pip install 'moe-tune[tpu-compile]'")
needs_gpu = pytest.mark.skipif(not wheels.available("gpu"),
                               reason="the CUDA plugin is missing: pip install 'moe-tune[gpu-compile]'")


def problem(stage: str, direction: str, **quant) -> FusedMoeProblem:
    """Qwen3-30B-A3B: hidden 2048, expert width 768 (gate and up concatenated: 1536), 128 experts, top-8."""
    shape = dict(k=2048, n=1536, glu="silu") if stage == "dispatch" else dict(k=768, n=2048)
    return FusedMoeProblem(tokens=512, m=4096, groups=128, dtype="bfloat16", stage=stage, direction=direction,
                           **shape, **quant)


# Every direction with float weights, and float8 weights in 128-row blocks where they are dequantized along
# the output (dispatch's backward: the combine kernel on the transposed weights).
PROBLEMS = [problem(stage, direction) for stage in ("dispatch", "combine") for direction in ("fwd", "bwd")] + [
    problem("dispatch", "bwd", rhs_qdtype="float8_e4m3fn", rhs_qblock=128)]
# (backend, target, a config over the chip's budget for the combine fwd problem, the compiler's words)
CASES = {
    "pallas_tpu": ("v5e", FusedPallasTpuConfig(tm=512, tk=768, tn=2048), "CompileTimeScopedVmemOom"),
    "triton": ("h100", FusedTritonConfig(block_m=128, block_k=128, block_n=128, num_stages=5),
               "Shared memory size limit exceeded"),
}


@pytest.mark.parametrize("backend", [pytest.param("pallas_tpu", marks=needs_tpu),
                                     pytest.param("triton", marks=needs_gpu)])
def test_defaults_compile_and_an_over_budget_config_is_refused_by_both(backend):
    target_name, over, words = CASES[backend]
    target = get_target(target_name)
    jobs = [CompileJob(target_name, "fused_moe", backend, p, search_space(target, "fused_moe", backend, p)[0])
            for p in PROBLEMS]
    combine = PROBLEMS[2]
    assert combine.stage == "combine" and combine.direction == "fwd"
    reason = config_error(target, "fused_moe", backend, over, combine)
    assert reason and ("VMEM" in reason or "shared memory" in reason), reason
    jobs.append(CompileJob(target_name, "fused_moe", backend, combine, over))
    with CompilePool(workers=1, timeout=300) as pool:
        results = pool.compile(jobs)
    failed = [f"{j.problem.stage} {j.problem.direction} {j.config.label()}: {r.status} {r.message}"
              for j, r in zip(jobs[:-1], results[:-1]) if not r.ok]
    assert not failed, "\n".join(failed)
    assert results[-1].status == REJECTED and words in results[-1].message, results[-1]


# Compiles the dispatch's kernels with gate and up as two operands (what the op hands a `split_weights`
# backend) for the chip, in a process that sees the compile-only wheel: prints one status per problem.
_PARTS_SCRIPT = """
import json, sys, jax
from moe_tune.kernels import get_op
from moe_tune.kernels.fused_moe.problem import FusedMoeProblem
from moe_tune.targets import get_target
from moe_tune.targets.calls import abstract_inputs, kernel_call
from moe_tune.targets.compile import compile_call

target, name = get_target(sys.argv[1]), sys.argv[2]
backend = get_op("fused_moe").backends.get(name)
for fields in json.loads(sys.argv[3]):
    p = FusedMoeProblem(**fields)
    def inputs(device, p=p):
        found = abstract_inputs("fused_moe", p, device)
        assert isinstance(found["rhs"], tuple) and len(found["rhs"]) == 2  # the dispatch's (gate, up)
        return found
    result = compile_call(target, kernel_call("fused_moe", name, p, backend.default_config(p)), inputs)
    print("STATUS", p.direction, result.status, result.message[:200], flush=True)
"""


@needs_tpu
def test_the_dispatch_kernels_compile_on_gate_and_up_parts():
    """pallas_tpu's dispatch without glu (column blocks in gate, then up) and its backward with float8 weights
    (the contraction over both parts), each given (gate, up) as two operands, compiled for a v5e."""
    problems = [dataclasses.replace(problem("dispatch", "fwd"), glu=None),
                problem("dispatch", "bwd", rhs_qdtype="float8_e4m3fn", rhs_qblock=128)]
    fields = json.dumps([dataclasses.asdict(p) for p in problems])
    proc = subprocess.run([sys.executable, "-c", _PARTS_SCRIPT, "v5e", "pallas_tpu", fields], env=wheels.worker_env(),
                          capture_output=True, text=True, timeout=300)
    statuses = [line for line in proc.stdout.splitlines() if line.startswith("STATUS")]
    assert len(statuses) == 2 and all(" ok" in line for line in statuses), (statuses, proc.stderr[-2000:])
