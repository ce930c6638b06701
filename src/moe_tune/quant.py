"""Quantized arrays for ragged_dot: `QArray`, symmetric absmax `quantize`, and `dequantize`.

A `QArray` holds 1-byte values (int8 or float8_e4m3fn) and float32 scales of the same rank. Along one axis
(the "scaled axis") each run of `block_size` consecutive values shares one scale; along every other axis
there is one scale per element. So `scale.shape` is `qvalue.shape` with the scaled axis replaced by
`qvalue.shape[axis] // block_size`, and `dequantize(q) = qvalue * scale` with the scale repeated
`block_size` times along that axis.

The layout is not stored: it is read off the shapes (`scale_layout`). The scaled axis is the one axis whose
scale dim differs from the value dim. When none differs (a block of 1, or an axis of length 1) every
element has its own scale, the array is valid for any expected axis, and its block size is 1.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from moe_tune.errors import UsageError

# Largest magnitude each quantized dtype stores; the one place these numbers live.
QMAX: dict[str, float] = {"int8": 127.0, "float8_e4m3fn": 448.0}
QDTYPES = tuple(QMAX)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QArray:
    """A quantized array: `qvalue` int8 | float8_e4m3fn, `scale` float32 of the same rank (see the module
    docstring for the layout). A pytree, so it passes through jit, vmap, grad (as a constant) and sharding."""

    qvalue: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.qvalue.shape)

    @property
    def ndim(self) -> int:
        return len(self.qvalue.shape)

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype of the stored values (int8 or float8_e4m3fn)."""
        return jnp.dtype(self.qvalue.dtype)

    def __getitem__(self, index) -> "QArray":
        """Slice along leading axes other than the scaled one (e.g. the groups of a [g, k, n] weight)."""
        return QArray(self.qvalue[index], self.scale[index])


def qmax(dtype) -> float:
    """Largest representable magnitude of a quantized dtype; UsageError for any other dtype."""
    name = jnp.dtype(dtype).name
    if name not in QMAX:
        raise UsageError(f"cannot quantize to {name}; use one of {', '.join(QDTYPES)}")
    return QMAX[name]


