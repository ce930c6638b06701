"""`moe_tune.ragged_dot`: the public grouped matmul. Picks a backend and, for each direction (fwd, and the
dlhs / drhs gradients of its custom VJP), a tuned config at trace time."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moe_tune.core import contexts
from moe_tune.core.errors import UsageError
from moe_tune.kernels.base import KernelConfig
from moe_tune.kernels.ragged_dot.problem import DIRECTIONS, RaggedDotProblem, int_scalar
from moe_tune.kernels.ragged_dot.definition import RAGGED_DOT
from moe_tune.kernels.ragged_dot.metadata import clip_group_sizes, select_shard
from moe_tune.kernels.ragged_dot.quant_plan import paired_lhs_block
from moe_tune.kernels.kernel_op import freeze_config
from moe_tune.kernels.pallas_util import sum_like
from moe_tune.core.quant import AsQArray, DynamicQuant, QArray, scale_layout


@dataclasses.dataclass(frozen=True)
class _Call:
    """Static (hashable) part of one call: backend, forward problem, configs the caller fixed per direction,
    per operand (lhs, rhs) the `AsQArray` template of a quantization-aware-training operand (its value a
    ShapeDtypeStruct), else None, and the routing distribution its lookups assume."""

    backend: str
    problem: RaggedDotProblem
    given: tuple[tuple[str, Any], ...]  # (direction, config or `freeze_config` tuple)
    ste: tuple[AsQArray | None, AsQArray | None] = (None, None)
    distribution: str | None = None  # the routing the tables are asked for (`moe_tune.core.contexts`)
    lhs_quant: tuple[str, int] | None = None  # (qdtype, block) of activations the fwd kernel quantizes

    def fwd_lhs(self, lhs):
        """The forward kernel's lhs: wrapped in `DynamicQuant` when the kernel quantizes it (the op's primal
        and residual stay the float x, whose gradient is then the straight-through one)."""
        return lhs if self.lhs_quant is None else DynamicQuant(lhs, *self.lhs_quant)

    def run(self, direction: str, a, b, group_sizes, group_offset):
        """One direction's kernel, its config resolved now (at trace time) by `RAGGED_DOT.resolve_config`."""
        problem = self.problem.with_direction(direction)
        resolved = RAGGED_DOT.resolve_config(self.backend, problem, dict(self.given).get(direction),
                                             distribution=self.distribution)
        return resolved.backend.run(problem, resolved.config, a, b, group_sizes, group_offset)


def _kernel_operand(x: jax.Array | QArray | AsQArray) -> jax.Array | QArray:
    """What the kernels read: an AsQArray is quantized here, inside the custom VJP, so that no gradient
    flows through the rounding (the straight-through rule is the bwd's)."""
    return x.quantize() if isinstance(x, AsQArray) else x


def _cotangent(primal_kind: AsQArray | None, x, grad: jax.Array | None):
    """The cotangent of one operand: None for a QArray (a constant), the straight-through gradient wrapped
    in the AsQArray's structure for a quantization-aware one (in its value's dtype), else `grad`."""
    if isinstance(x, QArray) and primal_kind is None:
        return None
    if primal_kind is not None:
        return dataclasses.replace(primal_kind, value=grad.astype(primal_kind.value.dtype))
    return grad


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ragged_dot(lhs, rhs, group_sizes, group_offset, call: _Call):
    return call.run("fwd", call.fwd_lhs(_kernel_operand(lhs)), _kernel_operand(rhs), group_sizes, group_offset)


def _ragged_dot_fwd(lhs, rhs, group_sizes, group_offset, call: _Call):
    a, b = _kernel_operand(lhs), _kernel_operand(rhs)
    return call.run("fwd", call.fwd_lhs(a), b, group_sizes, group_offset), (a, b, group_sizes, group_offset)


def _ragged_dot_bwd(call: _Call, residuals, dout):
    # lhs / rhs are what the forward kernel read: floats, or QArrays (given, or quantized from an AsQArray).
    # A given QArray gets no gradient, so its direction is not run; any other operand's gradient is that of
    # the dequantized product, run on the quantized kernels (dlhs reads rhs quantized, drhs lhs quantized).
    lhs, rhs, group_sizes, group_offset = residuals
    lhs_ste, rhs_ste = call.ste
    dlhs = drhs = None
    if not isinstance(lhs, QArray) or lhs_ste is not None:
        dlhs = call.run("dlhs", dout, rhs, group_sizes, group_offset)  # dout @ rhs[g]^T per group
    if not isinstance(rhs, QArray) or rhs_ste is not None:
        drhs = call.run("drhs", lhs, dout, group_sizes, group_offset)  # lhs[rows]^T @ dout[rows] per group
    # inside shard_map, the gradient of an operand replicated over the devices is the sum of theirs (`sum_like`)
    return _cotangent(lhs_ste, lhs, sum_like(dlhs, lhs)), _cotangent(rhs_ste, rhs, sum_like(drhs, rhs)), None, None


