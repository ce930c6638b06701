"""What machine we are on: the platform (cpu/gpu/tpu) and the normalized device kind that names tables."""

from __future__ import annotations

import functools
import re

import jax


from moe_tune.core.chips import GPU_TARGETS, TPU_TARGETS, for_device_kind

# The chips' budgets come from the compile-target table (`moe_tune.core.chips`), which the real compilers
# check (tests/test_real_compilers.py): one source of truth for the pruning rules and the compilers.

# Scoped VMEM a Pallas TPU kernel may use by default on every TPU generation (the smallest of the chips'
# defaults, 16 MiB): the safe budget for pruning block shapes where the chip is not known.
TPU_SCOPED_VMEM_BYTES = min(t.scoped_vmem_bytes for t in TPU_TARGETS)


def tpu_scoped_vmem_bytes(kind: str | None = None) -> int:
    """The default scoped VMEM of the TPU with device kind `kind` (default: this machine's), or the safe
    `TPU_SCOPED_VMEM_BYTES` for a chip not in the table."""
    found = for_device_kind(device_kind() if kind is None else kind)
    return found.scoped_vmem_bytes if found is not None and found.platform == "tpu" else TPU_SCOPED_VMEM_BYTES


def tpu_vmem_model(kind: str | None = None) -> tuple[int, bool]:
    """(VMEM reserve in bytes, whether temporaries take float32) of the TPU with device kind `kind` (default:
    this machine's) as the real compiler showed them (`targets.chips`); (0, False), v5e's, for a kind not in
    the table (the CPU, where megablox runs in interpret mode)."""
    found = for_device_kind(device_kind() if kind is None else kind)
    if found is None or found.platform != "tpu":
        return 0, False
    return found.vmem_reserve_bytes, found.float32_temporaries


# Shared memory one GPU thread block may use (the CUDA opt-in maximum), by a name in the device kind; the
# default is the conservative budget of older chips, used also when tuning in interpret mode on CPU.
GPU_SHARED_MEMORY_BYTES = {name: t.shared_memory_per_block for t in GPU_TARGETS for name in t.kind_names}
DEFAULT_GPU_SHARED_MEMORY_BYTES = 99 * 1024


def gpu_shared_memory_bytes(kind: str | None = None) -> int:
    kind = device_kind() if kind is None else kind
    return next((v for name, v in GPU_SHARED_MEMORY_BYTES.items() if name in kind), DEFAULT_GPU_SHARED_MEMORY_BYTES)


def gpu_compute_capability(kind: str | None = None) -> tuple[int, int] | None:
    """(major, minor) of the NVIDIA GPU with device kind `kind` (default: this machine's), None when unknown
    (not a GPU, or a chip not in the target table)."""
    kind = device_kind() if kind is None else kind
    return next((t.gpu.compute_capability for t in GPU_TARGETS for name in t.kind_names if name in kind), None)


def normalize_device_kind(kind: str) -> str:
    """`"NVIDIA H100 80GB HBM3"` -> `"nvidia_h100_80gb_hbm3"`: lowercase, runs of other characters -> `_`."""
    return re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_") or "unknown"


@functools.cache
def device_kind() -> str:
    """The table directory name of the default device, e.g. `cpu`, `nvidia_h100_80gb_hbm3`, `tpu_v5_lite`."""
    return normalize_device_kind(jax.devices()[0].device_kind)


@functools.cache
def platform() -> str:
    """`cpu`, `gpu` or `tpu` (ROCm and CUDA both report `gpu`)."""
    name = jax.default_backend()
    return "gpu" if name in ("cuda", "rocm") else name
