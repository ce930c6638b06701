"""Small helpers the Pallas and tiled kernels share: rounding, padding, TPU tile rows, dot precision, interpret
mode."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_tune.core import devices


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= `value` (both positive ints)."""
    return -(-value // multiple) * multiple


def pad_to(x: jax.Array, axis: int, block: int, value: float | int = 0) -> jax.Array:
    """`x` padded at the end of `axis` with `value` to a multiple of `block` (returned as is when it is one)."""
    extra = -x.shape[axis] % block
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def sublanes(dtype: str) -> int:
    """Rows per native TPU tile: 8 for 32-bit, 16 for 16-bit dtypes (two values packed per 32-bit sublane)."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def exact_f32_precision(dtype) -> jax.lax.Precision | None:
    """The precision of a kernel dot on `dtype` operands: HIGHEST for float32 (no TF32 on GPU tensor cores),
    so that results match a float32 reference; the chip's default otherwise."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def interpreted(native: str) -> bool:
    """Whether a Pallas kernel written for `native` (`"tpu"`: Mosaic, `"gpu"`: Triton) runs in interpret mode
    here. Read at trace time from `devices.platform()`, the one function tests patch to lower for another chip."""
    return devices.platform() != native