def quantize(x: jax.Array, dtype, *, axis: int, block_size: int | None = None) -> QArray:
    """Symmetric absmax quantization of `x` along `axis`.

    Each run of `block_size` elements along `axis` (the whole axis when None) shares the scale
    `max|x| / qmax(dtype)` (1 for an all-zero run); int8 values are rounded and clipped to [-127, 127].
    Returns QArray(qvalue [x.shape] in `dtype`, scale float32 [x.shape with axis -> x.shape[axis] // block_size]).
    """
    qmax(dtype)  # a UsageError for other dtypes
    ndim = np.ndim(x)
    if not -ndim <= axis < ndim:
        raise UsageError(f"axis {axis} is out of range for an array of rank {ndim}")
    size = np.shape(x)[axis]
    block = size if block_size is None else block_size
    if not isinstance(block, (int, np.integer)) or block <= 0 or size % block:
        raise UsageError(f"block_size {block_size!r} does not divide axis {axis % ndim} of length {size}")
    return _quantize(x, jnp.dtype(dtype).name, axis % ndim, int(block))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _quantize(x: jax.Array, dtype: str, axis: int, block: int) -> QArray:
    """`quantize` once its arguments are checked: one compiled function, also when called eagerly."""
    limit = QMAX[dtype]
    x = jnp.asarray(x, jnp.float32)
    size = x.shape[axis]
    runs = x.reshape(*x.shape[:axis], size // block, block, *x.shape[axis + 1:])
    absmax = jnp.max(jnp.abs(runs), axis=axis + 1, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / limit, 1.0).astype(jnp.float32)
    values = runs / scale
    if jnp.dtype(dtype) == jnp.int8:
        values = jnp.round(values)
    values = jnp.clip(values, -limit, limit).astype(dtype).reshape(x.shape)
    return QArray(values, jnp.squeeze(scale, axis + 1))


def scale_layout(q: QArray) -> tuple[int | None, int]:
    """(scaled axis, block size) read off the shapes; (None, 1) when every element has its own scale.
    UsageError when the shapes fit no layout."""
    vshape, sshape = tuple(q.qvalue.shape), tuple(q.scale.shape)
    differ = [i for i, (v, s) in enumerate(zip(vshape, sshape)) if v != s]
    if len(vshape) != len(sshape) or len(differ) > 1 or any(sshape[i] == 0 or vshape[i] % sshape[i] for i in differ):
        raise UsageError(f"QArray scale {sshape} fits no layout of values {vshape}: it must equal the values' "
                         "shape but along one axis, where it must divide it")
    if not differ:
        return None, 1
    return differ[0], vshape[differ[0]] // sshape[differ[0]]


def dequantize(q: QArray) -> jax.Array:
    """float32 `qvalue * scale`, the scale repeated `block_size` times along the scaled axis."""
    return _dequantize(q, jnp, jnp.float32)


def dequantize_host(q: QArray) -> np.ndarray:
    """float64 NumPy `qvalue * scale` (exact: a reference's operand), e.g. of a QArray of NumPy arrays."""
    return _dequantize(q, np, np.float64)


def _dequantize(q: QArray, xp, dtype):
    axis, block = scale_layout(q)
    scale = xp.asarray(q.scale, dtype)
    scale = scale if axis is None else xp.repeat(scale, block, axis=axis)
    return xp.asarray(q.qvalue).astype(dtype) * scale


def check_operand(q: QArray, *, name: str, layout: str) -> int:
    """Validate a ragged_dot operand: `q` must be scaled along axis 1 (the contracting k) with 1-byte values
    and float32 scales; `layout` names the expected layout for the message (e.g. "[g, k, n] ... scale
    [g, k/bs, n]"). Returns its block size along k (k for one scale per channel). One-line UsageError."""
    if q.dtype.name not in QMAX or jnp.dtype(q.scale.dtype) != jnp.float32:
        raise UsageError(f"{name} QArray must hold {' or '.join(QDTYPES)} values and float32 scales, got "
                         f"{q.dtype.name} and {jnp.dtype(q.scale.dtype).name}")
    try:
        axis, block = scale_layout(q)
    except UsageError:
        axis, block = -1, 0
    if axis not in (None, 1):
        raise UsageError(f"{name} QArray must be {layout}; got values {tuple(q.qvalue.shape)} with scale "
                         f"{tuple(q.scale.shape)}")
    return block if axis == 1 else 1


def split(x: jax.Array | QArray) -> tuple[jax.Array, jax.Array | None]:
    """(values, scale or None): the parts a kernel reads of an operand that may be quantized."""
    return (x.qvalue, x.scale) if isinstance(x, QArray) else (x, None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AsQArray:
    """Quantization-aware training: a float array that `moe_tune.ragged_dot` (and `moe_mlp`) quantizes inside
    the op, `quantize(value, dtype, axis=axis, block_size=block_size)`, and runs on the quantized kernels.

    Its gradient is the straight-through one: the gradient of the product of the dequantized operands with
    respect to the dequantized value, handed to `value` as is (rounding and clipping are passed through), in
    `value`'s dtype. A pytree whose only leaf is `value` (dtype, axis and block_size are static), so
    `jax.grad` of a function of the float weights flows through it.
    """

    value: jax.Array
    qdtype: str = dataclasses.field(metadata=dict(static=True))
    axis: int = dataclasses.field(default=1, metadata=dict(static=True))
    block_size: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    @property
    def ndim(self) -> int:
        return len(self.value.shape)

    def quantize(self) -> QArray:
        """The QArray the op runs on."""
        return quantize(self.value, self.qdtype, axis=self.axis, block_size=self.block_size)

    def __getitem__(self, index) -> "AsQArray":
        """Slice along leading axes other than the scaled one (e.g. one shard's experts)."""
        return dataclasses.replace(self, value=self.value[index])


def as_float(x: jax.Array | QArray) -> jax.Array:
    """`x` itself, or a QArray dequantized (float32)."""
    return dequantize(x) if isinstance(x, QArray) else x
