"""The calls into JAX's Mosaic GPU ragged-dot kernels (`jax.experimental.pallas.ops.gpu`), wrapped so that
they serve every problem the `mosaic_gpu` backend accepts (`mosaic_gpu.py` holds the rules and the config).

- `hopper_gmm`: `ragged_dot_mgpu.ragged_dot` (wgmma, sm_90), fwd and dlhs (`transpose_rhs`).
- `blackwell_gmm`: `blackwell_ragged_dot_mgpu.ragged_dot_kernel` (tcgen05, sm_100), fwd; dlhs reads rhs
  transposed by XLA first (the kernel has no `transpose_rhs`).
- `hopper_tgmm`: `transposed_ragged_dot_mgpu.transposed_ragged_dot` (wgmma), drhs.

What the wrapping adds: padding to whole blocks (the kernels demand `k % block_k == 0`, and more), the local
groups of an expert-parallel shard moved to row 0 (the kernels count groups from row 0 and have no
`group_offset`: the rows are rolled, run, and rolled back), and zero rows past the local groups (the
kernels never write them; their output buffer is uninitialized).

Two things the upstream kernels read from the process rather than their arguments are supplied while they
trace: the SM count (`jax.devices()[0].core_count`, which a compile-only target's process does not have: its
default device is the CPU) and interpret mode (they take no `interpret` argument; on a machine without a
GPU they run in Mosaic GPU's interpreter, `jax._src.pallas.mosaic_gpu.interpret`, through the Pallas
interpret-mode context).
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from moe_tune.core import devices
from moe_tune.kernels.pallas_util import pad_to
from moe_tune.kernels.ragged_dot.metadata import select_shard
from moe_tune.core.chips import for_device_kind

# SMs the interpreter simulates for the kernels that size their grid by the device (each SM is a thread of
# the interpreter: few keep interpret mode fast; the Hopper gmm fixes its own 132).
INTERPRET_SMS = 4
_LOCK = threading.Lock()  # the SM-count shim swaps module globals while a kernel traces


def _upstream() -> tuple[types.ModuleType, types.ModuleType, types.ModuleType]:
    """(ragged_dot_mgpu, transposed_ragged_dot_mgpu, blackwell_ragged_dot_mgpu), imported on first use (they
    import jax's test utilities: not worth paying for at `import moe_tune`)."""
    from jax.experimental.pallas.ops.gpu import blackwell_ragged_dot_mgpu, ragged_dot_mgpu, transposed_ragged_dot_mgpu

    return ragged_dot_mgpu, transposed_ragged_dot_mgpu, blackwell_ragged_dot_mgpu


def on_gpu() -> bool:
    """Whether a real GPU executes the kernels (else: a compile-only target, or the interpreter on CPU)."""
    return jax.default_backend() in ("cuda", "rocm")


def sm_count() -> int:
    """SMs of the GPU the kernels are built for: the device's own on a GPU, the target table's when compiling
    for a chip this machine does not have, `INTERPRET_SMS` in the interpreter."""
    if on_gpu():
        return int(jax.devices()[0].core_count)
    target = for_device_kind(devices.device_kind())
    if devices.platform() == "gpu" and target is not None and target.gpu is not None:
        return target.gpu.sm_count
    return INTERPRET_SMS


class _JaxWithSms:
    """The `jax` module as an upstream kernel module sees it while it traces, with devices that report
    `core_count` (only `devices` / `local_devices` differ from jax's)."""

    def __init__(self, sms: int):
        self._device = types.SimpleNamespace(core_count=sms)

    def __getattr__(self, name: str) -> Any:
        return getattr(jax, name)

    def devices(self, *_: Any) -> list[Any]:
        return [self._device]

    local_devices = devices


@contextlib.contextmanager
def upstream_kernels() -> Iterator[tuple[types.ModuleType, types.ModuleType, types.ModuleType]]:
    """The three upstream modules, traceable here: where the process has no GPU, the SM-count shim, and
    Mosaic GPU interpret mode where the platform is not a GPU either (`devices.platform()`, read at trace
    time)."""
    modules = _upstream()
    if on_gpu():
        yield modules
        return
    with _LOCK:
        saved = [m.jax for m in modules]
        for module in modules:
            module.jax = _JaxWithSms(sm_count())
        scope = _interpret_scope() if interpreting() else contextlib.nullcontext()
        try:
            with scope:
                yield modules
        finally:
            for module, value in zip(modules, saved):
                module.jax = value


@contextlib.contextmanager
def _interpret_scope() -> Iterator[None]:
    """Pallas' interpret-mode context set to Mosaic GPU's interpreter (the kernels pass no `interpret`; the
    context is what `plgpu.kernel` reads instead)."""
    from jax._src import config
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    previous = config.pallas_tpu_interpret_mode_context_manager.swap_local(InterpretGPUParams())
    try:
        yield
    finally:
        config.pallas_tpu_interpret_mode_context_manager.set_local(previous)


def interpreting() -> bool:
    """Whether the kernels run in Mosaic GPU's interpreter (no GPU, and not compiling for one)."""
    return not on_gpu() and devices.platform() != "gpu"


# --------------------------------------------------------------------------------------------------------
# The local groups of a shard


def local_groups(group_sizes: jax.Array, m: int, groups: int, group_offset: jax.Array | None
                 ) -> tuple[jax.Array, jax.Array]:
    """(int32 [groups] sizes of the local groups, int32 scalar first row of the first one), read as every
    backend reads them (`metadata.select_shard`: clipped to m; an offset out of range owns no row)."""
    sizes, offset = select_shard(group_sizes, 0 if group_offset is None else group_offset, m=m, groups=groups)
    local = jax.lax.dynamic_slice_in_dim(sizes, offset, groups)
    start = jnp.sum(jnp.where(jnp.arange(sizes.shape[0]) < offset, sizes, 0)).astype(jnp.int32)
    return local, start


def to_row_zero(x: jax.Array, start: jax.Array, shard: bool) -> jax.Array:
    """Rows of a shard's local groups moved to row 0 (a roll: the kernels count groups from row 0)."""
    return jnp.roll(x, -start, axis=0) if shard else x


def zero_past(out: jax.Array, sizes: jax.Array, start: jax.Array, shard: bool) -> jax.Array:
    """[m, n] output of a gmm run on rows moved to row 0: rows past the local groups zeroed (never written),
    then moved back to where the caller's rows are."""
    rows = jax.lax.broadcasted_iota(jnp.int32, (out.shape[0], 1), 0)
    out = jnp.where(rows < jnp.sum(sizes), out, jnp.zeros((), out.dtype))
    return jnp.roll(out, start, axis=0) if shard else out


# --------------------------------------------------------------------------------------------------------
# The kernels


def hopper_gmm(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array, *, block_m: int, block_n: int, block_k: int,
               max_concurrent_steps: int, grid_block_n: int, transpose_rhs: bool) -> jax.Array:
    """lhs [m, k], rhs [g, k, n] ([g, n, k] with transpose_rhs), one 16-bit dtype; sizes int32 [g] from row 0
    -> [m, n] in that dtype, rows past sum(sizes) unwritten (garbage). Pads to whole blocks and slices back."""
    if transpose_rhs and interpreting():
        # the interpreter's wgmma cannot read a transposed ref (`plgpu.transpose_ref`: "'TransposeTransform'
        # object has no attribute 'indices'"): there, rhs is transposed by XLA (the compiled kernel reads it
        # transposed in place, which the compile tests cover)
        rhs, transpose_rhs = jnp.swapaxes(rhs, 1, 2), False
    if rhs.shape[0] == 1 and interpreting():
        # one group: XLA:CPU's compiler dies compiling the interpreted kernel (SIGFPE, a division by zero it
        # folds); an empty second group avoids it
        rhs, sizes = pad_to(rhs, 0, 2), jnp.concatenate([sizes, jnp.zeros((1,), sizes.dtype)])
    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    lhs_p = pad_to(pad_to(lhs, 0, block_m), 1, block_k)
    rhs_p = pad_to(pad_to(rhs, 2 if transpose_rhs else 1, block_k), 1 if transpose_rhs else 2, block_n)
    with upstream_kernels() as (hopper, _, _):
        out = hopper.ragged_dot(lhs_p, rhs_p, group_sizes=sizes, block_m=block_m, block_n=block_n, block_k=block_k,
                                max_concurrent_steps=max_concurrent_steps, grid_block_n=grid_block_n,
                                transpose_rhs=transpose_rhs)
    return out[:m, :n]


def blackwell_gmm(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array, *, tile_m: int, tile_n: int, tile_k: int,
                  max_concurrent_steps: int, collective: bool, grid_tile_width: int, grid_minor_dim: int,
                  epilogue_tile_n: int, transpose_rhs: bool) -> jax.Array:
    """As `hopper_gmm`, on Blackwell's kernel: tiles of `tile_m` rows per CTA (a 2-CTA `collective` pair
    computes 2 x tile_m by 2 x tile_n). With transpose_rhs, rhs [g, n, k] is transposed by XLA first."""
    _, _, blackwell = _upstream()
    if transpose_rhs:
        rhs = jnp.swapaxes(rhs, 1, 2)
    m, k = lhs.shape
    n = rhs.shape[2]
    pair = 2 if collective else 1
    lhs_p = pad_to(pad_to(lhs, 0, tile_m * pair), 1, tile_k)
    rhs_p = pad_to(pad_to(rhs, 1, tile_k), 2, tile_n * pair)
    dims = blackwell.blackwell_matmul_mgpu.MatmulDimension
    config = blackwell.TuningConfig(tile_m=tile_m, tile_n=tile_n, tile_k=tile_k,
                                    max_concurrent_steps=max_concurrent_steps, collective=collective,
                                    grid_tile_width=grid_tile_width, grid_minor_dim=dims(grid_minor_dim),
                                    epilogue_tile_n=epilogue_tile_n)
    with upstream_kernels() as (_, _, blackwell):
        out = blackwell.ragged_dot_kernel(lhs_p, rhs_p, sizes, config)
    return out[:m, :n]


def hopper_tgmm(lhs: jax.Array, dout: jax.Array, sizes: jax.Array, *, block_m: int, block_n: int, block_k: int,
                max_concurrent_steps: int, grid_block_n: int) -> jax.Array:
    """lhs [m, k], dout [m, n], one 16-bit dtype; sizes int32 [g] from row 0 -> [g, k, n] in that dtype:
    out[i] = lhs[rows of group i]^T @ dout[same rows]. The kernel's own names: its `k` is our rows (tiled by
    block_k), its `m` our k (block_m), its `n` ours (block_n). Pads k, n and the rows to whole blocks."""
    _, k = lhs.shape
    n = dout.shape[1]
    lhs_p = pad_to(pad_to(lhs, 0, block_k), 1, block_m)
    dout_p = pad_to(pad_to(dout, 0, block_k), 1, block_n)
    with upstream_kernels() as (_, transposed, _):
        out = transposed.transposed_ragged_dot(lhs_p, dout_p, group_sizes=sizes, block_m=block_m, block_n=block_n,
                                               block_k=block_k, max_concurrent_steps=max_concurrent_steps,
                                               grid_block_n=grid_block_n)
    return out[:, :k, :n]
