"""How the weights reach the pallas_tpu fused kernels (`pallas_tpu_kernels.py`): one array, or gate and up as two
parts (`split_weights`, `base.py`), each its own operand, its blocks DMAed from where it lies in HBM: no
concatenated [groups, k, 2f] copy per call (~0.8 GB at qwen3-30b-a3b).

A `View` is one weight operand (its values, and its float32 scale when quantized) and the grid points
(j, v, kk) whose product it takes part in:
- one array: every point; with glu a second view of the same array, `offset` column blocks further (up);
- glu on (gate, up): both parts at every point, each into its own accumulator;
- parts along the output columns (the dispatch without glu, the training forward's [m, 2f]): a part serves
  the column blocks j in [lo, hi), under `pl.when`, into the one accumulator (tn divides each part's width);
- parts along the contraction (transpose_rhs: the dispatch's backward, dh @ [gate | up]^T): a part serves the
  k steps kk in [lo, hi), into the same accumulator (tk divides each part's width).

The pipeline DMAs a block only when its block index changes from one grid step to the next. Where a part is
idle its index map holds the block it reads next (below its range: the range's first point with the same
outer indices) or the one it read last (above: the range's last such point), so an idle part costs no DMA and
the weights move exactly as one array's did; each part only keeps its own (double-buffered) blocks in VMEM.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from moe_tune.kernels.fused_moe.base import kernel_parts


@dataclasses.dataclass(frozen=True)
class View:
    """One weight operand's place in the grid: `axis` (0: j, the output columns; 2: kk, the contraction) and
    the range [lo, hi) of it, in blocks, that it serves (axis None: every point); `offset` column blocks
    added to its index (the up view of one glu array)."""

    axis: int | None = None
    lo: int = 0
    hi: int = 0
    offset: int = 0


def weight_views(rhs, *, glu: str | None, transpose_rhs: bool, tk: int, tn: int) -> tuple[list, list[View]]:
    """The weight operands, [(values [g, k, n_p], float32 scale [g, k / bs, n_p] or None)], one per view, and
    their views. The parts are `base.kernel_parts` for the tile that runs along n (tn, or tk where n is the
    transposed contraction); `config_error` keeps them apart for the dispatch's gate | up where f is
    lane-aligned."""
    tile = tk if transpose_rhs else tn
    parts = kernel_parts(rhs, tile=tile, glu=glu)
    widths = [values.shape[2] for values, _ in parts]
    if glu:  # gate and up over the same output columns: two parts, or two views of one array
        if len(parts) == 2:
            return parts, [View(), View()]
        return parts * 2, [View(), View(offset=sum(widths) // 2 // tn)]
    if len(parts) == 1:
        return parts, [View()]
    views, lo = [], 0
    for width in widths:
        views.append(View(axis=2 if transpose_rhs else 0, lo=lo, hi=lo + width // tile))
        lo += width // tile
    return parts, views


def _point(view: View, point: tuple, last: tuple[int, int, int]) -> list:
    """The grid point whose block `view` holds at `point` (j, v, kk): the point itself inside its range;
    below it the range's first point with the same outer indices, above it the last (`last`: each axis's
    last index)."""
    point = list(point)
    if view.axis is None:
        return point
    here = point[view.axis]
    below, above = here < view.lo, here >= view.hi
    point[view.axis] = jnp.clip(here, view.lo, view.hi - 1)
    for axis in range(view.axis + 1, 3):
        point[axis] = jnp.where(below, 0, jnp.where(above, last[axis], point[axis]))
    return point


def rhs_specs(views: list[View], *, tk: int, tn: int, transpose_rhs: bool, scale_rows: int | None,
              last: tuple[int, int, int]) -> list:
    """BlockSpecs of the weight operands for grid (j, v, kk) (`last`: its last indices), each followed by its
    scale's when quantized: [g, k, n_p] -> (tk, tn) at (g, kk, j'); transposed (rhs[g].T) -> (tn, tk) at
    (g, j, kk'), j' / kk' counted from the view's range (plus its offset). Either way the block's rows run
    along the forward k, so a scale [g, k / bs, n_p] comes whole along k (`scale_rows` = k / bs)."""
    specs = []
    for view in views:
        def index(j, v, kk, gid, *_, view=view, scale=False):
            j, v, kk = _point(view, (j, v, kk), last)
            if transpose_rhs:
                return gid[v], 0 if scale else j, kk - view.lo
            return gid[v], 0 if scale else kk, j - view.lo + view.offset

        specs.append(pl.BlockSpec((None, tn, tk) if transpose_rhs else (None, tk, tn), index))
        if scale_rows is not None:
            cols = tk if transpose_rhs else tn
            specs.append(pl.BlockSpec((None, scale_rows, cols), lambda *a, index=index: index(*a, scale=True)))
    return specs


def serves(view: View, j, kk) -> jax.Array | None:
    """Whether `view` takes part in grid point (j, ., kk) (a bool scalar), or None: at every point."""
    if view.axis is None:
        return None
    here = j if view.axis == 0 else kk
    return (here >= view.lo) & (here < view.hi)
