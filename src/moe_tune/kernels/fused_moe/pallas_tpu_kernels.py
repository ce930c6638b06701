"""The fused MoE kernels in Pallas Mosaic TPU: `gather_gmm` (dispatch fused into the grouped matmul) and
`gmm_combine` (combine fused into it). The backend, its config and its validity rules are `pallas_tpu.py`.

Both walk the Megablox visit schedule (`ragged_dot/metadata.py`) with the grid (n tiles, visits, k tiles):
a visit multiplies one `tm`-row tile by its group's weights, `tk` of the contraction at a time, into a
float32 accumulator, and only that group's rows are kept. The n tiles are outermost (as in Megablox), so a
row tile shared by two groups is visited twice in a row for the same output block.

- gather_gmm: x stays in HBM. On the first visit of a row tile (per n tile) the kernel DMAs the x rows of
  the tile's local rows, `x[rows[i]]`, one DMA per row (`gather/pallas_tpu.RowDmaRing`, `rows` in SMEM by
  scalar prefetch), into a [tm, k] VMEM scratch that the k steps and the tile's second visit reuse: no
  [m, k] gathered copy exists, and the lhs traffic is that of Megablox, which re-reads lhs per n tile too.
  Rows outside the shard's range are never read. With `glu`, the gate and up blocks of the same columns
  come from the two parts (or two views of one array) and the activation runs in float32 before the one
  rounding. Gate and up are separate operands in every direction (`pallas_tpu_weights.py`: no concatenated
  copy of the weights).
  The row DMAs are waited for before the tile's first k step (not overlapped with the previous tile).
- gmm_combine: h blocks come through BlockSpecs as in Megablox. The output column slab [tokens, tn]
  stays resident in a float32 VMEM scratch for a whole n tile; after a visit's last k step each local row
  of the group is weighted (a scalar from SMEM) and added into `slab[rows[i]]`. Within one visit the rows
  belong to one expert, so (top-k experts being distinct) every add of a visit goes to a different token:
  a token's k contributions arrive in k different visits, never as a dependency chain inside one step.
  Invalid rows (outside the shard, or of weight 0 with skip_zero_weights) are skipped, never read, so
  their NaN cannot leak. The finished slab is DMAed to the float32 [tokens, n] output once per n tile.

Packed 16-bit x cannot be copied one row at a time by Mosaic (its tiles hold row pairs; see
`gather/pallas_tpu.py`), so gather_gmm stages a bfloat16 x ([tokens, k], not [m, k]) as 32-bit rows: when
`tk` tiles one half of k (or is all of k), column j and column j + k/2 share one uint32 (`pack_halves`), so
the gathered bytes stay those of bfloat16, and a k step unpacks its half exactly (bfloat16 is the top half
of a float32); otherwise as float32.

Quantized weights (QArray int8 / float8_e4m3fn, scale [g, k / bs, n]) stay 1-byte in HBM and VMEM; each
weight block is dequantized in float32 in sub-blocks of min(tile, bs) rows along the forward k (which the
block's rows run along in every direction), each times its row of the group's scales (a block whole along
k), then cast to the activations' dtype for the dot.

The scalar-prefetch tables (rows, and the combine's weights) live in SMEM: the rules cap them (about 128K
rows for gather_gmm, 64K for gmm_combine), past which the op runs its jax backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from moe_tune.kernels.fused_moe.activations import ACTIVATIONS
from moe_tune.kernels.fused_moe.base import kernel_operands, weight_refs, weights_shape
from moe_tune.kernels.fused_moe.pallas_tpu_weights import rhs_specs, serves, weight_views
from moe_tune.kernels.gather.pallas_tpu import RowDmaRing
from moe_tune.kernels.pallas_util import interpreted, out_struct, pallas_run, round_up
from moe_tune.kernels.ragged_dot.metadata import make_group_metadata


def _interpret():
    """False on TPU; elsewhere the TPU interpreter (simulated DMAs; fresh VMEM filled with NaN)."""
    return pltpu.InterpretParams() if interpreted("tpu") else False


def visit_schedule(group_sizes, group_offset, *, m_padded: int, tm: int, groups: int):
    """Scalar-prefetch tables: group_ids, tile_ids [visits], starts, ends [groups], and info int32 [3] =
    (number of real visits, first local row, one past the last local row)."""
    meta = make_group_metadata(group_sizes, m=m_padded, tm=tm, groups=groups,
                               group_offset=0 if group_offset is None else group_offset)
    info = jnp.stack([meta.num_visits, meta.group_starts[0], meta.group_ends[groups - 1]]).astype(jnp.int32)
    return meta.group_ids, meta.tile_ids, meta.group_starts, meta.group_ends, info


def packs_halves(dtype, kc: int, tk: int) -> bool:
    """Whether gather_gmm stages a 16-bit x [tokens, kc] as uint32 halves (else as float32): bfloat16 with
    every k step inside one lane-aligned half (tk divides kc / 2), or one step over all of kc."""
    half = kc // 2
    return jnp.dtype(dtype) == jnp.bfloat16 and kc % (2 * 128) == 0 and (half % tk == 0 or tk == kc)


def pack_halves(x: jax.Array) -> jax.Array:
    """bfloat16 [tokens, kc] -> uint32 [tokens, kc / 2]: low 16 bits column j, high 16 bits column j + kc/2."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    half = x.shape[1] // 2
    return bits[:, :half] | (bits[:, half:] << 16)


