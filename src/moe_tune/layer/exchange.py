"""The `all_to_all` strategy of the MoE layer across devices: each (token, k) entry travels to the device that
holds its expert, runs there, and travels back to its token's device for the weighted combine.

On the token's device the entries are sorted by global expert, which is the order (destination device,
local expert): one segment per global expert, so the receiver gets one segment per (peer, local expert) and
lays them out in (local expert, peer) order, which is expert order; no second sort is needed. Inside a
segment the entries keep their (token, k) order, so a receiver's rows are ordered by (local expert, global
token, k), global token = peer x local tokens + token.

Two exchanges carry the rows (`ShardingConfig.exchange`): `ragged`, `jax.lax.ragged_all_to_all`, sending
exactly the rows, only where the platform has it (TPU, GPU; XLA:CPU does not); and `fixed`, everywhere, a
fixed-capacity `jax.lax.all_to_all` of [devices, chunk, hidden] buffers, chunk = the most rows one device can
send to one peer, rearranged into the same expert order with plain gathers.

Capacity (`cap`, entries one device may receive): an entry is kept when its rank among all the entries bound
for its destination device, in (global token, k) order, is below `cap`; the rest are dropped whole (never
sent, weight 0 in the combine, the token's other entries not renormalized). The `all_gather` strategy applies
the same rule, so both strategies drop the same entries.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_tune.core import devices
from moe_tune.kernels.gather.op import ragged_gather, ragged_gather_reduce
from moe_tune.kernels.ragged_dot.op import ragged_dot
from moe_tune.layer import wire as wire_rows

# The layer's ways of splitting experts over devices (`sharded.py`): all_gather there, all_to_all here,
# in_kernel (the exchange inside Pallas TPU kernels) in `in_kernel.py`.
STRATEGIES = ("all_gather", "all_to_all", "in_kernel")

RAGGED_ALL_TO_ALL_PLATFORMS = ("tpu", "gpu")  # XLA:CPU does not implement ragged_all_to_all


def has_ragged_all_to_all(platform: str | None = None) -> bool:
    """Whether `platform` (None: the judged one) runs `jax.lax.ragged_all_to_all`; the fixed-capacity
    exchange runs everywhere."""
    return (devices.platform() if platform is None else platform) in RAGGED_ALL_TO_ALL_PLATFORMS


def worst_rows(tokens: int, top_k: int, devices: int, local: int) -> int:
    """The most (token, k) entries one device can receive when nothing is dropped: each of `devices` peers
    sends at most `tokens x min(top_k, local)` (a token's top_k experts are distinct, and at most `local` of
    them live on one device), so `tokens x top_k x min(devices, local / top_k)` in all (MaxText's bound,
    local tokens x min(EP, E / top_k) x top_k with E = devices x local)."""
    return devices * tokens * min(top_k, local)


def _exclusive(counts: jax.Array, axis: int) -> jax.Array:
    return jnp.cumsum(counts, axis=axis) - counts


def keep_mask(dest: jax.Array, *, axis: str, devices: int, me: jax.Array, cap: int) -> jax.Array:
    """bool [entries]: which of this device's (token, k) entries (`dest`: their destination devices, in
    (token, k) order) are within their destination's capacity `cap`, counting the entries of the peers
    before this one (their tokens come first) and then this device's own in (token, k) order."""
    entries = dest.shape[0]
    per_dest = jnp.bincount(dest, length=devices).astype(jnp.int32)
    before = _exclusive(jax.lax.all_gather(per_dest, axis), 0)[me]  # [devices]: earlier peers' entries to each
    order = jnp.argsort(dest, stable=True)
    rank_sorted = jnp.arange(entries, dtype=jnp.int32) - _exclusive(per_dest, 0)[dest[order]]
    rank = jnp.zeros((entries,), jnp.int32).at[order].set(rank_sorted)
    return before[dest] + rank < cap


