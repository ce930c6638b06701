"""`triton` backend: Pallas kernels for GPU (the Triton lowering) for gmm and tgmm; interpret mode elsewhere.

gmm walks the Megablox visit schedule (`metadata.py`): the grid is (visits, column blocks); a program
multiplies one `block_m`-row tile by its group's rhs block, `block_k` at a time, and stores only that
group's rows (a tile shared by two groups is visited twice, each visit storing disjoint rows). tgmm has one
program per (group, k block, n block), looping over the row tiles its group touches.

Operands are padded to whole blocks so that every load is in bounds (the same code then runs compiled and
in interpret mode); for the usual MoE shapes (k and n multiples of 128) only `m` ever needs padding.

Quantized operands (QArray, after `quantized.prepare_gmm` / `prepare_tgmm`) are loaded as 1-byte blocks
with their float32 scales, applied where the direction's plan says (`quant_plan.py`), one step function per
direction: where one STEP scale covers a whole `block_k` step the raw dot (int8 x int8 in int32) is
multiplied by it, and an OUTPUT scale (per row / channel) once after the k loop; otherwise (a shorter STEP
block, a DEQUANTIZE scale) the block is dequantized in the kernel from a gathered load of its scales.

4-bit weights: int4 blocks are loaded as Pallas' Triton lowering loads int4 (packed two a byte in memory,
unpacked in registers); mxfp4 (float4_e2m1fn, which Triton cannot load) travels as the same bits in int4 and
is decoded in the kernel (`tile_quant.decode_e2m1`). Activations quantized in the kernel (dynamic w8a8): each
k step is cut into their scale blocks, each block of x quantized where it is loaded (`tile_quant`, with
PTX's correctly rounded division and rounding) and multiplied by its weight block, int8 x int8 in int32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_tune.core import devices
from moe_tune.kernels.base import KernelConfig
from moe_tune.kernels.pallas_util import exact_f32_precision, interpreted, out_struct, pad_to, pallas_run
from moe_tune.kernels.ragged_dot.base import RaggedDotBackend, rows_in_local_groups
from moe_tune.kernels.ragged_dot.metadata import make_group_metadata
from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem
from moe_tune.kernels.ragged_dot.quant_plan import Apply, QuantPlan, gmm_plan, problem_plan, tgmm_plan
from moe_tune.kernels.ragged_dot.quantized import dot_dtypes, prepare_gmm, prepare_tgmm, with_absent_refs
from moe_tune.kernels.ragged_dot.tile_quant import block_scale, decode_e2m1, quantize_with

BLOCKS = (16, 32, 64, 128, 256)
# Smallest K of an 8-bit integer MMA on NVIDIA GPUs (16 for 16-bit floats): tl.dot rejects int8 x int8 below it.
MIN_INT8_BLOCK_K = 32


@dataclasses.dataclass(frozen=True)
class TritonConfig(KernelConfig):
    """Blocks of the matmul being run (for dlhs, block_k tiles n and block_n tiles k of the forward)."""

    block_m: int = 64
    block_k: int = 32
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


def _dot_dtype(plan: QuantPlan, a: jax.Array, b: jax.Array) -> jnp.dtype:
    """The one operand type of a float tile product (tl.dot takes one; mixed float inputs meet in float32).
    Quantized operands take the quantized steps' path instead, so any float type serves them here."""
    if plan.quantized:
        return jnp.dtype(jnp.float32)
    return jnp.promote_types(a.dtype, b.dtype)


def _scale_index(start, size: int, block: int, limit: int) -> jax.Array:
    """int32 [size]: the scale row of each of `size` entries from `start` (clipped: padding entries)."""
    return jnp.minimum((start + jnp.arange(size)) // block, limit - 1)


def _ptx(instruction: str, *args: jax.Array) -> jax.Array:
    """float32 `instruction` (PTX, operands $1.. of args' shape) elementwise: what Triton has no op for."""
    shape = args[0].shape
    operands = ",".join(["=r"] + ["r"] * len(args))
    [out] = plgpu.elementwise_inline_asm(
        instruction, args=[jnp.broadcast_to(a, shape) for a in args], constraints=operands, pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)])
    return out


