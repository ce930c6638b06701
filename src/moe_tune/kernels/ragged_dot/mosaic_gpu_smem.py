"""Shared memory of JAX's Mosaic GPU ragged-dot kernels, counted the way Mosaic GPU counts it.

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

Checked against the compiler for every candidate of the search spaces (benchmarks/compile_check.py).
"""

from __future__ import annotations

SMEM_ALIGNMENT = 1024  # jax._src.pallas.mosaic_gpu.core.SMEM_ALIGNMENT
BARRIER_BYTES = 8  # jax.experimental.mosaic.gpu.utils.MBARRIER_BYTES
TMEM_ADDRESS_BYTES = 4


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
    buffers = (_aligned(steps * tile_m * tile_k * itemsize) + _aligned(steps * tile_k * tile_n * itemsize)
               + _aligned(tile_m * epilogue_tile_n * itemsize))
    return buffers + (3 * steps + 4) * BARRIER_BYTES + TMEM_ADDRESS_BYTES