def _varies_over(value: jax.Array) -> frozenset:
    """The manual mesh axes `value` varies over under shard_map's check_vma types (`vma`, or
    `manual_axis_type.varying` in the JAX versions that name it so); empty outside shard_map."""
    aval = jax.typeof(value)
    axes = getattr(aval, "vma", None)
    if axes is None:
        axes = getattr(getattr(aval, "manual_axis_type", None), "varying", ())
    return frozenset(axes)


def varying(value: jax.Array, axes) -> jax.Array:
    """`value` typed as varying over the mesh axes `axes` (its transpose sums the gradient over them).
    Unchanged where it varies over them already."""
    missing = tuple(sorted(set(axes) - _varies_over(value)))
    if not missing:
        return value
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(value, missing, to="varying")
    return jax.lax.pvary(value, missing)


def _varying_like(buffer: jax.Array, reference: jax.Array) -> jax.Array:
    """`buffer` typed as varying over the mesh axes `reference` varies over (a fresh zeros buffer is
    invariant; `ragged_all_to_all` wants its output argument typed like its operand under check_vma)."""
    return varying(buffer, _varies_over(reference))


class _Plan:
    """The segment bookkeeping of one exchange, all int32: `counts` [devices, experts] (every device's
    entries per global expert), this device's `send` [experts] and `recv` [devices, local] (what each peer
    sends for each local expert), where the received segments lie (`recv_offset` [devices, local], expert
    order) and the receiver's group sizes (`group_sizes` [local])."""

    def __init__(self, send: jax.Array, *, axis: str, me: jax.Array, devices: int, local: int):
        self.send, self.devices, self.local = send, devices, local
        self.counts = jax.lax.all_gather(send, axis)  # [devices (sender), experts]
        self.recv = jax.lax.dynamic_slice_in_dim(self.counts, me * local, local, axis=1)
        self.group_sizes = jnp.sum(self.recv, axis=0)
        self.recv_offset = _exclusive(self.group_sizes, 0)[None, :] + _exclusive(self.recv, 0)
        self.send_offset = _exclusive(send, 0)
        totals = jnp.sum(self.counts, axis=0).reshape(devices, local)
        # where this device's segment for expert (q, e) lands on q: q's recv_offset[me, e]
        self.land_offset = (_exclusive(totals, 1).reshape(-1) + _exclusive(self.counts, 0)[me])
        # where the segment (peer p, local expert e) returns to on p: p's send_offset of expert (me, e)
        self.home_offset = jax.lax.dynamic_slice_in_dim(_exclusive(self.counts, 1), me * local, local, axis=1)


def _ragged_there(rows, plan: _Plan, rows_out: int, axis: str) -> jax.Array:
    out = _varying_like(jnp.zeros((rows_out,) + rows.shape[1:], rows.dtype), rows)
    return jax.lax.ragged_all_to_all(rows, out, plan.send_offset, plan.send, plan.land_offset,
                                     plan.recv.reshape(-1), axis_name=axis)


def _ragged_back(rows, plan: _Plan, rows_out: int, axis: str) -> jax.Array:
    out = _varying_like(jnp.zeros((rows_out,) + rows.shape[1:], rows.dtype), rows)
    return jax.lax.ragged_all_to_all(rows, out, plan.recv_offset.reshape(-1), plan.recv.reshape(-1),
                                     plan.home_offset.reshape(-1), plan.send, axis_name=axis)


