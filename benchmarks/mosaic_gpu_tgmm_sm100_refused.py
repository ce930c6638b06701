"""The sm_100 drhs kernel's (`mosaic_gpu_tgmm_sm100`) shared-memory rule held to the real B200 compiler from the
other side: every config of the drhs candidate grid that `config_error` refuses for its shared memory is
compiled anyway, and must fail in the compiler for that reason (no false rejects); the sweep
(`moe-tune sweep --target b200 --direction drhs`) compiles the accepted ones (no false accepts).

    .venv/bin/python benchmarks/mosaic_gpu_tgmm_sm100_refused.py [--workers 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

from moe_tune.kernels.ragged_dot import RaggedDotProblem
from moe_tune.kernels.ragged_dot.mosaic_gpu import MosaicGpuConfig
from moe_tune.targets import get_target
from moe_tune.targets.jobs import CompileJob, CompilePool, config_error

SMEM_REASON, COMPILER_REASON = "bytes of shared memory", "exceeds available shared memory"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    target = get_target("b200")
    problem = RaggedDotProblem(m=2048, k=2048, n=768, groups=16, lhs_dtype="bfloat16", rhs_dtype="bfloat16",
                               out_dtype="bfloat16", direction="drhs")
    refused = []
    for block_n, block_k, steps, epilogue in itertools.product([64, 128, 256], [64, 128], [1, 2, 3, 4, 6],
                                                               [64, 128, 256]):
        config = MosaicGpuConfig(block_m=128, block_n=block_n, block_k=block_k, max_concurrent_steps=steps,
                                 epilogue_tile_n=epilogue)
        reason = config_error(target, "ragged_dot", "mosaic_gpu", config, problem)
        if reason is not None and SMEM_REASON in reason:
            refused.append((config, reason))
    print(f"b200 drhs {problem.m}x{problem.k}x{problem.n} g={problem.groups}: {len(refused)} configs refused "
          "for shared memory, each compiled anyway")
    jobs = [CompileJob("b200", "ragged_dot", "mosaic_gpu", problem, config) for config, _ in refused]
    with CompilePool(workers=args.workers, timeout=300) as pool:
        results = pool.compile(jobs)
    false_rejects = 0
    for (config, reason), result in zip(refused, results):
        fields = {k: v for k, v in dataclasses.asdict(config).items() if k in
                  ("block_n", "block_k", "max_concurrent_steps", "epilogue_tile_n")}
        agrees = result.status == "rejected" and COMPILER_REASON in result.message
        false_rejects += not agrees
        print(f"{fields} rule: {reason} | compiler: {result.status} {result.message}")
    print(f"false rejects (refused by the rule, yet the compiler did not fail for shared memory): {false_rejects}")


if __name__ == "__main__":
    main()
