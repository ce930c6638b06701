"""Where each scale of a quantized ragged_dot is applied: one plan per (direction, scale layout).

Like Megablox's `make_group_metadata`, `make_plan` is a pure function of static facts, here the direction,
the forward k, and each kernel operand's stored dtype and scale block along k. Every reader of the
quantization rules asks it instead of deciding again: `quantized.prepare_gmm` / `prepare_tgmm` (what happens
before the kernel), the config checks and memory estimates (`tiled`, `megablox`, `triton`) through
`problem_plan`, and the kernels (`tiled`, `megablox_quant`, `triton`) through `gmm_plan` / `tgmm_plan`, from
the arrays they are given (a kernel can be called without a problem).

A kernel applies a scale cheaply only where the scale lies along the matmul's reduction axis in blocks (the
raw dot of a k step is multiplied by its block's scale) or is one per output row / column (the output tile
is multiplied once after the k loop). A scale that varies along the reduction element by element is folded
into the other, float operand before the kernel, so that the kernel reads the 1-byte values as they are; a
scale in blocks along an output axis dequantizes the operand's block before its dot. The kernel operands
are `a` and `b` (`RaggedDotBackend.run`):

    direction  a, b                          a's scale                     b's scale
    fwd        lhs [m, k], rhs [g, k, n]     per row: OUTPUT               per channel: OUTPUT
                                             sub-channel: STEP             sub-channel: STEP
    dlhs       dout [m, n], rhs [g, k, n]^T  none (a QArray dout: BEFORE)  per channel: FOLD (into dout rows)
                                                                           sub-channel: DEQUANTIZE (k is out)
    drhs       lhs [m, k]^T, dout [m, n]     per row: FOLD (into dout)     none (a QArray dout: BEFORE)
                                             sub-channel: DEQUANTIZE

The plan also says what the kernel loads (`OperandPlan.dtype`), whether `TiledConfig.dequantize` applies
(`dequantizable`), whether the dots run in float32 (`float32_dots`), and the scale blocks a kernel step holds
(`scale_blocks`, for memory estimates).

Once the folds are done the kernel's own plan (from its arrays) says NONE where FOLD was, and float32 for
the operand folded into.

4-bit weights (int4, float4_e2m1fn = mxfp4) follow the same placements as the 1-byte ones: the kernel loads
the 4-bit blocks (`OperandPlan.four_bit`) and converts them where it loads them. Activations quantized in the
kernel (dynamic w8a8, `moe_tune.DynamicQuant`; fwd only): operand a is float in memory (`dtype`), and the
kernel quantizes each tile it loads to `quantize_to` (int8, float8_e4m3fn) per row and block of `block`
along k, its scale from the tile itself; that scale then applies as a stored one would (OUTPUT for one per
row, STEP for sub-channel blocks). In dlhs the activations are not an operand (their gradient is the
straight-through one: dout times the dequantized weights); in drhs they are read as the floats they are.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_tune.core.quant_format import FOUR_BIT, QDTYPES
from moe_tune.kernels.ragged_dot.problem import OPERANDS, RaggedDotProblem

FLOAT32 = "float32"  # the dtype of an operand a scale was folded into, or one dequantized before the kernel


class Apply(enum.Enum):
    """Where one operand's scale is applied."""

    NONE = "none"  # no scale: a float operand, or 1-byte values whose scale was folded into the other one
    BEFORE = "before"  # the operand is dequantized whole (float32) before the kernel: a quantized dout, which
    # no ragged_dot direction passes (kept correct, not fast)
    FOLD = "fold"  # multiplied into the other operand (float32) before the kernel: the scale varies along
    # the reduction element by element (dlhs per channel: into dout's rows; drhs per row: into dout)
    STEP = "step"  # multiplies the raw dot of each k step inside the k loop (blocks along the reduction k)
    OUTPUT = "output"  # multiplies the output tile once after the k loop (one scale per row / channel)
    DEQUANTIZE = "dequantize"  # the operand's block times its scales before its dot, in the k loop (blocks
    # along an output axis: dlhs / drhs sub-channel; or fwd weights with `QuantPlan.with_dequantize`)


