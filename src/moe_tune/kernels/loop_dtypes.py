"""How the pure-JAX CPU kernels hold low-precision arrays inside their loops, and load blocks of them.

XLA CPU computes bfloat16 elementwise ops in float32: a bfloat16 array that a loop slices is converted
whole to float32 before the loop (the convert is hoisted), sliced there and converted back to bfloat16
per block for the dot, and a bfloat16 output updated in a loop is converted to float32 and back around
every update. (float16 is sliced and updated in place: it needs none of this.) Measured in
benchmarks/NOTES.md (13): that, not the dot, made the bf16 tiled ragged_dot 2.2-2.5x slower than its
float32 path. XLA does not touch integers, so the kernels carry bfloat16 arrays as their uint16 bits
(`as_bits`), which loops slice and update in place at 2 bytes per element, and convert a block only where
they use it (`load`): the one mechanism for bf16 blocks and for 1-byte quantized ones (int8, fp8), which
stay 1-byte in memory the same way.

`as_bits` itself is a copy on XLA CPU (a bitcast-convert is a loop over the elements, not a free
reinterpretation): applied to an array a loop only reads, it costs a pass over the whole array before
the loop (NOTES 13). `per_iteration` avoids that pass for a loop that reads only some blocks of an input
(the gathers' rows): the input seen through it is not loop-invariant, so XLA cannot hoist a convert or
bitcast of it out of the loop; it stays fused into the gather or slice that reads each block (NOTES 15 for
the gathers, 17 for the tiled ragged_dot: bf16 2.3x faster at 128 groups, where the weights' whole-array
copy had been a third of the time).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_BITS = jnp.dtype(jnp.uint16)


def as_bits(x: jax.Array) -> jax.Array:
    """x as a loop should carry it: bfloat16 as its uint16 bits, anything else unchanged."""
    return jax.lax.bitcast_convert_type(x, _BITS) if x.dtype == jnp.bfloat16 else x


def from_bits(x: jax.Array, dtype) -> jax.Array:
    """The inverse of `as_bits` for an array whose logical dtype is `dtype`."""
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype == _BITS and jnp.dtype(dtype) != _BITS else x


def e4m3fn_to_float32(x: jax.Array) -> jax.Array:
    """float8_e4m3fn -> float32, exact (NaN included), built from the bits with integer ops and one select.

    XLA CPU's own convert of this dtype runs about 2x slower (an fp8 weight block loaded per group: 20.9 ms
    against 11.2 for 64 x [2048, 768], benchmarks/NOTES.md 14.5). e4m3fn: 1 sign bit, 4 exponent bits
    (bias 7), 3 mantissa bits, no infinities, NaN at magnitude 0x7F."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
    magnitude, sign = bits & 0x7F, (bits & 0x80) << 24
    # a normal value: re-bias the exponent (7 -> 127: + 120) and move both fields to float32's places
    normal = jax.lax.bitcast_convert_type(sign | ((magnitude + (120 << 3)) << 20), jnp.float32)
    # a subnormal (exponent 0): mantissa x 2^-9, computed, not built (float32 subnormals may be flushed)
    subnormal = jnp.where(sign != 0, -1.0, 1.0) * magnitude.astype(jnp.float32) * 2.0**-9
    value = jnp.where(magnitude < 8, subnormal, normal)
    return jnp.where(magnitude == 0x7F, jnp.nan, value)


def load(block: jax.Array, dtype, compute, scale: jax.Array | float | None = None) -> jax.Array:
    """A block of an array carried by `as_bits` (logical dtype `dtype`), converted to the `compute` dtype
    of the op that uses it, times `scale` (in float32, where given). float8_e4m3fn goes through
    `e4m3fn_to_float32`."""
    block = from_bits(block, dtype)
    if block.dtype == jnp.float8_e4m3fn and jnp.dtype(compute) != block.dtype:
        block = e4m3fn_to_float32(block)
    block = block.astype(compute)
    return block if scale is None else block.astype(jnp.float32) * scale


def per_iteration(x: jax.Array, step: jax.Array) -> jax.Array:
    """x, for a loop body that reads blocks of it at iteration `step` (any traced loop variable).

    An optimization barrier ties x to `step`, so XLA's loop-invariant code motion cannot hoist an op on the
    whole of x out of the loop: XLA CPU's bf16 -> f32 convert, or `as_bits`, then runs fused into the gather
    of each block, on that block's elements only, instead of as a pass over all of x before the loop. The
    barrier itself compiles away: x is passed into the loop, not copied."""
    return jax.lax.optimization_barrier((x, step))[0]
