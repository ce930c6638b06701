"""Megablox-style group metadata: which (row tile, group) pairs a grouped matmul must visit.

Rows of `lhs` are sorted by group. Cutting them into tiles of `tm` rows, a tile that holds rows of several
groups is visited once per group (each visit multiplies the tile by that group's rhs and keeps only that
group's rows). Visiting tiles in this order means a tile's visits are consecutive, and the total number of
visits is at most `ceil(m / tm) + groups - 1`: the efficiency model of the ragged-dot talk,
`N / (N + G (1 - 1/T))`, is the ratio of useful tiles to visits.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class GroupMetadata(NamedTuple):
    """Visit schedule of a grouped matmul over the `groups` local groups.

    group_starts: int32 [groups], first row of each local group.
    group_ends: int32 [groups], one past the last row of each local group (clipped to m).
    group_ids: int32 [max_visits], local group of each visit.
    tile_ids: int32 [max_visits], row tile of each visit (in [0, ceil(m / tm))).
    num_visits: int32 scalar, how many leading entries of group_ids / tile_ids are real; entries past it
        repeat a valid (group, tile) pair, so a fixed-size grid may run them without writing wrong rows.
    """

    group_starts: jax.Array
    group_ends: jax.Array
    group_ids: jax.Array
    tile_ids: jax.Array
    num_visits: jax.Array


def max_visits(m: int, tm: int, groups: int) -> int:
    """Static upper bound on the number of visits: every tile once plus one extra per group boundary."""
    return -(-m // tm) + groups - 1


def clip_group_sizes(group_sizes: jax.Array, m: int) -> jax.Array:
    """int32 group sizes as every backend reads them: negative sizes count as 0, and rows past `m` are
    dropped (a group that would end past row m ends at m, the groups after it are empty)."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), m)
    return jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))


def offset_in_range(group_offset: jax.Array | int, total_groups: int, groups: int) -> jax.Array:
    """bool scalar: whether the shard `[group_offset, group_offset + groups)` lies inside the
    `total_groups` groups. An offset outside selects no group at all (every row comes out zero)."""
    offset = jnp.asarray(group_offset, jnp.int32)
    return (offset >= 0) & (offset <= total_groups - groups)


def select_shard(group_sizes: jax.Array, group_offset: jax.Array | int, *, m: int, groups: int
                 ) -> tuple[jax.Array, jax.Array]:
    """(group sizes, offset) that every backend reads the same way: sizes clipped (`clip_group_sizes`), and
    for an out-of-range offset (`offset_in_range`) all sizes 0 and offset 0, so the shard owns no row (a
    bare `dynamic_slice` would clamp the offset and compute some other shard's groups)."""
    sizes = clip_group_sizes(group_sizes, m)
    valid = offset_in_range(group_offset, sizes.shape[0], groups)
    return jnp.where(valid, sizes, 0), jnp.where(valid, jnp.asarray(group_offset, jnp.int32), 0)


def group_bounds(group_sizes: jax.Array, *, m: int, groups: int, group_offset: jax.Array | int = 0
                 ) -> tuple[jax.Array, jax.Array]:
    """int32 [groups] first row and one-past-last row (clipped to m) of the groups
    `[group_offset, group_offset + groups)`; rows are sorted by group, negative sizes count as 0, and an
    offset out of range selects no group (`select_shard`)."""
    sizes, offset = select_shard(group_sizes, group_offset, m=m, groups=groups)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    return (jax.lax.dynamic_slice_in_dim(starts, offset, groups),
            jax.lax.dynamic_slice_in_dim(ends, offset, groups))


def make_group_metadata(
    group_sizes: jax.Array,
    *,
    m: int,
    tm: int,
    groups: int | None = None,
    group_offset: jax.Array | int = 0,
) -> GroupMetadata:
    """Build the visit schedule for rows tiled by `tm`.

    Args:
      group_sizes: int [total_groups], rows per group, in row order. Rows past `sum(group_sizes)` belong to
        no group and are never visited.
      m: number of rows of lhs (static).
      tm: rows per tile (static, positive).
      groups: how many groups to schedule, starting at `group_offset` (static; default all).
      group_offset: first group to schedule (may be traced): an expert-parallel shard computes only the
        groups `[group_offset, group_offset + groups)`.

    Returns:
      GroupMetadata; pure function of its inputs, jit-friendly.
    """
    groups = group_sizes.shape[0] if groups is None else groups
    starts, ends = group_bounds(group_sizes, m=m, groups=groups, group_offset=group_offset)

    nonempty = ends > starts
    first_tile = starts // tm
    last_tile = (ends - 1) // tm
    visits = jnp.where(nonempty, last_tile - first_tile + 1, 0)

    bound = max_visits(m, tm, groups)
    group_ids = jnp.repeat(jnp.arange(groups, dtype=jnp.int32), visits, total_repeat_length=bound)
    first_visit = jnp.cumsum(visits) - visits
    position = jnp.arange(bound, dtype=jnp.int32)
    tile_ids = first_tile[group_ids] + position - first_visit[group_ids]
    num_visits = visits.sum().astype(jnp.int32)
    # Padding entries: repeat the last real visit so that running them is harmless.
    last = jnp.maximum(num_visits - 1, 0)
    group_ids = jnp.where(position < num_visits, group_ids, group_ids[last])
    tile_ids = jnp.where(position < num_visits, tile_ids, tile_ids[last])
    tile_ids = jnp.clip(tile_ids, 0, -(-m // tm) - 1)
    return GroupMetadata(starts, ends, group_ids, tile_ids.astype(jnp.int32), num_visits)
