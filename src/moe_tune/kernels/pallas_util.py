"""Small helpers the Pallas and tiled kernels share: rounding, padding, TPU tile rows, dot precision, interpret
mode, the types of their outputs and loop carries inside `jax.shard_map`, and how the pure-JAX CPU kernels
hold low-precision arrays inside their loops and load blocks of them.

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

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

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


# Inside `jax.shard_map` (check_vma=True, its default) every value's type says which manual mesh axes it varies
# over (its vma). A kernel's operands may vary over some axes (a shard's rows, its experts' weights) and be
# invariant over others, so a loop carry initialised from a constant, or a Pallas output whose type is given
# as a ShapeDtypeStruct, must be typed as varying over the axes its operands vary over: a while loop's carry
# types must match, and pallas_call refuses a ShapeDtypeStruct without one. These helpers give that type, with
# the API of the installed JAX (vma frozensets in `jax.typeof(x).vma` and `ShapeDtypeStruct(vma=)`, or
# `ManualAxisType`s in `manual_axis_type`); outside shard_map every vma is empty and they change nothing.

_STRUCT_FIELDS = inspect.signature(jax.ShapeDtypeStruct).parameters


def varying_axes(*operands: Any) -> frozenset:
    """The manual mesh axes that any array in `operands` (arrays, pytrees such as QArrays, or None) varies
    over: empty outside `jax.shard_map` and for operands invariant across it (anything but a JAX array or
    tracer counts as invariant)."""
    axes: set = set()
    for leaf in jax.tree.leaves(operands):
        if not isinstance(leaf, jax.Array):  # a NumPy array or a Python number is the same on every device
            continue
        aval = jax.typeof(leaf)
        vma = getattr(aval, "vma", None)
        if vma is None:
            mat = getattr(aval, "manual_axis_type", None)
            vma = getattr(mat, "varying", ())
        axes.update(vma)
    return frozenset(axes)


def out_struct(shape: tuple[int, ...], dtype: Any, *operands: Any) -> jax.ShapeDtypeStruct:
    """A kernel output's `jax.ShapeDtypeStruct` (a Pallas `out_shape`), varying over the manual axes its
    `operands` vary over (`varying_axes`)."""
    axes = varying_axes(*operands)
    if "manual_axis_type" in _STRUCT_FIELDS:
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=axes))
    if "vma" in _STRUCT_FIELDS:
        return jax.ShapeDtypeStruct(shape, dtype, vma=axes)
    return jax.ShapeDtypeStruct(shape, dtype)


def vary_like(x: Any, *operands: Any) -> Any:
    """`x` (an array or a pytree of them, e.g. a loop's initial carry) typed as varying over every manual axis
    that it or `operands` vary over: the type a loop body that reads the operands gives its carry. Outside
    shard_map, or where the operands are invariant, x itself."""
    axes = varying_axes(x, *operands)

    def cast(leaf):
        missing = tuple(sorted(axes - varying_axes(leaf), key=str))
        if not missing:
            return leaf
        if hasattr(jax.lax, "pcast"):
            return jax.lax.pcast(leaf, missing, to="varying")
        return jax.lax.pvary(leaf, missing)

    return jax.tree.map(cast, x)


def _manual_mesh():
    """The abstract mesh of the `jax.shard_map` being traced, or None outside one (or on a JAX without it)."""
    get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
    mesh = None if get_mesh is None else get_mesh()
    return mesh if mesh is not None and getattr(mesh, "manual_axes", ()) else None


def vma_unchecked(kernel: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`kernel(*args, **kwargs)` as a `jax.shard_map` with check_vma=False runs it, for kernels a checking
    shard_map refuses: JAX's own whose Pallas `out_shape` carries no vma (Megablox `gmm` / `tgmm`), and any
    Pallas kernel in interpret mode, whose lowering binds the kernel's ops on the operands' blocks with no cast
    between varying and invariant values (a block index from the program id, say). Inside shard_map the kernel
    runs in a nested shard_map over no further axes with check_vma=False (each device computes what it would
    in the outer one: nothing is communicated), and its results are then typed varying over the axes its array
    arguments vary over (`vary_like`), which is what they do. Outside shard_map, a plain call."""
    mesh = _manual_mesh()
    if mesh is None:
        return kernel(*args, **kwargs)
    leaves, tree = jax.tree.flatten((args, kwargs))
    arrays = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]

    def call(*values):
        full = list(leaves)
        for i, value in zip(arrays, values):
            # The nested shard_map's arguments keep the outer types, its own values have none (no check): a full
            # slice (an identity XLA removes) gives the arguments the type of the rest, so that the loops of an
            # interpreted kernel carry one type.
            full[i] = jax.lax.slice(value, (0,) * value.ndim, value.shape)
        inner_args, inner_kwargs = jax.tree.unflatten(tree, full)
        return kernel(*inner_args, **inner_kwargs)

    values = [leaves[i] for i in arrays]
    out = jax.shard_map(call, mesh=mesh, in_specs=P(), out_specs=P(), axis_names=frozenset(),
                        check_vma=False)(*values)
    return vary_like(out, *values)


def pallas_run(call: Callable[..., Any], *args: Any, interpret: bool) -> Any:
    """`call(*args)` for the result of a `pl.pallas_call` (its out_shape from `out_struct`): compiled as is; in
    interpret mode through `vma_unchecked` (see there)."""
    return vma_unchecked(call, *args) if interpret else call(*args)


def sum_like(cotangent: Any, primal: Any) -> Any:
    """A custom VJP's `cotangent` (an array, a pytree of them, or None) for the operand `primal`, summed over
    the manual axes it varies over and `primal` does not: inside shard_map the gradient of an operand that is
    the same on every device is the sum of every device's, which JAX's own transpose of the implicit cast
    computes, and a custom VJP must return it typed as the operand is."""
    extra = varying_axes(cotangent) - varying_axes(primal)
    if not extra:
        return cotangent

    def reduce(leaf):
        axes = tuple(sorted(varying_axes(leaf) & extra, key=str))
        return jax.lax.psum(leaf, axes) if axes else leaf

    return jax.tree.map(reduce, cotangent)


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
