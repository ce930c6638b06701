"""Quantized arrays for ragged_dot: `QArray`, `quantize` (symmetric absmax; OCP MX for mxfp4), `dequantize`.

A `QArray` holds low-precision values (int8, float8_e4m3fn, int4, float4_e2m1fn) and scales of the same
rank (float32; an mxfp4 array's may be float8_e8m0fnu, the power of two the MX format stores). Along one axis
(the "scaled axis") each run of `block_size` consecutive values shares one scale; along every other axis
there is one scale per element. So `scale.shape` is `qvalue.shape` with the scaled axis replaced by
`qvalue.shape[axis] // block_size`, and `dequantize(q) = qvalue * scale` with the scale repeated
`block_size` times along that axis.

What a valid format is (the dtype, its alias mxfp4, the block and its rule) is `quant_format.QuantFormat`'s
to say; this module quantizes with one.

The scale layout is not stored: it is read off the shapes (`scale_layout`). The scaled axis is the one axis
whose scale dim differs from the value dim. When none differs (a block of 1, or an axis of length 1) every
element has its own scale, the array is valid for any expected axis, and its block size is 1.

The memory layout is stored: `QArray.layout` (`quant_format.QLAYOUTS`), "kn" (the default) holds `qvalue` and
`scale` as they read; "nk" holds both with their last two axes swapped (a [g, k, n] weight as [g, n, k], k
contiguous; block scales [g, n, k/bs], per-channel ones [g, n, 1]). Everything a reader asks of a QArray is
logical, the same for both layouts: `shape`, `scale_layout`, `dequantize`, `check_operand`, `split`. Only
`qvalue` / `scale` are the stored arrays; `relayout` moves an array between layouts (one transpose of each)
and `in_layout` is how a kernel that reads one layout gets it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from moe_tune.core.errors import UsageError
from moe_tune.core.quant_format import (ACTIVATION_QDTYPES, ALIASES, DEFAULT_QLAYOUT, FOUR_BIT,  # noqa: F401
                                        MX_BLOCK, QDTYPES, QLAYOUTS, QMAX, QUANT_NAMES, QuantFormat,
                                        check_layout, qdtype_name)

MX_EMAX = 2  # e2m1's largest exponent: the MX scale is 2**(floor(log2(max|x|)) - MX_EMAX)
SCALE_DTYPES = {"float32": QDTYPES, "float8_e8m0fnu": ("float4_e2m1fn",)}  # scale dtype -> value dtypes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QArray:
    """A quantized array: `qvalue` int8 | float8_e4m3fn | int4 | float4_e2m1fn, `scale` float32 (mxfp4: or
    float8_e8m0fnu) of the same rank, stored in `layout` ("kn": as they read; "nk": the last two axes swapped,
    see the module docstring). A pytree whose leaves are `qvalue` and `scale` (`layout` is static), so it
    passes through jit, vmap, grad (as a constant), tree_map and sharding; an "nk" array's expert axis (axis
    0) is axis 0 of its stored arrays too."""

    qvalue: jax.Array
    scale: jax.Array
    layout: str = dataclasses.field(default=DEFAULT_QLAYOUT, metadata=dict(static=True))

    def __post_init__(self) -> None:
        check_layout(self.layout)  # only the static field: the leaves may be specs or placeholders in a pytree

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape (what `dequantize` returns), whatever the layout."""
        return _logical(tuple(self.qvalue.shape), self.layout)

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """The logical shape of the scales ("kn"'s `scale.shape`), whatever the layout."""
        return _logical(tuple(self.scale.shape), self.layout)

    @property
    def ndim(self) -> int:
        return len(self.qvalue.shape)

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype of the stored values (`QDTYPES`)."""
        return jnp.dtype(self.qvalue.dtype)

    def __getitem__(self, index) -> "QArray":
        """Slice along leading axes other than the scaled one and the last two (e.g. the groups of a [g, k, n]
        weight); the layout is kept."""
        return QArray(self.qvalue[index], self.scale[index], self.layout)


def _logical(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """A stored shape as it reads: "nk" swaps the last two axes back (the swap is its own inverse)."""
    return shape if layout == "kn" else (*shape[:-2], shape[-1], shape[-2])


def _swap(x, layout: str):
    """A stored array as it reads in `layout` (or the reverse): "nk" swaps the last two axes (NumPy arrays
    stay NumPy, contiguous in their new order: what a host copy stores); "kn" is `x` itself."""
    if layout == "kn":
        return x
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(np.swapaxes(x, -1, -2))
    return jnp.swapaxes(x, -1, -2)


def relayout(q: "QArray", layout: str) -> "QArray":
    """`q` stored in `layout` (`QLAYOUTS`): the same logical values, shape and scales; its own arrays when it
    is already in it, else one transpose of the values and one of the scales (offline, once: jit it with the
    loading code, or call it on host arrays). One-line UsageError for a bad layout, an array of rank < 2 in
    "nk", or anything but a QArray."""
    check_layout(layout)
    if not isinstance(q, QArray):
        raise UsageError(f"relayout takes a QArray (moe_tune.quantize's result), got {type(q).__name__}")
    if layout == q.layout:
        return q
    if len(q.qvalue.shape) < 2:
        raise UsageError(f"layout {layout!r} swaps the last two axes: it needs an array of rank >= 2, got shape "
                         f"{q.shape}")
    # to "kn" first (undo q's swap), then into `layout`: with two layouts one of the two is the identity
    qvalue, scale = (_swap(_swap(x, q.layout), layout) for x in (q.qvalue, q.scale))
    return QArray(qvalue, scale, layout)


def in_layout(x, layouts: tuple[str, ...] = (DEFAULT_QLAYOUT,)):
    """What a kernel that reads `layouts` is given: `x` itself unless it is a QArray stored in another layout,
    then `relayout(x, layouts[0])` (one transpose XLA fuses into the kernel's operand where it can); the
    one place a backend that reads "kn" gets an "nk" array's logical view."""
    return relayout(x, layouts[0]) if isinstance(x, QArray) and x.layout not in layouts else x


def qmax(dtype) -> float:
    """Largest representable magnitude of a quantized dtype; UsageError for any other dtype."""
    return QuantFormat.parse(dtype).qmax


def quantize(x: jax.Array, dtype, *, axis: int, block_size: int | None = None, layout: str = DEFAULT_QLAYOUT
             ) -> QArray:
    """Quantization of `x` along `axis`: each run of `block_size` elements along `axis` (the whole axis when
    None) shares one scale; `dtype` is a stored dtype name (`QDTYPES`) or "mxfp4".

    - int8, float8_e4m3fn, int4: symmetric absmax, scale `max|x| / qmax(dtype)` (1 for an all-zero run);
      integer values are rounded and clipped to [-qmax, qmax] (int4: [-7, 7]; AWQ/GPTQ-style int4 usually
      takes block_size=128).
    - mxfp4 (= float4_e2m1fn, OCP Microscaling): blocks of 32 (block_size may be omitted), each scaled by the
      power of two `2**(floor(log2(max|x|)) - 2)` (1 for an all-zero run; the exponent kept within float32's
      normal range); values rounded to the nearest e2m1 value (ties to even) and clamped to +-6.

    Returns QArray(qvalue [x.shape] in the stored dtype, scale float32 [x.shape with axis ->
    x.shape[axis] // block_size]) stored in `layout` ("nk": both arrays' last two axes swapped, one transpose
    here; the values are those of "kn" bit for bit). One-line UsageError naming the argument for: an `x` that
    is already quantized (a QArray, AsQArray or DynamicQuant), a dtype that is not quantized, a `block_size`
    that is not a positive integer or does not divide the axis (`QuantFormat.along`'s rule), an empty axis, a
    layout not in `QLAYOUTS` (or "nk" for an array of rank < 2).
    """
    if isinstance(x, (QArray, AsQArray, DynamicQuant)):
        raise UsageError(f"quantize takes a float array, got a {type(x).__name__}: x is already quantized "
                         "(pass its float values, or dequantize(x) first)")
    form = QuantFormat.parse(dtype, block_size)  # a UsageError for other dtypes and blocks
    check_layout(layout)
    ndim = np.ndim(x)
    _check_axis(axis, ndim, "axis")
    form = form.along(np.shape(x)[axis], axis=f"axis {axis % ndim}")
    # quantized as "kn", then moved: the values of both layouts are one computation's, bit for bit
    return relayout(_quantize(x, form.dtype, axis % ndim, form.block), layout)


def _check_axis(axis, ndim: int, name: str) -> None:
    """UsageError naming `name` unless `axis` is an int in [-ndim, ndim)."""
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool) or not -ndim <= axis < ndim:
        raise UsageError(f"{name} {axis!r} is out of range for an array of rank {ndim}: it must be an int in "
                         f"[{-ndim}, {ndim})")


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _quantize(x: jax.Array, dtype: str, axis: int, block: int) -> QArray:
    """`quantize` once its arguments are checked: one compiled function, also when called eagerly."""
    return quantize_tile(jnp.asarray(x, jnp.float32), dtype, axis, block)


