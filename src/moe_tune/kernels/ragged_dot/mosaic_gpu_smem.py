"""Shared memory (and Blackwell's tensor memory) of the Mosaic GPU ragged-dot kernels, counted the way Mosaic
GPU counts it.

Pallas' Mosaic GPU lowering (`jax/_src/pallas/mosaic_gpu/lowering.py`, `_estimate_resources`) sizes a
kernel's shared memory from its `run_scoped` allocations: each allocation scope's buffers are summed, each
rounded up to `SMEM_ALIGNMENT` (1024 bytes), scopes nested inside one another add up, and scopes one after
the other take the larger of the two; barriers (8 bytes each) come after the buffers, and a kernel holding
tensor memory (TMEM, Blackwell) keeps 4 bytes for its address. `mosaic/gpu/core.py` then refuses a kernel
over the chip's opt-in limit (`Mosaic GPU kernel exceeds available shared memory: smem_bytes=... >
max_smem_bytes=232448`, 227 KiB on H100 and B200).

What each kernel allocates (read from the kernels in `jax.experimental.pallas.ops.gpu`):
- Hopper gmm: an `emit_pipeline` over the k steps with `steps` buffers of the lhs and rhs blocks and one
  barrier per buffer (`steps` is `max_concurrent_steps`, cut to the number of k steps: the pipeline does that
  when its grid is static); then, after it, the output block for the TMA store.
- Hopper tgmm: the same pipeline over a group's row blocks (a dynamic grid: `steps` is not cut), then the
  output block.
- Blackwell gmm: one scope with `steps` buffers of the lhs (`tile_m x tile_k`) and rhs (`tile_k x tile_n`,
  per CTA) blocks, the epilogue block (`tile_m x epilogue_tile_n`), 3 x `steps` + 4 barriers and TMEM.
- Blackwell tgmm (`mosaic_gpu_tgmm_sm100`, this project's): the same scope with `steps` lhs (`block_k x
  block_m`) and dout (`block_k x block_n`) blocks, the epilogue block and 3 x `steps` + 1 barriers.

Tensor memory (TMEM, sm_100): each allocation takes its columns (one per float32 value of a row), rounded up
to 8; the kernel's total is allocated rounded up to a power of two, at least 32, at most the 512 columns of an
SM (`_estimate_resources`' `tmem_scratch_cols`, then `tcgen05.tmem_alloc_exact_ncols`).

Checked against the compiler for every candidate of the search spaces (benchmarks/compile_check.py).
"""

from __future__ import annotations

SMEM_ALIGNMENT = 1024  # jax._src.pallas.mosaic_gpu.core.SMEM_ALIGNMENT
BARRIER_BYTES = 8  # jax.experimental.mosaic.gpu.utils.MBARRIER_BYTES
TMEM_ADDRESS_BYTES = 4
TMEM_COLUMNS = 512  # 32-bit columns of an SM's tensor memory (128 lanes each)


def _aligned(size: int) -> int:
    return -(-size // SMEM_ALIGNMENT) * SMEM_ALIGNMENT


def hopper_gmm_bytes(block_m: int, block_n: int, block_k: int, steps: int, k: int, itemsize: int,
                     out_itemsize: int) -> int:
    """Shared memory of `ragged_dot_mgpu.ragged_dot` for a contraction of `k` (already padded to block_k)."""
    steps = min(steps, k // block_k)
    pipeline = _aligned(steps * block_m * block_k * itemsize) + _aligned(steps * block_k * block_n * itemsize)
    store = _aligned(block_m * block_n * out_itemsize)
    return max(pipeline, store) + steps * BARRIER_BYTES


def hopper_tgmm_bytes(block_m: int, block_n: int, block_k: int, steps: int, itemsize: int,
                      out_itemsize: int) -> int:
    """Shared memory of `transposed_ragged_dot_mgpu.transposed_ragged_dot` (block_k tiles the rows)."""
    pipeline = _aligned(steps * block_k * block_m * itemsize) + _aligned(steps * block_k * block_n * itemsize)
    store = _aligned(block_m * block_n * out_itemsize)
    return max(pipeline, store) + steps * BARRIER_BYTES


def blackwell_gmm_bytes(tile_m: int, tile_n: int, tile_k: int, steps: int, epilogue_tile_n: int, itemsize: int
                        ) -> int:
    """Shared memory of `blackwell_ragged_dot_mgpu.ragged_dot_kernel` (tiles per CTA; a 2-CTA pair holds the
    same in each CTA)."""
    return _with_tmem(steps * tile_m * tile_k * itemsize, steps * tile_k * tile_n * itemsize,
                      tile_m * epilogue_tile_n * itemsize, barriers=3 * steps + 4)


def blackwell_tgmm_bytes(block_m: int, block_n: int, block_k: int, steps: int, epilogue_tile_n: int,
                         itemsize: int) -> int:
    """Shared memory of `mosaic_gpu_tgmm_sm100` (block_k tiles the rows): one scope with `steps` lhs and dout
    blocks, the epilogue block, 3 x `steps` + 1 barriers and TMEM."""
    return _with_tmem(steps * block_k * block_m * itemsize, steps * block_k * block_n * itemsize,
                      block_m * epilogue_tile_n * itemsize, barriers=3 * steps + 1)


def _with_tmem(*buffers: int, barriers: int) -> int:
    """One allocation scope of `buffers` (bytes each) and `barriers`, in a kernel holding TMEM."""
    return sum(_aligned(b) for b in buffers) + barriers * BARRIER_BYTES + TMEM_ADDRESS_BYTES


def tmem_columns(*float32_columns: int) -> int:
    """TMEM columns a kernel allocates for float32 allocations of these many columns each (over
    TMEM_COLUMNS: the kernel cannot be built)."""
    used = sum(-(-c // 8) * 8 for c in float32_columns)
    return max(32, 1 << (used - 1).bit_length())
