"""Compiling for chips this machine does not have.

- the target table (TPU v4 / v5e / v5p / v6e, GPU H100 / H200 / A100 / B200) and their device facts are
  `moe_tune.core.chips` (re-exported here); `moe_tune.core.devices` reads its budgets from it.
- `wheels`: where the compile-only compilers (libtpu, the CUDA plugin) are, and the one-line error without.
- `compile`: one call compiled for a target, as a `CompileResult`; `calls`: a kernel call's abstract inputs.
- `jobs`: which configs to compile for a target, and many calls compiled in worker processes (`CompileJob`,
  `CompilePool`, on the `moe_tune.workers` pool).
- `ptx_dump`: compile workers that keep the PTX XLA:GPU produced for each job; `ptx_mix`: the instruction mix
  of a kernel's k loop read from that PTX (MMAs, conversions, load and shared-store widths).
- `slice_plan`: the layer across devices planned for a multi-chip slice (`core.chips.SLICES`): each strategy
  compiled for the slice in compile workers (`slice_compile`), its collectives read from the HLO
  (`collectives`), fits, a floor from the chips' published facts, a recommendation (`moe-tune plan`).

This package (all of it but what its workers run) loads neither libtpu nor the CUDA plugin: only the worker
processes do.
"""

from moe_tune.core.chips import TARGETS, GpuFacts, Target, get_target

__all__ = ["TARGETS", "GpuFacts", "Target", "get_target"]