_ragged_dot.defvjp(_ragged_dot_fwd, _ragged_dot_bwd)


def _ste_template(x: Any) -> AsQArray | None:
    """An AsQArray's static description (its value a ShapeDtypeStruct: hashable), else None."""
    if not isinstance(x, AsQArray):
        return None
    return dataclasses.replace(x, value=jax.ShapeDtypeStruct(x.value.shape, x.value.dtype))


def given_configs(config: Any, directions: tuple[str, ...] = DIRECTIONS) -> tuple[tuple[str, Any], ...]:
    """`config` is one config (or field dict) for fwd, or a mapping direction -> config (`directions`: the
    op's). A mapping that names some directions and other keys (`{"fwd": ..., "bwd": ...}`) is a UsageError
    naming them."""
    if config is None:
        return ()
    if isinstance(config, Mapping) and config and set(config) <= set(directions):
        items = config.items()
    elif isinstance(config, Mapping) and set(config) & set(directions):
        unknown = sorted(set(config) - set(directions))
        raise UsageError(f"config keys {unknown} are not directions: a config per direction takes "
                         f"{', '.join(directions)} (a config's own fields go in one of them)")
    else:
        items = [("fwd", config)]
    return tuple((d, freeze_config(c)) for d, c in items if c is not None)


def _concrete(x: Any) -> np.ndarray | None:
    """`x` as a NumPy array when its value is known now (a Python int, a NumPy or a committed JAX array),
    None when it is traced (inside jit, grad or vmap): a traced value cannot be checked, only normalized."""
    if x is None or isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def _template(x: AsQArray) -> QArray:
    """The QArray an AsQArray becomes, shapes and dtypes only (nothing is quantized); UsageError unless its
    value is an array."""
    if not isinstance(x.value, (jax.Array, np.ndarray)):
        raise UsageError(f"an AsQArray's value must be a float array, got {type(x.value).__name__}")
    return jax.eval_shape(AsQArray.quantize, x)


def _jax_array(x: Any) -> Any:
    """A NumPy array as a JAX array; anything else as is (checked later, with the operand's name)."""
    return jnp.asarray(x) if isinstance(x, np.ndarray) else x


def _check_groups(group_sizes: Any, group_offset: Any, *, m: int, groups: int) -> None:
    """One-line UsageErrors for group sizes and offsets whose values are known (see `shard_groups` for
    what traced ones do instead): a negative size, `sum(group_sizes) > m`, an offset whose shard
    `[offset, offset + groups)` does not lie inside `group_sizes`."""
    sizes, offset = _concrete(group_sizes), _concrete(group_offset)
    if sizes is not None and (sizes < 0).any():
        first = int(np.argmax(sizes < 0))
        raise UsageError(f"group_sizes must be >= 0, got {int(sizes[first])} for group {first}")
    if sizes is not None and int(sizes.sum()) > m:
        raise UsageError(f"sum(group_sizes) = {int(sizes.sum())} exceeds lhs's {m} rows")
    total = group_sizes.shape[0]
    if offset is not None and not 0 <= int(offset) <= total - groups:
        raise UsageError(f"group_offset {int(offset)} is out of range: with {total} groups in group_sizes and "
                         f"{groups} in rhs it must be in [0, {total - groups}]")


def shard_groups(group_sizes: jax.Array, group_offset: Any, *, m: int, groups: int
                  ) -> tuple[jax.Array, jax.Array | None]:
    """The group sizes and offset every backend is given, so that all of them compute the same rows from
    traced values too: negative sizes count as 0, rows past m belong to no group, and an offset out of range
    selects no group (every row zero). `metadata.select_shard` defines it; checked first when concrete."""
    offset = None if group_offset is None else int_scalar(group_offset, "group_offset")
    _check_groups(group_sizes, group_offset, m=m, groups=groups)
    if offset is None:
        return clip_group_sizes(jnp.asarray(group_sizes), m), None
    return select_shard(jnp.asarray(group_sizes), offset, m=m, groups=groups)


def _dynamic_lhs(lhs: Any, rhs: Any, lhs_quant: str | None, block: int | None) -> tuple[str, int] | None:
    """(qdtype, block) of activations quantized in the kernel (`lhs_quant`), else None; the block defaults to
    the weights' own scale block along k (so the two scales' steps agree), k for per-channel weights."""
    if lhs_quant is None:
        if block is not None:
            raise UsageError("lhs_quant_block needs lhs_quant")
        return None
    if isinstance(lhs, (QArray, AsQArray, DynamicQuant)):
        raise UsageError(f"lhs_quant quantizes float activations in the kernel; lhs is a {type(lhs).__name__}")
    if block is None and isinstance(rhs, QArray) and rhs.ndim == 3:
        axis, rhs_block = scale_layout(rhs)
        block = paired_lhs_block(lhs.shape[1], rhs_block if axis == 1 else None)
    marker = DynamicQuant(lhs, lhs_quant, block)
    return marker.qdtype, marker.block()