def _unpack(u: jax.Array, high) -> jax.Array:
    """float32 values of the bfloat16 halves of uint32 `u`: the high ones where `high` (a bool scalar), else
    the low ones (a bfloat16 is a float32 whose low 16 bits are zero)."""
    bits = jnp.where(high, u & jnp.uint32(0xFFFF0000), u << 16)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def lhs_step(xbuf, kk, *, tk: int, kc: int, packed: bool, dtype) -> jax.Array:
    """Columns [kk * tk, (kk + 1) * tk) of the gathered rows in the dot's dtype."""
    if not packed:
        return xbuf[:, pl.ds(pl.multiple_of(kk * tk, tk), tk)].astype(dtype)
    half = kc // 2
    if tk == kc:
        u = xbuf[...]
        return jnp.concatenate([_unpack(u, False), _unpack(u, True)], axis=1).astype(dtype)
    start = kk * tk
    high = start >= half
    u = xbuf[:, pl.ds(pl.multiple_of(jnp.where(high, start - half, start), tk), tk)]
    return _unpack(u, high).astype(dtype)


def _dot(a, w, transpose_rhs: bool):
    """f32 a [tm, tk] @ w ([tk, tn], or [tn, tk] read transposed)."""
    dims = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))
    return jax.lax.dot_general(a, w, dims, preferred_element_type=jnp.float32)


def _weight_block(w_ref, s_ref, tile_index, *, tile: int, block: int | None, dtype) -> jax.Array:
    """The weight block in the dot's dtype. Quantized (s_ref float32 [k / block, cols], whole along the forward
    k, which the block's rows tile with `tile` at `tile_index`): dequantized in float32 in sub-blocks of
    min(tile, block) rows, each within one scale block, then cast (a bfloat16 dot rounds the dequantized
    values once, as a bfloat16 layer does)."""
    if s_ref is None:
        return w_ref[...].astype(dtype)
    sub = min(tile, block)
    parts = []
    for j in range(tile // sub):
        row = jax.lax.div(tile_index * tile + j * sub, jnp.int32(block))  # truncating: Mosaic's `//` needs `sign`
        parts.append(w_ref[pl.ds(j * sub, sub), :].astype(jnp.float32) * s_ref[pl.ds(row, 1), :])
    return (parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)).astype(dtype)


def accumulate_visit(accs, weights, views, a, j, kk, *, row_tile: int, row_index, block: int | None, dtype,
                transpose_rhs: bool) -> None:
    """accs += a @ each view's weight block: with as many accumulators as views (glu's gate and up) each its
    own; else the one accumulator, each view's product where it serves (j, kk) (`pallas_tpu_weights`: gate
    or up, under pl.when)."""
    for i, (view, (w_ref, s_ref)) in enumerate(zip(views, weights)):
        acc = accs[i] if len(accs) == len(views) else accs[0]

        def step(acc=acc, w_ref=w_ref, s_ref=s_ref):
            w = _weight_block(w_ref, s_ref, row_index, tile=row_tile, block=block, dtype=dtype)
            acc[...] += _dot(a, w, transpose_rhs)

        when = serves(view, j, kk)
        step() if when is None else pl.when(when)(step)


