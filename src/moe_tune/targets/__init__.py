"""Compiling for chips this machine does not have.

- the target table (TPU v4 / v5e / v5p / v6e, GPU H100 / A100 / B200) and their device facts are
  `moe_tune.core.chips` (re-exported here); `moe_tune.core.devices` reads its budgets from it.
- `wheels`: where the compile-only compilers (libtpu, the CUDA plugin) are, and the one-line error without.
- `compile`: one call compiled for a target, as a `CompileResult`; `calls`: a kernel call's abstract inputs.
- `pool`: many calls compiled in worker processes (`CompilePool`, `CompileJob`).

This package (and all of it but the worker) loads neither libtpu nor the CUDA plugin: only the worker
processes do.
"""

from moe_tune.core.chips import TARGETS, GpuFacts, Target, get_target

__all__ = ["TARGETS", "GpuFacts", "Target", "get_target"]