class _Slots:
    """The fixed-capacity exchange's slot maps: send slot (q, s) carries this device's row
    `per_dest_start[q] + s` when s < rows for q; received slot (p, s) lands on receive row `land[p, s]`
    (`rows_in` where the slot is empty)."""

    def __init__(self, plan: _Plan, chunk: int, rows_in: int):
        devices, local = plan.devices, plan.local
        s = jnp.arange(chunk, dtype=jnp.int32)
        per_dest = jnp.sum(plan.send.reshape(devices, local), axis=1)
        self.send_row = _exclusive(per_dest, 0)[:, None] + s[None, :]  # [devices, chunk]
        self.send_valid = s[None, :] < per_dest[:, None]
        ends = jnp.cumsum(plan.recv, axis=1)  # [devices, local]: inclusive ends of each peer's segments
        expert = jnp.sum(s[None, :, None] >= ends[:, None, :], axis=2)  # [devices, chunk]
        self.recv_valid = expert < local
        expert = jnp.minimum(expert, local - 1)
        rank = s[None, :] - jnp.take_along_axis(ends - plan.recv, expert, axis=1)
        land = jnp.take_along_axis(plan.recv_offset, expert, axis=1) + rank
        self.land = jnp.where(self.recv_valid, land, rows_in)
        self.chunk, self.rows_in = chunk, rows_in


def _fixed_there(rows, plan: _Plan, slots: _Slots, axis: str) -> jax.Array:
    devices, chunk, width = plan.devices, slots.chunk, rows.shape[1]
    buffer = jnp.take(rows, slots.send_row.reshape(-1), axis=0, mode="fill", fill_value=0)
    buffer = jnp.where(slots.send_valid.reshape(-1, 1), buffer, 0).reshape(devices, chunk, width)
    got = jax.lax.all_to_all(buffer, axis, 0, 0).reshape(devices * chunk, width)
    slot_of_row = jnp.full((slots.rows_in,), devices * chunk, jnp.int32).at[slots.land.reshape(-1)].set(
        jnp.arange(devices * chunk, dtype=jnp.int32), mode="drop")
    return jnp.take(got, slot_of_row, axis=0, mode="fill", fill_value=0)


def _fixed_back(rows, plan: _Plan, slots: _Slots, rows_out: int, dest_of_row, axis: str) -> jax.Array:
    devices, chunk, width = plan.devices, slots.chunk, rows.shape[1]
    buffer = jnp.take(rows, slots.land.reshape(-1), axis=0, mode="fill", fill_value=0)
    buffer = jnp.where(slots.recv_valid.reshape(-1, 1), buffer, 0).reshape(devices, chunk, width)
    got = jax.lax.all_to_all(buffer, axis, 0, 0).reshape(devices * chunk, width)
    row = jnp.arange(rows_out, dtype=jnp.int32)
    slot = dest_of_row * chunk + row - slots.send_row[:, 0][dest_of_row]
    return jnp.take(got, slot, axis=0, mode="fill", fill_value=0)  # rows past those sent read past the end


class Route(NamedTuple):
    """One device's routed entries, as both exchanging strategies send them: `key` int32 [entries] (each
    (token, k) entry's global expert, `devices x local` for a dropped one), `entry_of_row` / `row_of_entry`
    int32 [entries] (the stable sort by key and its inverse: send order is expert order, dropped entries
    last), `sent` int32 (entries sent), `valid` bool [entries] (kept entries) and the exchange's `_Plan`."""

    key: jax.Array
    entry_of_row: jax.Array
    row_of_entry: jax.Array
    sent: jax.Array
    valid: jax.Array
    plan: _Plan


