"""The device a rule is judged for: this machine's by default, or a chip named by `judging(...)`.

A `Device` is a platform (`cpu`, `gpu`, `tpu`) and a normalized device kind (the name of its tables). Every
rule that depends on the chip (a Pallas kernel's compiled or interpret path, a backend's VMEM or shared-memory
budget, which backend is the platform's default) reads `platform()` / `device_kind()` here, which answer for
the innermost `judging(device)` block and else for this machine. Compiling for a chip this machine does not
have (`targets/`) and judging a table tuned elsewhere (`moe-tune validate`) pass the chip's `Device` to
`judging`; nothing patches a module attribute. Like the tables, it is read at trace time.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import re
from collections.abc import Iterator

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


@dataclasses.dataclass(frozen=True)
class Device:
    """A chip as the rules see it: `platform` (`cpu`, `gpu`, `tpu`) and normalized `kind` (`tpu_v5_lite`)."""

    platform: str
    kind: str


_judged: contextvars.ContextVar[Device | None] = contextvars.ContextVar("moe_tune_judged_device", default=None)


@functools.cache
def this_machine() -> Device:
    """The default JAX device of this process (ROCm and CUDA both report platform `gpu`)."""
    name = jax.default_backend()
    return Device("gpu" if name in ("cuda", "rocm") else name, normalize_device_kind(jax.devices()[0].device_kind))


def current() -> Device:
    """The device rules are judged for now: the innermost `judging` block's, else this machine's."""
    judged = _judged.get()
    return judged if judged is not None else this_machine()


@contextlib.contextmanager
def judging(device: Device | None) -> Iterator[Device]:
    """Inside, `platform()` and `device_kind()` report `device` (None: this machine), so kernels traced take
    that chip's compiled path and the backends' rules prune with its budgets. Blocks nest."""
    token = _judged.set(device)
    try:
        yield current()
    finally:
        _judged.reset(token)


@contextlib.contextmanager
def judging_kind(kind: str) -> Iterator[Device]:
    """`judging` the chip whose tables lie under device kind `kind` (`chips.for_device_kind`), or this machine
    where moe-tune knows no such chip (cpu, an unlisted GPU): how a table tuned elsewhere is validated (a Triton
    tile that fits an H100's 227 KiB of shared memory, not this machine's)."""
    found = for_device_kind(kind)
    with judging(None if found is None else Device(found.platform, found.device_kind)) as device:
        yield device


def device_kind() -> str:
    """The table directory name of the judged device, e.g. `cpu`, `nvidia_h100_80gb_hbm3`, `tpu_v5_lite`."""
    return current().kind


def platform() -> str:
    """`cpu`, `gpu` or `tpu` of the judged device: the one switch between compiled and interpret mode."""
    return current().platform
