"""The chips moe-tune can compile for without having them: their names, topologies and device facts.

One table, `TARGETS`, holds every fact a backend prunes a search space with (a TPU's scoped VMEM budget,
a GPU's shared memory per block and compute capability), and what the compile-only topology is built from
(a TPU topology name; a GPU's `GpuTargetConfigProto`, rendered by `gpu_config.py` from the facts here).
`moe_tune.core.devices` reads its budgets from this table, so the pruning rules and the compilers see the same
chip. Numbers are the chips' published figures (CUDA device attributes for the GPUs); where a rule and the
compiler disagreed, the compiler's limit is what is written here.
"""

from __future__ import annotations

import dataclasses

from moe_tune.core.errors import UsageError

MIB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class GpuFacts:
    """What XLA's GPU compiler needs to know about an NVIDIA chip (`GpuTargetConfigProto.gpu_device_info`)."""

    compute_capability: tuple[int, int]
    sm_count: int
    shared_memory_per_block_optin: int  # the most one thread block may use: what Triton checks a kernel against
    shared_memory_per_sm: int
    fp32_units_per_sm: int
    l2_cache_bytes: int
    clock_ghz: float
    memory_bytes: int
    memory_bandwidth: int  # bytes per second
    # the same on every chip here (sm_80 to sm_100)
    shared_memory_per_block: int = 48 * 1024  # without opting in
    registers_per_sm: int = 65536
    registers_per_block: int = 65536
    threads_per_block: int = 1024
    threads_per_sm: int = 2048
    threads_per_warp: int = 32


@dataclasses.dataclass(frozen=True)
class ChipFacts:
    """A chip's published budgets, for planning a layer on a slice of it (`targets/slice_plan.py`).

    hbm_bytes: memory per chip; hbm_bandwidth: bytes per second; peak_bf16_flops: dense bfloat16 FLOP/s;
    interconnect_bandwidth: the chip's inter-chip bandwidth in bytes per second, both directions together (as
    TPU ICI and NVLink are published: a chip sends at half of it while it receives at the other half).
    source: where the figures are published.
    """

    hbm_bytes: int
    hbm_bandwidth: float
    peak_bf16_flops: float
    interconnect_bandwidth: float
    source: str


GB = 10**9
GIB = 1024**3
# Published per-chip figures. TPUs: the Cloud TPU system architecture pages (cloud.google.com/tpu/docs/v5e,
# /v5p, /v6e), key specifications table: peak compute per chip (bf16), HBM capacity and bandwidth per chip,
# bidirectional inter-chip interconnect (ICI) bandwidth per chip. Where the page gives a capacity both in GB
# and GiB the smaller is kept (v5e: 16 GB). H100: the NVIDIA H100 Tensor Core GPU datasheet (H100 SXM: 80 GB
# HBM3 at 3.35 TB/s, NVLink 900 GB/s) and the NVIDIA H100 Tensor Core GPU Architecture whitepaper (dense
# BF16 tensor 989.4 TFLOP/s for H100 SXM5; the datasheet's 1,979 is with sparsity). H200: the NVIDIA H200
# Tensor Core GPU datasheet (H200 SXM: 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; its BF16 tensor figure, 1,979
# TFLOP/s with sparsity, is the H100 SXM's: the same GH100 SMs, so dense 989.4 as above).
CHIP_FACTS = {
    "v5e": ChipFacts(16 * GB, 819 * GB, 197e12, 400 * GB, "cloud.google.com/tpu/docs/v5e"),
    "v5p": ChipFacts(95 * GIB, 2765 * GB, 459e12, 1200 * GB, "cloud.google.com/tpu/docs/v5p"),
    "v6e": ChipFacts(32 * GB, 1600 * GB, 918e12, 800 * GB, "cloud.google.com/tpu/docs/v6e"),
    "h100": ChipFacts(80 * GB, 3350 * GB, 989.4e12, 900 * GB,
                      "NVIDIA H100 datasheet (SXM), H100 architecture whitepaper (dense BF16)"),
    "h200": ChipFacts(141 * GB, 4800 * GB, 989.4e12, 900 * GB,
                      "NVIDIA H200 datasheet (SXM), H100 architecture whitepaper (dense BF16, the same SMs)"),
}


@dataclasses.dataclass(frozen=True)
class SparseCoreFacts:
    """A TPU's SparseCores: `cores` per chip, each with `subcores` vector subcores of `lanes` 32-bit lanes and
    `vmem_bytes` of VMEM per vector subcore."""

    cores: int
    subcores: int
    lanes: int
    vmem_bytes: int


