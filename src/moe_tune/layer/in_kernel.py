"""The `in_kernel` strategy of the MoE layer across devices: the token exchange inside Pallas Mosaic TPU kernels
by remote DMA (`in_kernel_gmm` for the dispatch, fused with the gate/up matmul; `in_kernel_return` for the
return, fused into the down projection's epilogue), so the program holds no XLA all-to-all or all-gather of
token rows; only int32 metadata goes through XLA collectives.

One call, per device of the expert axis (P devices, `local` experts each):

1. Routing, as the `all_to_all` strategy's (`exchange.route`): this device's (token, k) entries sorted by
   global expert, which is the order (destination device, local expert), the capacity rule of
   `exchange.keep_mask` (entries past a device's capacity are never sent), and one `all_gather` of every
   device's per-expert counts (int32 [P, experts], `exchange._Plan`): from it each device knows where each of
   its segments lands in its owner's receive buffer and how many rows every peer sends it.
2. Dispatch and gate/up (`in_kernel_gmm.dispatch_gate_up`, one collective kernel): every device starts the DMAs
   of its sent rows, read straight from x (no gathered copy), at the kernel's first grid step, walking them in
   (local expert, destination device) order, into the owner's receive buffer [rows_in, d], laid out like the
   `all_to_all` strategy's: expert order (local expert, then source device). rows_in is the worst case
   (`exchange.worst_rows`), or the capacity when one is given. The same kernel runs the gate/up grouped
   matmul (the fused kernels' visit schedule, glu epilogue in float32, float or quantized weights) over that
   buffer, waiting before an expert's first visit for that expert's rows only (counts from the metadata):
   the matmul of expert 0 runs while the rows of experts 1, 2, ... are in flight.
   Fallback (`fused_refusal`): an activation the fused epilogue does not know by name, no tile of either fused
   kernel within the chip's scoped VMEM (`in_kernel_rules`), or metadata past the kernel's SMEM budget (three
   int32 per entry), runs the dispatch as `scatter_rows` and the unfused
   experts (`exchange.local_experts`) after it, where no matmul starts before the whole exchange has landed.
3. Down projection and return (`in_kernel_return.down_return`, one collective kernel): the down grouped
   matmul over the gate/up kernel's output, and in the epilogue of every visit each finished output row DMAed
   from VMEM straight back to its token's device, at the position that device sent it from (send order); the
   weighted combine there (`ragged_gather_reduce`, dropped entries selected away).
   In the fallback both ways are `scatter_rows` (dispatch before, return after `exchange.local_experts`).

Gradients: a `jax.custom_vjp` whose backward is the `all_to_all` strategy's backward (the pullback of
`exchange.all_to_all_layer` on the same inputs, recomputed: the fixed-capacity exchange, or the ragged one
where the platform has it), so the backward moves its rows with XLA collectives; the forward's output and the
`all_to_all` strategy's agree up to accumulation order.

Where it runs: TPU (compiled), and off accelerators in Pallas TPU interpret mode (the host devices of a
`jax.shard_map`; slow, for tests). GPU is refused (`sharding_choice.layer_config_error`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moe_tune.core.errors import UsageError
from moe_tune.kernels.fused_moe.activations import activation_name
from moe_tune.kernels.gather.op import ragged_gather_reduce
from moe_tune.kernels.pallas_util import round_up
from moe_tune.layer import exchange, in_kernel_gmm, in_kernel_return
from moe_tune.layer.in_kernel_return import down_return
from moe_tune.layer.in_kernel_tpu import DISPATCH_ID, RETURN_ID, scatter_rows

PLATFORMS = ("tpu", "cpu")  # TPU compiled; CPU in Pallas TPU interpret mode


def fused_refusal(x, w_gate, w_down, glu: str | None, rows_in: int, top_k: int, row_tile: int = 0) -> str | None:
    """Why the two fused kernels cannot serve this device's layer at `row_tile` (0: the rules' largest), or None:
    `in_kernel_gmm.refusal`, then `in_kernel_return.refusal` for the rows the gate/up kernel hands it."""
    reason = in_kernel_gmm.refusal(x, w_gate, glu, rows_in, top_k, row_tile)
    if reason is not None:
        return reason
    tm = in_kernel_gmm.gate_up_tiles(x, w_gate, rows_in, row_tile)[0]
    return in_kernel_return.refusal(round_up(rows_in, tm), w_down, x.dtype, row_tile)


def _forward(x, weights, chosen, w_gate, w_up, w_down, *, axis: str, devices: int, me, cap: int | None,
             activation, skip_zero_weights: bool, flags: dict, row_tile: int = 0):
    """The layer through the fused kernels (or, refused, the two `scatter_rows` kernels):
    `exchange.all_to_all_layer`'s contract. `row_tile`: both fused kernels' row tile (0: the rules' largest);
    one the rules refuse where another tile fits is a UsageError, not a silent fallback."""
    tokens, top_k = chosen.shape
    local = w_gate.shape[0]
    entries = tokens * top_k
    route = exchange.route(chosen, axis=axis, devices=devices, me=me, cap=cap, local=local)
    plan = route.plan
    rows_in = exchange.receive_rows(tokens, top_k, devices, local, cap)
    # dispatch: the segment of global expert g (send rows [send_offset[g], + send[g]), expert order) lands at
    # land_offset[g] on g's device; each row read from x at its token
    experts = jnp.arange(devices * local, dtype=jnp.int32)
    there = (plan.send_offset, plan.send, experts // local, plan.land_offset)
    mine = jax.lax.dynamic_slice_in_dim(plan.send, me * local, local)  # rows this device keeps
    received_total = jnp.sum(plan.group_sizes)
    from_others = received_total - jnp.sum(mine)
    kernel = functools.partial(scatter_rows, axis=axis, devices=devices)
    glu = activation_name(activation)
    reason = fused_refusal(x, w_gate, w_down, glu, rows_in, top_k, row_tile)
    if reason is not None and row_tile and fused_refusal(x, w_gate, w_down, glu, rows_in, top_k) is None:
        raise UsageError(f"ep_strategy 'in_kernel': {reason}: pass a smaller row_tile, or 0 (the rules' largest)")
    if reason is None:
        h = in_kernel_gmm.dispatch_gate_up(x, route, w_gate, w_up, rows_in=rows_in, top_k=top_k, activation=glu,
                                           axis=axis, devices=devices, me=me, row_tile=row_tile)
        back = down_return(h, w_down, route, entries=entries, axis=axis, devices=devices, out_dtype=x.dtype,
                           row_tile=row_tile)
    else:
        received = kernel(x, there, from_others, rows_in, src_row=route.entry_of_row // top_k,
                          collective_id=DISPATCH_ID)
        done = exchange.local_experts(received, plan.group_sizes, w_gate, w_up, w_down, activation=activation,
                                      distribution=flags["distribution"])
        # return: the received segment (source p, local expert e) at recv_offset[p, e] goes back to p at p's
        # send position of expert (me, e), home_offset[p, e]
        peers = jnp.broadcast_to(jnp.arange(devices, dtype=jnp.int32)[:, None], (devices, local))
        back_segments = tuple(a.reshape(-1) for a in (plan.recv_offset, plan.recv, peers, plan.home_offset))
        back = kernel(done, back_segments, route.sent - jnp.sum(mine), entries, collective_id=RETURN_ID)
    out = ragged_gather_reduce(back, route.row_of_entry, weights.reshape(entries), route.valid, top_k,
                               skip_zero_weights=skip_zero_weights, **flags)
    return out.astype(x.dtype), (entries - route.sent).astype(jnp.int32)


def in_kernel_layer(x, weights, chosen, w_gate, w_up, w_down, *, axis: str, devices: int, me, cap: int | None,
                    ragged: bool, activation, skip_zero_weights: bool, flags: dict,
                    row_tile: int = 0) -> tuple[jax.Array, jax.Array]:
    """x [t, d] (this device's tokens), weights float32 / chosen int32 [t, top_k] (their routing), this
    device's local experts' weights (float or QArray) -> ([t, d] in x.dtype: the layer's output for these
    tokens; int32: how many of these tokens' entries were dropped). Differentiable in x, weights and float
    expert weights through the `all_to_all` strategy's backward (`ragged`: its exchange there). `row_tile`:
    the fused kernels' row tile (`ShardingConfig.row_tile`; 0: the VMEM rules' largest)."""
    del me  # traced outside the custom VJP's functions, which may not close over it: each takes its own
    options = dict(axis=axis, devices=devices, cap=cap, activation=activation, skip_zero_weights=skip_zero_weights,
                   flags=flags)

    def primal(x, weights, chosen, w_gate, w_up, w_down):
        return _forward(x, weights, chosen, w_gate, w_up, w_down, me=jax.lax.axis_index(axis), row_tile=row_tile,
                        **options)

    def exchanged(chosen, x, weights, w_gate, w_up, w_down):
        return exchange.all_to_all_layer(x, weights, chosen, w_gate, w_up, w_down, me=jax.lax.axis_index(axis),
                                         ragged=ragged, **options)

    def forward(*operands):  # the residuals are the operands: the backward recomputes its exchange
        return primal(*operands), operands

    def backward(operands, cotangent):
        x, weights, chosen, *experts = operands
        _, pullback = jax.vjp(functools.partial(exchanged, chosen), x, weights, *experts)
        dx, dweights, *dexperts = pullback(cotangent)
        return (dx, dweights, None, *dexperts)  # None: chosen's (integer) cotangent is zero

    layer = jax.custom_vjp(primal)
    layer.defvjp(forward, backward)
    return layer(x, weights, chosen, w_gate, w_up, w_down)
