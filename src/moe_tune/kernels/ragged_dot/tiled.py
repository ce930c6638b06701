"""`tiled` backend: a pure-JAX grouped matmul (and its transposed form, tgmm) that walks the Megablox visit
schedule; the CPU backend.

A `fori_loop` with a dynamic trip count (the number of visits) runs one `[tm, k] x [k, n]` matmul per
(row tile, group) visit, in `tn`-wide column blocks and `tk`-deep contraction chunks, and writes back only
the rows of the visited group. Work is proportional to `ceil(m / tm) + groups - 1` tiles, so small `tm`
wastes less on tiles shared by two groups while large `tm` amortizes the per-visit overhead: the trade-off
the tuner resolves per shape.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_tune.kernels.base import KernelConfig
from moe_tune.kernels.ragged_dot.base import RaggedDotBackend
from moe_tune.kernels.ragged_dot.metadata import make_group_metadata
from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem

# Cap on column blocks x contraction chunks per visit: each one is an unrolled dot in the loop body, and
# compile time grows with them.
MAX_BLOCKS_PER_VISIT = 32


@dataclasses.dataclass(frozen=True)
class TiledConfig(KernelConfig):
    """tm: rows per tile; tk, tn: blocks of the k x n plane (for dlhs: of n x k, the matmul it runs).
    Clamped to the dimensions they tile."""

    tm: int = 256
    tk: int = 1024
    tn: int = 1024


def _blocks(size: int, block: int) -> list[tuple[int, int]]:
    return [(start, min(block, size - start)) for start in range(0, size, block)]


def _acc_dtype(out_dtype) -> jnp.dtype:
    """Accumulate low-precision results in f32 (what preferred_element_type asks of a matmul unit)."""
    return jnp.dtype(jnp.float32) if jnp.dtype(out_dtype).itemsize < 4 else jnp.dtype(out_dtype)


def tiled_ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    tm: int,
    tk: int,
    tn: int,
    out_dtype: jnp.dtype,
    group_offset: jax.Array | None = None,
    transpose_rhs: bool = False,
) -> jax.Array:
    """gmm. lhs [m, k], rhs [groups, k, n] ([groups, n, k] if transpose_rhs), group_sizes int [total_groups]
    -> [m, n] in out_dtype."""
    m, k = lhs.shape
    groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tm, tk, tn = min(tm, m), min(tk, k), min(tn, n)
    meta = make_group_metadata(
        group_sizes, m=m, tm=tm, groups=groups, group_offset=0 if group_offset is None else group_offset
    )
    acc_dtype = _acc_dtype(out_dtype)
    row_in_tile = jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
    k_blocks, n_blocks = _blocks(k, tk), _blocks(n, tn)
    # rhs block [kb, nb], or [nb, kb] when transposed: contract lhs dim 1 with the matching rhs dim.
    dims = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))

    def visit(i, out):
        group = meta.group_ids[i]
        # The last tile is shifted back to end at row m when tm does not divide m; rows it shares with
        # the previous tile are rewritten with the same values, because only the group's rows are stored.
        row0 = jnp.minimum(meta.tile_ids[i] * tm, m - tm)
        rows = row0 + row_in_tile
        keep = (rows >= meta.group_starts[group]) & (rows < meta.group_ends[group])
        x = jax.lax.dynamic_slice_in_dim(lhs, row0, tm, axis=0)
        w = rhs[group]
        for n0, nb in n_blocks:
            acc = None
            for k0, kb in k_blocks:
                wb = w[n0:n0 + nb, k0:k0 + kb] if transpose_rhs else w[k0:k0 + kb, n0:n0 + nb]
                part = jax.lax.dot_general(x[:, k0:k0 + kb], wb, dims, preferred_element_type=acc_dtype)
                acc = part if acc is None else acc + part
            current = jax.lax.dynamic_slice(out, (row0, n0), (tm, nb))
            block = jnp.where(keep, acc.astype(out_dtype), current)
            out = jax.lax.dynamic_update_slice(out, block, (row0, n0))
        return out

    return jax.lax.fori_loop(0, meta.num_visits, visit, jnp.zeros((m, n), out_dtype))


def tiled_transposed_ragged_dot(
    lhs: jax.Array,
    dout: jax.Array,
    group_sizes: jax.Array,
    *,
    tm: int,
    tk: int,
    tn: int,
    out_dtype: jnp.dtype,
    num_groups: int,
    group_offset: jax.Array | None = None,
) -> jax.Array:
    """tgmm. lhs [m, k], dout [m, n] -> [num_groups, k, n]: each visit adds lhs_tile^T @ dout_tile, over the
    visited group's rows only, into that group's [k, n] result (kept in f32 for low-precision outputs)."""
    m, k = lhs.shape
    n = dout.shape[1]
    tm, tk, tn = min(tm, m), min(tk, k), min(tn, n)
    meta = make_group_metadata(
        group_sizes, m=m, tm=tm, groups=num_groups, group_offset=0 if group_offset is None else group_offset
    )
    acc_dtype = _acc_dtype(out_dtype)
    row_in_tile = jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
    contract_rows = (((0,), (0,)), ((), ()))

    def visit(i, acc):
        group = meta.group_ids[i]
        row0 = jnp.minimum(meta.tile_ids[i] * tm, m - tm)
        rows = row0 + row_in_tile
        # the shifted last tile may hold rows already counted by the previous tile: keep each row once
        keep = ((rows >= meta.group_starts[group]) & (rows < meta.group_ends[group])
                & (rows >= meta.tile_ids[i] * tm))
        x = jax.lax.dynamic_slice_in_dim(lhs, row0, tm, axis=0)
        x = jnp.where(keep, x, jnp.zeros((), x.dtype))
        d = jax.lax.dynamic_slice_in_dim(dout, row0, tm, axis=0)
        for k0, kb in _blocks(k, tk):
            for n0, nb in _blocks(n, tn):
                part = jax.lax.dot_general(x[:, k0:k0 + kb], d[:, n0:n0 + nb], contract_rows,
                                           preferred_element_type=acc_dtype)
                current = jax.lax.dynamic_slice(acc, (group, k0, n0), (1, kb, nb))
                acc = jax.lax.dynamic_update_slice(acc, current + part[None], (group, k0, n0))
        return acc

    acc = jax.lax.fori_loop(0, meta.num_visits, visit, jnp.zeros((num_groups, k, n), acc_dtype))
    return acc.astype(out_dtype)


def _pow2_up_to(limit: int, low: int) -> list[int]:
    values, v = [], low
    while v < limit:
        values.append(v)
        v *= 2
    return values + [limit]


class TiledRaggedDot(RaggedDotBackend):
    name = "tiled"
    revision = 1  # bump on changes that can change the fastest or a valid config (Backend.revision)
    config_cls = TiledConfig
    platforms = ("cpu", "gpu", "tpu")
    description = "pure-JAX loop over Megablox (row tile, group) visits; the CPU backend"

    def config_error(self, config: TiledConfig, problem: RaggedDotProblem) -> str | None:
        for field in ("tm", "tk", "tn"):
            value = getattr(config, field)
            if not isinstance(value, int) or value <= 0:
                return f"{field} must be a positive integer, got {value!r}"
        _, k, n = problem.matmul_dims()
        blocks = -(-k // min(config.tk, k)) * -(-n // min(config.tn, n))
        if blocks > MAX_BLOCKS_PER_VISIT:
            return f"{blocks} dots per visit (k/tk * n/tn) exceeds {MAX_BLOCKS_PER_VISIT}"
        return None

    def default_config(self, problem: RaggedDotProblem) -> TiledConfig:
        # A tile about a quarter of an average group keeps the boundary waste near 1/4 of a tile per group
        # without making visits tiny; full k and n let one dot per visit use the whole machine.
        m, k, n = problem.matmul_dims()
        rows_per_group = max(m // problem.groups, 1)
        tm = min(max(64, 1 << max(rows_per_group // 4, 1).bit_length() - 1), 512, m)
        return TiledConfig(tm=tm, tk=k, tn=n)

    def candidate_values(self, problem: RaggedDotProblem) -> dict[str, list[int]]:
        m, k, n = problem.matmul_dims()
        return {
            "tm": _pow2_up_to(min(m, 1024), 32),
            "tk": sorted({k, *(v for v in (256, 512) if v < k)}),
            "tn": sorted({n, *(v for v in (128, 256, 512) if v < n)}),
        }

    def gmm(self, lhs, rhs, group_sizes, *, config, out_dtype, group_offset=None, transpose_rhs=False):
        return tiled_ragged_dot(lhs, rhs, group_sizes, tm=config.tm, tk=config.tk, tn=config.tn,
                                out_dtype=out_dtype, group_offset=group_offset, transpose_rhs=transpose_rhs)

    def tgmm(self, lhs, dout, group_sizes, *, config, out_dtype, num_groups, group_offset=None):
        return tiled_transposed_ragged_dot(lhs, dout, group_sizes, tm=config.tm, tk=config.tk, tn=config.tn,
                                           out_dtype=out_dtype, num_groups=num_groups, group_offset=group_offset)