@dataclasses.dataclass(frozen=True)
class Target:
    """One chip to compile for.

    Attributes:
      name: what `--target` takes (`v5e`, `h100`).
      platform: `tpu` or `gpu` (what `devices.platform()` reports on the chip).
      device_kind: the normalized device kind the real chip reports (`devices.device_kind()`): the table
        directory its tuned entries, and its compile records, live under.
      description: the device kind as the chip spells it.
      topology: TPU only: the `get_topology_desc` name of a small slice (`v5e:2x2`); one chip of it is used.
      scoped_vmem_bytes: TPU only: the scoped VMEM a Pallas kernel gets by default (`vmem_limit_bytes` unset);
        the budget the megablox / pallas_tpu rules prune against.
      vmem_reserve_bytes: TPU only: VMEM the compiler took beyond the megablox model (`compiler_bytes`) on
        this chip, kept free by the rules.
      float32_temporaries: TPU only: the compiler's temporaries take float32 whatever the block's dtype (v4:
        no bfloat16 vector unit), as measured (benchmarks/compile_check.py).
      gpu: GPU only: the facts of its target config.
      kind_names: GPU only: names that identify the chip (and chips with the same limits) in a device kind.
      sparse_core: TPU only: the chip's SparseCores as Pallas can program them, or None (v4, v5e).
    """

    name: str
    platform: str
    device_kind: str
    description: str
    topology: str | None = None
    scoped_vmem_bytes: int | None = None
    vmem_reserve_bytes: int = 0
    float32_temporaries: bool = False
    gpu: GpuFacts | None = None
    kind_names: tuple[str, ...] = ()
    sparse_core: SparseCoreFacts | None = None

    @property
    def shared_memory_per_block(self) -> int | None:
        """GPU only: the opt-in shared memory of one thread block (the Triton limit)."""
        return None if self.gpu is None else self.gpu.shared_memory_per_block_optin

    @property
    def extra(self) -> str:
        """The package extra that brings this target's compiler."""
        return f"{self.platform}-compile"


def _tpu(name: str, topology: str, device_kind: str, description: str, scoped_mib: int, reserve_mib: float = 0,
         float32_temporaries: bool = False, sparse_core: SparseCoreFacts | None = None) -> Target:
    return Target(name=name, platform="tpu", device_kind=device_kind, description=description, topology=topology,
                  scoped_vmem_bytes=scoped_mib * MIB, vmem_reserve_bytes=int(reserve_mib * MIB),
                  float32_temporaries=float32_temporaries, sparse_core=sparse_core)


# SparseCores as `pltpu.get_tpu_info().sparse_core` reports them for compile-only devices of v5p:2x2x1 and v6e:2x2
# (jax 0.10.2, libtpu 0.0.42): v5p 4 cores x 16 subcores, 8 lanes, 512 KiB VMEM per subcore; v6e 2 x 16, 8 lanes,
# 256 KiB. It reports none for v4 and v5e.
_V5P_SPARSE_CORE = SparseCoreFacts(cores=4, subcores=16, lanes=8, vmem_bytes=512 * 1024)
_V6E_SPARSE_CORE = SparseCoreFacts(cores=2, subcores=16, lanes=8, vmem_bytes=256 * 1024)


# Scoped VMEM defaults as libtpu 0.0.42 enforces them (measured: an 18 MiB megablox kernel fails on v4, v5e
# and v5p, compiles on v6e; v4 reports "Used 18.45M of 16.00M vmem"). v4's reserve and float32 temporaries:
# fitted to its compile verdicts (compile_check.py); v6e's float32 temporaries too (its one false accept of
# 72 with v5e's model, a 30 MiB estimate); v5p is not measured yet, so it gets v4's caution.
TPU_TARGETS = (
    _tpu("v4", "v4:2x2x1", "tpu_v4", "TPU v4", 16, reserve_mib=2, float32_temporaries=True),
    _tpu("v5e", "v5e:2x2", "tpu_v5_lite", "TPU v5 lite", 16),
    _tpu("v5p", "v5p:2x2x1", "tpu_v5", "TPU v5", 16, reserve_mib=2, float32_temporaries=True,
         sparse_core=_V5P_SPARSE_CORE),
    _tpu("v6e", "v6e:2x2", "tpu_v6_lite", "TPU v6 lite", 32, float32_temporaries=True, sparse_core=_V6E_SPARSE_CORE),
)

