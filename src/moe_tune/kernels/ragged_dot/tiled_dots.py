"""The products of one row tile of the `tiled` backend's gmm (fwd, dlhs): one dot per (column block,
contraction chunk), the scales applied where the direction's plan says (`quant_plan.py`), and the dtypes
those dots run in on XLA CPU.

Quantized values are converted where a block is loaded (`pallas_util.load`). 4-bit weights are carried as
their bytes (`pallas_util.packed_bytes`, two values a byte along the weights' last axis) and unpacked per
block (`pallas_util.load_nibbles`): the even and the odd columns of the block as two operands, each with its
own dot (fwd: their outputs interleaved; dlhs: the contraction split, the halves summed). Activations quantized in the kernel (dynamic
w8a8, `OperandPlan.quantize_to`) are quantized here, per row tile, from the tile itself
(`quant.quantize_tile`: the same ops as `quantize`, so the result is that of the quantized operand bit for
bit), and their scales then apply as stored ones would.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_tune.kernels.pallas_util import load, load_nibbles
from moe_tune.kernels.ragged_dot.quant_plan import Apply, QuantPlan
from moe_tune.kernels.ragged_dot.quantized import dot_dtypes, k_chunk
from moe_tune.core.quant import quantize_tile


def _blocks(size: int, block: int) -> list[tuple[int, int]]:
    return [(start, min(block, size - start)) for start in range(0, size, block)]


# A kernel whose smallest tiles hold at most this many rows runs its bf16 dots in float32: XLA CPU's bf16 dot
# costs more per call than the f32 one, which a dot of a few rows does not amortize (64 dots of 4 rows: bf16
# 16.5 ms, f32 12.5; of 8 rows: 17.7 against 18.9; FINDINGS.md: small tails at decode).
F32_DOT_MAX_ROWS = 4


def cpu_dot_dtypes(a_dtype, b_dtype, min_rows: int | None = None) -> tuple[jnp.dtype, jnp.dtype]:
    """(operand, accumulator) dtypes of a dot: `quantized.dot_dtypes` (every backend's rule: bf16 stays bf16,
    which the CPU dot runs natively), except float16, which runs in float32 here as XLA CPU's own dot does
    (an f16 dot measured slower: FINDINGS.md: bf16 ragged_dot on CPU), and bf16 in a kernel whose smallest tiles hold
    `min_rows` <= F32_DOT_MAX_ROWS rows (every dot of the kernel then runs in f32: a group's weights are
    converted once, for one dtype, before its tiles)."""
    operand, acc = dot_dtypes(jax.ShapeDtypeStruct((), a_dtype), jax.ShapeDtypeStruct((), b_dtype))
    small = min_rows is not None and min_rows <= F32_DOT_MAX_ROWS
    if operand == jnp.float16 or (operand == jnp.bfloat16 and small):
        return jnp.dtype(jnp.float32), acc
    return operand, acc


def _scale_rows(scale: jax.Array, block: int, start: int, size: int) -> jax.Array:
    """Rows [start, start + size) of `scale` repeated `block` times along axis 0 (static bounds): the
    per-element scale of those rows of an operand scaled in blocks of `block` rows."""
    first = start // block
    rows = jnp.repeat(scale[first:-(-(start + size) // block)], block, axis=0)
    return rows[start - first * block:start - first * block + size]


_NN, _NT = (((1,), (0,)), ((), ())), (((1,), (1,)), ((), ()))  # x @ w, x @ w^T


@dataclasses.dataclass(frozen=True)
class _TileDots:
    """The static side of one tile's products: the kernel's plan (operand dtypes, where each scale applies),
    (start, size) of the contraction chunks and column blocks (a dot each), the dots' dtypes, the output's;
    `packed`: the weights are 4-bit values carried as `packed_bytes` along their last axis."""

    plan: QuantPlan
    k_blocks: tuple[tuple[int, int], ...]
    n_blocks: tuple[tuple[int, int], ...]
    operand: jnp.dtype
    acc: jnp.dtype
    out_dtype: jnp.dtype
    packed: bool = False

    @property
    def halves(self) -> tuple[int | None, ...]:
        """The parts of each weight block a dot takes: (None,) the whole block; packed: (0, 1) the even and
        the odd elements along the weights' last axis."""
        return (0, 1) if self.packed else (None,)


