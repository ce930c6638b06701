"""The `in_kernel` strategy's return fused into its down projection (Pallas Mosaic TPU, interpret mode off TPU):
one collective kernel per device of the expert axis that multiplies the gate/up kernel's output by its local
experts' down weights and, in the epilogue of every visit, DMAs each finished output row straight back to its
token's device, at the position that device sent the row from (its send order). No output buffer of the down
projection is written to HBM on the expert's device, and no separate exchange runs after it.

The matmul is the Megablox visit schedule of the fused kernels (`pallas_tpu_kernels`: grid (n tiles, visits,
k tiles), h blocks by BlockSpec, float or quantized weight blocks, one float32 accumulator). After a visit's
last k step (group e, row tile [row0, row0 + tm)):

1. the visit's staging slot (two, alternating by grid step) is free once the row DMAs the visit two steps
   earlier started from it have finished (their counts, per slot and kind, in SMEM scratch);
2. the accumulator is rounded to the output dtype and packed into the slot as 32-bit words (`pack_words`);
3. for every source device p (segments (p, e) of the receive layout, expert order), each of the group's rows
   of the tile that came from p is DMAed to row `home[p, e] + rank` of p's output, columns of this n tile: a
   local copy when p is this device, a remote copy otherwise.

Every device first waits at a barrier (each peer has entered the kernel, so its output buffer exists), and at
its last grid step for its own DMAs and for the rows the others return to it: the rows it sent them (counts
from the exchanged metadata), once per n tile. No deadlock: a device waits for arrivals only after issuing all
its own sends, and sends never wait on a receiver. Rows nobody returns (entries dropped by capacity, never
sent) stay zero: the output is aliased to a zeros buffer. The weighted combine runs on the token's device
after the kernel (`ragged_gather_reduce`), where the routing weights are: no weight travels with the rows.

Rows travel as 32-bit words (Mosaic copies single rows of 32-bit arrays only): a bfloat16 output tile [tm, tn]
as uint32 [tm, tn / 2], columns c and c + tn / 2 of the tile in one word (`pack_words`, unpacked per n tile
by `unpack_words`); every other dtype as float32.

Metadata (SMEM): the visit schedule's tables and three int32 per (local expert, device) segment: no per-row
table, so its size does not grow with the tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from moe_tune.core.errors import UsageError
from moe_tune.kernels.fused_moe.base import kernel_operands, weight_refs, weights_shape
from moe_tune.kernels.fused_moe.pallas_tpu_kernels import accumulate_visit, visit_schedule, weight_scale_layout
from moe_tune.kernels.fused_moe.pallas_tpu_weights import rhs_specs, weight_views
from moe_tune.kernels.pallas_util import interpreted, out_struct, round_up, vma_unchecked
from moe_tune.layer import in_kernel_gmm, in_kernel_rules, in_kernel_tpu

# The barrier semaphore's collective id: the kernel follows the fused dispatch (in_kernel_gmm.DISPATCH_GMM_ID).
RETURN_GMM_ID = 10
# The widest n tile `down_tiles` tries: all of the hidden size up to 2048 (one row DMA per returned row at most
# model widths), else multiples of 128 below it that divide it; the VMEM rule (`in_kernel_rules`) picks.
TN_MAX = 2048


def packs(dtype, tn: int) -> bool:
    """Whether output tiles of `tn` columns travel as packed bfloat16 halves (else as float32)."""
    return jnp.dtype(dtype) == jnp.bfloat16 and tn % 2 == 0


def pack_words(out: jax.Array, packed: bool) -> jax.Array:
    """float32 [tm, tn] -> the words a row DMA moves: packed, uint32 [tm, tn / 2] with the bfloat16 rounding of
    column c in the low half and of column c + tn / 2 in the high half (32-bit operations only: a bfloat16 is
    the top half of a float32); else float32 [tm, tn]."""
    if not packed:
        return out
    half = out.shape[1] // 2
    rounded = out.astype(jnp.bfloat16).astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(rounded, jnp.uint32)
    return (bits[:, :half] >> 16) | (bits[:, half:] & jnp.uint32(0xFFFF0000))


def unpack_words(words: jax.Array, dtype, tn: int, packed: bool) -> jax.Array:
    """The inverse of `pack_words`, per n tile: words [rows, d / tn x width] -> [rows, d] in `dtype`."""
    if not packed:
        return words.astype(dtype)
    rows, width = words.shape
    tile = words.reshape(rows * (width // (tn // 2)), tn // 2)
    return in_kernel_tpu.from_words(tile, jnp.bfloat16).reshape(rows, width * 2).astype(dtype)


def down_tiles(rows: int, w_down, out_dtype, row_tile: int = 0, h_dtype=None) -> tuple[int, int, int] | None:
    """The tiles `down_return` runs for `rows` rows of h (in `h_dtype`, default `out_dtype`), this device's
    w_down [local, f, d] (float or QArray) and outputs in `out_dtype`: `in_kernel_gmm.tiles` (contraction f,
    output columns d up to `TN_MAX`) under the kernel's VMEM rule (`in_kernel_rules.down_vmem_bytes`) and whole
    lanes of packed words where Mosaic compiles it (`in_kernel_rules.words_aligned`), at
    `row_tile` (0: any); None when none fits."""
    _, f, d = weights_shape(w_down)
    form = in_kernel_rules.weight_format(w_down)
    h_dtype = out_dtype if h_dtype is None else h_dtype

    def need(tm: int, tk: int, tn: int) -> int:
        return in_kernel_rules.down_vmem_bytes(tm, tk, tn, h_dtype=h_dtype, packed=packs(out_dtype, tn), weights=form)

    within = in_kernel_rules.fits_vmem(need)

    lanes = not interpreted("tpu")  # a Mosaic layout rule: interpret mode copies rows of any width

    def fits(tm: int, tk: int, tn: int) -> bool:
        aligned = not lanes or in_kernel_rules.words_aligned(tn, d, packed=packs(out_dtype, tn))
        return aligned and within(tm, tk, tn)

    return in_kernel_gmm.tiles(rows, f, d, False, tn_max=TN_MAX, fits=fits, row_tile=row_tile)


def refusal(rows: int, w_down, out_dtype, row_tile: int = 0) -> str | None:
    """Why `down_return` cannot serve `rows` rows of h (no tile within the chip's scoped VMEM at `row_tile`,
    0: any), or None (the caller then runs the unfused experts and `scatter_rows`)."""
    if down_tiles(rows, w_down, out_dtype, row_tile) is None:
        at = f" at row_tile {row_tile}" if row_tile else ""
        return f"no tile of its down return{at} fits the chip's {in_kernel_rules.vmem_budget() >> 20} MiB of VMEM"
    return None


def _kernel(gid, tid, starts, ends, info, offset_ref, count_ref, home_ref, expected_ref, h_ref, zeros_hbm, *refs,
            axis: str, devices: int, tm: int, tw: int, k_steps: int, packed: bool, dot_dtype, quant_block, views):
    """Scalar prefetch (SMEM): gid, tid, starts, ends, info (`visit_schedule`); offset / count / home int32
    [local x devices] (segment (e, p) at e x devices + p: its first receive row, its rows, and where they go on
    p); expected int32 [1] (rows this device sent the others). Then h_ref [tm, tk], zeros_hbm (the output's
    initial value, aliased), the weight operands of `views`; output back_hbm [entries, n tiles x tw] (HBM);
    scratch acc float32 [tm, tn], stage [2, tm, tw] words, local_sems / send_sems DMA [2], recv_sem, pending
    int32 [4] (SMEM: per staging slot, its unfinished local and remote row DMAs)."""
    del zeros_hbm
    weights, (back_hbm, acc, stage, local_sems, send_sems, recv_sem, pending) = weight_refs(
        refs, len(views), quant_block is not None)
    j, v, kk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    visits = pl.num_programs(1)
    last = (j == pl.num_programs(0) - 1) & (v == visits - 1) & (kk == k_steps - 1)
    me = jax.lax.axis_index(axis)
    one_row = (stage.at[0, pl.ds(0, 1)], back_hbm.at[pl.ds(0, 1), pl.ds(0, tw)])  # a wait's descriptor: one row

    def local_copy(src, dst, slot):
        return pltpu.make_async_copy(src, dst, local_sems.at[slot])

    def remote_copy(src, dst, slot, dev):
        return pltpu.make_async_remote_copy(src, dst, send_sems.at[slot], recv_sem, device_id={axis: dev},
                                            device_id_type=pltpu.DeviceIdType.MESH)

    def drain(slot):  # the row DMAs started from staging slot `slot` have finished
        jax.lax.fori_loop(0, pending[2 * slot], lambda i, c: (local_copy(*one_row, slot).wait(), c)[1], 0)
        jax.lax.fori_loop(0, pending[2 * slot + 1], lambda i, c: (remote_copy(*one_row, slot, me).wait_send(), c)[1],
                          0)
        pending[2 * slot] = 0
        pending[2 * slot + 1] = 0

    @pl.when((j == 0) & (v == 0) & (kk == 0))
    def _():
        in_kernel_tpu.enter_barrier(axis, devices)  # every peer is in the kernel: its buffers exist
        for i in range(4):
            pending[i] = 0

    real = v < info[0]

    @pl.when(real & (kk == 0))
    def _():
        acc[...] = jnp.zeros(acc.shape, jnp.float32)

    @pl.when(real)
    def _():
        accumulate_visit([acc], weights, views, h_ref[...].astype(dot_dtype), j, kk, row_tile=h_ref.shape[1],
                         row_index=kk, block=quant_block, dtype=dot_dtype, transpose_rhs=False)

    @pl.when(real & (kk == k_steps - 1))
    def _():
        slot = jax.lax.rem(j * visits + v, 2)
        drain(slot)
        stage[slot] = pack_words(acc[...], packed)
        group, row0 = gid[v], tid[v] * tm
        cols = pl.ds(pl.multiple_of(j * tw, tw), tw)

        def source(p, counts):  # the group's rows of this tile that device p sent
            segment = group * devices + p
            first, home = offset_ref[segment], home_ref[segment]
            lo = jnp.maximum(first, row0)
            hi = jnp.minimum(first + count_ref[segment], row0 + tm)
            here = p == me

            def send(r, carry):
                src, dst = stage.at[slot, pl.ds(r - row0, 1)], back_hbm.at[pl.ds(home + r - first, 1), cols]
                pl.when(here)(lambda: local_copy(src, dst, slot).start())
                pl.when(~here)(lambda: remote_copy(src, dst, slot, p).start())
                return carry

            jax.lax.fori_loop(lo, hi, send, 0)
            sent = jnp.maximum(hi - lo, 0)
            return counts[0] + jnp.where(here, sent, 0), counts[1] + jnp.where(here, 0, sent)

        n_local, n_remote = jax.lax.fori_loop(0, devices, source, (jnp.int32(0), jnp.int32(0)))
        pending[2 * slot] = n_local
        pending[2 * slot + 1] = n_remote

    @pl.when(last)
    def _():  # after the last visit's sends: every DMA of this device done, every row returned to it landed
        drain(0)
        drain(1)
        arrivals = expected_ref[0] * pl.num_programs(0)
        jax.lax.fori_loop(0, arrivals, lambda i, c: (remote_copy(*one_row, 0, me).wait_recv(), c)[1], 0)


def down_return(h: jax.Array, w_down, route, *, entries: int, axis: str, devices: int, out_dtype, row_tile: int = 0,
                tile: tuple[int, int, int] | None = None) -> jax.Array:
    """Inside `jax.shard_map` over `axis` (`devices` devices), called by every device of it at once, after
    `in_kernel_gmm.dispatch_gate_up`.

    h [m, f] (the gate/up kernel's output: rows in expert order (local expert, source device), rows past
    sum(group_sizes) never read), w_down [local, f, d] (float, or QArray scaled along f), `route` (this
    device's `exchange.route`), `entries` (tokens x top_k of this device) -> [entries, d] in `out_dtype`: row i
    is the down projection of this device's send-order row i, computed on its expert's device and accumulated
    there in float32 (rounded once to out_dtype); rows never sent (dropped) are zero. Tiles: `tile` (tm, tk,
    tn) as given (the rules' audit compiles tiles past them), else `down_tiles` at `row_tile`; a UsageError
    when none fits."""
    local, f, d = weights_shape(w_down)
    m = h.shape[0]
    chosen = tile or down_tiles(m, w_down, out_dtype, row_tile, h.dtype)
    if chosen is None:
        raise UsageError(f"ep_strategy 'in_kernel': {refusal(m, w_down, out_dtype, row_tile)}")
    tm, tk, tn = chosen
    packed = packs(out_dtype, tn)
    tw = tn // 2 if packed else tn
    word = jnp.uint32 if packed else jnp.float32
    m_p = round_up(m, tm)
    if m_p != m:
        h = jnp.pad(h, ((0, m_p - m), (0, 0)))
    plan = route.plan
    tables = visit_schedule(plan.group_sizes, None, m_padded=m_p, tm=tm, groups=local)
    # segment (e, p) at e x devices + p: the receive layout's (p, e) transposed
    segments = [jnp.transpose(a).reshape(-1).astype(jnp.int32) for a in (plan.recv_offset, plan.recv,
                                                                          plan.home_offset)]
    mine = jax.lax.dynamic_slice_in_dim(plan.send, jax.lax.axis_index(axis) * local, local)
    expected = jnp.reshape(route.sent - jnp.sum(mine), (1,)).astype(jnp.int32)
    scalars = (*tables, *segments, expected)
    parts, views = weight_views(w_down, glu=None, transpose_rhs=False, tk=tk, tn=tn)
    rhs, scale = parts[0]
    scale_rows, block = weight_scale_layout(rhs, scale)
    dot_dtype = h.dtype if scale is not None else jnp.promote_types(h.dtype, rhs.dtype)
    n_tiles = d // tn
    zeros = jnp.zeros((entries, n_tiles * tw), word)
    operands = (h, zeros, *kernel_operands(parts))
    grid = (n_tiles, tables[0].shape[0], f // tk)
    kernel = functools.partial(_kernel, axis=axis, devices=devices, tm=tm, tw=tw, k_steps=f // tk, packed=packed,
                               dot_dtype=dot_dtype, quant_block=block, views=views)
    interpret = in_kernel_tpu.interpret_params()
    call = pl.pallas_call(
        kernel,
        out_shape=out_struct((entries, n_tiles * tw), word, *scalars, *operands),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=grid,
            in_specs=[pl.BlockSpec((tm, tk), lambda j, v, kk, gid, tid, *_: (tid[v], kk)),
                      pl.BlockSpec(memory_space=pl.ANY),
                      *rhs_specs(views, tk=tk, tn=tn, transpose_rhs=False, scale_rows=scale_rows,
                                 last=tuple(size - 1 for size in grid))],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32), pltpu.VMEM((2, tm, tw), word),
                            pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA,
                            pltpu.SMEM((4,), jnp.int32)]),
        input_output_aliases={len(scalars) + 1: 0},  # zeros (after the scalars and h) is the output's buffer
        # staging slots and pending DMAs carry state across grid steps: every axis is sequential
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary", "arbitrary"),
                                             collective_id=RETURN_GMM_ID, has_side_effects=True),
        interpret=interpret,
        name="moe_tune_down_return",
    )
    # vma_unchecked: as `scatter_rows` (the device index against the kernel's constants)
    words = vma_unchecked(call, *scalars, *operands)
    return unpack_words(words, out_dtype, tn, packed)
