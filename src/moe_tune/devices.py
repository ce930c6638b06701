"""What machine we are on: the platform (cpu/gpu/tpu) and the normalized device kind that names tables."""

from __future__ import annotations

import functools
import re

import jax


# Scoped VMEM a Pallas TPU kernel may use by default (the compiler's default scoped limit on v5e; larger
# chips allow more, so this is the safe budget for pruning block shapes).
TPU_SCOPED_VMEM_BYTES = 16 * 1024 * 1024


# Shared memory one GPU thread block may use, by device kind (the CUDA opt-in maximum); the default is the
# conservative budget of older chips, used also when tuning in interpret mode on CPU.
GPU_SHARED_MEMORY_BYTES = {"h100": 227 * 1024, "h200": 227 * 1024, "h800": 227 * 1024, "a100": 163 * 1024}
DEFAULT_GPU_SHARED_MEMORY_BYTES = 99 * 1024


def gpu_shared_memory_bytes(kind: str | None = None) -> int:
    kind = device_kind() if kind is None else kind
    return next((v for name, v in GPU_SHARED_MEMORY_BYTES.items() if name in kind), DEFAULT_GPU_SHARED_MEMORY_BYTES)


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
