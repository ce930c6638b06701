"""How the pure-JAX CPU kernels hold low-precision arrays inside their loops, and load blocks of them.

XLA CPU computes bfloat16 elementwise ops in float32: a bfloat16 array that a loop slices is converted whole to
float32 before the loop (the convert is hoisted), sliced there and converted back to bfloat16 per block for the
dot, and a bfloat16 output updated in a loop is converted to float32 and back around every update. (float16 is
sliced and updated in place: it needs none of this.) That, not the dot, made the bf16 tiled ragged_dot 2.2-2.5x
slower than its float32 path (FINDINGS.md: bf16 ragged_dot on CPU). XLA does not touch integers, so the kernels
carry bfloat16 arrays as their uint16 bits (`as_bits`), which loops slice and update in place at 2 bytes per
element, and convert a block only where they use it (`load`): the one mechanism for bf16 blocks and for 1-byte
quantized ones (int8, fp8), which stay 1-byte in memory the same way.

`as_bits` itself is a copy on XLA CPU (a bitcast-convert is a loop over the elements, not a free
reinterpretation): applied to an array a loop only reads, it costs a pass over the whole array before
the loop. `per_iteration` avoids that pass for a loop that reads only some blocks of an input
(the gathers' rows): the input seen through it is not loop-invariant, so XLA cannot hoist a convert or
bitcast of it out of the loop; it stays fused into the gather or slice that reads each block (FINDINGS.md:
bf16 gathers on CPU, bf16 ragged_dot on CPU: bf16 2.3x faster at 128 groups, where the weights' whole-array
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


def update_slice(out: jax.Array, block: jax.Array, starts: tuple) -> jax.Array:
    """`dynamic_update_slice(out, block, starts)` for an output a loop carries in its own dtype (block in
    that dtype too): a bfloat16 one is updated through its bits (bitcast to uint16, update, bitcast back).
    XLA CPU fuses the three into one in-place update of the carried buffer, where a bfloat16 update is
    converted whole to float32 and back (13) and a uint16 carry needs a final bitcast, a copy: a second
    output-sized buffer in temp (a [64, 1024, 512] output: temp 68 -> 8 MiB; FINDINGS.md: drhs carry in its
    output)."""
    if out.dtype != jnp.bfloat16:
        return jax.lax.dynamic_update_slice(out, block, starts)
    return from_bits(jax.lax.dynamic_update_slice(as_bits(out), as_bits(block), starts), out.dtype)


def e4m3fn_to_float32(x: jax.Array) -> jax.Array:
    """float8_e4m3fn -> float32, exact (NaN included), built from the bits with integer ops and one select.

    XLA CPU's own convert of this dtype runs about 2x slower (an fp8 weight block loaded per group: 20.9 ms
    against 11.2 for 64 x [2048, 768]; FINDINGS.md: sub-channel dequantize). e4m3fn: 1 sign bit, 4 exponent bits
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


# 4-bit values (int4, float4_e2m1fn). XLA CPU stores them packed, two a byte along the last axis (the even
# element in the low nibble), but reads them element by element: a dynamic slice and convert of an int4
# block inside a loop ran at 0.27x the int8 one's speed (FINDINGS.md: 4-bit on XLA CPU). The kernels instead carry
# the array's bytes (`packed_bytes`), slice those, and unpack each loaded block with integer ops
# (`load_nibbles`): the even and the odd elements as two arrays, which the kernels multiply separately (no
# interleave of the weights). The bitcast to bytes is not free either: XLA CPU expands it into one pass over
# the weights per call (40% of the int4/128 decode kernel's time in its breakdown), still faster in
# the loop benchmark than converting int4 blocks in the loop.


def packed_bytes(x: jax.Array) -> jax.Array:
    """4-bit x [..., c] (c even) -> uint8 [..., c/2], the bytes that hold it (element 2j in the low nibble of
    byte j). One pass over x on XLA CPU (its bitcast of a 4-bit array is expanded into a loop), so done once,
    outside the kernel's loops."""
    return jax.lax.bitcast_convert_type(x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2), jnp.uint8)


def e2m1_to_float32(code: jax.Array) -> jax.Array:
    """float4_e2m1fn codes (0..15 in any integer dtype) -> float32, exact, from the bits: 1 sign bit, 2
    exponent bits (bias 1), 1 mantissa bit; exponent 0 is 0 or the subnormal 0.5."""
    code = code.astype(jnp.uint32)
    exponent, mantissa = (code >> 1) & 3, code & 1
    normal = ((exponent + 126) << 23) | (mantissa << 22)  # float32's exponent bias is 127, e2m1's 1
    bits = jnp.where(exponent == 0, mantissa * (126 << 23), normal) | ((code & 8) << 28)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def load_nibbles(block: jax.Array, odd: bool, dtype, compute, scale: jax.Array | float | None = None) -> jax.Array:
    """The even (`odd` False) or odd elements of a `packed_bytes` block (uint8 [..., c/2]) of 4-bit `dtype`
    values, in the `compute` dtype, times `scale` (float32). The bytes are widened to 32 bits first: XLA
    CPU's shifts and masks on 8-bit lanes measured slower in one noisy run."""
    word = block.astype(jnp.int32)
    if jnp.dtype(dtype) == jnp.int4:  # the nibble moved to the top, then sign-extended by an arithmetic shift
        values = jax.lax.shift_right_arithmetic(jax.lax.shift_left(word, 24 if odd else 28), 28)
    else:
        values = e2m1_to_float32((word >> 4) if odd else (word & 0xF))
    values = values.astype(compute)
    return values if scale is None else values.astype(jnp.float32) * scale


def per_iteration(x: jax.Array, step: jax.Array) -> jax.Array:
    """x, for a loop body that reads blocks of it at iteration `step` (any traced loop variable).

    An optimization barrier ties x to `step`, so XLA's loop-invariant code motion cannot hoist an op on the
    whole of x out of the loop: XLA CPU's bf16 -> f32 convert, or `as_bits`, then runs fused into the gather
    of each block, on that block's elements only, instead of as a pass over all of x before the loop. The
    barrier itself compiles away: x is passed into the loop, not copied."""
    return jax.lax.optimization_barrier((x, step))[0]