def _gather_gmm_kernel(gid, tid, starts, ends, info, rows_ref, x_hbm, *refs, tm, tk, tn, kc, dmas, glu,
                       transpose_rhs, dot_dtype, quant_block, packed, views):
    """gid / tid int32 [visits], starts / ends int32 [groups], info int32 [3], rows_ref int32 [m_p] (SMEM);
    x_hbm [tokens, kc] in HBM; the weight operands of `views` (`pallas_tpu_weights`), each followed by its
    scale block when quantized; o_ref [tm, tn]; xbuf [tm, kc]; acc f32 (1, or 2 with glu); sems DMA [dmas]."""
    n_acc = 2 if glu else 1
    weights, (o_ref, xbuf, *rest) = weight_refs(refs, len(views), quant_block is not None)
    accs, sems = rest[:n_acc], rest[n_acc]
    j, v, kk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    # The block's rows run along the forward k: the contraction (tk at kk), or transposed the output (tn at j).
    row_tile, row_index = (tn, j) if transpose_rhs else (tk, kk)
    real = v < info[0]
    tile = tid[v]
    row0 = tile * tm
    first_of_tile = (v == 0) | (tile != tid[jnp.maximum(v - 1, 0)])

    @pl.when(real & (kk == 0) & first_of_tile)
    def _():
        lo, hi = jnp.maximum(info[1], row0), jnp.minimum(info[2], row0 + tm)
        ring = RowDmaRing(x_hbm, xbuf.at[pl.ds(0, 1)], sems, dmas)

        def issue(i, slot):
            ring.start(rows_ref[i], xbuf.at[pl.ds(i - row0, 1)], i - lo, slot)
            return ring.next_slot(slot)

        jax.lax.fori_loop(lo, hi, issue, jnp.int32(0))
        ring.drain(jnp.maximum(hi - lo, 0))

    @pl.when(real)
    def _():
        @pl.when(kk == 0)
        def _():
            for acc in accs:
                acc[...] = jnp.zeros(acc.shape, jnp.float32)

        a = lhs_step(xbuf, kk, tk=tk, kc=kc, packed=packed, dtype=dot_dtype)
        accumulate_visit(accs, weights, views, a, j, kk, row_tile=row_tile, row_index=row_index, block=quant_block,
                    dtype=dot_dtype, transpose_rhs=transpose_rhs)

        @pl.when(kk == kc // tk - 1)
        def _():
            out = accs[0][...]
            if glu:
                out = ACTIVATIONS[glu][0](out) * accs[1][...]
            group = gid[v]
            row = row0 + jax.lax.broadcasted_iota(jnp.int32, out.shape, 0)
            keep = (row >= starts[group]) & (row < ends[group])
            # A select: the tile's other rows hold another group's result (written by its own visit) or
            # rows never gathered (stale VMEM, maybe NaN).
            o_ref[...] = jnp.where(keep, out.astype(o_ref.dtype), o_ref[...])


def pallas_gather_gmm(x, rows, rhs, group_sizes, *, tm: int, tk: int, tn: int, dmas_in_flight: int, out_dtype,
                      group_offset=None, glu: str | None = None, transpose_rhs: bool = False) -> jax.Array:
    """x [tokens, kc] (f32 / bf16; kc a multiple of 128), rows int32 [m], rhs [g, k, n] float or QArray (int8 /
    float8_e4m3fn scaled along k; read as rhs[g].T with transpose_rhs, kc = n), or a tuple of such parts
    standing for their concatenation along n (gate, up), group_sizes int32 [total] normalized -> [m, n_out] in
    out_dtype (n_out = n / 2 with glu; k transposed). Rows outside the local groups are left unwritten here;
    the caller zeroes them."""
    m, kc = rows.shape[0], x.shape[1]
    groups, k_w, n_all = weights_shape(rhs)
    n_w = k_w if transpose_rhs else n_all
    n_out = n_w // 2 if glu else n_w
    parts, views = weight_views(rhs, glu=glu, transpose_rhs=transpose_rhs, tk=tk, tn=tn)
    rhs, scale = parts[0]
    m_p = round_up(m, tm)
    tables = visit_schedule(group_sizes, group_offset, m_padded=m_p, tm=tm, groups=groups)
    visits = tables[0].shape[0]
    # Mosaic copies 32-bit rows only: stage a 16-bit x as float32 (a [tokens, kc] copy, not [m, kc]).
    packed = packs_halves(x.dtype, kc, tk)
    staged = pack_halves(x) if packed else x if x.dtype.itemsize == 4 else x.astype(jnp.float32)
    dot_dtype = x.dtype if scale is not None else jnp.promote_types(x.dtype, rhs.dtype)
    n_acc = 2 if glu else 1
    scale_rows, block = weight_scale_layout(rhs, scale)
    kernel = functools.partial(_gather_gmm_kernel, tm=tm, tk=tk, tn=tn, kc=kc, dmas=dmas_in_flight, glu=glu,
                               transpose_rhs=transpose_rhs, dot_dtype=dot_dtype, quant_block=block, packed=packed,
                               views=views)
    grid = (pl.cdiv(n_out, tn), visits, kc // tk)
    args = (*tables, jnp.pad(rows.astype(jnp.int32), (0, m_p - m)), staged, *kernel_operands(parts))
    call = pl.pallas_call(
        kernel,
        out_shape=out_struct((m, n_out), out_dtype, *args),  # a ragged last row tile is clipped on write
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=grid,
            in_specs=[pl.BlockSpec(memory_space=pl.ANY),
                      *rhs_specs(views, tk=tk, tn=tn, transpose_rhs=transpose_rhs, scale_rows=scale_rows,
                                 last=tuple(size - 1 for size in grid))],
            out_specs=pl.BlockSpec((tm, tn), lambda j, v, kk, gid, tid, *_: (tid[v], j)),
            scratch_shapes=[pltpu.VMEM((tm, staged.shape[1]), staged.dtype),
                            *[pltpu.VMEM((tm, tn), jnp.float32)] * n_acc,
                            pltpu.SemaphoreType.DMA((dmas_in_flight,))],
        ),
        # The xbuf scratch carries a tile's rows from one grid step to the next: every axis is sequential.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary", "arbitrary")),
        cost_estimate=pl.CostEstimate(
            flops=2 * m * kc * n_w, transcendentals=m * n_out if glu else 0,
            bytes_accessed=m * staged.shape[1] * 4 + groups * k_w * n_all * rhs.dtype.itemsize
            + m * n_out * jnp.dtype(out_dtype).itemsize),
        interpret=_interpret(),
        name="moe_tune_gather_gmm",
    )
    return pallas_run(call, *args, interpret=interpreted("tpu"))


def weight_scale_layout(rhs, scale) -> tuple[int | None, int | None]:
    """(scale rows = k / block, block) of a quantized rhs [g, k, n] with scale [g, k / block, n]; (None, None)
    for float weights."""
    if scale is None:
        return None, None
    return scale.shape[1], rhs.shape[1] // scale.shape[1]


def _gmm_combine_kernel(gid, tid, starts, ends, info, rows_ref, w_smem, h_ref, *refs, tm, tk, tn, k_steps, skip_zero,
                        transpose_rhs, dot_dtype, quant_block, views):
    """gid / tid / starts / ends / info as in `_gather_gmm_kernel`; rows_ref int32 [m_p] and w_smem f32 [m_p]
    (SMEM); h_ref [tm, tk]; the weight operands of `views` (and their scale blocks when quantized); out_hbm
    f32 [tokens, n] in HBM; acc f32 [tm, tn]; slab f32 [tokens, tn]; sem one DMA semaphore."""
    weights, (out_hbm, acc, slab, sem) = weight_refs(refs, len(views), quant_block is not None)
    j, v, kk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row_tile, row_index = (tn, j) if transpose_rhs else (tk, kk)
    last_v, last_k = pl.num_programs(1) - 1, k_steps - 1

    @pl.when((v == 0) & (kk == 0))
    def _():
        slab[...] = jnp.zeros(slab.shape, jnp.float32)

    @pl.when(v < info[0])
    def _():
        @pl.when(kk == 0)
        def _():
            acc[...] = jnp.zeros(acc.shape, jnp.float32)

        accumulate_visit([acc], weights, views, h_ref[...].astype(dot_dtype), j, kk, row_tile=row_tile,
                    row_index=row_index, block=quant_block, dtype=dot_dtype, transpose_rhs=transpose_rhs)

        @pl.when(kk == last_k)
        def _():
            group, row0 = gid[v], tid[v] * tm

            def add(i, carry):
                weight = w_smem[i]

                t = rows_ref[i]

                def accumulate():
                    slab[pl.ds(t, 1), :] += weight * acc[pl.ds(i - row0, 1), :]

                # a row sent past the tokens (`op.normalized_rows`: a token index out of range) adds nothing
                inside = t < slab.shape[0]
                pl.when(jnp.logical_and(inside, weight != 0) if skip_zero else inside)(accumulate)
                return carry

            # Only the group's rows: the tile's other rows may be NaN (outside the shard) or another
            # group's (added by that group's visit).
            jax.lax.fori_loop(jnp.maximum(starts[group], row0), jnp.minimum(ends[group], row0 + tm), add, 0)

    @pl.when((v == last_v) & (kk == last_k))
    def _():
        copy = pltpu.make_async_copy(slab, out_hbm.at[:, pl.ds(pl.multiple_of(j * tn, tn), tn)], sem)
        copy.start()
        copy.wait()


def pallas_gmm_combine(h, rhs, group_sizes, rows, row_weights, *, tokens: int, tm: int, tk: int, tn: int,
                       out_dtype, group_offset=None, skip_zero_weights: bool = False,
                       transpose_rhs: bool = False) -> jax.Array:
    """h [m, kc] (f32 / bf16), rhs [g, k, n] float or QArray, or parts, as in `pallas_gather_gmm` (kc = k;
    transposed kc = n), group_sizes int32 [total] normalized, rows int32 [m], row_weights [m] -> [tokens, n]
    ([tokens, k] transposed) in out_dtype, accumulated in float32 (tn must divide the output columns: the slab
    is copied out in whole column blocks)."""
    m, kc = h.shape
    groups, k_w, n_all = weights_shape(rhs)
    n = k_w if transpose_rhs else n_all
    parts, views = weight_views(rhs, glu=None, transpose_rhs=transpose_rhs, tk=tk, tn=tn)
    rhs, scale = parts[0]
    scale_rows, block = weight_scale_layout(rhs, scale)
    m_p = round_up(m, tm)
    tables = visit_schedule(group_sizes, group_offset, m_padded=m_p, tm=tm, groups=groups)
    visits = tables[0].shape[0]
    pad = (0, m_p - m)
    dot_dtype = h.dtype if scale is not None else jnp.promote_types(h.dtype, rhs.dtype)
    kernel = functools.partial(_gmm_combine_kernel, tm=tm, tk=tk, tn=tn, k_steps=kc // tk,
                               skip_zero=skip_zero_weights, transpose_rhs=transpose_rhs, dot_dtype=dot_dtype,
                               quant_block=block, views=views)
    grid = (n // tn, visits, kc // tk)
    # h is not padded: a ragged last tile's rows are past m, never added.
    args = (*tables, jnp.pad(rows.astype(jnp.int32), pad), jnp.pad(row_weights.astype(jnp.float32), pad), h,
            *kernel_operands(parts))
    call = pl.pallas_call(
        kernel,
        out_shape=out_struct((tokens, n), jnp.float32, *args),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=7,
            grid=grid,
            in_specs=[pl.BlockSpec((tm, tk), lambda j, v, kk, gid, tid, *_: (tid[v], kk)),
                      *rhs_specs(views, tk=tk, tn=tn, transpose_rhs=transpose_rhs, scale_rows=scale_rows,
                                 last=tuple(size - 1 for size in grid))],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32), pltpu.VMEM((tokens, tn), jnp.float32),
                            pltpu.SemaphoreType.DMA(())],
        ),
        # Each n tile owns its slab and its output columns: n tiles may run on different cores.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        cost_estimate=pl.CostEstimate(
            flops=2 * m * kc * n, transcendentals=0,
            bytes_accessed=(n // tn) * m * kc * h.dtype.itemsize + groups * k_w * n_all * rhs.dtype.itemsize
            + tokens * n * 4),
        interpret=_interpret(),
        name="moe_tune_gmm_combine",
    )
    return pallas_run(call, *args, interpret=interpreted("tpu")).astype(out_dtype)