def _weights(w, rows: tuple[int, int], cols: tuple[int, int], half: int | None, dtype, compute, scale):
    """Block [rows, cols] ((start, size) each) of the weights w in the `compute` dtype, times `scale` (f32)
    where given; packed (`half` 0 or 1): its even or odd columns, unpacked from the bytes that hold them."""
    (r0, rb), (c0, cb) = rows, cols
    if half is None:
        return load(w[r0:r0 + rb, c0:c0 + cb], dtype, compute, scale)
    return load_nibbles(w[r0:r0 + rb, c0 // 2:(c0 + cb) // 2], half == 1, dtype, compute, scale)


def _part(x: jax.Array, half: int | None) -> jax.Array:
    """x's columns that meet one part of a weight block (`_TileDots.halves`): all, or every other one."""
    return x if half is None else x[:, half::2]


def fwd_product(x, w, xs, ws, dots: _TileDots) -> list[tuple[int, jax.Array]]:
    """fwd: x [rows, k] @ w [k, n] -> list of (n0, [rows, nb] block in out_dtype), one dot per (column block,
    contraction chunk). x and w are carried as `pallas_util.as_bits` and loaded block by block in the dot's
    dtype. Scales (`dots.plan`): xs None or [rows, k/bl], ws None or [k/br, n]; a STEP scale multiplies the
    dot of each chunk (which lies inside one of its blocks), an OUTPUT one each result block once after its k
    loop. DEQUANTIZE weights (`QuantPlan.with_dequantize`): each weight block times its scales in f32 before
    its dot, so that a chunk may span many scale blocks (one dot instead of one per block), then rounded to
    the dot's dtype (bf16 for bf16 dots: an error at bf16's level, where the per-block dots are exact).
    A float x the plan quantizes (`quantize_to`) is quantized here, whole rows of the tile per scale block."""
    a, b = dots.plan.a, dots.plan.b
    x_dtype = a.dtype
    if a.quantize_to is not None:  # dynamic: the tile's own scales [rows, k/bl], no copy of x outside it
        tile = quantize_tile(load(x, a.dtype, jnp.float32), a.quantize_to, 1, a.block)
        x, xs, x_dtype = tile.qvalue, tile.scale, a.quantize_to
    x_chunks = [load(x[:, k0:k0 + kb], x_dtype, dots.operand) for k0, kb in dots.k_blocks]  # reused by every column
    blocks = []
    for n0, nb in dots.n_blocks:
        parts = []
        for half in dots.halves:  # packed 4-bit weights: the even, then the odd columns
            acc = None
            for (k0, kb), xb in zip(dots.k_blocks, x_chunks):
                scale = _scale_rows(ws, b.block, k0, kb)[:, n0:n0 + nb] if b.scale is Apply.DEQUANTIZE else None
                scale = None if scale is None else _part(scale, half)
                wb = _weights(w, (k0, kb), (n0, nb), half, b.dtype, dots.operand, scale).astype(dots.operand)
                part = jax.lax.dot_general(xb, wb, _NN, preferred_element_type=dots.acc)
                if b.scale is Apply.STEP:
                    part = part.astype(jnp.float32) * _part(ws[k0 // b.block, None, n0:n0 + nb], half)
                if a.scale is Apply.STEP:
                    part = part.astype(jnp.float32) * xs[:, k0 // a.block, None]
                acc = part if acc is None else acc + part
            if b.scale is Apply.OUTPUT:
                acc = acc.astype(jnp.float32) * _part(ws[:1, n0:n0 + nb], half)
            if a.scale is Apply.OUTPUT:
                acc = acc.astype(jnp.float32) * xs[:, :1]
            parts.append(acc)
        # the even and odd columns interleaved back: a small [rows, nb] output block
        acc = parts[0] if len(parts) == 1 else jnp.stack(parts, axis=-1).reshape(parts[0].shape[0], nb)
        blocks.append((n0, acc.astype(dots.out_dtype)))
    return blocks


def dlhs_product(x, w, xs, ws, dots: _TileDots) -> list[tuple[int, jax.Array]]:
    """dlhs: x [rows, n] @ w^T (w [k, n]) -> list of (k0, [rows, kb] block in out_dtype), one dot per (column
    block, contraction chunk); here the columns are the forward k and the contraction n. x is float (xs is
    always None); a DEQUANTIZE weight scale ws [k/br, n] runs along the output columns: each weight block is
    dequantized in f32 before its dot (`QuantPlan.float32_dots`)."""
    b = dots.plan.b
    x_chunks = [load(x[:, k0:k0 + kb], dots.plan.a.dtype, dots.operand) for k0, kb in dots.k_blocks]
    blocks = []
    for n0, nb in dots.n_blocks:
        acc = None
        for (k0, kb), xb in zip(dots.k_blocks, x_chunks):
            for half in dots.halves:  # packed 4-bit weights: the contraction's even, then odd elements
                scale = _scale_rows(ws, b.block, n0, nb)[:, k0:k0 + kb] if b.scale is Apply.DEQUANTIZE else None
                scale = None if scale is None else _part(scale, half)
                wb = _weights(w, (n0, nb), (k0, kb), half, b.dtype, dots.operand, scale)
                part = jax.lax.dot_general(_part(xb, half), wb, _NT, preferred_element_type=dots.acc)
                acc = part if acc is None else acc + part
        blocks.append((n0, acc.astype(dots.out_dtype)))
    return blocks


def tile_dots(plan: QuantPlan, *, k: int, n: int, tk: int, tn: int, min_rows: int, out_dtype,
              transpose_rhs: bool = False) -> _TileDots:
    """A gmm's `_TileDots` (contraction k, n output columns): chunks of tk cut so that none straddles a STEP
    scale block, blocks of tn; dots in float32 where the plan says so, else `cpu_dot_dtypes` (min_rows: the rows
    of the kernel's smallest tiles). 4-bit weights are `packed` where every block along the weights' last
    axis (fwd: the columns; dlhs, `transpose_rhs`: the contraction) starts and ends on a byte."""
    f32 = jnp.dtype(jnp.float32)
    operand, acc = (f32, f32) if plan.float32_dots else cpu_dot_dtypes(plan.a.dot_dtype, plan.b.dot_dtype, min_rows)
    k_blocks, n_blocks = tuple(_blocks(k, k_chunk(k, tk, *plan.step_blocks))), tuple(_blocks(n, tn))
    packed = plan.b.four_bit and all(v % 2 == 0 for block in (k_blocks if transpose_rhs else n_blocks) for v in block)
    return _TileDots(plan, k_blocks, n_blocks, operand, acc, out_dtype, packed)


