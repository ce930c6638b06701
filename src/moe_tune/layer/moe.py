"""`moe_mlp`: a whole routed-expert MoE block built from moe-tune's tuned kernels.

route (softmax, top-k) -> sort the (token, k) entries by expert -> `ragged_gather` (dispatch) -> three
`ragged_dot`s (gate, up, down) -> `dense_gather_reduce` weighted by the top-k weights (combine). With
`expert_offset` the weights hold one expert-parallel shard's experts: only that shard's rows are gathered
and multiplied, the combine is a `ragged_gather_reduce` over the shard's valid entries, and the result is this shard's
partial sum (add the shards' outputs, e.g. with a psum).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from moe_tune.core import contexts
from moe_tune.core.errors import UsageError
from moe_tune.kernels.fused_moe.activations import ACTIVATIONS
from moe_tune.layer.fusion_choice import use_fused
from moe_tune.layer import sharded
from moe_tune.layer.fused_layer import fused_experts, serve_or_train
from moe_tune.kernels.gather.op import dense_gather_reduce, ragged_gather, ragged_gather_reduce
from moe_tune.kernels.ragged_dot.op import ragged_dot
from moe_tune.kernels.ragged_dot.problem import int_scalar
from moe_tune.core.quant import AsQArray, QArray


def route(router_logits: jax.Array, top_k: int, *, renormalize: bool = True) -> tuple[jax.Array, jax.Array]:
    """Softmax over experts, then the top_k: (weights float32 [tokens, top_k], experts int32 [tokens, top_k]).
    `renormalize` rescales each token's top_k weights to sum to 1 (Mixtral, Qwen3-MoE)."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def moe_mlp(
    x: jax.Array,
    router_logits: jax.Array,
    w_gate: jax.Array | QArray | AsQArray,
    w_up: jax.Array | QArray | AsQArray,
    w_down: jax.Array | QArray | AsQArray,
    top_k: int,
    *,
    expert_offset: jax.Array | int | None = None,
    renormalize: bool = True,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.silu,
    skip_zero_weights: bool = False,
    ragged_gather_fallback: bool | None = None,
    ragged_gather_reduce_fallback: bool | None = None,
    distribution: str | None = None,
    fused: bool | None = None,
    expert_axis: str | None = None,
    tensor_axis: str | None = None,
    ep_strategy: str | sharded.ShardingConfig | None = None,
    capacity_factor: float | None = None,
    tokens_replicated: bool = False,
    return_stats: bool = False,
) -> jax.Array:
    """A gated-MLP MoE block: `out[t] = sum_k w[t,k] * down_e(act(gate_e(x[t])) * up_e(x[t]))`, e = expert k
    of token t. Differentiable in x, router_logits and the three weights.

    Args:
      x: [tokens, hidden].
      router_logits: [tokens, experts] (all experts, also under expert parallelism).
      w_gate, w_up: [local_experts, hidden, intermediate]; w_down: [local_experts, intermediate, hidden].
        Each may be a `QArray` (scaled along its axis 1, the contracting one: a constant, no gradient) or an
        `AsQArray` (quantization-aware training: straight-through gradient); the gathers stay float.
      top_k: experts per token.
      expert_offset: first expert of this shard when local_experts < experts (int32 scalar, may be traced);
        None means every expert is local.
      renormalize, activation: see `route`; the activation of the gate projection (SiLU).
      skip_zero_weights, ragged_gather_fallback, ragged_gather_reduce_fallback: passed to the gather ops.
      distribution: the routing (`balanced`, `skewed`, ...) every kernel's table lookup assumes; None: the
        `moe_tune.use_distribution` block around the call, else $MOE_TUNE_DISTRIBUTION, else `balanced`.
      fused: run the experts on the fused kernels (`kernels/fused_moe/layer.py`: the dispatch gather inside
        the gate/up grouped matmul, the combine inside the down projection's epilogue; no [tokens x top_k,
        hidden] buffers) or unfused; None: the tables' measured choice for this layer's shape (`moe_fusion`).
      expert_axis, tensor_axis: inside `jax.shard_map`, the mesh axes the experts and the intermediate
        dimension are split over (`layer/sharded.py`): x is this device's tokens, the weights this device's
        [experts / EP, ..., intermediate / TP] shard, and the result the whole layer's output for x.
      ep_strategy, capacity_factor, tokens_replicated, return_stats: with `expert_axis` (`layer/sharded.py`):
        `all_gather` or `all_to_all` (tokens in one piece, the platform's exchange), or a whole
        `moe_tune.layer.sharding_choice.ShardingConfig` (strategy; token_chunks C, dividing tokens: C chunks
        of tokens / C, each its own exchange, experts and combine; exchange `fixed` or, on TPU and GPU,
        `ragged`), None: `sharded.resolve_strategy` (the tables' choice); a cap of `ceil(c x tokens / C x
        top_k)` entries per device and token chunk (None: nothing dropped), tokens the same on every device
        of `expert_axis` (decode), and `(out, {"dropped", "entries"})` returned instead of out.

    Returns:
      [tokens, hidden] in x.dtype: this shard's experts' contribution (all of it without expert_offset).
    """
    if getattr(x, "ndim", None) != 2:
        raise UsageError(f"x must be [tokens, hidden], got {getattr(x, 'shape', type(x).__name__)}")
    tokens, hidden = x.shape
    if getattr(router_logits, "ndim", None) != 2 or router_logits.shape[0] != tokens:
        raise UsageError(f"router_logits must be [tokens, experts] = [{tokens}, E], got "
                         f"{getattr(router_logits, 'shape', type(router_logits).__name__)}")
    experts = router_logits.shape[-1]
    shapes = {name: getattr(w, "shape", type(w).__name__) for name, w in
              (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down))}
    if any(not isinstance(shape, tuple) or len(shape) != 3 for shape in shapes.values()):
        raise UsageError("expert weights must be [local_experts, k, n] arrays, QArrays or AsQArrays, got "
                         + ", ".join(f"{name} {shape}" for name, shape in shapes.items()))
    local = w_gate.shape[0]
    if w_up.shape != w_gate.shape or w_down.shape != (local, w_gate.shape[2], hidden) or w_gate.shape[1] != hidden:
        raise UsageError(f"expert weights disagree: w_gate {w_gate.shape}, w_up {w_up.shape}, w_down {w_down.shape}"
                         f" for hidden {hidden}")
    if not isinstance(top_k, (int, np.integer)) or isinstance(top_k, bool) or not 0 < top_k <= experts:
        raise UsageError(f"top_k must be a Python int in [1, {experts}], got {top_k!r}")
    if isinstance(activation, str) and activation in ACTIVATIONS:
        activation = ACTIVATIONS[activation][0]  # a known name: the fused kernels take it by name too
    elif not callable(activation):
        raise UsageError(f"activation must be a callable or one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    across = expert_axis is not None or tensor_axis is not None
    if across and expert_offset is not None:
        raise UsageError("expert_offset is not taken with expert_axis or tensor_axis: the mesh axes place the experts")
    if not across and (ep_strategy is not None or capacity_factor is not None or tokens_replicated or return_stats):
        raise UsageError("ep_strategy, capacity_factor, tokens_replicated and return_stats need an expert_axis "
                         "(moe_mlp inside jax.shard_map, or moe_tune.sharded_moe_mlp)")
    if not across and expert_offset is None and local != experts:
        raise UsageError(f"the weights hold {local} experts but the router {experts}: pass expert_offset")
    distribution = contexts.distribution_for_call(distribution)  # checked now, and the same for every kernel
    flags = {"ragged_gather_fallback": ragged_gather_fallback,
             "ragged_gather_reduce_fallback": ragged_gather_reduce_fallback, "distribution": distribution}

    weights, chosen = route(router_logits, top_k, renormalize=renormalize)
    if across:
        return sharded.layer(_experts, x, weights, chosen, w_gate, w_up, w_down, experts=experts, expert_axis=expert_axis,
                             tensor_axis=tensor_axis, ep_strategy=ep_strategy, capacity_factor=capacity_factor,
                             tokens_replicated=tokens_replicated, return_stats=return_stats, fused=fused,
                             activation=activation, skip_zero_weights=skip_zero_weights, flags=flags)
    entries = tokens * top_k
    flat_expert = chosen.reshape(entries)
    entry_of_row = jnp.argsort(flat_expert, stable=True).astype(jnp.int32)  # expert-ordered row -> entry
    row_of_entry = jnp.zeros((entries,), jnp.int32).at[entry_of_row].set(jnp.arange(entries, dtype=jnp.int32))
    group_sizes = jnp.bincount(flat_expert, length=experts).astype(jnp.int32)

    offset = None if expert_offset is None else int_scalar(expert_offset, "expert_offset")
    # fused=None: the measured choice for the forward, and where the layer is differentiated the one measured
    # forward+backward (`moe_fusion` direction bwd: a training step's layer)
    serve, train = (use_fused(fused, tokens=tokens, hidden=hidden, intermediate=w_gate.shape[2], experts=experts,
                              local=local, top_k=top_k, dtype=x.dtype, weights=(w_gate, w_up, w_down),
                              distribution=distribution, direction=direction) for direction in ("fwd", "bwd"))
    run = functools.partial(_experts, top_k=top_k, activation=activation, skip_zero_weights=skip_zero_weights,
                            flags=flags)
    return serve_or_train(run, serve, train, x, weights, w_gate, w_up, w_down, entry_of_row, row_of_entry,
                          group_sizes, offset)


def _experts(fused: bool, x, weights, w_gate, w_up, w_down, entry_of_row, row_of_entry, group_sizes, offset, *,
             top_k: int, activation, skip_zero_weights: bool, flags: dict) -> jax.Array:
    """`moe_mlp`'s experts after routing, fused or not: weights float32 [tokens, top_k]; entry_of_row int32
    [tokens x top_k] (expert-ordered row -> (token, k) entry), row_of_entry its inverse, group_sizes int32
    [experts], offset the shard's first expert (None: all local) -> [tokens, hidden] in x.dtype."""
    entries, local = entry_of_row.shape[0], w_gate.shape[0]
    distribution = flags["distribution"]
    if fused:
        return fused_experts(x, entry_of_row // top_k, weights.reshape(entries)[entry_of_row], group_sizes, offset,
                             w_gate, w_up, w_down, activation=activation, skip_zero_weights=skip_zero_weights,
                             distribution=distribution)
    ends = jnp.cumsum(group_sizes)
    start = jnp.int32(0) if offset is None else ends[offset] - group_sizes[offset]
    end = ends[-1] if offset is None else ends[offset + local - 1]
    rows = ragged_gather(x, entry_of_row // top_k, start, end, **flags)  # [entries, hidden], expert order
    gate = ragged_dot(rows, w_gate, group_sizes, group_offset=offset, distribution=distribution)
    up = ragged_dot(rows, w_up, group_sizes, group_offset=offset, distribution=distribution)
    expert_out = ragged_dot(activation(gate) * up, w_down, group_sizes, group_offset=offset,
                            distribution=distribution)
    combine = dict(skip_zero_weights=skip_zero_weights, **flags)
    if offset is None:  # every expert is local: every entry is valid (the tensor-parallel combine)
        out = dense_gather_reduce(expert_out, row_of_entry, weights.reshape(entries), top_k, **combine)
    else:
        valid = (row_of_entry >= start) & (row_of_entry < end)
        out = ragged_gather_reduce(expert_out, row_of_entry, weights.reshape(entries), valid, top_k, **combine)
    return out.astype(x.dtype)  # as the fused path: float32 weights would promote a bfloat16 x's expert outputs


def weight_spec(w, name: str, spec: tuple, mesh) -> Any:
    """The shard_map spec of one expert weight (`spec` for its values): a QArray's scale is split like its
    values along an axis where it has one scale per value, kept whole where it has one scale for the whole
    axis (the same for every slice), and split by blocks where whole blocks fall on each device. `spec` names
    the logical axes; an "nk" QArray's stored arrays get it with their last two axes swapped."""
    if isinstance(w, QArray):
        spec = spec if w.layout == "kn" else (*spec[:-2], spec[-1], spec[-2])
        scale_spec = []
        for dim, (value, scale, axis) in enumerate(zip(w.qvalue.shape, w.scale.shape, spec)):
            parts = 1 if axis is None else mesh.shape[axis]
            if scale == value or scale % parts == 0:
                scale_spec.append(axis)
            elif scale == 1:
                scale_spec.append(None)
            else:
                raise UsageError(f"{name}: its {scale} scale blocks along axis {dim} do not split over the "
                                 f"{parts} devices of mesh axis {axis!r}")
        return QArray(P(*spec), P(*scale_spec), w.layout)
    if isinstance(w, AsQArray):
        return jax.tree_util.tree_map(lambda _: P(*spec), w)
    return P(*spec)


def sharded_moe_mlp(x, router_logits, w_gate, w_up, w_down, top_k: int, *, mesh, expert_axis: str = "expert",
                    tensor_axis: str | None = None, tokens_replicated: bool = False, return_stats: bool = False,
                    **moe_mlp_options):
    """`moe_mlp` on global arrays over `mesh`: x [T, d] and router_logits [T, E] split by tokens over
    `expert_axis` (whole on every device with `tokens_replicated=True`), w_gate / w_up [E, d, f] and w_down
    [E, f, d] split by experts over `expert_axis` and by f over `tensor_axis` (QArrays with their scales).
    Returns [T, d] split like x (and the stats, replicated, with `return_stats=True`). The other options are
    `moe_mlp`'s (ep_strategy, capacity_factor, fused, activation, ...)."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise UsageError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    for role, axis in (("expert_axis", expert_axis), ("tensor_axis", tensor_axis)):
        if axis is not None and axis not in mesh.shape:
            raise UsageError(f"{role} {axis!r} is not an axis of the mesh (axes: {', '.join(mesh.axis_names)})")
    if "expert_offset" in moe_mlp_options:
        raise UsageError("sharded_moe_mlp places the experts itself: expert_offset is not taken")
    ep = mesh.shape[expert_axis]
    tp = 1 if tensor_axis is None else mesh.shape[tensor_axis]
    tokens = getattr(x, "shape", (None,))[0]
    if not tokens_replicated and tokens is not None and tokens % ep:
        raise UsageError(f"x's {tokens} tokens do not split over the {ep} devices of expert_axis {expert_axis!r}")
    experts = getattr(w_gate, "shape", (None,))[0]
    if experts is not None and experts % ep:
        raise UsageError(f"the {experts} experts do not split over the {ep} devices of expert_axis {expert_axis!r}")
    intermediate = getattr(w_gate, "shape", (None,) * 3)[-1]
    if intermediate is not None and intermediate % tp:
        raise UsageError(f"the intermediate dimension {intermediate} does not split over the {tp} devices of "
                         f"tensor_axis {tensor_axis!r}")
    token_spec = P() if tokens_replicated else P(expert_axis)
    in_specs = (token_spec, token_spec, weight_spec(w_gate, "w_gate", (expert_axis, None, tensor_axis), mesh),
                weight_spec(w_up, "w_up", (expert_axis, None, tensor_axis), mesh),
                weight_spec(w_down, "w_down", (expert_axis, tensor_axis, None), mesh))
    out_specs = (token_spec, {"dropped": P(), "entries": P()}) if return_stats else token_spec

    def body(x, router_logits, w_gate, w_up, w_down):
        return moe_mlp(x, router_logits, w_gate, w_up, w_down, top_k, expert_axis=expert_axis,
                       tensor_axis=tensor_axis, tokens_replicated=tokens_replicated, return_stats=return_stats,
                       **moe_mlp_options)

    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(
        x, router_logits, w_gate, w_up, w_down)
