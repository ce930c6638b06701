"""`tiled` backend: the fused dispatch and combine as pure-JAX loops, the CPU backend.

Both kernels loop over the local groups; each group's rows go through full `tm`-row tiles (unmasked) and then
`tail`-row tiles for the rest (masked to the group), as the tiled ragged_dot does (`ragged_dot/tiled.py`).

- gather_gmm: a tile's lhs rows are gathered from x by `rows` straight into the dot's operand ([tm, k], in
  cache), never into an [m, k] buffer; with glu the gate and up columns come out of one dot against the
  concatenated weights and the activation runs on the f32 result before the one rounding. Its [m, n] output
  is only written, never read back, so XLA CPU runs the loops in the output's buffer (see there).
- gmm_combine: a tile's product [tm, n] stays in f32, is weighted by its rows' top-k weights and
  scatter-added into the f32 [tokens, n] output (rows outside the group selected to 0 first: their h may be
  NaN); there is no [m, n] product. A token's contributions arrive from the tiles of its top_k experts, each
  add part of a different tile's epilogue, not a chain of k additions at the end.

The weights are read per group (`rhs[g]`, transposed by the dot's dimension numbers for the backward
directions, never copied transposed); a QArray's group is dequantized to the dot's dtype once per group.
Where an average group fits one tile (decode, `sequenced_weights`), the dispatch reads them per tile instead,
gate then up, so one part's slice is live at a time (`_sequenced_products`).
bf16 inputs are read through their bits (`pallas_util`); the dispatch's bf16 output is written through its
bits (`pallas_util.update_slice`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_tune.kernels.base import KernelConfig, positive_int_error
from moe_tune.kernels.fused_moe.activations import ACTIVATIONS, apply
from moe_tune.kernels.fused_moe.base import FusedMoeBackend, weight_parts, weights_shape
from moe_tune.kernels.fused_moe.problem import FusedMoeProblem
from moe_tune.kernels.pallas_util import as_bits, load, per_iteration, update_slice
from moe_tune.kernels.pallas_util import vary_like
from moe_tune.kernels.ragged_dot.metadata import group_bounds
from moe_tune.core.quant import QArray, dequantize

# 192 and 384 (multiples of 64 between the powers of two) and tails of 64, for groups of about 384 rows
# (deepseek-v2-lite prefill): there 192:64 or 256:64 led three of the four fused calls in a loaded run
# (spreads up to 76%, results/fused_tiles_cpu_2core_2026-11-25_deepseek_prefill); the sweeps then kept 128:32
# within noise (FINDINGS.md: fused tiles)
TM = (16, 32, 64, 128, 192, 256, 384, 512)
TAILS = (4, 8, 16, 32, 64)
# Groups of at most this many rows on average (decode: qwen3-30b-a3b 16, deepseek-v2-lite 24 at 256 tokens)
# get one tile each by default (`default_tm`).
DECODE_ROWS = 32


@dataclasses.dataclass(frozen=True)
class TiledFusedConfig(KernelConfig):
    """tm: rows per full tile; tail: rows per tile for what is left of a group after its full tiles (masked).
    Clamped to m."""

    tm: int = 128
    tail: int = 16


def _dot_dtype(dtype) -> jnp.dtype:
    """The operand dtype of the kernels' dots: bf16 stays bf16 (XLA CPU runs it natively), f16 runs in f32
    (as the tiled ragged_dot measured: FINDINGS.md: bf16 ragged_dot on CPU)."""
    return jnp.dtype(jnp.bfloat16) if jnp.dtype(dtype) == jnp.bfloat16 else jnp.dtype(jnp.float32)


def _group_weight(part, g, step, compute) -> jax.Array:
    """part[g] (one of `base.weight_parts`) in the dot's dtype, read in the loop iteration `step`: a QArray's
    group dequantized (float32, then rounded once to `compute`)."""
    if isinstance(part, QArray):
        return dequantize(QArray(part.qvalue[g], part.scale[g])).astype(compute)
    return load(as_bits(per_iteration(part, step))[g], part.dtype, compute)


def _group_weights(rhs, g, compute) -> list[jax.Array]:
    """The parts of rhs[g] (`base.weight_parts`) in the dot's dtype."""
    return [_group_weight(part, g, g, compute) for part in weight_parts(rhs)]