def route(chosen, *, axis: str, devices: int, me, cap: int | None, local: int) -> Route:
    """chosen int32 [t, top_k] (global experts of this device's tokens) -> its `Route`: the capacity rule of
    `keep_mask` where `cap` is given, and the plan's all_gather of every device's per-expert counts."""
    tokens, top_k = chosen.shape
    experts, entries = devices * local, tokens * top_k
    flat = chosen.reshape(entries)
    keep = None if cap is None else keep_mask(flat // local, axis=axis, devices=devices, me=me, cap=cap)
    key = flat if keep is None else jnp.where(keep, flat, experts)  # dropped entries sort last, never sent
    entry_of_row = jnp.argsort(key, stable=True).astype(jnp.int32)
    row_of_entry = jnp.zeros((entries,), jnp.int32).at[entry_of_row].set(jnp.arange(entries, dtype=jnp.int32))
    send = jnp.bincount(key, length=experts + 1)[:experts].astype(jnp.int32)
    plan = _Plan(send, axis=axis, me=me, devices=devices, local=local)
    valid = jnp.ones((entries,), bool) if keep is None else keep
    return Route(key, entry_of_row, row_of_entry, jnp.sum(send), valid, plan)


def receive_rows(tokens: int, top_k: int, devices: int, local: int, cap: int | None) -> int:
    """Rows of one device's receive buffer: `worst_rows`, or the capacity `cap` when that is fewer."""
    rows = worst_rows(tokens, top_k, devices, local)
    return rows if cap is None else min(rows, cap)


def local_experts(rows, group_sizes, w_gate, w_up, w_down, *, activation, distribution) -> jax.Array:
    """The three grouped matmuls on rows already in local-expert order (rows past sum(group_sizes) give 0),
    in rows' dtype (the dtype they travel back in)."""
    gate = ragged_dot(rows, w_gate, group_sizes, distribution=distribution)
    up = ragged_dot(rows, w_up, group_sizes, distribution=distribution)
    out = ragged_dot(activation(gate) * up, w_down, group_sizes, distribution=distribution)
    return out.astype(rows.dtype)


def all_to_all_layer(x, weights, chosen, w_gate, w_up, w_down, *, axis: str, devices: int, me, cap: int | None,
                     ragged: bool, activation, skip_zero_weights: bool, flags: dict,
                     wire: str = "native") -> tuple[jax.Array, jax.Array]:
    """x [t, d] (this device's tokens), weights float32 / chosen int32 [t, top_k] (their routing), this
    device's local experts' weights -> ([t, d] in x.dtype: the layer's output for these tokens, summed over
    every device's experts; int32: how many of these tokens' entries were dropped). `wire` "fp8": the rows
    go out as float8_e4m3fn values with their float32 scales, one message a row (`wire.pack`), through the
    same exchange, and come back in x.dtype."""
    tokens, top_k = chosen.shape
    local = w_gate.shape[0]
    entries = tokens * top_k
    routed = route(chosen, axis=axis, devices=devices, me=me, cap=cap, local=local)
    key, entry_of_row, row_of_entry, sent, plan = (routed.key, routed.entry_of_row, routed.row_of_entry,
                                                   routed.sent, routed.plan)
    rows_in = receive_rows(tokens, top_k, devices, local, cap)
    distribution = flags["distribution"]
    run = dict(activation=activation, distribution=distribution)
    if ragged:
        there = lambda rows: _ragged_there(rows, plan, rows_in, axis)
    else:
        chunk = tokens * min(top_k, local) if cap is None else min(cap, tokens * min(top_k, local))
        slots = _Slots(plan, chunk, rows_in)
        there = lambda rows: _fixed_there(rows, plan, slots, axis)
    if wire == "fp8":  # x's rows quantized on this device; their fp8 values and scales gathered and sent
        send = lambda a: there(wire_rows.take_rows(a, entry_of_row // top_k, 0, sent))
        done = wire_rows.fp8_experts(x, send, plan.group_sizes, w_gate, w_up, w_down, **run)
    else:
        rows = ragged_gather(x, entry_of_row // top_k, 0, sent, **flags)  # [entries, d] in send order
        done = local_experts(there(rows), plan.group_sizes, w_gate, w_up, w_down, **run)
    if ragged:
        back = _ragged_back(done, plan, entries, axis)
    else:
        dest_of_row = jnp.minimum(key[entry_of_row] // local, devices - 1)
        back = _fixed_back(done, plan, slots, entries, dest_of_row, axis)
    out = ragged_gather_reduce(back, row_of_entry, weights.reshape(entries), routed.valid, top_k,
                               skip_zero_weights=skip_zero_weights, **flags)
    return out.astype(x.dtype), (entries - sent).astype(jnp.int32)