def quantize_tile(x: jax.Array, dtype: str, axis: int, block: int) -> QArray:
    """`quantize`'s arithmetic on a float32 array, unchecked and not jitted: what a kernel runs on a tile it
    loaded (`DynamicQuant`), the same ops as the whole-array `quantize`, so the two agree bit for bit."""
    limit = QMAX[dtype]
    size = x.shape[axis]
    runs = x.reshape(*x.shape[:axis], size // block, block, *x.shape[axis + 1:])
    absmax = jnp.max(jnp.abs(runs), axis=axis + 1, keepdims=True)
    if dtype == "float4_e2m1fn":
        # frexp: absmax = mantissa * 2**e with mantissa in [0.5, 1), so floor(log2(absmax)) = e - 1 exactly
        exponent = jnp.clip(jnp.frexp(absmax)[1] - 1 - MX_EMAX, -126, 127)
        scale = jnp.where(absmax > 0, jnp.ldexp(jnp.ones_like(absmax), exponent), 1.0).astype(jnp.float32)
    else:
        scale = jnp.where(absmax > 0, absmax / limit, 1.0).astype(jnp.float32)
    values = runs / scale
    if jnp.issubdtype(jnp.dtype(dtype), jnp.integer):
        values = jnp.round(values)
    # clipped first: the casts' own overflow rules differ by dtype; e2m1 rounds to nearest in the cast
    values = jnp.clip(values, -limit, limit).astype(dtype).reshape(x.shape)
    return QArray(values, jnp.squeeze(scale, axis + 1))


def from_checkpoint(values: jax.Array | np.ndarray, scale: jax.Array | np.ndarray, dtype, *,
                    packed_axis: int | None = None, layout: str = DEFAULT_QLAYOUT) -> QArray:
    """A QArray of a checkpoint's own values and scales, nothing requantized and nothing transposed: the
    arrays are taken as stored in `layout`. ragged_dot weights in "kn": values [g, k, n] with scale
    [g, k/bs, n]; in "nk" (a checkpoint that stores each expert [n, k], k contiguous, as most do): values
    [g, n, k] with scale [g, n, k/bs] (per channel [g, n, 1]). `relayout` moves the result to the other
    layout.

    values: in the stored dtype (`dtype`: int4, "mxfp4" / float4_e2m1fn, int8, float8_e4m3fn), or, for the
      4-bit ones, uint8 holding two values a byte along `packed_axis` (the low nibble first, as AWQ and
      gpt-oss's mxfp4 blocks pack them), then unpacked here (that axis doubles).
    scale: float32, or for mxfp4 float8_e8m0fnu or uint8 holding e8m0 bits (the biased exponent: 2**(b - 127);
      kept as float8_e8m0fnu).
    One-line UsageError for anything else (a layout not in `QLAYOUTS` included).
    """
    name = qdtype_name(dtype)
    check_layout(layout)
    for what, array in (("values", values), ("scale", scale)):
        if not isinstance(array, (jax.Array, np.ndarray)):
            raise UsageError(f"from_checkpoint: {what} must be a NumPy or JAX array, got {type(array).__name__}")
    values = jnp.asarray(values)
    if packed_axis is not None:
        if name not in FOUR_BIT or values.dtype != jnp.uint8:
            raise UsageError(f"packed_axis needs 4-bit values packed in uint8, got {name} in {values.dtype}")
        _check_axis(packed_axis, values.ndim, "packed_axis")
        values = _unpack_nibbles(values, name, packed_axis % values.ndim)
    if jnp.dtype(values.dtype).name != name:
        raise UsageError(f"checkpoint values are {jnp.dtype(values.dtype).name}, not {name}"
                         + (" (pass packed_axis for uint8-packed 4-bit values)" if values.dtype == jnp.uint8 else ""))
    scale = jnp.asarray(scale)
    if scale.dtype == jnp.uint8 and name == "float4_e2m1fn":
        scale = jax.lax.bitcast_convert_type(scale, jnp.float8_e8m0fnu)
    if layout != "kn" and values.ndim < 2:
        raise UsageError(f"layout {layout!r} swaps the last two axes: it needs values of rank >= 2, got shape "
                         f"{tuple(values.shape)}")
    q = QArray(values, scale, layout)
    _check_scale_dtype(q, "checkpoint")
    scale_layout(q)  # a UsageError for scales that fit no layout
    return q


def _unpack_nibbles(packed: jax.Array, dtype: str, axis: int) -> jax.Array:
    """uint8 [..., s, ...] holding two 4-bit values a byte (low nibble first) -> `dtype` [..., 2s, ...]."""
    low, high = packed & 0xF, packed >> 4
    pairs = jnp.stack([low, high], axis=axis + 1)  # [..., s, 2, ...]
    nibbles = pairs.reshape(*packed.shape[:axis], 2 * packed.shape[axis], *packed.shape[axis + 1:])
    if dtype == "int4":  # two's complement in 4 bits
        return (nibbles.astype(jnp.int8) - 16 * (nibbles >= 8).astype(jnp.int8)).astype(jnp.int4)
    # e2m1: sign, 2 exponent bits (bias 1), 1 mantissa bit; its 16 values in code order
    table = jnp.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], jnp.float32)
    return table[nibbles.astype(jnp.int32)].astype(jnp.float4_e2m1fn)