def ragged_dot(
    lhs: jax.Array | QArray | AsQArray,
    rhs: jax.Array | QArray | AsQArray,
    group_sizes: jax.Array,
    *,
    preferred_element_type: Any = None,
    group_offset: jax.Array | None = None,
    backend: str | None = None,
    config: KernelConfig | Mapping[str, Any] | None = None,
    distribution: str | None = None,
    lhs_quant: str | None = None,
    lhs_quant_block: int | None = None,
) -> jax.Array:
    """Grouped matmul: `out[rows of group i] = lhs[rows] @ rhs[i]`; differentiable in lhs and rhs.

    Either operand may be quantized (`moe_tune.QArray`, scaled along k: lhs scale [m, k/bs], rhs scale
    [groups, k/bs, n]); the result is that of the dequantized operands up to float32 accumulation. A QArray
    is a constant for autodiff (no gradient flows into it, and its direction is not run); the gradient of
    the other, float operand is that of the dequantized product, run on the quantized kernels. An
    `moe_tune.AsQArray` (quantization-aware training) is quantized inside the op and gets the
    straight-through gradient (that of the dequantized value) in its value's dtype.

    Args:
      lhs: [m, k], rows sorted by group (float32, bfloat16 or float16; or a QArray / AsQArray).
      rhs: [groups, k, n] (or a QArray / AsQArray).
      group_sizes: int [total_groups], each >= 0, summing to at most m; rows past `sum(group_sizes)` come out
        zero. Known values that break this are a UsageError; traced ones count negative sizes as 0 and
        drop rows past m (every backend alike).
      preferred_element_type: output dtype (default: the promoted dtype of the float operands, float32 when
        both are quantized); low-precision inputs are accumulated in float32. Gradients come back in lhs's and rhs's dtypes.
      group_offset: int32 scalar; with it, `group_sizes` covers all groups and this call computes only the
        local groups `[group_offset, group_offset + groups)` (an expert-parallel shard); other rows are zero.
        It must lie in `[0, total_groups - groups]`: a known value outside is a UsageError, a traced one
        selects no group (every row, and drhs's result, zero).
      backend: `xla`, `tiled`, `megablox`, `triton`, `mosaic_gpu`; None picks by platform (the registry's
        `platform_defaults`: cpu tiled, gpu triton, tpu megablox).
      config: the backend's config (or a dict of its fields) for the forward pass, or a mapping
        `{"fwd": ..., "dlhs": ..., "drhs": ...}`; directions left out are looked up in the tables (exact,
        nearest m, else the backend's heuristic default) when they are traced.
      distribution: the routing (group-size distribution: `balanced`, `skewed`, ...) the table lookups assume,
        for every direction; None: the `moe_tune.use_distribution` block around the call, else
        $MOE_TUNE_DISTRIBUTION, else `balanced` (`moe_tune.core.contexts`).
      lhs_quant: "int8" (or "float8_e4m3fn"): dynamic w8a8, with quantized weights. The forward kernel
        quantizes each lhs tile where it loads it, symmetric absmax per row and `lhs_quant_block` elements
        along k (default: rhs's scale block; k for per-channel weights), the scale from the tile itself (no
        quantized copy of lhs). The result is that of the quantized-then-dequantized operands; lhs's
        gradient is the straight-through one (dout times the dequantized weights).

    Returns:
      [m, n] in `preferred_element_type`.
    """
    # a QArray of NumPy parts as JAX arrays: a kernel indexes them with traced group ids
    lhs, rhs = (jax.tree.map(_jax_array, x) if isinstance(x, QArray) else x for x in (lhs, rhs))
    # an AsQArray is described by the QArray it becomes (its shapes only: nothing is quantized here)
    lhs_q, rhs_q = (_template(x) if isinstance(x, AsQArray) else x for x in (lhs, rhs))
    dynamic = _dynamic_lhs(lhs, rhs_q, lhs_quant, lhs_quant_block)
    lhs_q = lhs_q if dynamic is None else DynamicQuant(lhs, *dynamic)
    problem = RaggedDotProblem.from_arrays(
        lhs_q, rhs_q, group_sizes, preferred_element_type=preferred_element_type, group_offset=group_offset
    )
    impl = RAGGED_DOT.backend(backend)
    group_sizes, group_offset = shard_groups(group_sizes, group_offset, m=problem.m, groups=problem.groups)
    call = _Call(impl.name, problem, given_configs(config), (_ste_template(lhs), _ste_template(rhs)),
                 contexts.distribution_for_call(distribution), lhs_quant=dynamic)
    return _ragged_dot(lhs, rhs, group_sizes, group_offset, call)