def _sequenced_products(a, rhs, g, step, compute) -> list[jax.Array]:
    """`_products(a, _group_weights(rhs, g, compute), False)`, each part's weights read (a copy on XLA CPU: a
    dot's operand) only after the previous part's dot, so one part's [k, n_p] slice is live at a time and is
    used by its dot right after it is made, instead of every part's slice held across the group's tiles.

    The order is a data dependence: the next part's group index is min(g, groups - 1 + (v != v)) for v an
    element of the previous dot's result, which is g for every v but which XLA cannot fold. (An optimization
    barrier tying the next part to the previous result did not order them: XLA CPU split the barrier's tuple
    and hoisted the weights' half out of the loop.)"""
    results = []
    for part in weight_parts(rhs):
        if results:
            v = results[-1][0, 0]
            g = jnp.minimum(g, part.shape[0] - 1 + (v != v).astype(jnp.int32))
        results.append(_dot(a, _group_weight(part, g, step, compute), False))
    return results


def _dot(a, w, transpose_rhs: bool) -> jax.Array:
    """a [r, c] @ w [c, n] (transpose_rhs: w [n, c] contracted on its axis 1), accumulated in float32."""
    dims = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))
    return jax.lax.dot_general(a, w, dims, preferred_element_type=jnp.float32)


def _products(a, parts: list[jax.Array], transpose_rhs: bool) -> list[jax.Array]:
    """a times the weight parts, float32: one [r, n_p] result per part (their columns side by side make the
    product with the concatenated weights), or with transpose_rhs one [r, k] result, the parts splitting the
    contraction (a's columns) instead."""
    if not transpose_rhs:
        return [_dot(a, w, False) for w in parts]
    total, col = None, 0
    for w in parts:
        width = w.shape[1]
        part = _dot(a[:, col:col + width], w, True)
        total, col = part if total is None else total + part, col + width
    return [total]