class Layout(NamedTuple):
    """What a kernel operand holds: its stored dtype name, how many elements along the forward k share one
    scale (k: one scale per row / channel; None: no scale), and `quantize_to`: the dtype a float operand's
    tiles are quantized to in the kernel (dynamic w8a8; `block` is then the block of those scales)."""

    dtype: str
    block: int | None = None
    quantize_to: str | None = None


@dataclasses.dataclass(frozen=True)
class OperandPlan:
    """One kernel operand: `dtype` the dtype of the blocks the kernel loads (1-byte or 4-bit values, a float
    dtype, float32 after a fold), `scale` where its scale applies, `block` its scale block along the forward
    k (None: no scale in the kernel), `quantize_to` the dtype the kernel quantizes its float tiles to
    (dynamic w8a8: the scales are computed in the kernel, per row and `block`), else None."""

    dtype: str
    scale: Apply = Apply.NONE
    block: int | None = None
    quantize_to: str | None = None

    @property
    def low_bit(self) -> bool:
        """Whether the kernel loads quantized values (int8, float8, int4, float4) of this operand."""
        return jnp.dtype(self.dtype).name in QDTYPES

    @property
    def four_bit(self) -> bool:
        """Whether the kernel loads 4-bit values (int4, float4_e2m1fn) of this operand."""
        return jnp.dtype(self.dtype).name in FOUR_BIT

    @property
    def dot_dtype(self) -> str:
        """The dtype of this operand's values where they meet the dot: `quantize_to` when the kernel
        quantizes the tile, else `dtype`."""
        return self.quantize_to or self.dtype

    def scaled_after(self, step: int) -> bool:
        """Whether a k step of `step` elements lies inside one of this operand's STEP scale blocks, so that
        the step's raw dot can be multiplied by that scale (else the step's block must be dequantized)."""
        return self.scale is Apply.STEP and self.block % step == 0


