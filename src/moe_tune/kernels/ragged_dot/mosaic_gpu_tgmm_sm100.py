"""drhs on Blackwell (sm_100): a transposed ragged dot written in Pallas Mosaic GPU with tcgen05 and TMEM.

    out[i] = lhs[rows of group i]^T @ dout[rows of group i]      lhs [m, k], dout [m, n] -> out [g, k, n]

JAX 0.10.2 / 0.11 ship no tcgen05 transposed ragged dot (their `transposed_ragged_dot_mgpu` issues wgmma,
which sm_100 does not have), so this module has its own. Written for this project from the Mosaic GPU
primitives (`plgpu.tcgen05_mma`, `plgpu.TMEM`, `plgpu.async_load_tmem`, TMA copies and barriers).

How the work is cut (the names are the backend's tgmm names: `block_m` tiles k, `block_n` tiles n,
`block_k` tiles the rows being contracted):
- XLA first lays the rows out group by group, each group starting on a whole row block with zero rows up to
  the next one (`_padded_rows`: a gather of lhs and dout). No row block then holds rows of two groups, so the
  kernel needs no masking, and a shard's local groups (`group_offset`) and rows past sum(group_sizes) are
  simply never gathered.
- One CTA per output tile (group, k tile, n tile). Inside it one warp issues the TMA copies of the group's row
  blocks into `max_concurrent_steps` shared-memory slots, another issues one tcgen05 MMA per row block,
  (block_m x block_k)^T-read lhs block times the (block_k x block_n) dout block, accumulating float32 in TMEM
  (block_m lanes x block_n columns); an MMA frees its slot through a barrier the tensor core arrives on. The
  warpgroup then reads the accumulator out of TMEM in `epilogue_tile_n`-column slices, casts it to the
  operands' dtype and stores it with TMA.
- Empty groups compute nothing; their tiles are zeroed by XLA after the kernel (the kernel skips them and
  leaves their output unwritten).

Not run on a GPU here, and not in an interpreter: Mosaic GPU's interpreter has no TMEM ("Unsupported memory
space: tmem"). It is compiled for a B200 by the real compiler (tests/test_real_compilers_mosaic_gpu.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_tune.kernels.pallas_util import pad_to

TCGEN05_ROWS = 128  # the tcgen05 M this kernel issues: block_m (tiles of k) is always 128 lanes of TMEM
SWIZZLE_BYTES = 128  # every tile's minor dimension is a multiple of 64 16-bit values: the 128-byte swizzle


def blackwell_tgmm(lhs: jax.Array, dout: jax.Array, sizes: jax.Array, start: jax.Array, *, block_m: int,
                   block_n: int, block_k: int, max_concurrent_steps: int, epilogue_tile_n: int) -> jax.Array:
    """lhs [m, k], dout [m, n] of one 16-bit dtype; sizes int32 [g] of the local groups, whose rows start at
    row `start` (int32 scalar) -> [g, k, n] in that dtype, float32-accumulated; groups of size 0 give zeros."""
    if lhs.dtype != dout.dtype:
        raise ValueError(f"lhs {lhs.dtype} and dout {dout.dtype} must have one dtype")
    _, k = lhs.shape
    n = dout.shape[1]
    groups = sizes.shape[0]
    lhs_p, dout_p, block_starts = _padded_rows(lhs, dout, sizes, start, block_k)
    lhs_p, dout_p = pad_to(lhs_p, 1, block_m), pad_to(dout_p, 1, block_n)
    out = _kernel(lhs_p, dout_p, block_starts, groups=groups, block_m=block_m, block_n=block_n, block_k=block_k,
                  steps=max_concurrent_steps, epilogue_tile_n=epilogue_tile_n)
    out = out[:, :k, :n]
    return jnp.where((sizes > 0)[:, None, None], out, jnp.zeros((), out.dtype))


def _padded_rows(lhs: jax.Array, dout: jax.Array, sizes: jax.Array, start: jax.Array, rows: int
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(lhs [p, k], dout [p, n], int32 [g + 1] first row block of each group and the end of the last): the
    local groups' rows, each group from a multiple of `rows` on, zero rows between; p, a multiple of `rows`, is
    the most any group sizes summing to at most m can need."""
    m = lhs.shape[0]
    groups = sizes.shape[0]
    blocks = -(-sizes // rows)
    block_starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(blocks).astype(jnp.int32)])
    row_starts = start + jnp.cumsum(sizes) - sizes  # first row of each group in the caller's rows
    padded = (-(-m // rows) + groups) * rows  # sum(ceil(s / rows)) <= ceil(m / rows) + groups - 1
    block = jnp.arange(padded, dtype=jnp.int32) // rows
    group = jnp.searchsorted(block_starts[1:], block, side="right").astype(jnp.int32)  # == groups: past the last
    safe = jnp.minimum(group, groups - 1)
    within = jnp.arange(padded, dtype=jnp.int32) - block_starts[safe] * rows
    valid = (group < groups) & (within < sizes[safe])
    source = jnp.clip(row_starts[safe] + within, 0, m - 1)

    def gather(x: jax.Array) -> jax.Array:
        return jnp.where(valid[:, None], jnp.take(x, source, axis=0), jnp.zeros((), x.dtype))

    return gather(lhs), gather(dout), block_starts


def _kernel(lhs: jax.Array, dout: jax.Array, block_starts: jax.Array, *, groups: int, block_m: int, block_n: int,
            block_k: int, steps: int, epilogue_tile_n: int) -> jax.Array:
    """The tcgen05 kernel on rows laid out by `_padded_rows`: lhs [p, k] (k a multiple of block_m), dout [p, n]
    (n a multiple of block_n), block_starts int32 [g + 1] -> [g, k, n] (tiles of empty groups unwritten)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    dtype = lhs.dtype
    k, n = lhs.shape[1], dout.shape[1]
    swizzle_elems = SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
    transforms = (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(SWIZZLE_BYTES))
    copy_warp, mma_warp = 0, 1

    def body(lhs_gmem, dout_gmem, starts_gmem, out_gmem, lhs_smem, dout_smem, out_smem, lhs_loaded, dout_loaded,
             consumed, done, acc):
        group, k_tile, n_tile = (jax.lax.axis_index(axis) for axis in ("g", "k", "n"))
        first = starts_gmem[group]
        count = starts_gmem[group + 1] - first
        k_slice, n_slice = pl.ds(k_tile * block_m, block_m), pl.ds(n_tile * block_n, block_n)

        @pl.when(count > 0)
        def _():
            @pl.core_map(plgpu.WarpMesh(axis_name="warp"))
            def _per_warp():
                warp = jax.lax.axis_index("warp")

                @pl.when(warp == copy_warp)
                def _copy():
                    def step(i, carry):
                        slot = jax.lax.rem(i, steps)

                        @pl.when(i >= steps)  # the slot's previous block must have been read by its MMA
                        def _():
                            plgpu.barrier_wait(consumed.at[slot])

                        rows = pl.ds((first + i) * block_k, block_k)
                        plgpu.copy_gmem_to_smem(lhs_gmem.at[rows, k_slice], lhs_smem.at[slot], lhs_loaded.at[slot])
                        plgpu.copy_gmem_to_smem(dout_gmem.at[rows, n_slice], dout_smem.at[slot],
                                                dout_loaded.at[slot])
                        return carry

                    jax.lax.fori_loop(0, count, step, None)

                @pl.when(warp == mma_warp)
                def _mma():
                    def step(i, carry):
                        slot = jax.lax.rem(i, steps)
                        plgpu.barrier_wait(lhs_loaded.at[slot])
                        plgpu.barrier_wait(dout_loaded.at[slot])
                        # [block_m, block_k] (lhs block read transposed) @ [block_k, block_n] into TMEM
                        plgpu.tcgen05_mma(acc, plgpu.transpose_ref(lhs_smem.at[slot], (1, 0)), dout_smem.at[slot],
                                          consumed.at[slot], accumulate=i > 0)
                        return carry

                    jax.lax.fori_loop(0, count, step, None)
                    plgpu.tcgen05_commit_arrive(done.at[0])  # arrives once every MMA issued above has finished

            plgpu.barrier_wait(done.at[0])
            for part in range(block_n // epilogue_tile_n):
                columns = pl.ds(part * epilogue_tile_n, epilogue_tile_n)
                out_smem[...] = plgpu.async_load_tmem(acc.at[:, columns], layout=plgpu.Layout.TCGEN05).astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    out_smem, out_gmem.at[group, k_slice, pl.ds(n_tile * block_n + part * epilogue_tile_n,
                                                                epilogue_tile_n)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # out_smem is written again next part
            plgpu.wait_load_tmem()

    scratch = dict(
        lhs_smem=plgpu.SMEM((steps, block_k, block_m), dtype, transforms=transforms),
        dout_smem=plgpu.SMEM((steps, block_k, block_n), dtype, transforms=transforms),
        out_smem=plgpu.SMEM((block_m, epilogue_tile_n), dtype),
        lhs_loaded=plgpu.Barrier(num_arrivals=1, num_barriers=steps),
        dout_loaded=plgpu.Barrier(num_arrivals=1, num_barriers=steps),
        consumed=plgpu.Barrier(num_arrivals=1, num_barriers=steps, orders_tensor_core=True),
        done=plgpu.Barrier(num_arrivals=1, num_barriers=1, orders_tensor_core=True),
        acc=plgpu.TMEM((block_m, block_n), jnp.float32),
    )
    call = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((groups, k, n), dtype),
        scratch_types=scratch,
        grid=(groups, k // block_m, n // block_n),
        grid_names=("g", "k", "n"),
        kernel_name=f"moe_tune_tgmm_sm100_{block_m}x{block_n}x{block_k}_s{steps}_e{epilogue_tile_n}",
    )
    return call(lhs, dout, block_starts)

