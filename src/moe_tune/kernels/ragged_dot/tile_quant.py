"""Quantization arithmetic inside the Pallas ragged_dot kernels (`megablox_quant.py`, `triton.py`).

- e2m1 (mxfp4) values as int4 bits: neither Mosaic TPU before v7 nor Triton loads `float4_e2m1fn` blocks
  (Mosaic: "Unsupported type vector<...xf4E2M1FN>"; Triton: `tt.load` takes no f4 tensor), while both load
  `int4` blocks (4 bits an element in memory). The kernels read the same bits as int4 (a ref bitcast in
  Mosaic, a free XLA bitcast before the Triton call) and `decode_e2m1` turns them into float32, exactly.
- Activations quantized where the kernel loads them (dynamic w8a8, `moe_tune.DynamicQuant`):
  `block_scale` and `quantize_with` are `quant.quantize_tile`'s arithmetic on a [rows, cols] tile, one
  scale per row over the tile's columns (one scale block), the same ops in the same order, so that the
  kernel's values and scales are those of `DynamicQuant.quantize()` bit for bit (the Triton kernel passes
  its own division and rounding: it has no lowering of `round`, and its `/` is approximate).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from moe_tune.core.quant import QMAX

def decode_e2m1(bits: jax.Array) -> jax.Array:
    """float32 values of e2m1 codes held as int4 (the same 4 bits: sign, 2 exponent bits, 1 mantissa bit).
    Magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 for codes 0..7: code / 2 up to 4, then code - 2, and 6 for 7."""
    code = bits.astype(jnp.int32) & 15
    magnitude = code & 7
    m = magnitude.astype(jnp.float32)
    value = jnp.where(magnitude <= 4, 0.5 * m, jnp.where(magnitude == 7, 6.0, m - 2.0))
    return jnp.where(code >= 8, -value, value)


def block_scale(x: jax.Array, qdtype: str, *,
                divide: Callable[[jax.Array, jax.Array], jax.Array] = jnp.divide) -> jax.Array:
    """float32 [rows, 1]: the scale of each row of the float32 tile x [rows, block] (one scale block per
    row), `quant.quantize_tile`'s rule: max|x| / qmax, 1 for an all-zero row (`divide`: see `quantize_with`)."""
    absmax = jnp.max(jnp.abs(x), axis=1, keepdims=True)
    return jnp.where(absmax > 0, divide(absmax, jnp.full_like(absmax, QMAX[qdtype])), 1.0).astype(jnp.float32)


def quantize_with(x: jax.Array, scale: jax.Array, qdtype: str, *,
                  divide: Callable[[jax.Array, jax.Array], jax.Array] = jnp.divide,
                  round_fn: Callable[[jax.Array], jax.Array] = jnp.round) -> jax.Array:
    """x [rows, cols] float32 quantized to `qdtype` (int8, float8_e4m3fn) with its rows' scales [rows, 1]:
    x / scale, rounded for integers, clipped to +-qmax, cast. `divide` and `round_fn` stand in for the
    kernel's own correctly rounded division and round-half-to-even where its compiler has none of its own."""
    limit = QMAX[qdtype]
    values = divide(x, scale)
    if jnp.issubdtype(jnp.dtype(qdtype), jnp.integer):
        values = round_fn(values)
    return jnp.clip(values, -limit, limit).astype(qdtype)
