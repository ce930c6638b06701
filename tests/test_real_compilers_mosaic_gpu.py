"""The `mosaic_gpu` ragged_dot backend compiled by the real Mosaic GPU compiler (the CUDA plugin's, ptxas
included) for an H100 and a B200, on this CPU-only machine (`moe_tune.targets`), at the shapes of one MoE
layer: each direction the chip serves with its default config, the largest config of one direction's space
(the one nearest the chip's 227 KiB of shared memory; on B200 the drhs space of this project's tcgen05 kernel,
`mosaic_gpu_tgmm_sm100`), and a config just over the limit, refused by the rules and by the compiler. The whole spaces were compiled by
`moe-tune sweep --target` and benchmarks/compile_check.py (no false accepts); these keep the kernels and the
wrappers honest in `make test`.

One worker pool per chip: after compiling for sm_90, a process compiling Mosaic GPU for sm_100 fails in ptxas
("SM version specified by .target is higher than default SM version assumed").
"""

from __future__ import annotations

import pytest

from moe_tune.kernels.ragged_dot.mosaic_gpu import MosaicGpuConfig, MosaicGpuRaggedDot
from moe_tune.layer.models import get_preset, kernel_problems
from moe_tune.targets import get_target, wheels
from moe_tune.targets.compile import REJECTED, acting_as
from moe_tune.targets.jobs import CompileJob, CompilePool, config_error, jobs_for, search_space

pytestmark = pytest.mark.skipif(not wheels.available("gpu"),
                                reason="the CUDA plugin is missing: pip install 'moe-tune[gpu-compile]'")

PRESET, TOKENS = "qwen3-30b-a3b", 512  # m = 4096 rows, k = 2048, n = 768, 128 experts


def gate_up(direction: str):
    return next(c.problem for c in kernel_problems(get_preset(PRESET), TOKENS, dtype="bfloat16")
                if c.role == "gate/up" and c.problem.direction == direction)


# per chip: the direction whose largest config is compiled, and a config of it over the shared-memory limit
OVER_THE_LIMIT = {"h100": ("fwd", MosaicGpuConfig(block_m=128, block_n=256, block_k=128, max_concurrent_steps=6)),
                  "b200": ("drhs", MosaicGpuConfig(block_m=128, block_n=128, block_k=128, max_concurrent_steps=4))}


def largest(target, problem, space):
    """The config of `space` asking for the most shared memory, as the backend counts it for `target`."""
    impl = MosaicGpuRaggedDot()
    with acting_as(target):
        return max(space, key=lambda c: impl.shared_memory_bytes(c, problem))


@pytest.mark.parametrize("chip", ["h100", "b200"])
def test_compiles_for_the_chip(chip):
    """Each direction with its default config (drhs on B200: this project's tcgen05 kernel), the largest
    config of one direction's space, and a config just over the shared-memory limit, which the rules refuse
    and the compiler refuses for the same reason (every candidate of the sweeps' spaces compiles: see
    benchmarks/results/mosaic_gpu_target_sweep_*)."""
    target = get_target(chip)
    big_direction, over_config = OVER_THE_LIMIT[chip]
    jobs = []
    for direction in ("fwd", "dlhs", "drhs"):
        problem = gate_up(direction)
        space = search_space(target, "ragged_dot", "mosaic_gpu", problem)
        configs = list(dict.fromkeys([space[0], largest(target, problem, space)] if direction == big_direction
                                     else space[:1]))
        jobs += jobs_for(target, "ragged_dot", "mosaic_gpu", problem, configs)
    over_problem = gate_up(big_direction)
    assert "bytes of shared memory" in config_error(target, "ragged_dot", "mosaic_gpu", over_config, over_problem)
    jobs.append(CompileJob(chip, "ragged_dot", "mosaic_gpu", over_problem, over_config))
    with CompilePool(workers=1, timeout=300) as pool:
        results = pool.compile(jobs)
    over = results.pop()
    failed = [f"{j.problem.direction} {j.config.label()}: {r.status} {r.message}" for j, r in zip(jobs, results)
              if not r.ok]
    assert not failed, f"{chip}:\n" + "\n".join(failed)
    assert all(r.compile_s > 0 and r.memory for r in results)
    # refused by the rules for its shared memory, and by the compiler for the same reason
    assert over.status == REJECTED and "exceeds available shared memory" in over.message, over
