"""The MoE layer across devices: experts split over one mesh axis (expert parallelism, EP), the intermediate
dimension over another (tensor parallelism, TP), with JAX's `shard_map` as the engine.

`moe_mlp(..., expert_axis=, tensor_axis=)` inside the caller's `jax.shard_map` runs here (`layer`);
`sharded_moe_mlp` (in `moe.py`, beside `moe_mlp`) wraps it in a `shard_map` for global arrays. Strategies (`ep_strategy`):

- `all_gather`: every device gathers the tokens' rows and routing over `expert_axis`, runs its own experts'
  rows (`ragged_gather` over their [start, end), the grouped matmuls or the fused kernels,
  `ragged_gather_reduce`), and the partial outputs are reduce-scattered (`psum_scatter`) back to the tokens'
  devices.
- `all_to_all`: entries sent to their experts' devices and back (`exchange.py`).
- `in_kernel`: the same entries and routing, the rows moved by remote DMA inside Pallas TPU kernels
  (`in_kernel.py`): TPU, and interpret mode off accelerators.

`ShardingConfig.token_chunks` C > 1 (an `ep_strategy` config, or the tables' choice) runs a device's t tokens
as C consecutive chunks of t / C (C must divide t), each its own exchange, experts and combine under either
strategy, the outputs concatenated: XLA may then overlap one chunk's collectives with another's grouped
matmuls (MaxText's num_moe_token_chunks). Every kernel of a chunk looks its config up under the chunk's local
shapes (t / C tokens). `ShardingConfig.exchange` picks the all-to-all's implementation (`exchange.py`),
`ShardingConfig.row_tile` the row tile of in_kernel's fused kernels (0: their VMEM rules' largest,
`in_kernel_rules`).
`ShardingConfig.wire` "fp8" sends the dispatched rows as float8_e4m3fn with their scales under either
strategy, straight into the gate/up grouped matmuls (`wire.py`); it needs rows to send (not with
`tokens_replicated`) and the unfused experts (not with `fused=True`).

Tokens replicated over `expert_axis` (`tokens_replicated=True`: decode, where every device of the axis holds
the same batch) are served without gathering: each device runs its experts' entries and the partial outputs
are summed (`psum`). With `tensor_axis`, each device's down projection is a partial sum over its slice of the
intermediate dimension; the outputs are summed (`psum`) over `tensor_axis`.

`capacity_factor` c caps the entries one device receives from one token chunk at `ceil(c x t / C x top_k)`
(t: the tokens one device holds, C its token chunks; `ceil(c x t x top_k)` in one piece); the rule (rank in
(global token, k) order among the chunk's entries bound for that device) is `exchange.keep_mask`'s and the
same under both strategies. `return_stats=True` returns `(out, stats)`, stats = {"dropped": int32, the
entries dropped over the whole expert axis and every chunk; "entries": their total}; with a capacity and the
`moe_tune.layer.sharded` logger enabled for INFO when the layer is traced, each call also logs the count
(from the first device of the mesh axes).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp

from moe_tune.core import devices as _devices
from moe_tune.core.errors import UsageError
from moe_tune.layer import exchange, in_kernel
from moe_tune.layer import wire as wire_rows
from moe_tune.layer.exchange import STRATEGIES
from moe_tune.layer.fused_layer import serve_or_train
from moe_tune.layer.fusion_choice import use_fused
from moe_tune.layer.sharding_choice import (
    ShardingConfig,
    config_for,
    default_sharding,
    layer_config_error,
)

_log = logging.getLogger(__name__)


def resolve_strategy(ep_strategy: str | ShardingConfig | None, *, tokens: int, hidden: int, intermediate: int,
                     experts: int, top_k: int, ep: int, tp: int, dtype: Any, tokens_replicated: bool,
                     platform: str, weights: tuple = ()) -> ShardingConfig:
    """The config one call runs (strategy, token chunks, exchange): a `ShardingConfig` when given (checked
    for these `tokens` on `platform`); a strategy name with the tokens in one piece and the platform's
    exchange; None: the default (`sharding_choice.default_sharding`: `all_to_all` where the platform has a
    ragged all-to-all, only the routed rows travel; `all_gather` elsewhere, the fixed-capacity all-to-all
    moves worst-case buffers). Tokens replicated over the expert axis need no exchange: the strategy then
    only names how the partial outputs are combined, and both serve alike.
    The one place a measured choice per (layer, mesh) answers from: None with tokens split over an expert
    axis of 2 or more devices asks the tables' `moe_sharding` entry for these local shapes, mesh and the
    quantization of `weights` (this device's w_gate, w_up, w_down; `sharding_choice.config_for`), else the
    default."""
    if ep_strategy is None:
        if tokens_replicated or ep < 2:
            return default_sharding(platform)
        return config_for(tokens=tokens, hidden=hidden, intermediate=intermediate, experts=experts, top_k=top_k,
                          ep=ep, tp=tp, dtype=dtype, weights=weights)
    if isinstance(ep_strategy, ShardingConfig):
        reason = layer_config_error(ep_strategy, tokens=tokens, platform=platform)
        if reason is not None:
            raise UsageError(f"ep_strategy {ep_strategy.label()}: {reason}")
        return ep_strategy
    if not isinstance(ep_strategy, str) or ep_strategy not in STRATEGIES:
        raise UsageError(f"ep_strategy must be one of {', '.join(STRATEGIES)}, a ShardingConfig or None, got "
                         f"{ep_strategy!r}")
    config = dataclasses.replace(default_sharding(platform), strategy=ep_strategy)
    reason = layer_config_error(config, tokens=tokens, platform=platform)
    if reason is not None:
        raise UsageError(f"ep_strategy {ep_strategy!r}: {reason}")
    return config


def axis_size(axis: str, role: str) -> int:
    """The size of mesh axis `axis` bound by the surrounding shard_map; a UsageError naming `role` when no
    such axis is bound here."""
    if not isinstance(axis, str):
        raise UsageError(f"{role} must be a mesh axis name (a str), got {axis!r}")
    try:
        return int(jax.lax.axis_size(axis))
    except (NameError, KeyError, ValueError):  # JAX's unbound-axis error, by version
        raise UsageError(f"{role} {axis!r} is not a mesh axis bound here: call moe_mlp inside jax.shard_map over "
                         f"a mesh with that axis, or call moe_tune.sharded_moe_mlp on global arrays") from None


def capacity(capacity_factor: float | None, tokens: int, top_k: int) -> int | None:
    """Entries one device may receive from `tokens` tokens per device (one token chunk's):
    `ceil(c x tokens x top_k)`; None (no cap) for None."""
    if capacity_factor is None:
        return None
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or not (
            math.isfinite(capacity_factor) and capacity_factor > 0):
        raise UsageError(f"capacity_factor must be a positive number or None, got {capacity_factor!r}")
    return math.ceil(capacity_factor * tokens * top_k)


def layer(experts_fn, x, weights, chosen, w_gate, w_up, w_down, *, experts: int, expert_axis: str | None,
          tensor_axis: str | None, ep_strategy: str | ShardingConfig | None, capacity_factor: float | None,
          tokens_replicated: bool, return_stats: bool, fused: bool | None, activation, skip_zero_weights: bool,
          flags: dict):
    """`moe_mlp` across devices, after its checks and routing (weights float32 / chosen int32 [t, top_k] of
    this device's tokens): the output [t, d] in x.dtype, with the stats when `return_stats`. The config's
    token chunks run one after another in the program (each its own collectives, kernels and capacity),
    their outputs concatenated and their dropped counts summed."""
    tokens, hidden = x.shape
    top_k = chosen.shape[1]
    local, intermediate = w_gate.shape[0], w_gate.shape[2]
    ep = 1 if expert_axis is None else axis_size(expert_axis, "expert_axis")
    tp = 1 if tensor_axis is None else axis_size(tensor_axis, "tensor_axis")
    if tensor_axis is not None and tensor_axis == expert_axis:
        raise UsageError(f"expert_axis and tensor_axis must be different mesh axes, got {expert_axis!r} twice")
    if local * ep != experts:
        raise UsageError(f"the weights hold {local} experts per device but the router has {experts} over "
                         f"{ep} devices of expert_axis {expert_axis!r}: each device must hold experts / {ep}")
    if expert_axis is None and (ep_strategy is not None or capacity_factor is not None or tokens_replicated):
        raise UsageError("ep_strategy, capacity_factor and tokens_replicated need an expert_axis")
    capacity(capacity_factor, tokens, top_k)  # the factor checked before the config is looked up
    config = resolve_strategy(ep_strategy, tokens=tokens, hidden=hidden, intermediate=intermediate,
                              experts=experts, top_k=top_k, ep=ep, tp=tp, dtype=x.dtype,
                              tokens_replicated=tokens_replicated, platform=_devices.platform(),
                              weights=(w_gate, w_up, w_down))
    chunks = config.token_chunks
    part = tokens // chunks
    cap = capacity(capacity_factor, part, top_k)
    me = jnp.int32(0) if expert_axis is None else jax.lax.axis_index(expert_axis)
    # the same tokens meet other weights on each device of tensor_axis (and of expert_axis when replicated):
    # typed as varying over both, so every kernel's gradient in them is per device, summed by the transpose
    axes = tuple(axis for axis in (expert_axis, tensor_axis) if axis is not None)
    x, weights = exchange.varying(x, axes), exchange.varying(weights, axes)
    options = dict(activation=activation, skip_zero_weights=skip_zero_weights, flags=flags)
    exchanged = config.strategy in ("all_to_all", "in_kernel") and not tokens_replicated and ep > 1
    if exchanged and fused:
        raise UsageError("fused=True runs the experts with the dispatch gather and the combine inside the "
                         f"kernels, which the {config.strategy} strategy does on other devices: pass "
                         "ep_strategy='all_gather' or fused=None")
    exchange_layer = in_kernel.in_kernel_layer if config.strategy == "in_kernel" else exchange.all_to_all_layer
    tiled = {"row_tile": config.row_tile} if config.strategy == "in_kernel" else {}  # its fused kernels' row tile
    if config.wire == "fp8" and fused and ep_strategy is None:  # the tables' choice yields to the caller's fused=True
        config = dataclasses.replace(config, wire="native")
    fp8 = config.wire == "fp8"
    if fp8 and (tokens_replicated or fused):
        raise UsageError(f"ep_strategy {config.label()}: the fp8 wire quantizes the rows sent to other devices and "
                         "feeds them to the unfused grouped matmuls; "
                         + ("replicated tokens send none: pass wire='native'" if tokens_replicated else
                            "the fused kernels take float rows: pass fused=None or wire='native'"))
    if fp8:  # the unfused experts (fused=None's choice is not asked), gate/up fed the fp8 rows
        options["wire"], fused = "fp8", False

    def run(x, weights, chosen):  # one token chunk: its exchange, experts and combine
        if exchanged:
            return exchange_layer(x, weights, chosen, w_gate, w_up, w_down, axis=expert_axis, devices=ep, me=me,
                                  cap=cap, ragged=config.exchange == "ragged", **options, **tiled)
        return _gathered(experts_fn, x, weights, chosen, w_gate, w_up, w_down, axis=expert_axis,
                         replicated=tokens_replicated, me=me, experts=experts, cap=cap, fused=fused, **options)

    if chunks == 1:
        out, dropped = run(x, weights, chosen)
    else:
        pieces = [run(*(a[c * part:(c + 1) * part] for a in (x, weights, chosen))) for c in range(chunks)]
        out = jnp.concatenate([piece for piece, _ in pieces], axis=0)
        dropped = sum(count for _, count in pieces)
    entries = tokens * top_k * (1 if tokens_replicated else ep)
    if tensor_axis is not None:
        out = jax.lax.psum(out, tensor_axis)
    if expert_axis is not None:
        dropped = jax.lax.psum(dropped, expert_axis)
    if cap is not None and _log.isEnabledFor(logging.INFO):
        first = me == 0 if tensor_axis is None else (me == 0) & (jax.lax.axis_index(tensor_axis) == 0)
        jax.debug.callback(_log_drops, dropped, first, entries=entries, factor=capacity_factor, cap=cap,
                           chunks=chunks)
    if not return_stats:
        return out
    return out, {"dropped": dropped, "entries": jnp.int32(entries)}


def _log_drops(dropped, first, *, entries: int, factor: float, cap: int, chunks: int) -> None:
    if bool(first):
        per = "per device" if chunks == 1 else f"per device in each of {chunks} token chunks"
        _log.info("moe_mlp capacity_factor %s (%d entries %s): %d of %d (token, k) entries dropped",
                  factor, cap, per, int(dropped), entries)


def _gathered(experts_fn, x, weights, chosen, w_gate, w_up, w_down, *, axis, replicated: bool, me, experts: int,
              cap: int | None, fused, activation, skip_zero_weights: bool, flags: dict, wire: str = "native"):
    """The all_gather strategy (and replicated tokens): every device runs its experts' entries of all the
    axis's tokens; the partial outputs are reduce-scattered (summed, for replicated tokens) over `axis`.
    `wire` "fp8": x is gathered as fp8 rows with their scales inside `wire.gathered_experts`."""
    local = w_gate.shape[0]
    if axis is not None and not replicated:
        weights, chosen = (jax.lax.all_gather(a, axis, tiled=True) for a in (weights, chosen))
        x = x if wire == "fp8" else jax.lax.all_gather(x, axis, tiled=True)
    tokens, top_k = chosen.shape
    entries = tokens * top_k
    flat = chosen.reshape(entries)
    offset = me * local
    mine = (flat >= offset) & (flat < offset + local)
    dropped = jnp.int32(0)
    key = flat
    if cap is not None:  # the same rule as exchange.keep_mask: rank in (global token, k) order
        over = mine & (jnp.cumsum(mine.astype(jnp.int32)) > cap)
        dropped = jnp.sum(over.astype(jnp.int32))
        key = jnp.where(over, experts, flat)  # sorted past every expert: outside this device's rows
    entry_of_row = jnp.argsort(key, stable=True).astype(jnp.int32)
    row_of_entry = jnp.zeros((entries,), jnp.int32).at[entry_of_row].set(jnp.arange(entries, dtype=jnp.int32))
    group_sizes = jnp.bincount(key, length=experts + 1)[:experts].astype(jnp.int32)
    offset_arg = None if axis is None else offset.astype(jnp.int32)
    if wire == "fp8":
        out = wire_rows.gathered_experts(x, weights, w_gate, w_up, w_down, entry_of_row, row_of_entry, group_sizes,
                                         offset.astype(jnp.int32), axis=axis, top_k=top_k, activation=activation,
                                         skip_zero_weights=skip_zero_weights, flags=flags)
        return jax.lax.psum_scatter(out, axis, scatter_dimension=0, tiled=True), dropped
    serve, train = (use_fused(fused, tokens=tokens, hidden=x.shape[1], intermediate=w_gate.shape[2],
                              experts=experts, local=local, top_k=top_k, dtype=x.dtype,
                              weights=(w_gate, w_up, w_down), distribution=flags["distribution"],
                              direction=direction) for direction in ("fwd", "bwd"))

    def run(use, *operands):
        return experts_fn(use, *operands, top_k=top_k, activation=activation,
                          skip_zero_weights=skip_zero_weights, flags=flags)

    out = serve_or_train(run, serve, train, x, weights, w_gate, w_up, w_down, entry_of_row, row_of_entry,
                         group_sizes, offset_arg)
    if axis is not None:
        out = jax.lax.psum(out, axis) if replicated else jax.lax.psum_scatter(out, axis, scatter_dimension=0,
                                                                              tiled=True)
    return out, dropped
