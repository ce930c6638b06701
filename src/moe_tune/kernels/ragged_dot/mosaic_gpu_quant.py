"""`mosaic_gpu_quant` backend: quantized weights (int8 per channel; float8_e4m3fn, int4 and mxfp4 in blocks along
k) on Hopper's tensor cores through this project's Mosaic GPU kernel (`mosaic_gpu_quant_kernel.swap_ab_gmm`):
the weights dequantized in registers and fed to `wgmma` as its A operand, swap-AB (weights on the 64-row
side, tokens on the N side), float32 accumulation, a 16-bit result. The forward and dlhs (dx = dout @ W^T:
the same kernel, the weights read as stored [g, k, n], k on the tile's rows).

Where each scale applies is `quant_plan`'s rule, read with `with_dequantize(True)`: one scale per channel
multiplies the accumulator once after the k loop (OUTPUT); a block scale along k multiplies each weight tile
in registers before its wgmma (DEQUANTIZE: the tile is dequantized, then one dot per k step; blocks shorter
than the step, mxfp4's 32, take one scale row each). mxfp4's e2m1 codes are read as their int4 bits (sm_90
converts no float4) and decoded in registers.

What the wrapper does around the kernel (`gmm`): the forward reads the weights in the "nk" storage
(`QArray.layout`: [g, n, k], k contiguous, the A operand's rows; a "kn" array is transposed by XLA first,
`quant.in_layout`) and the block scales as [g, k / block, n] (one row of n per k block: a TMA tile of block_n
float32); dlhs reads "kn" and its scales as they are. The rows of each local group are placed on whole
blocks of block_m tokens (`placement`), transposed ([k, tokens]: wgmma's B operand), so that every output
tile belongs to one group and is stored whole; the transposed output is read back to the callers' rows,
zero for rows outside the local groups (past sum(group_sizes), other shards).

What no config can run (`chip_error`, so that the op falls back with one warning): a GPU other than sm_90
(off a GPU the kernel runs in Mosaic GPU's interpreter); float weights (the `mosaic_gpu` backend's);
quantized activations; scale blocks that tiles of 64 along k cannot hold whole (dlhs: shorter than 64, so
mxfp4's dlhs falls back); drhs (it reads no quantized weights); activations other than bfloat16 / float16, or
a result of another dtype. dlhs with one scale per channel rounds the folded dout
(dout times the scale, float32) to the activations' 16-bit dtype for wgmma.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_tune.core import devices
from moe_tune.core.quant import QArray, in_layout
from moe_tune.kernels.base import KernelConfig
from moe_tune.kernels.pallas_util import pad_to
from moe_tune.kernels.ragged_dot import mosaic_gpu_kernels as kernels
from moe_tune.kernels.ragged_dot import mosaic_gpu_quant_kernel as qkernel
from moe_tune.kernels.ragged_dot import mosaic_gpu_smem as smem
from moe_tune.kernels.ragged_dot.base import RaggedDotBackend
from moe_tune.kernels.ragged_dot.mosaic_gpu import HOPPER, LOW_PRECISION, MMA_ROWS, chip, fit_block
from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem
from moe_tune.kernels.ragged_dot.quant_plan import Apply, gmm_plan, problem_plan
from moe_tune.kernels.ragged_dot.quantized import prepare_gmm

WEIGHT_DTYPES = ("int8", "float8_e4m3fn", "int4", "float4_e2m1fn")
FOUR_BIT = ("int4", "float4_e2m1fn")
TOKEN_BLOCKS = (16, 32, 64, 128, 256)  # wgmma N; 16-bit TMA rows of 32, 64 or 128 bytes (or whole swizzles)
# The float32 accumulator (block_n x block_m) a thread of the warpgroup holds, at most: ptxas (sm_90) fits
# 128 a thread with the dequantized tile beside it (255 registers, no spill, at 128 x 128 x 128 int4 and
# 256 x 64 x 64 fp8), and spills at 256 (256 x 128 x 64 int8: 768 bytes).
ACCUMULATOR_BUDGET = 128


@dataclasses.dataclass(frozen=True)
class MosaicGpuQuantConfig(KernelConfig):
    """Tiles of the swap-AB matmul: block_n weight rows (output columns; wgmma's M, a multiple of 64),
    block_m tokens (wgmma's N), block_k of the contraction per pipeline step; max_concurrent_steps: shared-
    memory buffers of each operand (the pipeline's depth). swap_ab: the weights on wgmma's A (register)
    side; False (weights through shared memory on the B side) is not built."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    max_concurrent_steps: int = 4
    swap_ab: bool = True


class MosaicGpuQuantRaggedDot(RaggedDotBackend):
    name = "mosaic_gpu_quant"
    revision = 1
    config_cls = MosaicGpuQuantConfig
    platforms = ("gpu",)
    jax_versions = ">=0.10.2,<0.12"  # Mosaic GPU's Pallas API and interpreter as read in 0.10.2; 0.11 on GPUs
    description = ("quantized weights dequantized in registers into wgmma (sm_90, swap-AB, Mosaic GPU); "
                   "interpreted elsewhere")

    def runs_on(self, platform: str) -> bool:
        return True  # compiled on GPU, in Mosaic GPU's interpreter elsewhere

    def chip_error(self, problem: RaggedDotProblem) -> str | None:
        if chip() != HOPPER:
            capability = devices.gpu_compute_capability()
            have = "an unknown GPU" if capability is None else f"sm_{capability[0]}{capability[1]}"
            return f"the Mosaic GPU quantized kernel needs sm_90 (wgmma with a register operand), this is {have}"
        if problem.rhs_qdtype is None:
            return "float weights: the mosaic_gpu backend serves them (this kernel dequantizes quantized weights)"
        if problem.lhs_qdtype is not None:
            return "quantized activations: this kernel reads 16-bit activations"
        if problem.rhs_qdtype not in WEIGHT_DTYPES:
            return f"{problem.rhs_qdtype} weights: this kernel dequantizes {', '.join(WEIGHT_DTYPES)}"
        if problem.direction == "drhs":
            return "drhs: it reads no quantized weights (the float kernels' direction)"
        a, _, out = problem.operand_dtypes()
        if a not in LOW_PRECISION:
            return f"{a} activations: the kernel feeds wgmma {' or '.join(LOW_PRECISION)} (the dequantized dtype)"
        if out != a:
            return f"a {out} result from {a} activations: the kernel writes the activations' dtype"
        if (placed := _scale_at(problem)) is None:
            return f"a scale block of {problem.rhs_qblock}: neither one per channel nor blocks along k"
        # fwd: one scale row per block of a k step (block_k 64: blocks dividing 64 or multiples of it); dlhs: one
        # per output tile of k rows (block_n, a multiple of 64)
        block = problem.rhs_qblock
        fits = block % MMA_ROWS == 0 or (problem.direction == "fwd" and MMA_ROWS % block == 0)
        if placed == qkernel.SCALE_DEQUANTIZE and not fits:
            if problem.direction == "fwd":
                return (f"a scale block of {block}: the kernel's tiles along k are multiples of {MMA_ROWS}, each "
                        "holding whole blocks or a part of one")
            return (f"a scale block of {block} in dlhs: the kernel's tiles along k are multiples of {MMA_ROWS} "
                    "rows, each within one block")
        return None

    def config_error(self, config: MosaicGpuQuantConfig, problem: RaggedDotProblem) -> str | None:
        if (reason := self.chip_error(problem)) is not None:
            return reason
        if not config.swap_ab:
            return ("swap_ab=False is not built: the weights are dequantized in registers, and registers feed "
                    "only wgmma's A operand (the weights' side under swap-AB)")
        bm, bn, bk = config.block_m, config.block_n, config.block_k
        if bn <= 0 or bn % MMA_ROWS or bn > 256:
            return f"block_n={bn} must be a multiple of {MMA_ROWS} up to 256 (wgmma's M, the weights' rows)"
        if bm not in TOKEN_BLOCKS:
            return f"block_m={bm} must be one of {TOKEN_BLOCKS} (wgmma's N, the tokens)"
        least = _least_block_k(problem)
        if bk <= 0 or bk % least or bk > 256:
            return f"block_k={bk} must be a multiple of {least} up to 256 for {problem.rhs_qdtype} weights"
        if _scale_at(problem) == qkernel.SCALE_DEQUANTIZE:
            # fwd: block_k steps along the scaled k; dlhs: block_n tiles it (the output)
            field, size = ("block_k", bk) if problem.direction == "fwd" else ("block_n", bn)
            several = problem.direction == "fwd" and size % problem.rhs_qblock == 0  # several blocks a step
            if problem.rhs_qblock % size and not several:
                return (f"{field}={size} must divide the scale block {problem.rhs_qblock} or be a multiple of it "
                        "(whole blocks a tile)" if problem.direction == "fwd"
                        else f"{field}={size} must divide the scale block {problem.rhs_qblock} (one scale row a tile)")
        if not 1 <= config.max_concurrent_steps <= 8:
            return f"max_concurrent_steps={config.max_concurrent_steps} must be in 1..8"
        if bn * bm > ACCUMULATOR_BUDGET * 128:
            return (f"block_n x block_m = {bn * bm}: a float32 accumulator of {bn * bm // 128} registers a thread, "
                    f"over the {ACCUMULATOR_BUDGET} one warpgroup holds without spilling")
        _, k, n = problem.matmul_dims()
        if bn > fit_block(256, n) or bk > fit_block(256, k, least):
            return f"block_n={bn} / block_k={bk} larger than the dimension they tile (n {n}, k {k})"
        if bm > fit_block(256, problem.m, 16):
            return f"block_m={bm} is larger than the rows ({problem.m})"
        need, budget = self.shared_memory_bytes(config, problem), devices.gpu_shared_memory_bytes()
        if need > budget:
            return f"needs {need} bytes of shared memory, over the {budget} bytes of one block"
        return None

    def shared_memory_bytes(self, config: MosaicGpuQuantConfig, problem: RaggedDotProblem) -> int:
        """Bytes of shared memory the kernel asks for, counted as Mosaic GPU counts them (`mosaic_gpu_smem`)."""
        a, _, out = (jnp.dtype(d).itemsize for d in problem.operand_dtypes())
        _, k, _ = problem.matmul_dims()
        bm, bn, bk = config.block_m, config.block_n, config.block_k
        bits = 4 if problem.rhs_qdtype in FOUR_BIT else 8
        steps = min(config.max_concurrent_steps, -(-k // bk))  # the pipeline's static grid cuts it
        buffers = [steps * bk * bm * a, steps * bn * bk * bits // 8]
        if _scale_at(problem) == qkernel.SCALE_DEQUANTIZE:  # rows of scales a step: of n (fwd), of k (dlhs)
            rows = max(1, bk // problem.rhs_qblock) if problem.direction == "fwd" else 1
            buffers.append(steps * rows * (bn if problem.direction == "fwd" else bk) * 4)
        pipeline = sum(_aligned(b) for b in buffers) + steps * smem.BARRIER_BYTES
        epilogue = _aligned(bn * bm * out)
        if _scale_at(problem) == qkernel.SCALE_OUTPUT:  # the per-channel scales, brought in by TMA
            epilogue = max(epilogue, _aligned(bn * 4) + smem.BARRIER_BYTES)
        return max(pipeline, epilogue)

    def default_config(self, problem: RaggedDotProblem) -> MosaicGpuQuantConfig:
        _, k, n = problem.matmul_dims()
        rows = -(-problem.m // problem.groups)  # tokens of a group on average: decode fills few columns
        block_m = next((b for b in TOKEN_BLOCKS if b >= rows), 64) if rows < 64 else 64
        block_k = 128 if problem.rhs_qblock is None or problem.rhs_qblock % 128 == 0 else 64
        block_n = fit_block(128, n)
        if problem.direction == "dlhs" and _scale_at(problem) == qkernel.SCALE_DEQUANTIZE:
            block_n, block_k = min(block_n, problem.rhs_qblock), 128  # output tiles of k within a scale block
        return MosaicGpuQuantConfig(block_m=block_m, block_n=block_n, block_k=fit_block(block_k, k),
                                    max_concurrent_steps=4)

    def candidate_values(self, problem: RaggedDotProblem) -> dict[str, list]:
        return {"block_m": [16, 32, 64, 128], "block_n": [64, 128, 256], "block_k": [64, 128, 256],
                "max_concurrent_steps": [2, 3, 4], "swap_ab": [True]}

    # ---- the kernels

    def gmm(self, lhs, rhs, group_sizes, *, config, out_dtype, group_offset=None, transpose_rhs=False):
        if not isinstance(rhs, QArray) or isinstance(lhs, QArray):
            raise TypeError("the mosaic_gpu_quant backend runs float activations against quantized weights (its "
                            "chip_error says why)")
        compute = jnp.dtype(lhs.dtype)
        if transpose_rhs:
            # dlhs: dx [m, k] = dout @ W^T; the weights read in the "kn" storage ([g, k, n]: the output k on
            # the tile's rows, the contraction n contiguous); a per-channel scale is folded into dout first
            ops = prepare_gmm(lhs, rhs, group_sizes, group_offset, True)
            x, values, scale = ops.lhs.astype(compute), ops.rhs, ops.rhs_scale
            placed, along = ops.plan(True).b.scale, qkernel.ALONG_OUTPUT
        else:
            weights = in_layout(rhs, ("nk",))  # [g, n, k]: the output n on the tile's rows, k contiguous
            x, values = lhs, weights.qvalue
            if values.dtype == jnp.float4_e2m1fn:  # sm_90 converts no float4: its bits as int4 (a free bitcast)
                values = jax.lax.bitcast_convert_type(values, jnp.int4)
            scale = jnp.swapaxes(weights.scale, 1, 2).astype(jnp.float32)  # [g, k/bs, n]
            plan = gmm_plan(lhs, None, jax.ShapeDtypeStruct((values.shape[0], *rhs.shape[1:]), values.dtype), scale,
                            transpose_rhs=False)
            placed, along = plan.with_dequantize(True).b.scale, qkernel.ALONG_REDUCTION
        e2m1 = jnp.dtype(rhs.dtype) == jnp.dtype(jnp.float4_e2m1fn)
        return self._swap_ab(x, values, scale, _SCALE_AT[placed], along, group_sizes, group_offset, config,
                             out_dtype, e2m1)

    @staticmethod
    def _swap_ab(x, values, scale, scale_at, along, group_sizes, group_offset, config, out_dtype, e2m1):
        """x [m, red] 16-bit, values [g, out, red] quantized, scale f32 [g, red/bs, out] (along the reduction)
        or [g, out/bs, red] (along the output) or None -> [m, out] in out_dtype, zero outside the local groups."""
        (m, red), (groups, out, _) = x.shape, values.shape
        bm, bn, bk = config.block_m, config.block_n, config.block_k
        if scale is None:  # nothing to apply: a placeholder the kernel does not read
            scale = jnp.ones((groups, 1, 1), jnp.float32)
        block = (red if along == qkernel.ALONG_REDUCTION else out) // scale.shape[1]
        sizes, start = kernels.local_groups(group_sizes, m, groups, group_offset)
        place = placement(sizes, start, m, bm)
        x_t = jnp.zeros((red, place.tiles * bm), x.dtype).at[:, place.column].set(x.T, mode="drop")
        x_t = pad_to(x_t, 0, bk)
        values = pad_to(pad_to(values, 1, bn), 2, bk)  # zero weights past the dims: they add nothing
        if scale.shape[2] > 1:  # scales along the padded minor dim too (out, or red along the output)
            scale = pad_to(scale, 2, bn if along == qkernel.ALONG_REDUCTION else bk)
        out_t = qkernel.swap_ab_gmm(
            x_t, values, scale, place.tile_groups, place.used, block_m=bm, block_n=bn, block_k=bk,
            steps=config.max_concurrent_steps, scale_at=scale_at, block=block, out_dtype=jnp.dtype(x.dtype),
            interpret=kernels.interpreting(), scale_along=along, e2m1_bits=e2m1)
        rows = jnp.take(out_t[:out], jnp.minimum(place.column, place.tiles * bm - 1), axis=1).T
        return jnp.where(place.valid[:, None], rows, jnp.zeros((), rows.dtype)).astype(out_dtype)

    def tgmm(self, lhs, dout, group_sizes, *, config, out_dtype, num_groups, group_offset=None):
        raise TypeError("the mosaic_gpu_quant backend has no drhs kernel (its chip_error refuses drhs)")


def _least_block_k(problem: RaggedDotProblem) -> int:
    """The shortest k step of the weights' tiles: 64, wgmma's K granule for a register operand read with
    the swizzles these tiles get (32 is refused by the compiler: "K must be a multiple of 64")."""
    return MMA_ROWS


def _aligned(size: int) -> int:
    return -(-size // smem.SMEM_ALIGNMENT) * smem.SMEM_ALIGNMENT


# quant_plan's placement of the weights' scale -> the kernel's (FOLD: applied to dout before the kernel)
_SCALE_AT = {Apply.OUTPUT: qkernel.SCALE_OUTPUT, Apply.DEQUANTIZE: qkernel.SCALE_DEQUANTIZE,
             Apply.FOLD: qkernel.SCALE_NONE, Apply.NONE: qkernel.SCALE_NONE}


def _scale_at(problem: RaggedDotProblem) -> str | None:
    """Where the kernel applies the weights' scale (`quant_plan` with its dequantize placement), None when
    no place fits."""
    return _SCALE_AT.get(problem_plan(problem).with_dequantize(True).b.scale)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the rows of the local groups lie in the kernel's token columns: each group from a block_m
    boundary on. column int32 [m]: the column of each caller row (tiles * block_m, past the end, for rows
    no local group owns); valid bool [m]; tile_groups int32 [tiles]: the group of each block of columns;
    used int32 [1]: blocks holding rows; tiles: the static bound cdiv(m, block_m) + groups - 1."""

    column: jax.Array
    valid: jax.Array
    tile_groups: jax.Array
    used: jax.Array
    tiles: int


def placement(sizes: jax.Array, start: jax.Array, m: int, block_m: int) -> Placement:
    """The placement of the local groups `sizes` (int32 [g], their rows from `start` on) on blocks of block_m
    columns (a group of s rows takes cdiv(s, block_m) blocks; together at most cdiv(m, block_m) + g - 1)."""
    groups = sizes.shape[0]
    tiles = -(-m // block_m) + groups - 1
    blocks = (sizes + block_m - 1) // block_m
    block_end = jnp.cumsum(blocks)
    row_end = jnp.cumsum(sizes)
    local = jnp.arange(m, dtype=jnp.int32) - start
    valid = (local >= 0) & (local < row_end[-1])
    group = jnp.clip(jnp.searchsorted(row_end, local, side="right"), 0, groups - 1)
    column = (block_end[group] - blocks[group]) * block_m + local - (row_end[group] - sizes[group])
    column = jnp.where(valid, column, tiles * block_m).astype(jnp.int32)
    tile_groups = jnp.clip(jnp.searchsorted(block_end, jnp.arange(tiles), side="right"), 0, groups - 1)
    return Placement(column, valid, tile_groups.astype(jnp.int32), block_end[-1:].astype(jnp.int32), tiles)
