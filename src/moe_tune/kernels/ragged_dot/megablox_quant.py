"""Quantized Pallas TPU gmm / tgmm for the `megablox` backend (JAX's Megablox kernels refuse int8 / fp8).

The quantized values travel into the kernel as they are (int8 or float8_e4m3fn blocks, half or a quarter of
the bytes of a float block; int4 and mxfp4 weights 4 bits an element, mxfp4 decoded from its bits in the
kernel, `tile_quant`), with their float32 scales as blocks of their own. Activations quantized in the kernel
(dynamic w8a8) arrive as floats; the fwd kernel quantizes each row's scale block of the lhs tile it loads.
The schedule is Megablox's:
the visits of `metadata.make_group_metadata` (a row tile shared by two groups is visited once per group)
arrive by scalar prefetch and pick each step's blocks.

gmm grid (n tiles, visits, k tiles), an f32 accumulator in VMEM; a visit's rows are stored at its last k
step, masked to its group. Where each scale applies is the direction's plan (`quant_plan.py`), one
accumulate function per direction: fwd multiplies the dot of each sub-block of a k tile by its STEP scales
(a tile never straddles a scale block) and OUTPUT scales once, at the store; dlhs dequantizes each weight
sub-block along the output (DEQUANTIZE). tgmm grid (n tiles, k tiles, visits): each group's [tk, tn] result
accumulates over its visits and is stored at its last one; an lhs DEQUANTIZE scale dequantizes each
sub-block of the lhs^T tile.

Off TPU both run in interpret mode (tests only). `quantized.py` folds the scales the plan folds before the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from moe_tune.kernels.pallas_util import out_struct, pad_to, pallas_run
from moe_tune.kernels.ragged_dot.metadata import make_group_metadata
from moe_tune.kernels.ragged_dot.quant_plan import Apply, LhsQuant, QuantPlan, gmm_plan, tgmm_plan
from moe_tune.kernels.ragged_dot.quantized import dot_dtypes, k_chunk, with_absent_refs
from moe_tune.kernels.ragged_dot.tile_quant import block_scale, decode_e2m1, quantize_with


_NN, _NT = (((1,), (0,)), ((), ())), (((1,), (1,)), ((), ()))  # x @ w, x @ w^T


def _dot(x: jax.Array, w: jax.Array, dims=_NN) -> jax.Array:
    """x @ w (or w^T), int8 x int8 in int32, else in float32; float32 operands at full precision (Mosaic's
    default may take bf16 passes), so results match a float32 reference."""
    if x.dtype == jnp.int8:
        return jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.int32)
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return jax.lax.dot_general(x, w, dims, precision=precision, preferred_element_type=jnp.float32)


def _div(index: jax.Array, block: int) -> jax.Array:
    """index // block for a non-negative traced index: truncating division (Mosaic lowers `//` on signed
    integers through `sign`, which needs to know the chip)."""
    return jax.lax.div(index, jnp.int32(block))


def _rows_of_group(group_ids, tile_ids, starts, ends, visit, tm: int, shape, axis: int) -> jax.Array:
    """bool `shape`: which entries along `axis` (rows of the visit's tile) belong to the visit's group."""
    group = group_ids[visit]
    rows = tile_ids[visit] * tm + jax.lax.broadcasted_iota(jnp.int32, shape, axis)
    return (rows >= starts[group]) & (rows < ends[group])


def _values(ref, rows, cols, dtype: str) -> jax.Array:
    """ref[rows, cols] ready for `.astype`: e2m1 (mxfp4) codes read as int4 bits and decoded to float32
    (`tile_quant`: Mosaic before TPU v7 computes on no float4 vector); any other dtype as stored (int4
    included). The bitcast is of the loaded value: a ref bitcast fails Mosaic's verifier on a block with a
    squeezed dim ("tpu.memref_bitcast: ranks do not match")."""
    if dtype == "float4_e2m1fn":
        return decode_e2m1(pltpu.bitcast(ref[rows, cols], jnp.int4))
    return ref[rows, cols]


def _fwd_accumulate(lhs_ref, lhs_scale_ref, rhs_ref, rhs_scale_ref, acc_ref, k_i, *, plan: QuantPlan, tk, chunk):
    """fwd: acc += x [tm, tk] @ w [tk, tn], a dot per `chunk` of the k tile (a chunk never straddles a scale
    block), each chunk's dot times its STEP scales. Activations quantized here (`OperandPlan.quantize_to`,
    dynamic w8a8): each chunk of x is quantized with its rows' scales over its whole scale block (the tile
    holds whole blocks, `megablox.quant_config_error`), computed once per block, and the chunk's dot is
    multiplied by them (for one scale per row the tile is the whole row, a single k step)."""
    a, b = plan.operands
    operand, _ = dot_dtypes(*(jax.ShapeDtypeStruct((), op.dot_dtype) for op in plan.operands))
    row_scales = {}  # dynamic lhs: first column of a scale block in the tile -> its rows' scales [tm, 1]
    for j in range(tk // chunk):
        cols = pl.ds(j * chunk, chunk)
        x = lhs_ref[:, cols]
        if a.quantize_to:
            first = j * chunk // a.block * a.block
            if first not in row_scales:
                row_scales[first] = block_scale(lhs_ref[:, pl.ds(first, a.block)].astype(jnp.float32),
                                                a.quantize_to)
            x = quantize_with(x.astype(jnp.float32), row_scales[first], a.quantize_to)
        w = _values(rhs_ref, cols, slice(None), b.dtype)
        part = _dot(x.astype(operand), w.astype(operand)).astype(jnp.float32)
        k0 = k_i * tk + j * chunk
        if b.scale is Apply.STEP:
            part = part * rhs_scale_ref[pl.ds(_div(k0, b.block), 1), :]
        if a.quantize_to:
            part = part * row_scales[first]
        elif a.scale is Apply.STEP:
            part = part * lhs_scale_ref[:, pl.ds(_div(k0, a.block), 1)]
        acc_ref[...] += part


def _dequantized_row_blocks(values_ref, scale_ref, tile_index, tile: int, block: int, dtype: str):
    """The DEQUANTIZE loop of both gradient kernels: the `tile` rows of `values_ref` (tile `tile_index` of an
    axis scaled in blocks of `block` rows, the forward k: dlhs's weight rows, tgmm's lhs^T rows) in sub-blocks
    of min(tile, block) rows, each within one scale block. Yields (rows: a pl.ds into the tile, float32
    values of those rows times their scale row of `scale_ref` [axis / block, cols], whole along the axis)."""
    sub = min(tile, block)
    for j in range(tile // sub):
        rows = pl.ds(j * sub, sub)
        scale_row = _div(tile_index * tile + j * sub, block)
        values = _values(values_ref, rows, slice(None), dtype).astype(jnp.float32)
        yield rows, values * scale_ref[pl.ds(scale_row, 1), :]


def _dlhs_accumulate(lhs_ref, rhs_ref, rhs_scale_ref, acc_ref, n_i, *, plan: QuantPlan, tn):
    """dlhs: acc += x [tm, tk] @ w^T (w [tn, tk]) in float32 (`QuantPlan.float32_dots`: x is dout, float, or
    float32 with a per-channel scale folded in); a DEQUANTIZE scale runs along w's rows, the output, in blocks:
    each sub-block of w rows is dequantized before its dot."""
    x = lhs_ref[...].astype(jnp.float32)
    if plan.b.scale is not Apply.DEQUANTIZE:
        acc_ref[...] += _dot(x, _values(rhs_ref, slice(None), slice(None), plan.b.dtype).astype(jnp.float32), _NT)
        return
    for rows, w in _dequantized_row_blocks(rhs_ref, rhs_scale_ref, n_i, tn, plan.b.block, plan.b.dtype):
        acc_ref[:, rows] += _dot(x, w, _NT)


def _gmm_kernel(group_ids, tile_ids, starts, ends, num_visits, *refs, plan: QuantPlan, tm, tk, tn, k_tiles, chunk):
    lhs_ref, lhs_scale_ref, rhs_ref, rhs_scale_ref, out_ref, acc_ref = refs
    n_i, visit, k_i = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when(k_i == 0)
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(visit < num_visits[0])
    def _accumulate():
        if plan.direction == "dlhs":
            _dlhs_accumulate(lhs_ref, rhs_ref, rhs_scale_ref, acc_ref, n_i, plan=plan, tn=tn)
        else:
            _fwd_accumulate(lhs_ref, lhs_scale_ref, rhs_ref, rhs_scale_ref, acc_ref, k_i, plan=plan, tk=tk,
                            chunk=chunk)

    @pl.when((k_i == k_tiles - 1) & (visit < num_visits[0]))
    def _store():
        acc = acc_ref[...]
        if plan.b.scale is Apply.OUTPUT:  # one scale per channel / row: once, at the store
            acc = acc * rhs_scale_ref[...]
        if plan.a.scale is Apply.OUTPUT and not plan.a.quantize_to:  # a dynamic lhs's scale: in the k step
            acc = acc * lhs_scale_ref[...]
        keep = _rows_of_group(group_ids, tile_ids, starts, ends, visit, tm, (tm, tn), 0)
        out_ref[...] = jax.lax.select(keep, acc, out_ref[...].astype(jnp.float32)).astype(out_ref.dtype)


def quantized_gmm(lhs: jax.Array, lhs_scale: jax.Array | None, rhs: jax.Array, rhs_scale: jax.Array | None,
                  lhs_quant: LhsQuant | None, group_sizes: jax.Array, *, tiling: tuple[int, int, int],
                  out_dtype: jnp.dtype, group_offset: jax.Array | None, transpose_rhs: bool,
                  interpret: bool) -> jax.Array:
    """gmm of `quantized.GmmOperands`: lhs [m, k] (float / int8 / fp8) with lhs_scale None or f32 [m, k/bs],
    rhs [g, k, n] (int8 / fp8 / int4 / float4_e2m1fn) with rhs_scale None or f32 [g, k/bs, n] (transpose_rhs:
    lhs float, rhs [g, n, k] with rhs_scale None or f32 [g, n/bs, k]); lhs_quant: a float lhs the kernel
    quantizes (fwd). -> [m, n] in out_dtype; rows of no local group are left unwritten (the caller masks
    them). Needs tk | k; sub-channel blocks a multiple or a divisor of the tile they scale (tk; tn with
    transpose_rhs); a dynamic lhs's blocks whole in tk; see `megablox.quant_config_error`."""
    tm, tk, tn = tiling
    m, k = lhs.shape
    groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    lhs = pad_to(lhs, 0, tm)  # rows past sum(group_sizes): no visit stores them
    lhs_scale = None if lhs_scale is None else pad_to(lhs_scale, 0, tm)
    meta = make_group_metadata(group_sizes, m=lhs.shape[0], tm=tm, groups=groups,
                               group_offset=0 if group_offset is None else group_offset)
    plan = gmm_plan(lhs, lhs_scale, rhs, rhs_scale, lhs_quant, transpose_rhs=transpose_rhs).kernel_plan()
    chunk = k_chunk(k, tk, *plan.step_blocks)

    # Scale blocks span the whole k / bs axis (a few KiB; a block of a few rows would break the TPU's 8-row
    # tiling); the kernel picks its rows.
    specs = {"lhs": pl.BlockSpec((tm, tk), lambda n_i, v, k_i, gid, tid, *_: (tid[v], k_i))}
    if lhs_scale is not None:
        specs["lhs_scale"] = pl.BlockSpec((tm, lhs_scale.shape[1]), lambda n_i, v, k_i, gid, tid, *_: (tid[v], 0))
    if transpose_rhs:
        specs["rhs"] = pl.BlockSpec((None, tn, tk), lambda n_i, v, k_i, gid, *_: (gid[v], n_i, k_i))
        scale_cols, scale_index = tk, lambda n_i, v, k_i, gid, *_: (gid[v], 0, k_i)
    else:
        specs["rhs"] = pl.BlockSpec((None, tk, tn), lambda n_i, v, k_i, gid, *_: (gid[v], k_i, n_i))
        scale_cols, scale_index = tn, lambda n_i, v, k_i, gid, *_: (gid[v], 0, n_i)
    if rhs_scale is not None:
        specs["rhs_scale"] = pl.BlockSpec((None, rhs_scale.shape[1], scale_cols), scale_index)
    kernel = with_absent_refs(
        functools.partial(_gmm_kernel, plan=plan, tm=tm, tk=tk, tn=tn, k_tiles=k // tk, chunk=chunk),
        5, [True, lhs_scale is not None, True, rhs_scale is not None])
    inputs = {"lhs": lhs, "lhs_scale": lhs_scale, "rhs": rhs, "rhs_scale": rhs_scale}
    args = (meta.group_ids, meta.tile_ids, meta.group_starts, meta.group_ends, meta.num_visits[None],
            *[inputs[name] for name in specs])
    out = pallas_run(pl.pallas_call(
        kernel,
        out_shape=out_struct((lhs.shape[0], n), out_dtype, *args),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            in_specs=list(specs.values()),
            out_specs=pl.BlockSpec((tm, tn), lambda n_i, v, k_i, gid, tid, *_: (tid[v], n_i)),
            grid=(pl.cdiv(n, tn), meta.group_ids.shape[0], k // tk),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
        name="moe_tune_quantized_gmm",
    ), *args, interpret=interpret)
    return out[:m]


def _tgmm_kernel(group_ids, tile_ids, starts, ends, num_visits, lhs_t_ref, scale_t_ref, dout_ref, out_ref,
                 acc_ref, *, plan: QuantPlan, tm, tk):
    k_i, visit = pl.program_id(1), pl.program_id(2)
    group = group_ids[visit]
    first = (visit == 0) | (group != group_ids[jnp.maximum(visit - 1, 0)])
    last = (visit == num_visits[0] - 1) | (group != group_ids[jnp.minimum(visit + 1, group_ids.shape[0] - 1)])

    @pl.when(first)
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(visit < num_visits[0])
    def _accumulate():
        d = dout_ref[...].astype(jnp.float32)
        d = jnp.where(_rows_of_group(group_ids, tile_ids, starts, ends, visit, tm, d.shape, 0), d, 0.0)
        keep = _rows_of_group(group_ids, tile_ids, starts, ends, visit, tm, (1, tm), 1)
        if plan.a.scale is not Apply.DEQUANTIZE:  # float32 products (`QuantPlan.float32_dots`)
            x = jnp.where(keep, _values(lhs_t_ref, slice(None), slice(None), plan.a.dtype).astype(jnp.float32), 0.0)
            acc_ref[...] += _dot(x, d)
            return
        for rows, x in _dequantized_row_blocks(lhs_t_ref, scale_t_ref, k_i, tk, plan.a.block, plan.a.dtype):
            acc_ref[rows, :] += _dot(jnp.where(keep, x, 0.0), d)

    @pl.when(last & (visit < num_visits[0]))
    def _store():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def quantized_tgmm(lhs: jax.Array, lhs_scale: jax.Array | None, dout: jax.Array, group_sizes: jax.Array, *,
                   tiling: tuple[int, int, int], out_dtype: jnp.dtype, num_groups: int,
                   group_offset: jax.Array | None, interpret: bool) -> jax.Array:
    """tgmm with 1-byte lhs values: lhs [m, k] (int8 / fp8) with lhs_scale None or f32 [m, k/bs]
    (sub-channel; a per-row scale is folded into dout first), dout [m, n] -> [num_groups, k, n] in
    out_dtype, float32 products and accumulation. Empty groups come out zero."""
    tm, tk, tn = tiling
    m, k = lhs.shape
    n = dout.shape[1]
    # Megablox's layout: lhs^T [k, m], so that a block [tk, tm] feeds the matmul unit untransposed.
    lhs_t, dout = pad_to(lhs, 0, tm).T, pad_to(dout, 0, tm)
    scale_t = None if lhs_scale is None else pad_to(lhs_scale, 0, tm).T
    meta = make_group_metadata(group_sizes, m=dout.shape[0], tm=tm, groups=num_groups,
                               group_offset=0 if group_offset is None else group_offset)
    specs = [pl.BlockSpec((tk, tm), lambda n_i, k_i, v, gid, tid, *_: (k_i, tid[v]))]
    if scale_t is not None:
        specs.append(pl.BlockSpec((scale_t.shape[0], tm), lambda n_i, k_i, v, gid, tid, *_: (0, tid[v])))
    specs.append(pl.BlockSpec((tm, tn), lambda n_i, k_i, v, gid, tid, *_: (tid[v], n_i)))
    plan = tgmm_plan(lhs, lhs_scale, dout).kernel_plan()
    kernel = with_absent_refs(functools.partial(_tgmm_kernel, plan=plan, tm=tm, tk=tk),
                              5, [True, scale_t is not None, True])
    args = (meta.group_ids, meta.tile_ids, meta.group_starts, meta.group_ends, meta.num_visits[None],
            *[x for x in (lhs_t, scale_t, dout) if x is not None])
    out = pallas_run(pl.pallas_call(
        kernel,
        out_shape=out_struct((num_groups, k, n), out_dtype, *args),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            in_specs=specs,
            out_specs=pl.BlockSpec((None, tk, tn), lambda n_i, k_i, v, gid, *_: (gid[v], k_i, n_i)),
            grid=(pl.cdiv(n, tn), pl.cdiv(k, tk), meta.group_ids.shape[0]),
            scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
        name="moe_tune_quantized_tgmm",
    ), *args, interpret=interpret)
    # Groups without rows have no visit, so their blocks were never written.
    nonempty = meta.group_ends > meta.group_starts
    return jnp.where(nonempty[:, None, None], out, jnp.zeros((), out.dtype))
