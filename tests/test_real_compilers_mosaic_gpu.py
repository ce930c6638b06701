"""The `mosaic_gpu` ragged_dot backend compiled by the real Mosaic GPU compiler (the CUDA plugin's, ptxas
included) for an H100 and a B200, on this CPU-only machine (`moe_tune.targets`), at the shapes of one MoE
layer: each direction the chip serves with its default config, and the largest config of the forward's space
(the one nearest the chip's 227 KiB of shared memory). The whole spaces were compiled by
`moe-tune sweep --target` and benchmarks/compile_check.py (no false accepts); these keep the kernels and the
wrappers honest in `make test`.

One worker pool per chip: after compiling for sm_90, a process compiling Mosaic GPU for sm_100 fails in ptxas
("SM version specified by .target is higher than default SM version assumed").
"""

from __future__ import annotations

import pytest

from moe_tune.models import get_preset, kernel_problems
from moe_tune.targets import get_target, wheels
from moe_tune.targets.compile import REJECTED
from moe_tune.targets.jobs import jobs_for, representative, search_space
from moe_tune.targets.pool import CompileJob, CompilePool
from moe_tune.kernels.ragged_dot.mosaic_gpu import MosaicGpuConfig

pytestmark = pytest.mark.skipif(not wheels.available("gpu"),
                                reason="the CUDA plugin is missing: pip install 'moe-tune[gpu-compile]'")

PRESET, TOKENS = "qwen3-30b-a3b", 512  # m = 4096 rows, k = 2048, n = 768, 128 experts


def gate_up(direction: str):
    return next(c.problem for c in kernel_problems(get_preset(PRESET), TOKENS, dtype="bfloat16")
                if c.role == "gate/up" and c.problem.direction == direction)


@pytest.mark.parametrize("chip,directions", [("h100", ("fwd", "dlhs", "drhs")), ("b200", ("fwd", "dlhs"))])
def test_compiles_for_the_chip(chip, directions):
    """Each direction the chip serves with its default config, and on H100 the largest config of the forward's
    space and one just over the shared-memory limit, which the compiler refuses for that reason (B200's are in
    benchmarks/compile_check.py's results: every candidate of the sweep's space compiles there too)."""
    target = get_target(chip)
    jobs = []
    for direction in directions:
        problem = gate_up(direction)
        space = search_space(target, "ragged_dot", "mosaic_gpu", problem)
        configs = representative(space, extra=1) if direction == "fwd" and chip == "h100" else space[:1]
        jobs += jobs_for(target, "ragged_dot", "mosaic_gpu", problem, configs)
    if chip == "h100":
        jobs.append(CompileJob(chip, "ragged_dot", "mosaic_gpu", gate_up("fwd"),
                               MosaicGpuConfig(block_m=128, block_n=256, block_k=128, max_concurrent_steps=6)))
    with CompilePool(workers=1, timeout=300) as pool:
        results = pool.compile(jobs)
    over = results.pop() if chip == "h100" else None
    failed = [f"{j.problem.direction} {j.config.label()}: {r.status} {r.message}" for j, r in zip(jobs, results)
              if not r.ok]
    assert not failed, f"{chip}:\n" + "\n".join(failed)
    assert all(r.compile_s > 0 and r.memory for r in results)
    if over is not None:  # refused by the rules for its shared memory, and by the compiler for the same reason
        assert over.status == REJECTED and "exceeds available shared memory" in over.message, over