@dataclasses.dataclass(frozen=True)
class QuantPlan:
    """Where the scales of one direction's kernel operands apply (see the module docstring).

    direction: fwd, dlhs or drhs; k: the forward k, the axis every scale runs along; a, b: the kernel's two
    operands (fwd: lhs, rhs; dlhs: dout, rhs; drhs: lhs, dout); dequantizable: whether the tiled kernel's
    `dequantize` applies (fwd, float activations, sub-channel weights: each weight block dequantized before
    full-k dots, `with_dequantize`)."""

    direction: str
    k: int
    a: OperandPlan
    b: OperandPlan
    dequantizable: bool = False

    @property
    def operands(self) -> tuple[OperandPlan, OperandPlan]:
        return self.a, self.b

    @property
    def quantized(self) -> bool:
        """Whether the kernel reads quantized values or quantizes a tile (then the backends run their
        quantized kernels)."""
        return self.a.low_bit or self.b.low_bit or self.a.quantize_to is not None

    @property
    def float32_dots(self) -> bool:
        """Whether every dot runs in float32: a gradient direction with 1-byte values, whose scales are either
        folded into the float operand (float32) or dequantize a block in float32. fwd dots follow
        `quantized.dot_dtypes` (int8 x int8 in int32, a 1-byte operand in its float partner's dtype)."""
        return self.direction != "fwd" and self.quantized

    @property
    def step_blocks(self) -> tuple[int, ...]:
        """Blocks of the STEP scales (a's, then b's): a k step must not straddle one (`quantized.k_chunk`)."""
        return tuple(op.block for op in self.operands if op.scale is Apply.STEP)

    @property
    def sub_channel_blocks(self) -> tuple[int, ...]:
        """Blocks of the sub-channel scales applied in the kernel (STEP or DEQUANTIZE): a kernel whose tile
        along the forward k holds whole blocks or a whole number of tiles per block needs no mask for them."""
        return tuple(op.block for op in self.operands if op.scale in (Apply.STEP, Apply.DEQUANTIZE))

    def kernel_plan(self) -> "QuantPlan":
        """Itself, for a kernel handed these operands; a ValueError if a scale that the plan applies before
        the kernel (FOLD, BEFORE) reached it: `quantized.prepare_gmm` / `prepare_tgmm` apply those first."""
        early = [name for name, op in (("a", self.a), ("b", self.b)) if op.scale in (Apply.FOLD, Apply.BEFORE)]
        if early:
            scale = getattr(self, early[0]).scale.value
            raise ValueError(f"{self.direction}: the scale of operand {early[0]} ({scale}) applies before the "
                             "kernel; pass the operands of quantized.prepare_gmm / prepare_tgmm")
        return self

    def with_dequantize(self, dequantize: bool) -> "QuantPlan":
        """This plan with b's sub-channel scales dequantizing each weight block before its dot (instead of a
        dot per scale block) where `dequantize` is asked for and applies (`dequantizable`); else itself."""
        if not (dequantize and self.dequantizable):
            return self
        return dataclasses.replace(self, b=dataclasses.replace(self.b, scale=Apply.DEQUANTIZE))

    def scale_blocks(self, tm: int, tk: int, tn: int) -> tuple[tuple[int, int], ...]:
        """Shapes of the float32 scale blocks a kernel step holds beside its operand blocks (tiles tm, tk, tn
        of the matmul it runs), whole along the k / bs scales as the Megablox kernels load them: fwd a
        [tm, k/bs], b [k/bs, tn]; dlhs b [k/bs, tk] (tk tiles its reduction, n); drhs a^T [k/bs, tm].
        A folded scale has none."""
        # (scales along k) -> block shape, for each operand a kernel may scale in its loop or at its store
        shape = {("fwd", "a"): lambda s: (tm, s), ("fwd", "b"): lambda s: (s, tn),
                 ("dlhs", "b"): lambda s: (s, tk), ("drhs", "a"): lambda s: (s, tm)}
        shapes = []
        for name, op in (("a", self.a), ("b", self.b)):
            if op.scale in (Apply.STEP, Apply.OUTPUT, Apply.DEQUANTIZE):
                shapes.append(shape[self.direction, name](self.k // op.block))
        return tuple(shapes)


def _placement(direction: str, operand: str, block: int | None, k: int) -> Apply:
    """Where a scale of `block` elements along k of kernel operand `operand` ("a" / "b") applies."""
    if block is None:
        return Apply.NONE
    float_operand = {"dlhs": "a", "drhs": "b"}.get(direction)  # dout: a gradient's float operand
    if operand == float_operand:
        return Apply.BEFORE
    if direction == "fwd":  # along the reduction k
        return Apply.OUTPUT if block == k else Apply.STEP
    return Apply.FOLD if block == k else Apply.DEQUANTIZE  # dlhs / drhs: along an output axis


def make_plan(direction: str, k: int, a: Layout, b: Layout) -> QuantPlan:
    """The plan of `direction` (fwd, dlhs, drhs) for kernel operands laid out as `a` and `b` (see the module
    docstring for which operands those are), their scales along the forward `k` in blocks of `block`."""
    if direction != "fwd":  # activations quantized in the kernel: only the forward kernel quantizes them
        a, b = (Layout(x.dtype) if x.quantize_to else x for x in (a, b))
    placements = {name: _placement(direction, name, layout.block, k) for name, layout in (("a", a), ("b", b))}
    # what the kernel loads: the other operand becomes float32 where a scale is folded into it
    folded_into = {"a": placements["b"] is Apply.FOLD, "b": placements["a"] is Apply.FOLD}
    plans = {}
    for name, layout in (("a", a), ("b", b)):
        as_float = folded_into[name] or placements[name] is Apply.BEFORE
        scale = placements[name]
        in_hand = scale not in (Apply.NONE, Apply.BEFORE)  # BEFORE: no scale is left once dequantized
        plans[name] = OperandPlan(FLOAT32 if as_float else layout.dtype, scale, layout.block if in_hand else None,
                                  layout.quantize_to)
    dequantizable = direction == "fwd" and a.block is None and placements["b"] is Apply.STEP
    return QuantPlan(direction, k, plans["a"], plans["b"], dequantizable)


def problem_plan(problem: RaggedDotProblem) -> QuantPlan:
    """The plan of the problem's direction: a quantized operand is its stored dtype (`lhs_qdtype`) with its
    scale block (`lhs_qblock`), a float one its dtype, activations quantized in the kernel (`lhs_qdynamic`)
    their float dtype quantized to `lhs_qdtype`; dout is float (`out_dtype`)."""
    float_dtypes = dict(zip(OPERANDS[problem.direction], problem.operand_dtypes()[:2]))

    def layout(operand: str) -> Layout:
        if operand == "dout":
            return Layout(float_dtypes[operand])
        qdtype, block = getattr(problem, f"{operand}_qdtype"), getattr(problem, f"{operand}_qblock")
        if operand == "lhs" and problem.lhs_qdynamic:
            return Layout(float_dtypes[operand], block, qdtype)
        return Layout(qdtype or float_dtypes[operand], block)

    a, b = (layout(operand) for operand in OPERANDS[problem.direction])
    return make_plan(problem.direction, problem.k, a, b)


def _layout(values: jax.Array, scale: jax.Array | None, k: int) -> Layout:
    """The layout of an operand whose values are scaled along axis 1, k long in the forward call."""
    return Layout(jnp.dtype(values.dtype).name, None if scale is None else k // scale.shape[1])


def gmm_plan(lhs: jax.Array, lhs_scale: jax.Array | None, rhs: jax.Array, rhs_scale: jax.Array | None,
             lhs_quant: "LhsQuant | None" = None, *, transpose_rhs: bool) -> QuantPlan:
    """The plan of a gmm from its arrays (shapes and dtypes only; tracers welcome): fwd lhs [m, k] with
    lhs_scale None or [m, k/bs], rhs [g, k, n] with rhs_scale None or [g, k/bs, n]; with transpose_rhs (dlhs)
    lhs is dout [m, n] and rhs the forward rhs [g, k, n], its scale still [g, k/bs, n]. `lhs_quant`: a float
    lhs the kernel quantizes tile by tile (`quantized.GmmOperands.lhs_quant`)."""
    k = rhs.shape[1]
    direction = "dlhs" if transpose_rhs else "fwd"
    lhs_k = lhs.shape[1]  # fwd: k; dlhs: n, along which a quantized dout is scaled
    a = _layout(lhs, lhs_scale, lhs_k)
    if lhs_quant is not None:
        a = Layout(a.dtype, lhs_quant.block, lhs_quant.qdtype)
    return make_plan(direction, k, a, _layout(rhs, rhs_scale, k))


class LhsQuant(NamedTuple):
    """Activations the kernel quantizes where it loads them (`moe_tune.DynamicQuant`): to `qdtype` (int8,
    float8_e4m3fn), one scale per row and `block` elements along k (k: one per row)."""

    qdtype: str
    block: int


def tgmm_plan(lhs: jax.Array, lhs_scale: jax.Array | None, dout: jax.Array,
              dout_scale: jax.Array | None = None) -> QuantPlan:
    """The plan of a tgmm (drhs) from its arrays: lhs [m, k] with lhs_scale None or [m, k/bs], dout [m, n]."""
    k = lhs.shape[1]
    return make_plan("drhs", k, _layout(lhs, lhs_scale, k), _layout(dout, dout_scale, dout.shape[1]))


def paired_lhs_block(k: int, rhs_block: int | None) -> int:
    """Elements along k per scale of activations quantized for a forward matmul with weights scaled in blocks
    of `rhs_block` along k (None: float weights): the weights' own block where it is sub-channel (< k), so
    both scales are STEP scales of the same k steps, else k (one scale per row, an OUTPUT scale). The one
    rule for activations quantized to meet weights: `ragged_dot(..., lhs_quant=)`'s default block and the
    MoE layer's fp8 dispatch rows (`layer/wire.py`)."""
    return rhs_block if rhs_block is not None and rhs_block < k else k
