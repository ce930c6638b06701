"""Small helpers the Pallas and tiled kernels share: rounding, padding, TPU tile rows, dot precision, interpret
mode, and the types of their outputs and loop carries inside `jax.shard_map`."""

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