def _check_scale_dtype(q: "QArray", name: str) -> None:
    """UsageError unless `q`'s scale dtype goes with its values (`SCALE_DTYPES`)."""
    values, scale = jnp.dtype(q.qvalue.dtype).name, jnp.dtype(q.scale.dtype).name
    if values not in QMAX or values not in SCALE_DTYPES.get(scale, ()):
        raise UsageError(f"{name} QArray must hold {' or '.join(QDTYPES)} values with float32 scales (mxfp4: "
                         f"or float8_e8m0fnu), got {values} and {scale}")


def scale_layout(q: QArray) -> tuple[int | None, int]:
    """(scaled axis, block size) read off the logical shapes (`QArray.shape`, `scale_shape`: the same for
    both memory layouts); (None, 1) when every element has its own scale. UsageError when the shapes fit no
    layout."""
    vshape, sshape = q.shape, q.scale_shape
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
    if not isinstance(q, QArray):
        raise UsageError(f"dequantize takes a QArray (moe_tune.quantize's result), got {type(q).__name__}")
    axis, block = scale_layout(q)
    # the logical arrays: a transpose of an "nk" array's values and scales, then the same products as "kn"'s
    values, scale = (xp.swapaxes(xp.asarray(x), -1, -2) if q.layout == "nk" else xp.asarray(x)
                     for x in (q.qvalue, q.scale))
    scale = scale.astype(dtype)  # float32 or float8_e8m0fnu: exact in either
    scale = scale if axis is None else xp.repeat(scale, block, axis=axis)
    return values.astype(dtype) * scale


