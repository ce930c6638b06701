"""Quantized operands of the ragged_dot kernels: what every backend's gmm / tgmm does before its kernel.

Which scale is folded into which operand, and which is left to the kernel, is the direction's plan
(`quant_plan.py`); `prepare_gmm` / `prepare_tgmm` carry out its FOLD and BEFORE steps, so that the kernel
reads 1-byte values as they are:

- dlhs (gmm with transpose_rhs: dout [m, n] x rhs [g, k, n]^T, reducing n): a per-channel rhs scale
  [g, 1, n] lies along n element by element, so it is folded into dout row by row (`dout[rows of g] *
  scale[g, 0]`); a sub-channel scale [g, k/bs, n] is left to the kernel.
- tgmm (drhs: lhs [m, k]^T x dout [m, n], reducing m): a per-row lhs scale [m, 1] is folded into dout; a
  sub-channel one [m, k/bs] is left to the kernel.

Folded operands are float32 (the product of a low-precision value and a float32 scale, kept exact).

Activations quantized in the kernel (`moe_tune.DynamicQuant`, fwd only) reach the kernel as their float
values with `GmmOperands.lhs_quant` saying what to quantize each loaded tile to (`quant.quantize_tile`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_tune.kernels.ragged_dot.metadata import group_bounds
from moe_tune.kernels.ragged_dot.quant_plan import Apply, LhsQuant, QuantPlan, gmm_plan, tgmm_plan
from moe_tune.core.quant import DynamicQuant, QArray, dequantize, split


class GmmOperands(NamedTuple):
    """What a gmm kernel reads. Without transpose_rhs: lhs [m, k] (float, int8 or fp8) with lhs_scale None
    or f32 [m, k/bs_l], rhs [g, k, n] (float, int8, fp8, int4, float4_e2m1fn) with rhs_scale None or f32
    [g, k/bs_r, n]. With transpose_rhs: lhs is float (lhs_scale None), rhs [g, n_out, k] with rhs_scale None
    or f32 [g, n_out/bs, k] (sub-channel). lhs_quant: a float lhs whose tiles the kernel quantizes (fwd,
    `quant_plan.LhsQuant`), else None."""

    lhs: jax.Array
    lhs_scale: jax.Array | None
    rhs: jax.Array
    rhs_scale: jax.Array | None
    lhs_quant: LhsQuant | None = None

    def plan(self, transpose_rhs: bool) -> QuantPlan:
        """The kernel's plan for these operands (`quant_plan.gmm_plan`)."""
        return gmm_plan(*self, transpose_rhs=transpose_rhs)


def row_groups(group_sizes: jax.Array, m: int, groups: int, group_offset: jax.Array | None) -> jax.Array:
    """int32 [m]: the local group of each row, clipped to [0, groups) for rows no local group owns (those
    rows come out zero, so which scale they see does not matter)."""
    starts, _ = group_bounds(group_sizes, m=m, groups=groups, group_offset=0 if group_offset is None else group_offset)
    rows = jnp.arange(m, dtype=jnp.int32)
    return jnp.clip(jnp.searchsorted(starts, rows, side="right").astype(jnp.int32) - 1, 0, groups - 1)


def fold_rows(x: jax.Array, row_scale: jax.Array) -> jax.Array:
    """float32 x * row_scale: x [m, n], row_scale [m, 1] or [m, n]."""
    return x.astype(jnp.float32) * row_scale


