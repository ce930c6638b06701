"""The `in_kernel` strategy's dispatch fused into its gate/up grouped matmul (Pallas Mosaic TPU, interpret mode off
TPU): one collective kernel per device of the expert axis that sends this device's rows to their experts' devices
by remote DMA and multiplies the rows it receives by its local experts' gate and up weights, starting on an
expert's rows as soon as they (not the whole exchange) have arrived.

Every device, at the kernel's first grid step, after the barrier (every peer has entered, so its receive buffer
exists): starts one DMA per sent row, x[src] -> row `dest` of device `dev`'s receive buffer, walking the rows in
(local expert, destination device) order, so that every receiver's expert-0 rows leave every peer first, then
expert 1's, ... A row that stays on this device is a local copy that signals `local_sems.at[e]`; a remote one
signals the sender's `send_sem` and the receiver's `recv_sems.at[e]` (e: the row's local expert on the
receiver). No send is waited for until the last grid step, so the matmuls run while the DMAs are in flight.

The matmul is `pallas_tpu_kernels`' gather_gmm schedule (the Megablox visits, grid (n tiles, visits, k tiles),
its lhs step, accumulation, glu epilogue and quantized weight blocks, imported), over the receive buffer
[m_p, w] (HBM, memory space ANY, the kernel's second output aliased to zeros) laid out in expert order
(local expert, then source device), as the `all_to_all` strategy's. Before the first visit of group e (n tile 0)
the kernel waits for group e's rows: `mine[e]` local copies and `remote[e]` arrivals (the counts from the
exchanged metadata, SMEM). Every visit then DMAs its group's rows of the tile from the receive buffer into a
[tm, w] VMEM scratch (one DMA per row, `gather/pallas_tpu.RowDmaRing`): rows of a tile's next group may still
be in flight at its first visit, so a visit never reuses rows another visit loaded. At the last grid step the
kernel waits for its remote sends; every row it expects has been waited for by then (a non-empty group is visited).

No deadlock: a device waits for expert e only after starting all its sends, so every row any device waits for
has been started by its sender.

Rows travel as 32-bit words (`in_kernel_tpu.as_words`: a bfloat16 [n, d] as uint32 [n, d / 2], the same layout
as the gather_gmm's `pack_halves`, unpacked exactly per k step; other 16-bit dtypes as float32).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from moe_tune.core.errors import UsageError
from moe_tune.kernels.fused_moe.activations import ACTIVATIONS
from moe_tune.kernels.fused_moe.base import kernel_operands, weight_refs, weights_shape
from moe_tune.kernels.fused_moe.pallas_tpu_kernels import (
    accumulate_visit,
    lhs_step,
    weight_scale_layout,
    visit_schedule,
)
from moe_tune.kernels.fused_moe.pallas_tpu_weights import rhs_specs, weight_views
from moe_tune.kernels.gather.pallas_tpu import RowDmaRing
from moe_tune.kernels.pallas_util import (
    out_struct,
    round_up,
    vma_unchecked,
)
from moe_tune.layer import in_kernel_rules, in_kernel_tpu
from moe_tune.layer.in_kernel_rules import LANES, ROW_ALIGN, ROW_TILES
from moe_tune.layer.in_kernel_tpu import SMEM_METADATA_BYTES, as_words

# The barrier semaphore's collective id: the fused return (in_kernel_return.RETURN_GMM_ID) follows this kernel.
DISPATCH_GMM_ID = 9
ROW_DMAS = 16  # row loads from the receive buffer one visit keeps outstanding
# The largest tiles `tiles` tries: rows per tile, contraction per k step, output columns per n tile (the down
# projection's: in_kernel_return.TN_MAX). Within them the VMEM rule (`in_kernel_rules`) picks.
TM, TK_MAX, TN_MAX = max(ROW_TILES), 1024, 2048


def _column_tiles(size: int, cap: int, span: int) -> list[int]:
    """Candidate tiles of a dimension of `size`, largest first: all of it when at most `cap`, then the multiples
    of 128 from `cap` down (`cap` itself when below 128) that divide `span` (the dimension, or the half a packed
    k step reads); all of it when nothing else does."""
    top = cap if cap < LANES else cap - cap % LANES
    found = ([size] if size <= cap else []) + [t for t in range(top, 0, -LANES) if t < size and span % t == 0]
    return found or [size]


def tiles(rows: int, hidden: int, f: int, packed: bool, tn_max: int = TN_MAX, *,
          fits: Callable[[int, int, int], bool] | None = None, row_tile: int = 0) -> tuple[int, int, int] | None:
    """(tm, tk, tn) for `rows` receive rows, the contraction `hidden` (logical columns) and output width `f`
    (gate/up's; the down projection's is the hidden size, with its own `tn_max`), the largest `fits` accepts
    (`in_kernel_rules`' VMEM rule; None: any), trying tm first, then tn, then tk, each largest first, or None
    when none fits. tm: `row_tile` when given, else the `ROW_TILES` up to `TM`, each capped at the rows rounded
    up to 16; tk all of hidden up to `TK_MAX`, then the multiples of 128 up to it that divide hidden (packed:
    half of it, so a k step reads one half of the words); tn all of f up to `tn_max`, then the multiples of 128
    below it dividing f (f itself when none does)."""
    cap = round_up(max(rows, 1), ROW_ALIGN)
    wanted = [row_tile] if row_tile else [t for t in reversed(ROW_TILES) if t <= TM] or [TM]
    row_tiles = list(dict.fromkeys(min(t, cap) for t in wanted))
    k_tiles = _column_tiles(hidden, TK_MAX, hidden // 2 if packed else hidden)
    n_tiles = _column_tiles(f, tn_max, f)
    for tm in row_tiles:
        for tn in n_tiles:
            for tk in k_tiles:
                if fits is None or fits(tm, tk, tn):
                    return tm, tk, tn
    return None


def gate_up_tiles(x, w_gate, rows_in: int, row_tile: int = 0) -> tuple[int, int, int] | None:
    """The tiles `dispatch_gate_up` runs for activations x [t, d] (or their ShapeDtypeStruct), this device's
    w_gate [local, d, f] (float or QArray) and `rows_in` receive rows: `tiles` under the kernel's VMEM rule."""
    _, hidden, f = weights_shape(w_gate)
    packed = _packs(x)
    need = functools.partial(in_kernel_rules.gate_up_vmem_bytes, word_bytes=hidden * (2 if packed else 4),
                             x_dtype=x.dtype, weights=in_kernel_rules.weight_format(w_gate))
    return tiles(rows_in, hidden, f, packed, fits=in_kernel_rules.fits_vmem(need), row_tile=row_tile)


def _kernel(gid, tid, starts, ends, info, src_ref, dev_ref, dest_ref, counts_ref, x_hbm, zeros_hbm, *refs, axis: str,
            devices: int, local: int, tm: int, tk: int, kc: int, glu: str, dot_dtype, quant_block, packed: bool,
            views):
    """Scalar prefetch (SMEM): gid, tid, starts, ends, info (`pallas_tpu_kernels.visit_schedule`), the sent rows in
    walk order src / dev / dest int32 [n_send], counts int32 [3 local + 1] = (mine [local]: rows this device
    keeps per local expert, remote [local]: rows the others send it, ends [local]: one past the walk's last row
    bound for each local expert, the remote sends' total). Then x_hbm [tokens, w] (HBM), zeros_hbm (the receive
    buffer's initial value, aliased), the weight operands of `views`; outputs o_ref [tm, tn] and recv_hbm
    [m_p, w] (HBM); scratch xbuf [tm, w], two float32 [tm, tn] accumulators, row-load semaphores DMA
    [ROW_DMAS], local_sems / recv_sems DMA [local], send_sem."""
    del zeros_hbm
    weights, (o_ref, recv_hbm, xbuf, acc_gate, acc_up, row_sems, local_sems, recv_sems, send_sem) = weight_refs(
        refs, len(views), quant_block is not None)
    accs = [acc_gate, acc_up]
    j, v, kk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    last = (j == pl.num_programs(0) - 1) & (v == pl.num_programs(1) - 1) & (kk == pl.num_programs(2) - 1)
    me = jax.lax.axis_index(axis)

    @pl.when((j == 0) & (v == 0) & (kk == 0))
    def _():
        in_kernel_tpu.enter_barrier(axis, devices)  # every peer is in the kernel: its buffers exist

        def expert_rows(expert, first):  # the walk's rows bound for local expert `expert` of their devices
            def start(i, carry):
                dev = dev_ref[i]
                src, dst = x_hbm.at[pl.ds(src_ref[i], 1)], recv_hbm.at[pl.ds(dest_ref[i], 1)]

                @pl.when(dev == me)
                def _():
                    pltpu.make_async_copy(src, dst, local_sems.at[expert]).start()

                @pl.when(dev != me)
                def _():
                    pltpu.make_async_remote_copy(src, dst, send_sem, recv_sems.at[expert], device_id={axis: dev},
                                                 device_id_type=pltpu.DeviceIdType.MESH).start()

                return carry

            end = counts_ref[2 * local + expert]
            jax.lax.fori_loop(first, end, start, 0)
            return end

        jax.lax.fori_loop(0, local, expert_rows, jnp.int32(0))

    real = v < info[0]
    group = gid[v]
    row0 = tid[v] * tm
    one_row = (x_hbm.at[pl.ds(0, 1)], recv_hbm.at[pl.ds(0, 1)])  # a wait needs only a descriptor of one row's size

    @pl.when(real & (j == 0) & (kk == 0) & ((v == 0) | (group != gid[jnp.maximum(v - 1, 0)])))
    def _():  # the first visit of the group: its rows from every device, this one included, have landed
        jax.lax.fori_loop(0, counts_ref[group], lambda i, c: (
            pltpu.make_async_copy(*one_row, local_sems.at[group]).wait(), c)[1], 0)
        remote = pltpu.make_async_remote_copy(*one_row, send_sem, recv_sems.at[group], device_id={axis: me},
                                              device_id_type=pltpu.DeviceIdType.MESH)
        jax.lax.fori_loop(0, counts_ref[local + group], lambda i, c: (remote.wait_recv(), c)[1], 0)

    @pl.when(real & (kk == 0))
    def _():  # this visit's rows of the tile (the group's only), from the receive buffer
        lo, hi = jnp.maximum(starts[group], row0), jnp.minimum(ends[group], row0 + tm)
        ring = RowDmaRing(recv_hbm, xbuf.at[pl.ds(0, 1)], row_sems, ROW_DMAS)

        def issue(i, slot):
            ring.start(i, xbuf.at[pl.ds(i - row0, 1)], i - lo, slot)
            return ring.next_slot(slot)

        jax.lax.fori_loop(lo, hi, issue, jnp.int32(0))
        ring.drain(jnp.maximum(hi - lo, 0))
        for acc in accs:
            acc[...] = jnp.zeros(acc.shape, jnp.float32)

    @pl.when(real)
    def _():
        a = lhs_step(xbuf, kk, tk=tk, kc=kc, packed=packed, dtype=dot_dtype)
        accumulate_visit(accs, weights, views, a, j, kk, row_tile=tk, row_index=kk, block=quant_block, dtype=dot_dtype,
                    transpose_rhs=False)

        @pl.when(kk == kc // tk - 1)
        def _():
            out = ACTIVATIONS[glu][0](accs[0][...]) * accs[1][...]
            row = row0 + jax.lax.broadcasted_iota(jnp.int32, out.shape, 0)
            keep = (row >= starts[group]) & (row < ends[group])
            # the tile's other rows: another group's result (its own visit's) or rows never loaded
            o_ref[...] = jnp.where(keep, out.astype(o_ref.dtype), o_ref[...])

    @pl.when(last)
    def _():  # every remote send has left before the kernel ends (the local copies were waited per group)
        send = pltpu.make_async_remote_copy(*one_row, send_sem, recv_sems.at[0], device_id={axis: me},
                                            device_id_type=pltpu.DeviceIdType.MESH)
        jax.lax.fori_loop(0, counts_ref[3 * local], lambda i, c: (send.wait_send(), c)[1], 0)


def _packs(x) -> bool:
    """Whether rows of x travel as packed bfloat16 halves (`as_words`' uint32), else as 32-bit values."""
    return x.dtype == jnp.bfloat16 and x.shape[1] % 2 == 0


def _words(x: jax.Array) -> tuple[jax.Array, bool]:
    """x as the rows the DMAs move, and whether they are packed bfloat16 halves (`as_words`' uint32)."""
    if _packs(x):
        return as_words(x), True
    return (x if x.dtype.itemsize == 4 else x.astype(jnp.float32)), False


def _walk(route, *, devices: int, local: int, me, top_k: int):
    """The sent rows in walk order (local expert, destination device), int32 [entries] each: src (x row), dev,
    dest (row of dev's receive buffer; rows past those sent are never read), and counts int32 [3 local + 1]
    (see `_kernel`)."""
    plan = route.plan
    entries = route.entry_of_row.shape[0]
    row = jnp.arange(entries, dtype=jnp.int32)
    sent_expert = jnp.minimum(route.key[route.entry_of_row], devices * local - 1)  # global expert of send row
    dev, expert = sent_expert // local, sent_expert % local
    dest = plan.land_offset[sent_expert] + row - plan.send_offset[sent_expert]
    order = jnp.argsort(jnp.where(row < route.sent, expert * devices + dev, devices * local), stable=True)
    mine = jax.lax.dynamic_slice_in_dim(plan.send, me * local, local)
    ends = jnp.cumsum(jnp.sum(plan.send.reshape(devices, local), axis=0))
    counts = jnp.concatenate([mine, plan.group_sizes - mine, ends, jnp.reshape(route.sent - jnp.sum(mine), (1,))])
    walk = (route.entry_of_row[order] // top_k, dev[order], dest[order])
    return tuple(a.astype(jnp.int32) for a in walk), counts.astype(jnp.int32)


def refusal(x, w_gate, activation_name: str | None, rows_in: int, top_k: int, row_tile: int = 0) -> str | None:
    """Why the fused dispatch cannot serve a layer (the caller then runs `scatter_rows` and the unfused experts),
    or None: an activation the kernel's epilogue does not know, no tile within the chip's scoped VMEM
    (`in_kernel_rules`) at `row_tile` (0: any), or metadata past `SMEM_METADATA_BYTES`
    (`in_kernel_return.refusal` is the down return's)."""
    if activation_name is None:
        return "an activation the fused epilogue does not know"
    chosen = gate_up_tiles(x, w_gate, rows_in, row_tile)
    if chosen is None:
        at = f" at row_tile {row_tile}" if row_tile else ""
        return f"no tile of its gate/up kernel{at} fits the chip's {in_kernel_rules.vmem_budget() >> 20} MiB of VMEM"
    smem = in_kernel_rules.gate_up_smem_bytes(x.shape[0] * top_k, rows_in, w_gate.shape[0], chosen[0])
    return in_kernel_rules.smem_error(smem, "its int32 metadata")


def dispatch_gate_up(x, route, w_gate, w_up, *, rows_in: int, top_k: int, activation: str, axis: str,
                     devices: int, me, row_tile: int = 0, tile: tuple[int, int, int] | None = None) -> jax.Array:
    """Inside `jax.shard_map` over `axis` (`devices` devices), called by every device of it at once.

    x [t, d] (this device's tokens), `route` (`exchange.route` of their top_k choices), this device's local
    experts' w_gate / w_up [local, d, f] (float, or QArray scaled along d) -> h [m_p, f] in x.dtype (m_p: rows_in
    rounded up to the row tile): activation(rows @ w_gate[e]) * (rows @ w_up[e]) of the rows every device sent
    this one, in expert order (local expert, source device), accumulated in float32 and rounded once; rows past
    sum(group_sizes) are unspecified (the return sends none of them back: no masked copy of h is made). `activation`: a name of
    `fused_moe.activations.ACTIVATIONS`. Tiles: `tile` (tm, tk, tn) as given (the rules' audit compiles tiles
    past them), else `gate_up_tiles` at `row_tile`; a UsageError when none fits."""
    local, hidden, f = weights_shape(w_gate)
    words, packed = _words(x)
    chosen = tile or gate_up_tiles(x, w_gate, rows_in, row_tile)
    if chosen is None:
        raise UsageError(f"ep_strategy 'in_kernel': {refusal(x, w_gate, activation, rows_in, top_k, row_tile)}")
    tm, tk, tn = chosen
    m_p = round_up(rows_in, tm)
    group_sizes = route.plan.group_sizes
    tables = visit_schedule(group_sizes, None, m_padded=m_p, tm=tm, groups=local)
    walk, counts = _walk(route, devices=devices, local=local, me=me, top_k=top_k)
    scalars = (*tables, *walk, counts)
    smem = 4 * sum(a.size for a in scalars)
    if smem > SMEM_METADATA_BYTES:  # `refusal` is the caller's check; this one keeps the kernel honest
        raise UsageError(f"ep_strategy 'in_kernel': {smem / 1024:.0f} KiB of metadata exceed SMEM's budget")
    parts, views = weight_views((w_gate, w_up), glu=activation, transpose_rhs=False, tk=tk, tn=tn)
    rhs, scale = parts[0]
    scale_rows, block = weight_scale_layout(rhs, scale)
    dot_dtype = x.dtype if scale is not None else jnp.promote_types(x.dtype, rhs.dtype)
    zeros = jnp.zeros((m_p, words.shape[1]), words.dtype)
    kernel = functools.partial(_kernel, axis=axis, devices=devices, local=local, tm=tm, tk=tk, kc=hidden,
                               glu=activation, dot_dtype=dot_dtype, quant_block=block, packed=packed, views=views)
    grid = (pl.cdiv(f, tn), tables[0].shape[0], hidden // tk)
    operands = (words, zeros, *kernel_operands(parts))
    any_space = pl.BlockSpec(memory_space=pl.ANY)
    interpret = in_kernel_tpu.interpret_params()
    call = pl.pallas_call(
        kernel,
        out_shape=(out_struct((m_p, f), x.dtype, *scalars, *operands),
                   out_struct((m_p, words.shape[1]), words.dtype, *scalars, *operands)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=grid,
            in_specs=[any_space, any_space,
                      *rhs_specs(views, tk=tk, tn=tn, transpose_rhs=False, scale_rows=scale_rows,
                                 last=tuple(size - 1 for size in grid))],
            out_specs=(pl.BlockSpec((tm, tn), lambda j, v, kk, gid, tid, *_: (tid[v], j)), any_space),
            scratch_shapes=[pltpu.VMEM((tm, words.shape[1]), words.dtype),
                            pltpu.VMEM((tm, tn), jnp.float32), pltpu.VMEM((tm, tn), jnp.float32),
                            pltpu.SemaphoreType.DMA((ROW_DMAS,)), pltpu.SemaphoreType.DMA((local,)),
                            pltpu.SemaphoreType.DMA((local,)), pltpu.SemaphoreType.DMA]),
        input_output_aliases={len(scalars) + 1: 1},  # zeros (after the scalars and x) is the receive buffer
        # the sends started at the first step and xbuf carry state across grid steps: every axis is sequential
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary", "arbitrary"),
                                             collective_id=DISPATCH_GMM_ID, has_side_effects=True),
        interpret=interpret,
        name="moe_tune_dispatch_gate_up",
    )
    # vma_unchecked: as `scatter_rows` (the device index against the kernel's constants)
    h, _ = vma_unchecked(call, *scalars, *operands)
    return h
