"""`tiled` backend: a pure-JAX grouped matmul that walks the Megablox visit schedule; the CPU backend.

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
    """tm: rows per tile; tk: contraction chunk; tn: output columns per block. Clamped to m, k, n."""

    tm: int = 256
    tk: int = 1024
    tn: int = 1024


def _blocks(size: int, block: int) -> list[tuple[int, int]]:
    return [(start, min(block, size - start)) for start in range(0, size, block)]


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
) -> jax.Array:
    """lhs [m, k], rhs [groups, k, n], group_sizes int [total_groups] -> [m, n] in out_dtype."""
    m, k = lhs.shape
    groups, _, n = rhs.shape
    tm, tk, tn = min(tm, m), min(tk, k), min(tn, n)
    meta = make_group_metadata(
        group_sizes, m=m, tm=tm, groups=groups, group_offset=0 if group_offset is None else group_offset
    )
    # Accumulate in f32 for low-precision inputs (what preferred_element_type asks of a matmul unit).
    acc_dtype = jnp.promote_types(out_dtype, jnp.float32) if jnp.dtype(out_dtype).itemsize < 4 else out_dtype
    row_in_tile = jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
    k_blocks, n_blocks = _blocks(k, tk), _blocks(n, tn)

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
                part = jnp.dot(x[:, k0:k0 + kb], w[k0:k0 + kb, n0:n0 + nb], preferred_element_type=acc_dtype)
                acc = part if acc is None else acc + part
            current = jax.lax.dynamic_slice(out, (row0, n0), (tm, nb))
            block = jnp.where(keep, acc.astype(out_dtype), current)
            out = jax.lax.dynamic_update_slice(out, block, (row0, n0))
        return out

    return jax.lax.fori_loop(0, meta.num_visits, visit, jnp.zeros((m, n), out_dtype))


def _pow2_up_to(limit: int, low: int) -> list[int]:
    values, v = [], low
    while v < limit:
        values.append(v)
        v *= 2
    return values + [limit]


class TiledRaggedDot(RaggedDotBackend):
    name = "tiled"
    config_cls = TiledConfig
    platforms = ("cpu", "gpu", "tpu")
    description = "pure-JAX loop over Megablox (row tile, group) visits; the CPU backend"

    def config_error(self, config: TiledConfig, problem: RaggedDotProblem) -> str | None:
        for field in ("tm", "tk", "tn"):
            value = getattr(config, field)
            if not isinstance(value, int) or value <= 0:
                return f"{field} must be a positive integer, got {value!r}"
        blocks = -(-problem.k // min(config.tk, problem.k)) * -(-problem.n // min(config.tn, problem.n))
        if blocks > MAX_BLOCKS_PER_VISIT:
            return f"{blocks} dots per visit (k/tk * n/tn) exceeds {MAX_BLOCKS_PER_VISIT}"
        return None

    def default_config(self, problem: RaggedDotProblem) -> TiledConfig:
        # A tile about a quarter of an average group keeps the boundary waste near 1/4 of a tile per group
        # without making visits tiny; full k and n let one dot per visit use the whole machine.
        rows_per_group = max(problem.m // problem.groups, 1)
        tm = min(max(64, 1 << max(rows_per_group // 4, 1).bit_length() - 1), 512, problem.m)
        return TiledConfig(tm=tm, tk=problem.k, tn=problem.n)

    def candidate_values(self, problem: RaggedDotProblem) -> dict[str, list[int]]:
        return {
            "tm": _pow2_up_to(min(problem.m, 1024), 32),
            "tk": sorted({problem.k, *(v for v in (512,) if v < problem.k)}),
            "tn": sorted({problem.n, *(v for v in (256, 512) if v < problem.n)}),
        }

    def __call__(self, lhs, rhs, group_sizes, *, config, out_dtype, group_offset=None):
        return tiled_ragged_dot(
            lhs, rhs, group_sizes, tm=config.tm, tk=config.tk, tn=config.tn,
            out_dtype=out_dtype, group_offset=group_offset,
        )
