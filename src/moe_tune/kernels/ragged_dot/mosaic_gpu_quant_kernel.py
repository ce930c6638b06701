"""The Hopper (sm_90) quantized grouped matmul kernel of the `mosaic_gpu_quant` backend: weights of 8 or 4 bits
dequantized in registers and fed to `wgmma` as its register (A) operand, the tokens read by `wgmma` from
shared memory (B). Swap-AB: the weights' n rows take wgmma's 64-row M side, the tokens its N side, so that a
decode step with a handful of rows per expert still fills the tensor cores' rows, and the accumulator holds
the output transposed.

    out_t[g-tile][n, rows] = sum over k steps of dequant(w_t[g][n, k-step]) @ x_t[k-step, rows]

Operands, as `swap_ab_gmm` takes them (`mosaic_gpu_quant.py` lays them out):
- x_t [k, tiles * block_m] bfloat16: the activations transposed, each group's rows starting on a block_m
  boundary (`tile_groups` says which group each block of block_m columns belongs to, `used_tiles` how many
  blocks hold rows): every output tile belongs to one group, so the stores are whole TMA tiles and no
  tile mixes groups.
- w_t [g, n, k]: the weights stored per group with the contraction contiguous (the "nk" storage), int8,
  float8_e4m3fn or int4; a weight tile is [block_n, block_k], the A operand's rows.
- scale float32: [g, 1, n] one per output channel (applied to the accumulator once after the k loop,
  `quant_plan.Apply.OUTPUT`), or [g, k / block, n] per block of `block` along k (each weight tile is
  multiplied by its k block's scale row in registers before its wgmma, `Apply.DEQUANTIZE`; block_k divides
  the block).
- out_t [n, tiles * block_m] bfloat16 (float32 accumulation); blocks past `used_tiles` are not written.

The gradient dx = dout @ W^T (dlhs) is the same kernel with the roles renamed: x_t is dout transposed [n,
tokens], the weights' tile is [block_n rows of k, block_k of n] of the "kn" storage [g, k, n] (n, the
contraction here, contiguous), and a block scale [g, k / block, n] lies along the output k (`scale_along`
"output": one row of n scales per output tile, multiplying the tile's columns; block_n divides the block).
Its per-channel scale is folded into dout before the kernel (`quant_plan`: FOLD), which then applies none.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from moe_tune.kernels.ragged_dot.tile_quant import decode_e2m1

SCALE_NONE, SCALE_OUTPUT, SCALE_DEQUANTIZE = "none", "output", "dequantize"
ALONG_REDUCTION, ALONG_OUTPUT = "reduction", "output"  # the axis a DEQUANTIZE scale's blocks run along
KERNEL_ENTRY = "moe_tune_quant_gmm_mosaic_gpu_kernel"  # the kernel's .entry in its PTX


def swap_ab_gmm(x_t: jax.Array, w_t: jax.Array, scale: jax.Array, tile_groups: jax.Array, used_tiles: jax.Array, *,
                block_m: int, block_n: int, block_k: int, steps: int, scale_at: str, block: int,
                out_dtype: jnp.dtype, interpret: bool, scale_along: str = ALONG_REDUCTION,
                e2m1_bits: bool = False) -> jax.Array:
    """out_t [n, tiles * block_m] = per tile t: dequant(w_t[tile_groups[t]]) @ x_t[:, tile t] (module docstring).

    x_t [k, tiles * block_m] 16-bit; w_t [g, n, k] quantized; scale f32 [g, 1, n] (scale_at "output") or
    [g, k / block, n] ("dequantize"); tile_groups int32 [tiles]; used_tiles int32 [1]. k % block_k == 0,
    n % block_n == 0, block_n % 64 == 0; with "dequantize", block % block_k == 0 (block % block_n == 0 along
    the output: scale [g, n / block, k], dlhs), or, along k only, block_k % block == 0 (several scale rows a
    step, each for its block's columns). scale_at "none": `scale` is not read. e2m1_bits: w_t holds e2m1
    (mxfp4) codes as int4 bits (sm_90 converts no float4), decoded in registers (`tile_quant.decode_e2m1`)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    k, columns = x_t.shape
    _, n, _ = w_t.shape
    tiles = columns // block_m
    k_steps = k // block_k
    compute = x_t.dtype
    along_output = scale_along == ALONG_OUTPUT
    per_scale = max(1, block // (block_n if along_output else block_k))  # output tiles / k steps a scale row
    # scale rows a k step holds: several where the blocks are shorter than the step (mxfp4's 32), along k only
    rows_per_step = 1 if along_output else max(1, block_k // block)
    e2m1 = jnp.dtype(w_t.dtype) == jnp.dtype(jnp.int4) and e2m1_bits

    def dequantized(w_smem, scale_smem):
        """The weight tile [block_n, block_k] in the compute dtype, scaled by its k block's row of scales
        (dequantize), in registers."""
        w = w_smem[...]  # layout inference loads it in the layout wgmma's A takes after the conversion
        if e2m1:
            w = decode_e2m1(w)  # float32, exact
        if scale_at != SCALE_DEQUANTIZE:
            # sm_90 has no fp8 -> bf16 conversion: through float32 (exact either way)
            return (w.astype(jnp.float32) if jnp.issubdtype(w.dtype, jnp.floating) else w).astype(compute)
        (s_smem,) = scale_smem
        # a scale per row of the tile (along the reduction: per output channel) or per column (along the output)
        axis = 1 if along_output else 0

        def row(j):
            vector = (s_smem[j] if interpret
                      else plgpu.load(s_smem.at[j], (), layout=plgpu.Layout.WGMMA.reduce(1 - axis)))
            return lax.broadcast_in_dim(vector, w.shape, [axis])

        scales = row(0)
        if rows_per_step > 1:  # the step's columns of block j take scale row j
            column = (lax.broadcasted_iota(jnp.int32, w.shape, 1) if interpret
                      else plgpu.broadcasted_iota(jnp.int32, w.shape, 1, layout=plgpu.Layout.WGMMA))
            for j in range(1, rows_per_step):
                scales = jnp.where(column >= j * block, row(j), scales)
        # in float32: the product is rounded once (and sm_90 converts fp8 to bf16 through float32)
        return (w.astype(jnp.float32) * scales).astype(compute)

    def moe_tune_quant_gmm(groups_gmem, used_gmem, x_gmem, w_gmem, s_gmem, o_gmem):  # the PTX entry's name
        t, ni = lax.axis_index("m"), lax.axis_index("n")
        group = groups_gmem[t]

        def k_loop(acc_ref, a_smem=None):
            """The pipelined k steps into acc_ref; `a_smem`: the interpreter's stand-in for the register
            operand (its wgmma reads refs only)."""

            def step(_, x_smem, w_smem, *scale_smem):
                w = dequantized(w_smem, scale_smem)
                if a_smem is not None:
                    a_smem[...] = w
                    w = a_smem
                plgpu.wgmma(acc_ref, w, x_smem)
                plgpu.wgmma_wait(0)  # the register operand and x's buffer stay live until the wgmma is done

            specs = [plgpu.BlockSpec((block_k, block_m), lambda kk: (kk, t)),
                     plgpu.BlockSpec((block_n, block_k), lambda kk: (ni, kk))]
            refs = [x_gmem, w_gmem.at[group]]
            if scale_at == SCALE_DEQUANTIZE and along_output:
                specs.append(plgpu.BlockSpec((1, block_k), lambda kk: (ni // per_scale, kk)))
                refs.append(s_gmem.at[group])
            elif scale_at == SCALE_DEQUANTIZE:
                specs.append(plgpu.BlockSpec((rows_per_step, block_n), lambda kk: (kk // per_scale, ni)))
                refs.append(s_gmem.at[group])
            plgpu.emit_pipeline(step, grid=(k_steps,), in_specs=specs, max_concurrent_steps=steps)(*refs)
            return acc_ref[...]

        def acc_scope(acc_ref):
            if interpret:
                return pl.run_scoped(functools.partial(k_loop, acc_ref), plgpu.SMEM((block_n, block_k), compute))
            return k_loop(acc_ref)

        @pl.when(t < used_gmem[0])
        def _():
            acc = pl.run_scoped(acc_scope, plgpu.ACC((block_n, block_m)))
            if scale_at == SCALE_OUTPUT:
                acc = acc * lax.broadcast_in_dim(_output_scale(s_gmem, group, ni), acc.shape, [0])

            @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((block_n, block_m), out_dtype))
            def _store(o_smem):
                o_smem[...] = acc.astype(out_dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[pl.ds(ni * block_n, block_n), pl.ds(t * block_m, block_m)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def _output_scale(s_gmem, group, ni):
        """float32 [block_n]: the tile's per-channel scales, brought to shared memory by TMA."""

        def load(s_smem, barrier):
            plgpu.copy_gmem_to_smem(s_gmem.at[group, pl.ds(0, 1), pl.ds(ni * block_n, block_n)], s_smem, barrier)
            plgpu.barrier_wait(barrier)
            return s_smem[0] if interpret else plgpu.load(s_smem.at[0], (), layout=plgpu.Layout.WGMMA.reduce(1))

        return pl.run_scoped(load, plgpu.SMEM((1, block_n), jnp.float32), plgpu.Barrier())

    interpret_params = None
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        interpret_params = InterpretGPUParams()
    kernel = plgpu.kernel(
        moe_tune_quant_gmm, out_type=jax.ShapeDtypeStruct((n, columns), out_dtype), grid=(tiles, n // block_n),
        grid_names=("m", "n"), interpret=interpret_params,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    return kernel(tile_groups, used_tiles, x_t, w_t, scale)