def prepare_gmm(lhs: jax.Array | QArray | DynamicQuant, rhs: jax.Array | QArray, group_sizes: jax.Array,
                group_offset: jax.Array | None, transpose_rhs: bool) -> GmmOperands:
    """Split the operands of gmm into values and scales, and carry out the plan's steps before the kernel
    (`quant_plan.gmm_plan`): a quantized dout (dlhs) dequantized, a per-channel rhs scale (dlhs) folded into
    dout by each row's group. A `DynamicQuant` lhs stays float, described by `lhs_quant`."""
    lhs_quant = LhsQuant(lhs.qdtype, lhs.block()) if isinstance(lhs, DynamicQuant) else None
    lhs = lhs.value if isinstance(lhs, DynamicQuant) else lhs
    (lhs_values, lhs_scale), (rhs_values, rhs_scale) = split(lhs), split(rhs)
    plan = gmm_plan(lhs_values, lhs_scale, rhs_values, rhs_scale, transpose_rhs=transpose_rhs)
    if plan.a.scale is Apply.BEFORE:
        lhs_values, lhs_scale = dequantize(lhs), None
    if plan.b.scale is Apply.FOLD:
        groups = rhs_values.shape[0]
        gid = row_groups(group_sizes, lhs_values.shape[0], groups, group_offset)
        lhs_values, rhs_scale = fold_rows(lhs_values, rhs_scale[gid, 0, :]), None
    return GmmOperands(lhs_values, lhs_scale, rhs_values, rhs_scale, lhs_quant)


def prepare_tgmm(lhs: jax.Array | QArray, dout: jax.Array | QArray) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """(lhs values, lhs sub-channel scale f32 [m, k/bs] or None, dout), after the plan's steps before the
    kernel (`quant_plan.tgmm_plan`): a per-row lhs scale [m, 1] lies along the reduced m and is folded into
    dout (float32); a quantized dout is dequantized."""
    (values, scale), (dout_values, dout_scale) = split(lhs), split(dout)
    plan = tgmm_plan(values, scale, dout_values, dout_scale)
    if plan.b.scale is Apply.BEFORE:
        dout_values = dequantize(dout)
    if plan.a.scale is Apply.FOLD:
        return values, None, fold_rows(dout_values, scale)
    return values, scale, dout_values


def dot_dtypes(a: jax.Array, b: jax.Array) -> tuple[jnp.dtype, jnp.dtype]:
    """(operand dtype, accumulator dtype) for a dot of a and b, either of which may hold quantized values:
    two integer operands (int8, int4) run on integers (int4 converted to int8; exact, int32); a quantized
    operand next to a float one is converted to that float dtype (exact: int8, float8_e4m3fn, int4 and
    float4_e2m1fn values fit bfloat16); two quantized float operands (or float and integer ones) meet in
    bfloat16. Accumulation is float32 or wider."""
    da, db = jnp.dtype(a.dtype), jnp.dtype(b.dtype)
    if jnp.issubdtype(da, jnp.integer) and jnp.issubdtype(db, jnp.integer):
        return jnp.dtype(jnp.int8), jnp.dtype(jnp.int32)
    floats = [d for d in (da, db) if d.itemsize > 1]
    common = jnp.promote_types(*floats) if len(floats) == 2 else (floats[0] if floats else jnp.dtype(jnp.bfloat16))
    return jnp.dtype(common), jnp.promote_types(common, jnp.float32)


def k_chunk(k: int, tk: int, *blocks: int) -> int:
    """Contraction chunk of one dot: tk (clamped to k), cut down so that no chunk straddles a block of any
    sub-channel scale in `blocks` (block sizes along k; k itself for one scale per row / channel)."""
    chunk = min(tk, k)
    sub = [b for b in blocks if b < k]
    return math.gcd(chunk, *sub) if sub else chunk


def with_absent_refs(kernel: Callable, leading: int, given: Sequence[bool]) -> Callable:
    """A Pallas kernel body that takes every optional input ref, called by pallas_call with only the inputs
    it was given: after the `leading` refs (scalar prefetch), None stands in for each input whose `given`
    entry is False; the refs after the inputs (outputs, scratch) follow unchanged."""

    def call(*refs):
        rest = iter(refs[leading:])
        inputs = [next(rest) if present else None for present in given]
        return kernel(*refs[:leading], *inputs, *rest)

    return call