def _tiles(starts, ends, g, tm: int, tail: int, m: int, tile_fn, carry, *, shifted: bool = True):
    """Run `tile_fn(row0, size, keep [size] bool, t, carry)` over group g's full tiles (keep None: all rows in
    the group) and then its tail tiles (keep: the rows of the tile in the group). A tail tile that would run
    past m is shifted back to end at m; with `shifted` False it is skipped instead (its rows are in the last
    `tail` rows of m, left to the caller), so every tile's rows before keep's are never touched."""
    start, end = starts[g], ends[g]
    full = jnp.maximum(end - start, 0) // tm
    row_in_tail = jnp.arange(tail, dtype=jnp.int32)

    def full_tile(t, carry):
        return tile_fn(start + t * tm, tm, None, t, carry)

    def tail_tile(t, carry):
        first = start + full * tm + t * tail
        row0 = jnp.minimum(first, m - tail)
        rows = row0 + row_in_tail
        return tile_fn(row0, tail, (rows >= first) & (rows < end), t, carry)

    carry = jax.lax.fori_loop(0, full, full_tile, carry)
    tail_start = start + full * tm
    tails = (end - tail_start + tail - 1) // tail
    if not shifted:  # the tiles t with tail_start + (t + 1) * tail <= m (floor division: 0 when none fits)
        tails = jnp.minimum(tails, (m - tail - tail_start) // tail + 1)
    return jax.lax.fori_loop(0, jnp.maximum(tails, 0), tail_tile, carry)


def tiled_gather_gmm(x, rows, rhs, group_sizes, *, tm: int, tail: int, out_dtype, group_offset=None,
                     glu: str | None = None, transpose_rhs: bool = False,
                     weights_per_tile: bool | None = None) -> jax.Array:
    """`FusedMoeBackend.gather_gmm` (see there): x [tokens, c], rows int32 [m], rhs [groups, c, n] (transpose:
    [groups, n, c]) -> [m, n] ([m, n/2] with glu) in out_dtype.

    The output is carried in out_dtype and only written, never read back (`pallas_util.update_slice`), so
    XLA CPU updates it in place and returns the carried buffer: no second [m, n] buffer in temp. A read of
    the carry (a tail tile's masked read-modify-write) made XLA CPU copy the carry, once per tail tile for a
    bf16 carry, and a uint16 carry costs an [m, n] copy after the loop (its bitcast; FINDINGS.md: fused layer
    memory). So a tail tile writes 0 on its rows past the group (a later group rewrites them; rows
    outside every group stay 0), and the tiles that would be shifted back over earlier rows are skipped:
    the last `tail` rows are written instead by each group that holds one of them, after its tiles, all of
    them from a [tail, n] block that merges those groups' rows (0 for the groups still to come). That write
    is inside the group loop: one after the loop was not run in place by XLA CPU within the whole layer (a
    copy of out), and the group's weights are already loaded there."""
    m, (groups, c_dim, n) = rows.shape[0], weights_shape(rhs)
    n = c_dim if transpose_rhs else n
    out_n = n // 2 if glu else n
    tm, tail = min(tm, m), min(tail, tm, m)
    starts, ends = group_bounds(group_sizes, m=m, groups=groups, group_offset=0 if group_offset is None else group_offset)
    compute = _dot_dtype(x.dtype)
    if weights_per_tile is None:
        weights_per_tile = sequenced_weights(m, group_sizes.shape[0], tm)
    weights_per_tile = weights_per_tile and not transpose_rhs and len(weight_parts(rhs)) > 1

    def products(ids, w, g, step) -> jax.Array:
        """float32 [len(ids), out_n]: x[ids] times group g's weight parts (w, or read here when None), with the
        activation."""
        xb = load(jnp.take(as_bits(per_iteration(x, step)), ids, axis=0, mode="clip"), x.dtype, compute)
        h = _sequenced_products(xb, rhs, g, step, compute) if w is None else _products(xb, w, transpose_rhs)
        if glu:
            return ACTIVATIONS[glu][0](h[0]) * h[1] if len(h) == 2 else apply(glu, h[0])
        return h[0] if len(h) == 1 else jnp.concatenate(h, axis=1)

    first = m - tail  # the last `tail` rows: each group that holds one writes them all, merged in `block`
    window = first + jnp.arange(tail, dtype=jnp.int32)

    def group(g, carry):
        out, block = carry
        w = None if weights_per_tile else _group_weights(rhs, g, compute)

        def tile(row0, size, keep, t, out):
            ids = jax.lax.dynamic_slice_in_dim(rows, row0, size)
            if keep is None:
                return update_slice(out, products(ids, w, g, t).astype(out_dtype), (row0, 0))
            # a row outside the group may hold any index (read row 0 instead) and its product may be NaN
            block = jnp.where(keep[:, None], products(jnp.where(keep, ids, 0), w, g, t), 0.0)
            return update_slice(out, block.astype(out_dtype), (row0, 0))

        out = _tiles(starts, ends, g, tm, tail, m, tile, out, shifted=False)
        keep = (window >= starts[g]) & (window < ends[g])

        def last_rows(carry):
            out, block = carry
            block = jnp.where(keep[:, None], products(jnp.where(keep, rows[first:], 0), w, g, g), block)
            return update_slice(out, block.astype(out_dtype), (first, 0)), block

        return jax.lax.cond(jnp.any(keep), last_rows, lambda carry: carry, (out, block))

    # inside shard_map the carries vary as the operands do (`vary_like`: a loop's carry type is its body's)
    init = vary_like((jnp.zeros((m, out_n), out_dtype), jnp.zeros((tail, out_n), jnp.float32)), x, rows, rhs,
                     group_sizes, group_offset)
    return jax.lax.fori_loop(0, groups, group, init)[0]


def tiled_gmm_combine(h, rhs, group_sizes, rows, row_weights, *, tokens: int, tm: int, tail: int, out_dtype,
                      group_offset=None, skip_zero_weights: bool = False, transpose_rhs: bool = False) -> jax.Array:
    """`FusedMoeBackend.gmm_combine` (see there): h [m, c], rhs [groups, c, n] (transpose: [groups, n, c]),
    rows int32 [m], row_weights [m] -> [tokens, n] in out_dtype, accumulated in float32."""
    m, (groups, c_dim, n) = h.shape[0], weights_shape(rhs)
    n = c_dim if transpose_rhs else n
    tm, tail = min(tm, m), min(tail, tm, m)
    starts, ends = group_bounds(group_sizes, m=m, groups=groups, group_offset=0 if group_offset is None else group_offset)
    compute = _dot_dtype(h.dtype)
    weights = row_weights.astype(jnp.float32)

    def group(g, acc):
        w = _group_weights(rhs, g, compute)

        def tile(row0, size, keep, t, acc):
            hb = load(jax.lax.dynamic_slice_in_dim(as_bits(per_iteration(h, t)), row0, size), h.dtype, compute)
            wt = jax.lax.dynamic_slice_in_dim(weights, row0, size)
            ids = jax.lax.dynamic_slice_in_dim(rows, row0, size)
            product = _products(hb, w, transpose_rhs)
            product = product[0] if len(product) == 1 else jnp.concatenate(product, axis=1)
            contribution = product * wt[:, None]
            drop = None if keep is None else ~keep
            if skip_zero_weights:
                drop = (wt == 0) if drop is None else drop | (wt == 0)
            if drop is not None:  # a select, not a multiply: a dropped row's product may be NaN
                contribution = jnp.where(drop[:, None], 0.0, contribution)
                ids = jnp.where(drop, tokens, ids)
            return acc.at[ids].add(contribution, mode="drop")

        return _tiles(starts, ends, g, tm, tail, m, tile, acc)

    acc = vary_like(jnp.zeros((tokens, n), jnp.float32), h, rhs, group_sizes, rows, row_weights, group_offset)
    acc = jax.lax.fori_loop(0, groups, group, acc)
    return acc.astype(out_dtype)


def sequenced_weights(m: int, num_group_sizes: int, tm: int) -> bool:
    """Whether the dispatch reads a group's gate and up weights per tile, one after the other
    (`_sequenced_products`), rather than both once per group: where an average group fits one tile (decode),
    so the reads are as many and only one part's slice is live."""
    return m <= tm * num_group_sizes


def _average_group_rows(problem: FusedMoeProblem) -> int:
    """Rows of an average group: m over all the experts (`num_group_sizes`), at least 1."""
    return max(problem.m // problem.num_group_sizes, 1)


def default_tm(problem: FusedMoeProblem) -> int:
    """Half an average group's rows (on this shard) rounded down to a power of two, in [16, 256]: nearly every
    group runs a full tile. Tiles of a whole average group left the groups below it all in tails; measured
    at qwen3-30b-a3b prefill bf16 (256 rows a group), tm 128 / tail 32 beat tm 256 / tail 16 in each of the
    four fused calls by 5-15% (FINDINGS.md: fused tiles).
    Where an average group holds at most `DECODE_ROWS` rows (decode), a whole average group rounded up to a
    power of two (at least 16) instead, with tails as large (`default_tail`): one tile for most groups, and so
    the dispatch reads the gate and up weights per tile, one at a time (`sequenced_weights`).
    An average group is m over all the experts (`num_group_sizes`): the op's problem at run time knows the
    shard by its total groups, not by `ep` (which only the sweep's problem sets); both give one default."""
    average = _average_group_rows(problem)
    if average <= DECODE_ROWS:
        return max(16, min(1 << (average - 1).bit_length(), problem.m))
    half = max(average // 2, 1)
    return max(16, min(256, 1 << (half.bit_length() - 1), problem.m))


def default_tail(problem: FusedMoeProblem, tm: int) -> int:
    """A quarter of the tile (at least 16, at most tm); the whole tile at decode (see `default_tm`)."""
    if _average_group_rows(problem) <= DECODE_ROWS:
        return tm
    return min(max(16, tm // 4), tm)


class TiledFusedMoe(FusedMoeBackend):
    name = "tiled"
    split_weights = True  # reads (gate, up) as two parts: no concatenated copy of the weights per call
    revision = 1  # bump on changes that can change the fastest or a valid config (Backend.revision)
    config_cls = TiledFusedConfig
    platforms = ("cpu", "gpu", "tpu")
    description = "pure-JAX loops over each group's row tiles, rows gathered / scatter-added per tile (CPU)"

    def config_error(self, config: TiledFusedConfig, problem: FusedMoeProblem) -> str | None:
        for name in ("tm", "tail"):
            if error := positive_int_error(name, getattr(config, name)):
                return error
        if config.tail > config.tm:
            return f"tail {config.tail} > tm {config.tm}"
        if config.tm > max(problem.m, TM[0]):
            return f"tm {config.tm} > m {problem.m}"
        return None

    def default_config(self, problem: FusedMoeProblem) -> TiledFusedConfig:
        tm = default_tm(problem)
        return TiledFusedConfig(tm=tm, tail=default_tail(problem, tm))

    def candidate_values(self, problem: FusedMoeProblem):
        return {"tm": [t for t in TM if t <= max(problem.m, TM[0])], "tail": list(TAILS)}

    def gather_gmm(self, x, rows, rhs, group_sizes, *, config, out_dtype, group_offset=None, glu=None,
                   transpose_rhs=False):
        return tiled_gather_gmm(x, rows, rhs, group_sizes, tm=config.tm, tail=config.tail, out_dtype=out_dtype,
                                group_offset=group_offset, glu=glu, transpose_rhs=transpose_rhs)

    def gmm_combine(self, h, rhs, group_sizes, rows, row_weights, *, tokens, config, out_dtype, group_offset=None,
                    skip_zero_weights=False, transpose_rhs=False):
        return tiled_gmm_combine(h, rhs, group_sizes, rows, row_weights, tokens=tokens, tm=config.tm,
                                 tail=config.tail, out_dtype=out_dtype, group_offset=group_offset,
                                 skip_zero_weights=skip_zero_weights, transpose_rhs=transpose_rhs)