def check_operand(q: QArray, *, name: str, layout: str) -> int:
    """Validate a ragged_dot operand: `q` must be scaled along axis 1 (the contracting k) with quantized
    values (`QDTYPES`) and float32 scales (mxfp4: or float8_e8m0fnu); `layout` names the expected layout for
    the message (e.g. "[g, k, n] ... scale [g, k/bs, n]"); the shapes are the logical ones, whatever
    `q.layout`. Returns its block size along k (k for one scale per channel). One-line UsageError."""
    _check_scale_dtype(q, name)
    try:
        axis, block = scale_layout(q)
    except UsageError:
        axis, block = -1, 0
    if axis not in (None, 1):
        stored = "" if q.layout == "kn" else f" (as read: layout {q.layout!r} stores them swapped)"
        raise UsageError(f"{name} QArray must be {layout}; got values {q.shape} with scale {q.scale_shape}{stored}")
    return block if axis == 1 else 1


def split(x: jax.Array | QArray) -> tuple[jax.Array, jax.Array | None]:
    """(values, float32 scale or None): the parts a kernel reads of an operand that may be quantized, in the
    "kn" layout (`in_layout`: an "nk" array's logical view), an e8m0 scale converted to float32, exactly
    (it is 1/32 of the values' elements)."""
    if not isinstance(x, QArray):
        return x, None
    x = in_layout(x)
    return x.qvalue, x.scale if x.scale.dtype == jnp.float32 else x.scale.astype(jnp.float32)


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DynamicQuant:
    """Activations quantized inside the kernel (dynamic w8a8): a float lhs `value` [m, k] whose tiles a kernel
    quantizes to `qdtype` (int8, float8_e4m3fn) where it loads them, symmetric absmax per row and block of
    `block_size` elements along k (None: the whole row), each scale computed from the tile itself: there is
    no pass over x before the kernel and no quantized copy of it. The result equals ragged_dot of
    `quantize()` (what a kernel computes tile by tile) up to float32 accumulation.
    `moe_tune.ragged_dot(x, w_q, gs, lhs_quant="int8")` builds one; so may a caller (an AsQArray-like marker).
    Its gradient is the straight-through one (that of `value` as a float operand). A pytree whose only leaf
    is `value`."""

    value: jax.Array
    qdtype: str = dataclasses.field(metadata=dict(static=True))
    block_size: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    def __post_init__(self) -> None:
        form = QuantFormat.parse(self.qdtype, dtype_arg="lhs_quant")
        if not form.activations:
            raise UsageError(f"activations are quantized in the kernel to {' or '.join(ACTIVATION_QDTYPES)}, not "
                             f"{form.name}")
        object.__setattr__(self, "qdtype", form.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    @property
    def ndim(self) -> int:
        return len(self.value.shape)

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype of the values in memory (the float activations)."""
        return jnp.dtype(self.value.dtype)

    def block(self) -> int:
        """Elements along k per scale (k for one scale per row); UsageError naming the rule when it does not
        divide k."""
        try:
            return QuantFormat.parse(self.qdtype, self.block_size).along(self.value.shape[1]).block
        except UsageError as error:
            raise UsageError(f"lhs_quant: {error}") from None

    def quantize(self) -> QArray:
        """The QArray a kernel computes tile by tile (the reference's operand)."""
        return quantize(self.value, self.qdtype, axis=1, block_size=self.block())


def as_float(x: jax.Array | QArray | DynamicQuant) -> jax.Array:
    """`x` itself, a QArray dequantized (float32), or a `DynamicQuant`'s quantized values dequantized."""
    x = x.quantize() if isinstance(x, DynamicQuant) else x
    return dequantize(x) if isinstance(x, QArray) else x