GPU_TARGETS = (
    Target(name="h100", platform="gpu", device_kind="nvidia_h100_80gb_hbm3", description="NVIDIA H100 80GB HBM3",
           kind_names=("h100", "h800"),  # H800: the H100's SMs (same shared memory)
           gpu=GpuFacts(compute_capability=(9, 0), sm_count=132, shared_memory_per_block_optin=227 * 1024,
                        shared_memory_per_sm=228 * 1024, fp32_units_per_sm=128,
                        l2_cache_bytes=50 * MIB, clock_ghz=1.98, memory_bytes=80 * 1024 * MIB,
                        memory_bandwidth=3_352_000_000_000)),
    # The H200: the H100's SMs, shared memory and L2 (sm_90, compiled as the H100 is) with 141 GB of HBM3e at
    # 4.8 TB/s. JAX reports its device kind as "NVIDIA H200" (`devices.normalize_device_kind`: nvidia_h200).
    Target(name="h200", platform="gpu", device_kind="nvidia_h200", description="NVIDIA H200",
           kind_names=("h200",),
           gpu=GpuFacts(compute_capability=(9, 0), sm_count=132, shared_memory_per_block_optin=227 * 1024,
                        shared_memory_per_sm=228 * 1024, fp32_units_per_sm=128,
                        l2_cache_bytes=50 * MIB, clock_ghz=1.98, memory_bytes=141 * GB,
                        memory_bandwidth=4_800_000_000_000)),
    Target(name="a100", platform="gpu", device_kind="nvidia_a100_sxm4_80gb", description="NVIDIA A100-SXM4-80GB",
           kind_names=("a100",),
           gpu=GpuFacts(compute_capability=(8, 0), sm_count=108, shared_memory_per_block_optin=163 * 1024,
                        shared_memory_per_sm=164 * 1024, fp32_units_per_sm=64,
                        l2_cache_bytes=40 * MIB, clock_ghz=1.41, memory_bytes=80 * 1024 * MIB,
                        memory_bandwidth=2_039_000_000_000)),
    Target(name="b200", platform="gpu", device_kind="nvidia_b200", description="NVIDIA B200",
           kind_names=("b200",),
           gpu=GpuFacts(compute_capability=(10, 0), sm_count=148, shared_memory_per_block_optin=227 * 1024,
                        shared_memory_per_sm=228 * 1024, fp32_units_per_sm=128,
                        l2_cache_bytes=126 * MIB, clock_ghz=1.965, memory_bytes=180 * 1024 * MIB,
                        memory_bandwidth=8_000_000_000_000)),
)

TARGETS: dict[str, Target] = {t.name: t for t in (*TPU_TARGETS, *GPU_TARGETS)}


def get_target(name: str) -> Target:
    """The target called `name` (case-insensitive); a one-line UsageError naming the known ones otherwise."""
    found = TARGETS.get(name.lower())
    if found is None:
        raise UsageError(f"unknown target {name!r}; known targets: {', '.join(TARGETS)}")
    return found


@dataclasses.dataclass(frozen=True)
class Slice:
    """A multi-chip slice to plan a layer for: `chips` compile-only devices of the chip `target`.

    topology: TPU: the `get_topology_desc` name (`v5e:8x8`); GPU: the `1xNx1` topology of N GPUs in one host.
    """

    name: str
    target: str
    topology: str
    chips: int

    @property
    def chip(self) -> Target:
        return TARGETS[self.target]

    @property
    def facts(self) -> ChipFacts:
        return CHIP_FACTS[self.target]


def _slices() -> dict[str, Slice]:
    tpu = [("v5e", "2x2", 4), ("v5e", "4x4", 16), ("v5e", "8x8", 64), ("v6e", "2x2", 4), ("v6e", "4x4", 16),
           ("v5p", "2x2x2", 8), ("v5p", "4x4x4", 64)]
    found = [Slice(f"{chip}:{shape}", chip, f"{chip}:{shape}", chips) for chip, shape, chips in tpu]
    found += [Slice(f"h100x{n}", "h100", f"1x{n}x1", n) for n in (4, 8)]
    found += [Slice("h200x8", "h200", "1x8x1", 8)]
    return {s.name: s for s in found}


SLICES: dict[str, Slice] = _slices()


def get_slice(name: str) -> Slice:
    """The slice called `name` (`v5e:8x8`, `h100x8`; case-insensitive); a one-line UsageError naming the known
    ones otherwise."""
    found = SLICES.get(name.lower())
    if found is None:
        raise UsageError(f"unknown slice {name!r}; known slices: {', '.join(SLICES)}")
    return found


def for_device_kind(kind: str) -> Target | None:
    """The target whose chip reports the normalized device kind `kind`, if any."""
    return next((t for t in TARGETS.values() if t.device_kind == kind), None)
