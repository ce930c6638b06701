"""The public dispatch and combine ops: `ragged_gather`, `ragged_gather_reduce`, `dense_gather_reduce`.

Each picks, per kernel it runs, a backend (the platform's, or the caller's; the plain-JAX one when a
fallback flag is set or the version guard says so) and a config (the caller's, else the tables', looked up
at trace time), and has a custom VJP in which the roles swap: the gradient of a gather is a gather-reduce
(scatter-add) and the gradient of a gather-reduce is a gather.

Fallback flags (as in MaxText): `ragged_gather_fallback` forces the plain-JAX path for the *gather* kernel,
wherever it runs (dispatch, and the backward of combine); `ragged_gather_reduce_fallback` does the same for
the *gather-reduce* kernel (combine, and the backward of dispatch). Each is a keyword argument of every op
here and of `moe_mlp`; None reads the environment variables below, so a whole run can be switched.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from moe_tune.core import contexts, settings
from moe_tune.core.errors import UsageError
from moe_tune.kernels.base import KernelConfig
from moe_tune.kernels.gather.plain_jax import row_range_mask
from moe_tune.kernels.gather.problem import GatherProblem
from moe_tune.kernels.gather.definition import OPS
from moe_tune.kernels.ragged_dot.problem import dtype_name, int_scalar
from moe_tune.kernels.kernel_op import freeze_config
from moe_tune.kernels.pallas_util import sum_like

ENV_GATHER_FALLBACK = settings.RAGGED_GATHER_FALLBACK
ENV_GATHER_REDUCE_FALLBACK = settings.RAGGED_GATHER_REDUCE_FALLBACK


@dataclasses.dataclass(frozen=True)
class _Kernel:
    """One kernel of a call, fixed at trace time: which op's tables, which backend, the caller's config."""

    op: str
    backend: str
    given: Any = None  # a config, or its `freeze_config` tuple; None asks the tables
    distribution: str | None = None  # the routing the tables are asked for (`moe_tune.core.contexts`)

    def gather(self, x, indices, start, end, weights):
        problem = GatherProblem(tokens=x.shape[0], rows=indices.shape[0], hidden=x.shape[1],
                                dtype=dtype_name(x.dtype), weighted=weights is not None)
        resolved = OPS[self.op].resolve_config(self.backend, problem, self.given, distribution=self.distribution)
        return resolved.backend.gather(x, indices, start, end, weights, config=resolved.config)

    def gather_reduce(self, x, indices, weights, valid, reduce_group_size: int):
        rows = indices.shape[0]
        problem = GatherProblem(tokens=rows // reduce_group_size, rows=rows, hidden=x.shape[1],
                                dtype=dtype_name(x.dtype))
        resolved = OPS[self.op].resolve_config(self.backend, problem, self.given, distribution=self.distribution)
        return resolved.backend.gather_reduce(x, indices, weights, valid, reduce_group_size, config=resolved.config)


@dataclasses.dataclass(frozen=True)
class _Kernels:
    """The two kernels of a call: `forward` runs the op, `backward` its gradient (the other kind)."""

    forward: _Kernel
    backward: _Kernel


def _kernels(forward_op: str, backward_op: str, backend: str | None, config: Any, gather_fallback: bool | None,
             reduce_fallback: bool | None, distribution: str | None = None) -> _Kernels:
    """The fallback flags (None: the environment, `settings`) pick the plain-JAX backend per kernel kind;
    `distribution` (None: the `moe_tune.use_distribution` block, else the environment) is what both look up."""
    gather_fb = settings.ragged_gather_fallback() if gather_fallback is None else bool(gather_fallback)
    reduce_fb = settings.ragged_gather_reduce_fallback() if reduce_fallback is None else bool(reduce_fallback)
    distribution = contexts.distribution_for_call(distribution)
    kernel = lambda op, given=None: _Kernel(op, OPS[op].backend(
        backend, force_fallback=gather_fb if op == "ragged_gather" else reduce_fb).name, given, distribution)
    return _Kernels(kernel(forward_op, freeze_config(config)), kernel(backward_op))


def _row_dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """float32 [rows]: per-row dot products of two [rows, hidden] arrays."""
    return jnp.einsum("rd,rd->r", a.astype(jnp.float32), b.astype(jnp.float32))


# --------------------------------------------------------------------------------------------------------
# ragged_gather: forward gather, backward gather-reduce


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ragged_gather(x, indices, start, end, weights, kernels: _Kernels):
    return kernels.forward.gather(x, indices, start, end, weights)


def _ragged_gather_fwd(x, indices, start, end, weights, kernels: _Kernels):
    return _ragged_gather(x, indices, start, end, weights, kernels), (x, indices, start, end, weights)


def _ragged_gather_bwd(kernels: _Kernels, residuals, dout):
    x, indices, start, end, weights = residuals
    dx = _scatter_add_rows(kernels.backward, dout, indices, start, end, weights, x.shape[0]).astype(x.dtype)
    dweights = None
    if weights is not None:  # d out[i] / d w[i] = x[indices[i]] on the valid rows: a ragged gather again
        rows = kernels.forward.gather(x, indices, start, end, None)
        dweights = _row_dot(rows, dout).astype(weights.dtype)
    return sum_like(dx, x), None, None, None, sum_like(dweights, weights)  # summed for replicated operands


_ragged_gather.defvjp(_ragged_gather_fwd, _ragged_gather_bwd)


def _scatter_add_rows(kernel: _Kernel, dout, indices, start, end, weights, tokens: int) -> jax.Array:
    """dx [tokens, hidden]: dx[t] = sum over valid rows i with indices[i] == t of w[i] * dout[i].

    When `indices` fans every token out exactly rows / tokens times (MoE dispatch), sorting the rows by token
    makes this a gather-reduce with reduce group size rows / tokens: the gather-reduce kernel runs it. Any
    other index pattern is handled exactly by a segment sum."""
    rows = indices.shape[0]
    valid = row_range_mask(rows, start, end)
    coef = jnp.ones((rows,), jnp.float32) if weights is None else weights.astype(jnp.float32)

    def segment_sum(_):
        contribution = jnp.where(valid[:, None], dout.astype(jnp.float32) * coef[:, None], 0.0)
        target = jnp.where(valid, indices, tokens)  # invalid rows go to a dropped extra segment
        return jax.ops.segment_sum(contribution, target, num_segments=tokens + 1)[:tokens].astype(dout.dtype)

    if rows % tokens:
        return segment_sum(None)
    fan_out = rows // tokens
    order = jnp.argsort(indices, stable=True).astype(jnp.int32)

    def gather_reduce(_):
        return kernel.gather_reduce(dout, order, coef[order], valid[order], fan_out)

    is_fan_out = jnp.all(indices[order] == jnp.arange(rows, dtype=jnp.int32) // fan_out)
    return jax.lax.cond(is_fan_out, gather_reduce, segment_sum, None)


# --------------------------------------------------------------------------------------------------------
# ragged_gather_reduce / dense_gather_reduce: forward gather-reduce, backward gather


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _gather_reduce(x, indices, weights, valid, reduce_group_size: int, kernels: _Kernels):
    return kernels.forward.gather_reduce(x, indices, weights, valid, reduce_group_size)


def _gather_reduce_fwd(x, indices, weights, valid, reduce_group_size, kernels):
    out = _gather_reduce(x, indices, weights, valid, reduce_group_size, kernels)
    return out, (x, indices, weights, valid)


def _gather_reduce_bwd(reduce_group_size, kernels, residuals, dout):
    x, indices, weights, valid = residuals
    rows = indices.shape[0]
    entry_valid = jnp.ones((rows,), bool) if valid is None else valid
    token = jnp.arange(rows, dtype=jnp.int32) // reduce_group_size
    dx = _scatter_to_entries(kernels.backward, dout, indices, weights, entry_valid, token, x.shape[0])
    # d out[t] / d w[i] = x[indices[i]]: read only valid rows (the others may be NaN).
    safe = jnp.where(entry_valid, indices, 0)
    rows_x = jnp.take(x, safe, axis=0, mode="clip")
    dweights = jnp.where(entry_valid, _row_dot(rows_x, jnp.take(dout, token, axis=0)), 0.0)
    return sum_like(dx.astype(x.dtype), x), None, sum_like(dweights.astype(weights.dtype), weights), None


_gather_reduce.defvjp(_gather_reduce_fwd, _gather_reduce_bwd)


def _scatter_to_entries(kernel: _Kernel, dout, indices, weights, valid, token, x_rows: int) -> jax.Array:
    """dx [x_rows, hidden]: dx[indices[i]] += valid[i] * w[i] * dout[token[i]].

    When `indices` is a permutation of x's rows (MoE combine), each row of x has exactly one entry, so dx is
    a gather of dout rows, weighted; the valid entries' rows form a range [lo, hi) on an expert-parallel
    shard, and the gather kernel does work only there. Other index patterns: an exact segment sum."""
    rows = indices.shape[0]
    coef = jnp.where(valid, weights.astype(jnp.float32), 0.0)

    def segment_sum(_):
        contribution = jnp.take(dout, token, axis=0).astype(jnp.float32) * coef[:, None]
        target = jnp.where(valid, indices, x_rows)
        return jax.ops.segment_sum(contribution, target, num_segments=x_rows + 1)[:x_rows].astype(dout.dtype)

    if rows != x_rows:
        return segment_sum(None)
    # entry_of_row[p] = the entry that reads row p, when indices is a permutation.
    in_range = (indices >= 0) & (indices < x_rows)
    entry_of_row = jnp.zeros((x_rows,), jnp.int32).at[jnp.where(in_range, indices, x_rows)].set(
        jnp.arange(rows, dtype=jnp.int32), mode="drop")
    counts = jnp.zeros((x_rows,), jnp.int32).at[jnp.where(in_range, indices, x_rows)].add(1, mode="drop")
    is_permutation = jnp.all(counts == 1)
    lo = jnp.min(jnp.where(valid, indices, x_rows))
    hi = jnp.max(jnp.where(valid, indices + 1, 0))

    def gather(_):
        return kernel.gather(dout, token[entry_of_row], lo, jnp.maximum(hi, lo), coef[entry_of_row])

    return jax.lax.cond(is_permutation, gather, segment_sum, None)


# --------------------------------------------------------------------------------------------------------
# Public API


def _check_common(x, indices, name: str) -> None:
    if getattr(x, "ndim", None) != 2:
        raise UsageError(f"{name}: x must be [rows, hidden], got shape {getattr(x, 'shape', None)}")
    if getattr(indices, "ndim", None) != 1 or not jnp.issubdtype(indices.dtype, jnp.integer):
        raise UsageError(f"{name}: indices must be a 1-D integer array, got {getattr(indices, 'shape', None)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise UsageError(f"{name}: x must be floating point, got {x.dtype}")


def _check_vector(value, rows: int, what: str, name: str) -> None:
    if getattr(value, "shape", None) != (rows,):
        raise UsageError(f"{name}: {what} must have shape ({rows},), got {getattr(value, 'shape', None)}")


def ragged_gather(
    x: jax.Array,
    indices: jax.Array,
    start: jax.Array | int,
    end: jax.Array | int,
    *,
    weights: jax.Array | None = None,
    backend: str | None = None,
    config: KernelConfig | Mapping[str, Any] | None = None,
    ragged_gather_fallback: bool | None = None,
    ragged_gather_reduce_fallback: bool | None = None,
    distribution: str | None = None,
) -> jax.Array:
    """Dispatch: `out[i] = x[indices[i]] * weights[i]` for `start <= i < end`; other rows are zero.

    Work is done only for the rows in [start, end) (an expert-parallel shard's rows of the expert-ordered
    buffer); indices outside the range are never read. Differentiable in x and weights; the gradient in x
    is a gather-reduce (scatter-add), run by the gather-reduce kernel when indices fan each token out
    equally (the MoE layout), else by a segment sum.

    Args:
      x: [tokens, hidden], float32 / bfloat16 / float16.
      indices: int [rows], values in [0, tokens) inside the range.
      start, end: int32 scalars (may be traced; one compile serves every range).
      weights: optional float [rows]; applied in float32, rounded once.
      backend: `jax`, `tiled`, `triton`, `pallas_tpu`, `sparsecore`; None picks by platform (cpu: tiled, gpu: jax, tpu:
        pallas_tpu). It also picks the backward's gather-reduce backend.
      config: the gather backend's config (or a dict of its fields); None looks it up in the tables.
      ragged_gather_fallback / ragged_gather_reduce_fallback: force the plain-JAX path for the gather /
        gather-reduce kernel; None reads $MOE_TUNE_RAGGED_GATHER_FALLBACK / ..._REDUCE_FALLBACK.
      distribution: the routing (`balanced`, `skewed`, ...) the table lookups of both kernels assume; None:
        the `moe_tune.use_distribution` block around the call, else $MOE_TUNE_DISTRIBUTION, else `balanced`.

    Returns:
      [rows, hidden] in x.dtype.
    """
    name = "ragged_gather"
    _check_common(x, indices, name)
    if weights is not None:
        _check_vector(weights, indices.shape[0], "weights", name)
    start, end = int_scalar(start, f"{name}: start"), int_scalar(end, f"{name}: end")
    kernels = _kernels("ragged_gather", "ragged_gather_reduce", backend, config, ragged_gather_fallback,
                       ragged_gather_reduce_fallback, distribution)
    return _ragged_gather(x, indices.astype(jnp.int32), start, end, weights, kernels)


def _combine(name: str, x, indices, topk_weights, valid, reduce_group_size, backend, config, skip_zero_weights,
             gather_fallback, reduce_fallback, distribution) -> jax.Array:
    _check_common(x, indices, name)
    rows = indices.shape[0]
    _check_vector(topk_weights, rows, "topk_weights", name)
    if valid is not None:
        _check_vector(valid, rows, "valid_rows_mask", name)
        valid = valid.astype(bool)
    if not isinstance(reduce_group_size, int) or reduce_group_size <= 0 or rows % reduce_group_size:
        raise UsageError(f"{name}: reduce_group_size must be a positive int dividing len(indices) = {rows}, got "
                         f"{reduce_group_size!r}")
    if skip_zero_weights:  # dropped before the kernel: a dropped entry is never read, so its NaN cannot leak
        nonzero = topk_weights != 0
        valid = nonzero if valid is None else valid & nonzero
        name = "ragged_gather_reduce"  # a mask now exists: the masked kernel and tables serve it
    kernels = _kernels(name, "ragged_gather", backend, config, gather_fallback, reduce_fallback, distribution)
    return _gather_reduce(x, indices.astype(jnp.int32), topk_weights, valid, reduce_group_size, kernels)


def ragged_gather_reduce(
    x: jax.Array,
    indices: jax.Array,
    topk_weights: jax.Array,
    valid_rows_mask: jax.Array,
    reduce_group_size: int,
    *,
    backend: str | None = None,
    config: KernelConfig | Mapping[str, Any] | None = None,
    skip_zero_weights: bool = False,
    ragged_gather_fallback: bool | None = None,
    ragged_gather_reduce_fallback: bool | None = None,
    distribution: str | None = None,
) -> jax.Array:
    """Combine: `out[t] = sum_j valid[i] * topk_weights[i] * x[indices[i]]`, `i = t * reduce_group_size + j`.

    Invalid entries are never read: their rows of x may hold anything (NaN, another shard's rows) and their
    indices may be out of range. Accumulates in float32. Differentiable in x and topk_weights; the gradient
    in x is a gather (run by the gather kernel when indices is a permutation of x's rows), zero on rows no
    valid entry reads.

    Args:
      x: [x_rows, hidden] expert outputs (float32 / bfloat16 / float16), usually x_rows = len(indices).
      indices: int [rows] (rows = tokens * reduce_group_size): the row of x each (token, k) entry reads.
      topk_weights: float [rows].
      valid_rows_mask: bool [rows].
      reduce_group_size: top_k (static).
      backend, config: as for `ragged_gather` (config is the gather-reduce backend's).
      skip_zero_weights: when True, an entry whose weight is exactly 0 is dropped like an invalid one, so a
        NaN / inf in its row of x gives 0, not NaN (and its weight gets no gradient). When False (the
        default) it multiplies: 0 * NaN = NaN propagates, as in a plain weighted sum.
      ragged_gather_fallback / ragged_gather_reduce_fallback, distribution: as for `ragged_gather`.

    Returns:
      [rows // reduce_group_size, hidden] in x.dtype.
    """
    return _combine("ragged_gather_reduce", x, indices, topk_weights, valid_rows_mask, reduce_group_size, backend,
                    config, skip_zero_weights, ragged_gather_fallback, ragged_gather_reduce_fallback, distribution)


def dense_gather_reduce(
    x: jax.Array,
    indices: jax.Array,
    topk_weights: jax.Array,
    reduce_group_size: int,
    *,
    backend: str | None = None,
    config: KernelConfig | Mapping[str, Any] | None = None,
    skip_zero_weights: bool = False,
    ragged_gather_fallback: bool | None = None,
    ragged_gather_reduce_fallback: bool | None = None,
    distribution: str | None = None,
) -> jax.Array:
    """`ragged_gather_reduce` with every entry valid (pure tensor parallelism: no shard owns a subrange).

    With `skip_zero_weights=True` the zero-weight entries become a mask, so the call runs (and is tuned) as
    a `ragged_gather_reduce`."""
    return _combine("dense_gather_reduce", x, indices, topk_weights, None, reduce_group_size, backend, config,
                    skip_zero_weights, ragged_gather_fallback, ragged_gather_reduce_fallback, distribution)
