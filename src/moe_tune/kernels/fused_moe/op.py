"""The public fused MoE ops: `gather_gmm` (fused dispatch) and `gmm_combine` (fused combine).

Each picks a backend (the platform's, or the caller's) and, per direction, a config (the caller's, else the
tables', at trace time), and has a custom VJP:

- gather_gmm: dx is a fused scatter-add, the combine kernel with the weights transposed (`gmm_combine`, row
  weights 1): no [m, k] gradient rows are written. d(weights) is the ragged_dot drhs (tgmm) of the gathered
  rows, which the backward does write ([m, k]): the existing, tuned ragged_dot kernel. With `glu` the forward
  under differentiation keeps the pre-activation product [m, n] (what the unfused layer keeps as gate and up)
  and the backward differentiates the activation on it.
- gmm_combine: dh is the dispatch kernel with the weights transposed (`gather_gmm` of d(out) rows) times each
  row's weight; d(row_weights) the row dot of h with it; d(weights) the ragged_dot drhs of the weighted h and
  the gathered d(out) rows.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moe_tune.core.errors import UsageError
from moe_tune.kernels.fused_moe.activations import ACTIVATIONS, apply
from moe_tune.kernels.fused_moe.base import weight_parts, weights_shape
from moe_tune.kernels.fused_moe.definition import FUSED_MOE, forward_glu
from moe_tune.kernels.fused_moe.plain_jax import local_rows
from moe_tune.kernels.fused_moe.problem import DIRECTIONS, FusedMoeProblem
from moe_tune.kernels.pallas_util import as_bits, from_bits
from moe_tune.kernels.pallas_util import sum_like
from moe_tune.kernels.gather.definition import RAGGED_GATHER
from moe_tune.kernels.gather.problem import GatherProblem
from moe_tune.kernels.ragged_dot.definition import RAGGED_DOT
from moe_tune.kernels.ragged_dot.metadata import group_bounds
from moe_tune.kernels.ragged_dot.op import _concrete, given_configs, shard_groups
from moe_tune.kernels.ragged_dot.problem import RHS_LAYOUT, RaggedDotProblem, dtype_name
from moe_tune.core.quant import QArray, check_operand, in_layout


@dataclasses.dataclass(frozen=True)
class _Call:
    """Static part of one call: backend name, the forward problem, the configs the caller fixed per direction."""

    backend: str
    problem: FusedMoeProblem
    given: tuple[tuple[str, Any], ...] = ()
    distribution: str | None = None  # the routing the tables are asked for (None: the runtime's)

    def _resolve(self, problem: FusedMoeProblem):
        options = {} if self.distribution is None else {"distribution": self.distribution}
        return FUSED_MOE.resolve_config(self.backend, problem, dict(self.given).get(problem.direction), **options)

    def gather_gmm(self, direction: str, a, rows, rhs, group_sizes, group_offset, *, glu: str | None):
        """dispatch fwd (its problem keyed on the `glu` it runs) or combine bwd (the weights transposed)."""
        problem = self.problem.with_direction(direction)
        if direction == "fwd":
            problem = dataclasses.replace(problem, glu=glu)
        resolved = self._resolve(problem)
        return resolved.backend.gather_gmm(a, rows, resolved.backend.takes(rhs), group_sizes,
                                           config=resolved.config, out_dtype=jnp.dtype(problem.dtype),
                                           group_offset=group_offset, glu=glu, transpose_rhs=problem.transpose_rhs)

    def gmm_combine(self, direction: str, a, rhs, group_sizes, rows, weights, group_offset, *,
                    skip_zero_weights: bool = False):
        """combine fwd or dispatch bwd (the weights transposed, into the dispatch's tokens)."""
        problem = self.problem.with_direction(direction)
        resolved = self._resolve(problem)
        return resolved.backend.gmm_combine(a, resolved.backend.takes(rhs), group_sizes, rows, weights,
                                            tokens=problem.tokens, config=resolved.config,
                                            out_dtype=jnp.dtype(problem.dtype), group_offset=group_offset,
                                            skip_zero_weights=skip_zero_weights, transpose_rhs=problem.transpose_rhs)


def _tgmm(lhs, dout, group_sizes, group_offset, *, groups: int, out_dtype, distribution: str | None) -> jax.Array:
    """[groups, k, n] = per local group lhs[rows]^T @ dout[rows]: the tuned ragged_dot drhs kernel."""
    problem = RaggedDotProblem(m=lhs.shape[0], k=lhs.shape[1], n=dout.shape[1], groups=groups,
                               lhs_dtype=dtype_name(lhs.dtype), rhs_dtype=dtype_name(out_dtype),
                               out_dtype=dtype_name(dout.dtype), direction="drhs",
                               total_groups=group_sizes.shape[0] if group_sizes.shape[0] != groups else None)
    options = {} if distribution is None else {"distribution": distribution}
    resolved = RAGGED_DOT.resolve_config(None, problem, **options)
    return resolved.backend.run(problem, resolved.config, lhs, dout, group_sizes, group_offset)


def _gather_rows(a, rows, group_sizes, group_offset, *, groups: int, weights=None, distribution: str | None):
    """[m, width]: a[rows[i]] (* weights[i]) on the shard's rows [start, end), 0 elsewhere: the tuned dispatch
    kernel (`ragged_gather`'s), which the backward's drhs reads (XLA CPU's own row gather was 2.5 s of a 35 s
    training step at qwen3-30b-a3b prefill, benchmarks/results/fused_cpu_*)."""
    m = rows.shape[0]
    starts, ends = group_bounds(group_sizes, m=m, groups=groups, group_offset=0 if group_offset is None else group_offset)
    problem = GatherProblem(tokens=a.shape[0], rows=m, hidden=a.shape[1], dtype=dtype_name(a.dtype),
                            weighted=weights is not None)
    options = {} if distribution is None else {"distribution": distribution}
    resolved = RAGGED_GATHER.resolve_config(None, problem, **options)
    return resolved.backend.gather(a, rows, starts[0], ends[groups - 1], weights, config=resolved.config)


def _constant(rhs) -> bool:
    """Whether the weights are QArrays: autodiff constants (no gradient, its kernel not run)."""
    return isinstance(weight_parts(rhs)[0], QArray)


def _no_grad(rhs):
    """The cotangent of constant weights: None, or a None per part."""
    return tuple(None for _ in rhs) if isinstance(rhs, tuple) else None


def _weights_grad(rhs, lhs, dout, group_sizes, group_offset, *, groups: int, distribution: str | None):
    """The gradient of float weights, in rhs's form: per part (its columns of dout) the ragged_dot drhs
    lhs[rows]^T @ dout[rows, part's columns], in the part's dtype; a tuple for parts (each computed on its
    own: no [groups, k, n] gradient is cut in two afterwards)."""
    parts = weight_parts(rhs)
    grads, col = [], 0
    for part in parts:
        width = part.shape[2]
        columns = dout if len(parts) == 1 else dout[:, col:col + width]
        grads.append(_tgmm(lhs, columns, group_sizes, group_offset, groups=groups, out_dtype=part.dtype,
                           distribution=distribution).astype(part.dtype))
        col += width
    return tuple(grads) if isinstance(rhs, tuple) else grads[0]


def _glu_grad(glu: str, h: jax.Array, dout: jax.Array) -> jax.Array:
    """d(act(gate) * up) / d[gate, up] for the pre-activation product h = [gate, up] ([m, 2f]) and dout [m, f]
    -> [m, 2f] in h.dtype, computed in float32 and rounded once: each half on its own, concatenated (bf16
    through its bits). Against the VJP of `apply` (its two slices transposed into two zero-padded [m, 2f]
    arrays and summed: a 190 ms pad+add at deepseek prefill ep 4 f32): no pad, and no more temp,
    because (a) the concatenate runs on bits (XLA CPU converts a bf16 concatenate to float32: both halves
    and the result in f32) and (b) an optimization barrier keeps the result one buffer (without it XLA
    folds the drhs' column slices of dh into the halves, which then live beside the concatenated copy).
    deepseek-v2-lite prefill ep 4 fused fwd+bwd temp: f32 1596 MiB (slices) / 1736 (halves, no barrier) ->
    1456, bf16 839 -> 733 (FINDINGS.md: gated gradient per half)."""
    f = h.shape[1] // 2
    gate, up, d = h[:, :f].astype(jnp.float32), h[:, f:].astype(jnp.float32), dout.astype(jnp.float32)
    act, act_pullback = jax.vjp(ACTIVATIONS[glu][0], gate)
    halves = [as_bits(half.astype(h.dtype)) for half in (act_pullback(d * up)[0], d * act)]
    return jax.lax.optimization_barrier(from_bits(jnp.concatenate(halves, axis=1), h.dtype))


# --------------------------------------------------------------------------------------------------------
# gather_gmm


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _gather_gmm(x, rows, rhs, group_sizes, group_offset, call: _Call):
    return call.gather_gmm("fwd", x, rows, rhs, group_sizes, group_offset,
                           glu=forward_glu(call.problem.glu, differentiated=False))


def _gather_gmm_fwd(x, rows, rhs, group_sizes, group_offset, call: _Call):
    glu = call.problem.glu
    # with glu, keep the pre-activation product (the unfused layer keeps gate and up): the backward
    # differentiates the activation on it
    h = call.gather_gmm("fwd", x, rows, rhs, group_sizes, group_offset, glu=forward_glu(glu, differentiated=True))
    out = h if glu is None else apply(glu, h.astype(jnp.float32)).astype(h.dtype)
    return out, (x, rows, rhs, group_sizes, group_offset, h)


def _gather_gmm_bwd(call: _Call, residuals, dout):
    x, rows, rhs, group_sizes, group_offset, h = residuals
    glu, m = call.problem.glu, rows.shape[0]
    dh = dout if glu is None else _glu_grad(glu, h, dout)
    # dx: the combine kernel with the weights transposed, every local row weighted 1 (a fused scatter-add)
    dx = call.gmm_combine("bwd", dh, rhs, group_sizes, rows, jnp.ones((m,), jnp.float32), group_offset)
    drhs = _no_grad(rhs)
    if not _constant(rhs):  # the rows gathered for it: the drhs kernel reads [m, k]
        gathered = _gather_rows(x, rows, group_sizes, group_offset, groups=call.problem.groups,
                                distribution=call.distribution)
        drhs = _weights_grad(rhs, gathered, dh, group_sizes, group_offset, groups=call.problem.groups,
                             distribution=call.distribution)
    return sum_like(dx.astype(x.dtype), x), None, sum_like(drhs, rhs), None, None  # summed for replicated ones


_gather_gmm.defvjp(_gather_gmm_fwd, _gather_gmm_bwd)


# --------------------------------------------------------------------------------------------------------
# gmm_combine


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _gmm_combine(h, rhs, group_sizes, rows, weights, group_offset, skip_zero_weights: bool, call: _Call):
    return call.gmm_combine("fwd", h, rhs, group_sizes, rows, weights, group_offset,
                            skip_zero_weights=skip_zero_weights)


def _gmm_combine_fwd(h, rhs, group_sizes, rows, weights, group_offset, skip_zero_weights, call):
    out = _gmm_combine(h, rhs, group_sizes, rows, weights, group_offset, skip_zero_weights, call)
    return out, (h, rhs, group_sizes, rows, weights, group_offset)


def _gmm_combine_bwd(skip_zero_weights, call: _Call, residuals, dout):
    h, rhs, group_sizes, rows, weights, group_offset = residuals
    m = h.shape[0]
    valid = local_rows(group_sizes, m, call.problem.groups, group_offset)
    if skip_zero_weights:  # a dropped row gets no gradient, its weight neither
        valid = valid & (weights != 0)
    w32 = weights.astype(jnp.float32)
    # d(out[t]) / d(h[i]) = w_i * dout[t] @ rhs^T: the dispatch kernel, weights transposed (0 outside the shard)
    g = call.gather_gmm("bwd", dout, rows, rhs, group_sizes, group_offset, glu=None).astype(jnp.float32)
    dh = jnp.where(valid[:, None], g * w32[:, None], 0.0).astype(h.dtype)
    safe_h = jnp.where(valid[:, None], h.astype(jnp.float32), 0.0)  # rows outside may hold NaN
    # the products masked, then summed per row: XLA CPU computes them in one pass over h and g in their dtype
    # and sums them (one float32 [m, k] buffer). As a row dot (an einsum, or a sum of the unmasked product,
    # which XLA rewrites into one) its operands were float32 copies of safe_h and g, two [m, k] buffers
    # (deepseek-v2-lite bf16 prefill ep 4: temp 702 -> 636 MiB; FINDINGS.md: fused layer memory).
    dweights = jnp.sum(jnp.where(valid[:, None], h.astype(jnp.float32) * g, 0.0), axis=1).astype(weights.dtype)
    drhs = _no_grad(rhs)
    if not _constant(rhs):  # the weighted d(out) rows gathered for it: the drhs kernel reads them
        dout_rows = _gather_rows(dout, rows, group_sizes, group_offset, groups=call.problem.groups,
                                 weights=jnp.where(valid, w32, 0.0), distribution=call.distribution)
        drhs = _weights_grad(rhs, safe_h.astype(h.dtype), dout_rows, group_sizes, group_offset,
                             groups=call.problem.groups, distribution=call.distribution)
    return sum_like(dh, h), sum_like(drhs, rhs), None, None, sum_like(dweights, weights), None


_gmm_combine.defvjp(_gmm_combine_fwd, _gmm_combine_bwd)


# --------------------------------------------------------------------------------------------------------
# Public API


def parts_error(parts: list, glu: str | None) -> str | None:
    """Why weight parts cannot stand for one [groups, k, n] weight of the fused ops (None: they can): each a
    float array or a QArray, all of one kind, groups and k (QArrays: one dtype and scale block), and with
    `glu` either one array or the (gate, up) pair of one shape. A QArray of no valid layout is a UsageError
    naming it."""
    kinds = ", ".join(f"{type(p).__name__} {getattr(p, 'shape', '')}".rstrip() for p in parts)
    if any(not isinstance(p, (jax.Array, np.ndarray, QArray)) for p in parts):
        return f"weights must be float arrays or QArrays, got {kinds}"
    if any(p.ndim != 3 for p in parts):
        return f"weights must be [groups, k, n], got {kinds}"
    if len({(p.shape[0], p.shape[1]) for p in parts}) != 1 or len({isinstance(p, QArray) for p in parts}) != 1:
        return f"weight parts must share groups and k and be all float or all QArray, got {kinds}"
    if glu is not None and len(parts) > 1 and (len(parts) != 2 or parts[0].shape != parts[1].shape):
        return f"with glu the weight parts are (gate, up) of one shape, got {kinds}"
    if isinstance(parts[0], QArray):
        quant = [(p.dtype.name, check_operand(p, name="rhs", layout=RHS_LAYOUT)) for p in parts]
        if len(set(quant)) != 1:
            return ("quantized weight parts must share dtype and scale block, got "
                    + ", ".join(f"{dtype} block {block}" for dtype, block in quant))
    return None


def _problem(a, rows, rhs, group_sizes, group_offset, *, stage: str, tokens: int | None, glu: str | None
             ) -> FusedMoeProblem:
    """Validate the operands (shapes, dtypes; UsageError) and describe them; tokens None: a's rows."""
    name = f"fused {stage}"
    parts = weight_parts(rhs)
    if (error := parts_error(parts, glu)) is not None:
        raise UsageError(f"{name}: {error}")
    groups, k, n = weights_shape(rhs)
    if (not isinstance(a, (jax.Array, np.ndarray)) or a.ndim != 2 or a.shape[1] != k
            or not jnp.issubdtype(a.dtype, jnp.floating)):
        raise UsageError(f"{name}: the activations must be a float array [rows, {k}], got "
                         f"{type(a).__name__} {getattr(a, 'shape', '')}")
    if getattr(rows, "ndim", None) != 1 or not jnp.issubdtype(rows.dtype, jnp.integer):
        raise UsageError(f"{name}: rows must be a 1-D integer array, got {getattr(rows, 'shape', None)}")
    if stage == "combine" and rows.shape[0] != a.shape[0]:
        raise UsageError(f"{name}: rows must have one entry per row of h ({a.shape[0]}), got {rows.shape[0]}")
    if getattr(group_sizes, "ndim", None) != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise UsageError(f"{name}: group_sizes must be a 1-D integer array")
    total = group_sizes.shape[0]
    if total < groups or (group_offset is None and total != groups):
        raise UsageError(f"{name}: group_sizes has {total} groups but the weights {groups} (pass group_offset to "
                         "shard)")
    quant: dict[str, Any] = {}
    if isinstance(parts[0], QArray):
        quant = {"rhs_qdtype": parts[0].dtype.name,
                 "rhs_qblock": check_operand(parts[0], name="rhs", layout=RHS_LAYOUT)}
    if glu is not None and glu not in ACTIVATIONS:
        raise UsageError(f"{name}: unknown glu activation {glu!r}; choose from {', '.join(ACTIVATIONS)}")
    return FusedMoeProblem(tokens=a.shape[0] if tokens is None else tokens, m=rows.shape[0], k=k, n=n,
                           groups=groups, dtype=dtype_name(a.dtype), stage=stage, glu=glu,
                           total_groups=total if total != groups else None, **quant)


def _check_rows(rows: Any, group_sizes: Any, group_offset: Any, *, tokens: int, groups: int, stage: str) -> None:
    """One-line UsageError for a row index that is known now (rows and group sizes concrete, as `ragged_dot`
    checks concrete group sizes) and lies outside `[0, tokens)` among the rows the local groups hold (the
    others are never read). Traced indices cannot be checked: `normalized_rows` makes every backend read them
    the same way."""
    values, sizes = _concrete(rows), _concrete(group_sizes)
    offset = 0 if group_offset is None else _concrete(group_offset)
    if values is None or sizes is None or offset is None:
        return
    sizes = np.maximum(sizes.astype(np.int64), 0)
    start = int(sizes[:int(offset)].sum())
    end = min(start + int(sizes[int(offset):int(offset) + groups].sum()), values.shape[0])
    local = values[start:end]
    bad = np.flatnonzero((local < 0) | (local >= tokens))
    if bad.size:
        i = start + int(bad[0])
        held = "x's" if stage == "dispatch" else "the output's"
        raise UsageError(f"fused {stage}: rows[{i}] = {int(values[i])} is outside {held} {tokens} tokens "
                         f"(rows [{start}, {end}) belong to the local groups and must index a token)")


def _as_read(rhs):
    """The weights (or their parts) as the fused backends read them: a QArray in another memory layout moved
    to "kn" (`core.quant.in_layout`: the same values; no fused backend reads "nk" as stored)."""
    return tuple(map(in_layout, rhs)) if isinstance(rhs, tuple) else in_layout(rhs)


def normalized_rows(rows: jax.Array, tokens: int, stage: str) -> jax.Array:
    """Token indices as every backend is given them, so that traced out-of-range values read the same way on
    each: the dispatch clamps them into `[0, tokens)` (as JAX indexing does: the row reads the nearest token);
    the combine sends them to `tokens`, the row past the output every backend drops (the row adds nothing)."""
    rows = rows.astype(jnp.int32)
    if stage == "dispatch":
        return jnp.clip(rows, 0, tokens - 1)
    return jnp.where((rows >= 0) & (rows < tokens), rows, tokens)


def gather_gmm(
    x: jax.Array,
    rows: jax.Array,
    rhs: jax.Array | QArray | tuple,
    group_sizes: jax.Array,
    *,
    group_offset: jax.Array | int | None = None,
    glu: str | None = None,
    backend: str | None = None,
    config: Any = None,
    distribution: str | None = None,
) -> jax.Array:
    """Fused dispatch: `out[i] = x[rows[i]] @ rhs[group(i)]` for the rows of the local groups (0 elsewhere),
    without writing the gathered rows; with `glu`, `act(h[:, :f]) * h[:, f:]` of that product.

    Args:
      x: [tokens, k] float32 / bfloat16 / float16.
      rows: int [m]: the token each expert-ordered row reads (any value outside the shard's rows: never read).
        A known index outside [0, tokens) among the shard's rows is a UsageError; a traced one is clamped
        into it on every backend (`normalized_rows`).
      rhs: [groups, k, n] float or `QArray` (scaled along k), or a tuple of such parts standing for their
        concatenation along n (gate and up: no concatenated copy for backends that read parts).
      group_sizes: int [total_groups], rows per group in row order; group_offset: as `ragged_dot` (an
        expert-parallel shard computes the local groups only; the shard's rows follow from the sizes).
      glu: `silu`, `gelu` or `relu`: rhs is gate and up concatenated (n = 2f), the output [m, f].
      backend: `tiled`, `jax`, ...; None picks by platform. config: the backend's config for fwd, or
        {"fwd": ..., "bwd": ...}; None looks them up in the tables at trace time, for the routing
        `distribution` (None: the runtime's, as `ragged_dot`).

    Returns:
      [m, n] ([m, n / 2] with glu) in x.dtype. Differentiable in x and float weights (a QArray is a constant).
    """
    rhs = _as_read(rhs)
    problem = _problem(x, rows, rhs, group_sizes, group_offset, stage="dispatch", tokens=None, glu=glu)
    sizes, offset = shard_groups(group_sizes, group_offset, m=problem.m, groups=problem.groups)
    _check_rows(rows, group_sizes, group_offset, tokens=problem.tokens, groups=problem.groups, stage="dispatch")
    call = _Call(FUSED_MOE.backend(backend).name, problem, given_configs(config, DIRECTIONS), distribution)
    return _gather_gmm(x, normalized_rows(rows, problem.tokens, "dispatch"), rhs, sizes, offset, call)


def gmm_combine(
    h: jax.Array,
    rhs: jax.Array | QArray,
    group_sizes: jax.Array,
    rows: jax.Array,
    row_weights: jax.Array,
    tokens: int,
    *,
    group_offset: jax.Array | int | None = None,
    skip_zero_weights: bool = False,
    backend: str | None = None,
    config: Any = None,
    distribution: str | None = None,
) -> jax.Array:
    """Fused combine: `out[t] = sum over local rows i with rows[i] == t of row_weights[i] * (h[i] @
    rhs[group(i)])`, accumulated in float32, with no [m, n] product written.

    The rules of `ragged_gather_reduce`: rows outside the local groups are never read (their h may be NaN);
    a valid row multiplies even at weight 0 (0 x NaN = NaN) unless `skip_zero_weights`, which drops it (and
    its weight gets no gradient).

    Args:
      h: [m, k] expert activations in expert order; rhs: [groups, k, n] float or QArray; group_sizes,
      group_offset: as `gather_gmm`; rows: int [m], the token of each row (a known index outside
      [0, tokens) among the shard's rows is a UsageError; a traced one adds nothing, on every backend);
      row_weights: float [m], each row's
      top-k weight; tokens: the output's rows (static). backend, config, distribution: as `gather_gmm`.

    Returns:
      [tokens, n] in h.dtype. Differentiable in h, the float weights and row_weights.
    """
    if not isinstance(tokens, (int, np.integer)) or isinstance(tokens, bool) or tokens <= 0:
        raise UsageError(f"fused combine: tokens must be a positive int, got {tokens!r}")
    tokens = int(tokens)
    rhs = _as_read(rhs)
    problem = _problem(h, rows, rhs, group_sizes, group_offset, stage="combine", tokens=tokens, glu=None)
    if getattr(row_weights, "shape", None) != (problem.m,):
        raise UsageError(f"fused combine: row_weights must have shape ({problem.m},), got "
                         f"{getattr(row_weights, 'shape', None)}")
    sizes, offset = shard_groups(group_sizes, group_offset, m=problem.m, groups=problem.groups)
    _check_rows(rows, group_sizes, group_offset, tokens=tokens, groups=problem.groups, stage="combine")
    call = _Call(FUSED_MOE.backend(backend).name, problem, given_configs(config, DIRECTIONS), distribution)
    return _gmm_combine(h, rhs, sizes, normalized_rows(rows, tokens, "combine"), row_weights, offset,
                        bool(skip_zero_weights), call)
