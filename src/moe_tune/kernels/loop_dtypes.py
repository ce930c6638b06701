"""How the pure-JAX CPU kernels hold low-precision arrays inside their loops, and load blocks of them.

XLA CPU computes bfloat16 elementwise ops in float32: a bfloat16 array that a loop slices is converted
whole to float32 before the loop (the convert is hoisted), sliced there and converted back to bfloat16
per block for the dot, and a bfloat16 output updated in a loop is converted to float32 and back around
every update. (float16 is sliced and updated in place: it needs none of this.) Measured in
benchmarks/NOTES.md (13): that, not the dot, made the bf16 tiled ragged_dot 2.2-2.5x slower than its
float32 path. XLA does not touch integers, so the kernels carry bfloat16 arrays as their uint16 bits
(`as_bits`), which loops slice and update in place at 2 bytes per element, and convert a block only where
they use it (`load`): the one mechanism for bf16 blocks and for 1-byte quantized ones (int8, fp8), which
stay 1-byte in memory the same way. (`as_bits` itself copies the array once on XLA CPU: see NOTES 13.)
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


def load(block: jax.Array, dtype, compute, scale: jax.Array | float | None = None) -> jax.Array:
    """A block of an array carried by `as_bits` (logical dtype `dtype`), converted to the `compute` dtype
    of the op that uses it, times `scale` (in float32, where given)."""
    block = from_bits(block, dtype).astype(compute)
    return block if scale is None else block.astype(jnp.float32) * scale