def _quantize_tile(x: jax.Array, qdtype: str, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """(values in qdtype, float32 scales [rows, 1]) of a float tile x [rows, cols] that is one scale block per
    row (`tile_quant`). Compiled, XLA's arithmetic is spelled in PTX: Triton lowers no `round`, and its `/`
    is the approximate div.full.f32 (2 ulp), which would put a few values one step off `moe_tune.quantize`'s;
    div.rn is correctly rounded and cvt.rni rounds half to even, as XLA does."""
    divide = jnp.divide if interpret else (lambda a, b: _ptx("div.rn.f32 $0, $1, $2;", a, b))
    round_fn = jnp.round if interpret else (lambda v: _ptx("cvt.rni.f32.f32 $0, $1;", v))
    x = x.astype(jnp.float32)
    scale = block_scale(x, qdtype, divide=divide)
    return quantize_with(x, scale, qdtype, divide=divide, round_fn=round_fn), scale


def _gmm_kernel(group_ids, tile_ids, starts, ends, num_visits, lhs_ref, lhs_scale_ref, rhs_ref, rhs_scale_ref,
                out_ref, *, plan: QuantPlan, block_m, block_k, block_n, k_blocks, precision, dtype, interpret):
    visit, col_block = pl.program_id(0), pl.program_id(1)
    transpose_rhs = plan.direction == "dlhs"

    @pl.when(visit < num_visits[0])
    def _():
        group, row0 = group_ids[visit], tile_ids[visit] * block_m
        col0 = col_block * block_n
        rows, cols = pl.ds(row0, block_m), pl.ds(col0, block_n)

        def body(kb, acc):
            k0 = kb * block_k
            x = lhs_ref[rows, pl.ds(k0, block_k)]
            if transpose_rhs:  # rhs is [g, n_out, k_contract]
                w = rhs_ref[group, cols, pl.ds(k0, block_k)]
            else:
                w = rhs_ref[group, pl.ds(k0, block_k), cols]
            if not plan.quantized:
                # tl.dot takes one operand type: both tiles in the promoted dtype (mixed: float32)
                return acc + plgpu.dot(x.astype(dtype), w.astype(dtype), trans_b=transpose_rhs, precision=precision)
            if transpose_rhs:
                return acc + _dlhs_quantized_step(x, w, rhs_scale_ref, group, col0, k0, plan=plan, block_k=block_k,
                                                  block_n=block_n)
            if not plan.a.quantize_to:
                return acc + _fwd_quantized_step(x, w, lhs_scale_ref, rhs_scale_ref, group, row0, col0, k0,
                                                 plan=plan, block_m=block_m, block_k=block_k, block_n=block_n)
            # activations quantized here: a dot per scale block of theirs (one per row: the one k step)
            sub = block_k if plan.a.block == plan.k else plan.a.block
            for j in range(block_k // sub):
                k_sub = k0 + j * sub
                x_q, x_scale = _quantize_tile(lhs_ref[rows, pl.ds(k_sub, sub)], plan.a.quantize_to, interpret)
                w = rhs_ref[group, pl.ds(k_sub, sub), cols]
                acc = acc + _fwd_quantized_step(x_q, w, x_scale, rhs_scale_ref, group, row0, col0, k_sub,
                                                plan=plan, block_m=block_m, block_k=sub, block_n=block_n)
            return acc

        acc = jax.lax.fori_loop(0, k_blocks, body, jnp.zeros((block_m, block_n), jnp.float32))
        if plan.b.scale is Apply.OUTPUT:  # one scale per channel
            acc = acc * rhs_scale_ref[group, 0, cols][None, :]
        if plan.a.scale is Apply.OUTPUT and not plan.a.quantize_to:  # one scale per row (a dynamic one: above)
            acc = acc * lhs_scale_ref[rows, 0][:, None]
        keep = (row0 + jnp.arange(block_m) >= starts[group]) & (row0 + jnp.arange(block_m) < ends[group])
        plgpu.store(out_ref.at[rows, cols], acc.astype(out_ref.dtype),
                    mask=jnp.broadcast_to(keep[:, None], (block_m, block_n)))


def _fwd_quantized_step(x, w, lhs_scale, rhs_scale_ref, group, row0, col0, k0, *, plan: QuantPlan, block_m,
                        block_k, block_n):
    """One block_k step of a fwd gmm with quantized operands -> f32 [block_m, block_n]: a STEP scale whose
    block holds the whole step (`OperandPlan.scaled_after`) multiplies the raw dot; a shorter one dequantizes
    its operand from a gathered load of its scales. `lhs_scale`: the lhs scale ref, or for activations
    quantized in the kernel their rows' scales of this step [block_m, 1]. mxfp4 weights arrive as int4 bits
    (`tile_quant.decode_e2m1`)."""
    a, b = plan.a, plan.b
    if b.dtype == "float4_e2m1fn":
        w = decode_e2m1(w)
    operand, _ = dot_dtypes(*(jax.ShapeDtypeStruct((), op.dot_dtype) for op in plan.operands))
    if operand == jnp.int8 and block_k < MIN_INT8_BLOCK_K:  # a dynamic lhs's short blocks: exact in bfloat16
        operand = jnp.dtype(jnp.bfloat16)
    x, w = x.astype(operand), w.astype(operand)
    after = [lhs_scale] if a.quantize_to else []  # scales of the whole step: [block_m, 1] / [1, block_n]
    if b.scale is Apply.STEP:
        if b.scaled_after(block_k):
            after.append(rhs_scale_ref[group, k0 // b.block, pl.ds(col0, block_n)][None, :])
        else:
            k_rows = _scale_index(k0, block_k, b.block, rhs_scale_ref.shape[1])
            cols = (col0 + jnp.arange(block_n))[None, :]
            w = w.astype(jnp.float32) * rhs_scale_ref[group, k_rows[:, None], cols]
    if a.scale is Apply.STEP and not a.quantize_to:
        if a.scaled_after(block_k):
            after.append(lhs_scale[pl.ds(row0, block_m), k0 // a.block][:, None])
        else:
            k_cols = _scale_index(k0, block_k, a.block, lhs_scale.shape[1])
            x = x.astype(jnp.float32) * lhs_scale[(row0 + jnp.arange(block_m))[:, None], k_cols[None, :]]
    return _step_dot(x, w, after, trans_b=False)


def _dlhs_quantized_step(x, w, rhs_scale_ref, group, col0, k0, *, plan: QuantPlan, block_k, block_n):
    """One block_k step of a dlhs gmm (w [block_n, block_k] of rhs^T) -> f32 [block_m, block_n]: a DEQUANTIZE
    scale runs along w's rows (the output): w is dequantized from a gathered load of its scales; the dot
    runs in float32 (`QuantPlan.float32_dots`: dout is float, float32 where a per-channel scale was folded)."""
    if plan.b.dtype == "float4_e2m1fn":
        w = decode_e2m1(w)
    operand, _ = dot_dtypes(x, w)
    x, w = x.astype(operand), w.astype(operand)
    if plan.b.scale is Apply.DEQUANTIZE:
        out_rows = _scale_index(col0, block_n, plan.b.block, rhs_scale_ref.shape[1])
        w = w.astype(jnp.float32) * rhs_scale_ref[group, out_rows[:, None], (k0 + jnp.arange(block_k))[None, :]]
    return _step_dot(x, w, [], trans_b=True)


def _step_dot(x, w, after, *, trans_b: bool) -> jax.Array:
    """f32 x @ w (or w^T), times the step's `after` scales; x and w meet in float32 where one was dequantized."""
    if x.dtype != w.dtype:  # one side was dequantized: both in float32
        x, w = x.astype(jnp.float32), w.astype(jnp.float32)
    part = plgpu.dot(x, w, trans_b=trans_b, precision=exact_f32_precision(x.dtype)).astype(jnp.float32)
    for scale in after:
        part = part * scale
    return part


def _tgmm_kernel(starts, ends, lhs_ref, lhs_scale_ref, dout_ref, out_ref, *, plan: QuantPlan, block_m, block_k,
                 block_n, precision, dtype):
    group, k_block, n_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = starts[group], ends[group]

    def body(tile, acc):
        row0 = tile * block_m
        rows = row0 + jnp.arange(block_m)
        keep = ((rows >= start) & (rows < end))[:, None]
        x = lhs_ref[pl.ds(row0, block_m), pl.ds(k_block * block_k, block_k)]
        d = dout_ref[pl.ds(row0, block_m), pl.ds(n_block * block_n, block_n)]
        if plan.float32_dots:  # quantized lhs: float32 products (a per-row scale was folded into dout)
            x, d = x.astype(jnp.float32), d.astype(jnp.float32)
            if plan.a.scale is Apply.DEQUANTIZE:
                k_cols = _scale_index(k_block * block_k, block_k, plan.a.block, lhs_scale_ref.shape[1])
                x = x * lhs_scale_ref[rows[:, None], k_cols[None, :]]
        else:  # tl.dot takes one operand type: both tiles in the promoted dtype (mixed: float32)
            x, d = x.astype(dtype), d.astype(dtype)
        x = jnp.where(keep, x, jnp.zeros_like(x))
        return acc + plgpu.dot(x, d, trans_a=True, precision=precision)

    first, last = start // block_m, (end + block_m - 1) // block_m
    acc = jax.lax.fori_loop(first, jnp.maximum(first, last), body, jnp.zeros((block_k, block_n), jnp.float32))
    out_ref[...] = acc.astype(out_ref.dtype)


def _dot_k(plan: QuantPlan, block_k: int) -> int:
    """The contraction of one dot: block_k, or for activations quantized in the kernel their scale block
    (a dot per block; one per row: the whole step)."""
    a = plan.a
    return block_k if not a.quantize_to or a.block == plan.k else min(a.block, block_k)


def _int8_dot(plan: QuantPlan, block_k: int) -> bool:
    """Whether the kernel's dots run int8 x int8: both operands integer where they meet the dot (int8, int4
    weights converted; a dynamic lhs quantized to int8; fwd only: a gradient's dout is float) and every STEP
    scale block a multiple of the dot's k (a shorter one dequantizes the step to float32). A dynamic lhs's
    blocks shorter than an int8 dot's k meet the weights in bfloat16 instead (`_fwd_quantized_step`)."""
    if not all(jnp.issubdtype(jnp.dtype(op.dot_dtype), jnp.integer) for op in plan.operands):
        return False
    step = _dot_k(plan, block_k)
    if plan.a.quantize_to and step < MIN_INT8_BLOCK_K:
        return False
    return all(op.scale is not Apply.STEP or op.quantize_to or op.scaled_after(step) for op in plan.operands)


def _dequantized_block(plan: QuantPlan, block_k: int) -> int | None:
    """The scale block of an operand that a k step of `block_k` dequantizes in the kernel (a STEP scale block
    shorter than the dot's k, activations quantized here aside), else None: that step meets the dot in float32."""
    step = _dot_k(plan, block_k)
    return next((op.block for op in plan.operands
                 if op.scale is Apply.STEP and not op.quantize_to and not op.scaled_after(step)), None)


def _dynamic_error(plan: QuantPlan, block_k: int) -> str | None:
    """Why block_k cannot hold the scale blocks of activations quantized in the kernel (their scales come from
    the tile: whole blocks in a k step, one dot each, a power of two >= 16 for tl.dot), else None."""
    a = plan.a
    if not a.quantize_to:
        return None
    if a.block == plan.k:
        if block_k < plan.k:
            return (f"block_k={block_k}: activations quantized per row in the kernel need the whole row (k={plan.k}) "
                    "in one k step, their scale blocks in the tile")
        return None
    if a.block < 16 or a.block & (a.block - 1) or block_k % a.block:
        return (f"block_k={block_k}: activations quantized in the kernel need whole scale blocks in a k step, "
                f"a power of two >= 16 that divides it (their block is {a.block})")
    return None


class TritonRaggedDot(RaggedDotBackend):
    name = "triton"
    revision = 3  # bump on changes that can change the fastest or a valid config (Backend.revision). 2: fp8
    # refused below sm_89, the quantized gradients' tiles counted in float32 (the real compiler's figures).
    # 3: 4-bit weights (int4, mxfp4), activations quantized in the kernel; dequantized steps' tiles in float32
    config_cls = TritonConfig
    platforms = ("gpu",)
    description = "Pallas Triton gmm/tgmm for GPUs; interpret mode elsewhere"

    def runs_on(self, platform: str) -> bool:
        return True  # compiled on GPU, in interpret mode elsewhere

    @property
    def interpret(self) -> bool:
        return interpreted("gpu")

    def chip_error(self, problem: RaggedDotProblem) -> str | None:
        """Triton converts float8 with an instruction of compute capability 8.9 and later; compiling an fp8
        kernel for an older GPU (an A100) aborts the process with an LLVM fatal error, not an exception."""
        capability = devices.gpu_compute_capability()
        fp8 = any(jnp.dtype(op.dot_dtype) == jnp.float8_e4m3fn for op in problem_plan(problem).operands)
        if fp8 and capability is not None and capability < (8, 9):
            return (f"float8 operands need compute capability >= 8.9 in Triton, this GPU has "
                    f"{capability[0]}.{capability[1]}")
        return None

    def config_error(self, config: TritonConfig, problem: RaggedDotProblem) -> str | None:
        if (reason := self.chip_error(problem)) is not None:
            return reason
        for name in ("block_m", "block_k", "block_n"):
            value = getattr(config, name)
            if value not in BLOCKS:
                return f"{name}={value} must be one of {BLOCKS} (a power of two >= 16 for tl.dot)"
        if config.num_warps not in (1, 2, 4, 8, 16):
            return f"num_warps={config.num_warps} must be a power of two <= 16"
        if not 1 <= config.num_stages <= 6:
            return f"num_stages={config.num_stages} must be in 1..6"
        _, gk, gn = problem.matmul_dims()
        plan = problem_plan(problem)
        if plan.a.four_bit:
            return "4-bit values are weights (rhs) only in triton"
        if (reason := _dynamic_error(plan, config.block_k)) is not None:
            return reason
        # A step dequantized in the kernel meets the dot in float32 at HIGHEST precision, which Triton compiles
        # to scalar FMAs: no tensor-core instruction in the k loop. In the PTX of the forward compiled for an
        # H100 (benchmarks/gpu_quant_proxy.py; results/gpu_quant_proxy_h100_compile_2026-12-02_pre_rule_whole_
        # space.*: mxfp4, int4/32, fp8/32 at m 4096 k 7168 n 2048, the whole space) all 162 block_k 32 configs
        # have wgmma or mma.sync and none of the 171 block_k 64 / 128 configs that compiled has any (512-16384
        # float32 FMAs a step); an A100's the same (gpu_quant_proxy_a100_compile_2026-12-02_pre_rule.*). On a
        # real H100 the shipped mxfp4 entry (profiles/data/nvidia_h100_80gb_hbm3) timed block_k 64 at 3.4-11x
        # and 128 at 113x its block_k 32 winner. So on a GPU a k step stays within the scale block wherever a
        # step of 32 (the default's) is valid and does (not where activations quantized here need a longer one).
        block = _dequantized_block(plan, config.block_k)
        if (devices.platform() == "gpu" and block is not None and _dynamic_error(plan, 32) is None
                and _dequantized_block(plan, 32) is None):
            return (f"block_k={config.block_k} loses the tensor cores: a k step longer than a scale block ({block}) "
                    "is dequantized to float32 in the kernel and its dot runs in scalar FMAs")
        int8_dot = _int8_dot(plan, config.block_k)
        if int8_dot and _dot_k(plan, config.block_k) < MIN_INT8_BLOCK_K:
            return f"block_k={config.block_k}: int8 x int8 dots need a k of at least {MIN_INT8_BLOCK_K}"
        fits = lambda block, size, smallest=16: block <= max(smallest, 1 << (size - 1).bit_length())
        if not fits(config.block_k, gk, MIN_INT8_BLOCK_K if int8_dot else 16) or not fits(config.block_n, gn):
            return "block larger than the dimension it tiles"
        need = self.shared_memory_bytes(config, problem)
        budget = devices.gpu_shared_memory_bytes()
        if need > budget:
            return f"needs {need // 1024} KiB of shared memory per block, over the {budget // 1024} KiB budget"
        return None

    def shared_memory_bytes(self, config: TritonConfig, problem: RaggedDotProblem) -> int:
        """Pipelined operand tiles: num_stages copies of the lhs and rhs blocks, in the dtype the dot takes
        them in: float32 for the quantized gradients (`QuantPlan.float32_dots`; Triton reports exactly
        this for them, e.g. 393216 bytes for 128 x 128 x 256 blocks in 2 stages); the quantized forward's as
        loaded (its 1-byte tiles compiled for H100 where the float-sized count refused them)."""
        plan, bm, bk, bn = problem_plan(problem), config.block_m, config.block_k, config.block_n
        dequantized = _dequantized_block(plan, bk) is not None
        if plan.quantized and not plan.float32_dots and not dequantized:
            # fwd: each tile as loaded (1-byte and 4-bit weights a byte an element, as Triton loads int4)
            a, b = (jnp.dtype(op.dtype).itemsize for op in plan.operands)
            return config.num_stages * (bm * bk * a + bk * bn * b)
        itemsize = max(jnp.dtype(problem.lhs_dtype).itemsize, jnp.dtype(problem.out_dtype).itemsize)
        if plan.float32_dots or dequantized:  # a step dequantized in the kernel (a scale block shorter than
            itemsize = 4  # the dot's k: mxfp4's 32) meets the dot in float32
        tiles = (bm * bk + bk * bn) if problem.direction != "drhs" else (bm * bk + bm * bn)
        return config.num_stages * tiles * itemsize

    def default_config(self, problem: RaggedDotProblem) -> TritonConfig:
        _, gk, gn = problem.matmul_dims()
        fit = lambda want, size: max(16, min(want, 1 << max(size - 1, 1).bit_length()))
        if problem.direction == "drhs":
            return TritonConfig(block_m=64, block_k=fit(64, gk), block_n=fit(64, gn), num_warps=4, num_stages=2)
        plan = problem_plan(problem)
        block_k = fit(32, gk)
        if plan.a.quantize_to:  # whole scale blocks of the activations in a k step (one per row: the row)
            block_k = min(max(block_k, fit(gk if plan.a.block == plan.k else plan.a.block, gk)), BLOCKS[-1])
        if _int8_dot(plan, block_k):
            block_k = max(block_k, MIN_INT8_BLOCK_K)
        return TritonConfig(block_m=64, block_k=block_k, block_n=fit(64, gn), num_warps=4, num_stages=2)

    def candidate_values(self, problem: RaggedDotProblem) -> dict[str, list[int]]:
        # activations quantized in the kernel may need their whole row (or a 256 block) in one k step
        block_k = [32, 64, 128, 256] if problem_plan(problem).a.quantize_to else [32, 64, 128]
        return {"block_m": [32, 64, 128], "block_k": block_k, "block_n": [64, 128, 256],
                "num_warps": [4, 8], "num_stages": [2, 3, 4]}

    def gmm(self, lhs, rhs, group_sizes, *, config, out_dtype, group_offset=None, transpose_rhs=False):
        lhs, lhs_scale, rhs, rhs_scale, lhs_quant = prepare_gmm(lhs, rhs, group_sizes, group_offset, transpose_rhs)
        plan = gmm_plan(lhs, lhs_scale, rhs, rhs_scale, lhs_quant, transpose_rhs=transpose_rhs).kernel_plan()
        if plan.b.dtype == "float4_e2m1fn":  # Triton loads no float4: the same bits as int4 (an XLA bitcast, free)
            rhs = jax.lax.bitcast_convert_type(rhs, jnp.int4)
        m, k = lhs.shape
        groups = rhs.shape[0]
        n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
        bm, bk, bn = config.block_m, config.block_k, config.block_n
        lhs_p = pad_to(pad_to(lhs, 0, bm), 1, bk)
        rhs_p = pad_to(pad_to(rhs, 2 if transpose_rhs else 1, bk), 1 if transpose_rhs else 2, bn)
        # scales: rows of lhs, and the columns a block reads along rhs's last axis, padded like the values
        lhs_scale = None if lhs_scale is None else pad_to(lhs_scale, 0, bm)
        rhs_scale = None if rhs_scale is None else pad_to(rhs_scale, 2, bk if transpose_rhs else bn)
        mp, kp = lhs_p.shape
        np_ = rhs_p.shape[1] if transpose_rhs else rhs_p.shape[2]
        meta = make_group_metadata(group_sizes, m=mp, tm=bm, groups=groups,
                                   group_offset=0 if group_offset is None else group_offset)
        dtype = _dot_dtype(plan, lhs, rhs)
        kernel = functools.partial(_gmm_kernel, plan=plan, block_m=bm, block_k=bk, block_n=bn, k_blocks=kp // bk,
                                   precision=exact_f32_precision(dtype), dtype=dtype, interpret=self.interpret)
        kernel = with_absent_refs(kernel, 5, [True, lhs_scale is not None, True, rhs_scale is not None])
        args = (meta.group_ids, meta.tile_ids, meta.group_starts, meta.group_ends, meta.num_visits[None], lhs_p,
                *[x for x in (lhs_scale, rhs_p, rhs_scale) if x is not None])
        out = pallas_run(pl.pallas_call(
            kernel,
            grid=(meta.group_ids.shape[0], np_ // bn),
            out_shape=out_struct((mp, np_), out_dtype, *args),
            compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
            interpret=self.interpret,
            name="moe_tune_gmm",
        ), *args, interpret=self.interpret)
        out = out[:m, :n]
        # Rows no local group owns were never stored.
        return jnp.where(rows_in_local_groups(group_sizes, m, groups, group_offset), out, jnp.zeros((), out.dtype))

    def tgmm(self, lhs, dout, group_sizes, *, config, out_dtype, num_groups, group_offset=None):
        lhs, lhs_scale, dout = prepare_tgmm(lhs, dout)
        plan = tgmm_plan(lhs, lhs_scale, dout).kernel_plan()
        m, k = lhs.shape
        n = dout.shape[1]
        bm, bk, bn = config.block_m, config.block_k, config.block_n
        lhs_p = pad_to(pad_to(lhs, 0, bm), 1, bk)
        dout_p = pad_to(pad_to(dout, 0, bm), 1, bn)
        meta = make_group_metadata(group_sizes, m=lhs_p.shape[0], tm=bm, groups=num_groups,
                                   group_offset=0 if group_offset is None else group_offset)
        dtype = _dot_dtype(plan, lhs, dout)
        kernel = functools.partial(_tgmm_kernel, plan=plan, block_m=bm, block_k=bk, block_n=bn,
                                   precision=exact_f32_precision(dtype), dtype=dtype)
        kernel = with_absent_refs(kernel, 2, [True, lhs_scale is not None, True])
        lhs_scale = None if lhs_scale is None else pad_to(lhs_scale, 0, bm)
        kp, np_ = lhs_p.shape[1], dout_p.shape[1]
        args = (meta.group_starts, meta.group_ends, lhs_p, *([] if lhs_scale is None else [lhs_scale]), dout_p)
        out = pallas_run(pl.pallas_call(
            kernel,
            grid=(num_groups, kp // bk, np_ // bn),
            out_specs=pl.BlockSpec((None, bk, bn), lambda g, i, j: (g, i, j)),
            out_shape=out_struct((num_groups, kp, np_), out_dtype, *args),
            compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
            interpret=self.interpret,
            name="moe_tune_tgmm",
        ), *args, interpret=self.interpret)
        return out[:, :k, :n]
