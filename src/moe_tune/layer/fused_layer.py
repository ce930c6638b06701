"""The expert part of `moe_mlp` on the fused kernels: `gather_gmm` (dispatch, gate and up as one grouped
matmul, the activation in its epilogue) then `gmm_combine` (down projection, weighted sum into the tokens).

Against the unfused layer (`ragged_gather` -> gate, up -> activation -> down -> gather-reduce) it writes
neither the gathered rows [tokens x top_k, hidden] nor the expert outputs [tokens x top_k, hidden], and the
gate and up products come out of one kernel."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from moe_tune.core.errors import UsageError
from moe_tune.kernels.fused_moe.activations import activation_name
from moe_tune.kernels.fused_moe.op import gather_gmm, gmm_combine, parts_error
from moe_tune.core.quant import AsQArray, QArray


def can_fuse(w_gate, w_up, w_down) -> str | None:
    """Why the fused path cannot run these expert weights, or None: quantization-aware weights (`AsQArray`)
    take the unfused path, whose ragged_dot owns their straight-through gradient, and so do a gate and up
    that one dispatch cannot read as parts (`op.parts_error`: a float one and a QArray, two quantized dtypes
    or scale blocks), which the unfused path runs as two ragged_dots."""
    if any(isinstance(w, AsQArray) for w in (w_gate, w_up, w_down)):
        return "AsQArray (quantization-aware) weights run unfused"
    error = parts_error([w_gate, w_up], None)
    return None if error is None else f"gate and up: {error}"


def fused_experts(
    x: jax.Array,
    token_of_row: jax.Array,
    row_weights: jax.Array,
    group_sizes: jax.Array,
    offset: jax.Array | None,
    w_gate: jax.Array | QArray,
    w_up: jax.Array | QArray,
    w_down: jax.Array | QArray,
    *,
    activation: Callable[[jax.Array], jax.Array],
    skip_zero_weights: bool,
    distribution: str | None = None,
) -> jax.Array:
    """x [tokens, hidden], token_of_row int32 [tokens x top_k] (expert order), row_weights float32 [same] (each
    row's top-k weight), group_sizes int32 [experts], offset: the shard's first expert or None; the weights
    as `moe_mlp` takes them -> [tokens, hidden] in x.dtype, this shard's experts' weighted sum.

    A known activation (`activations.ACTIVATIONS`) runs in the dispatch kernel's epilogue; any other callable
    runs after it on the [rows, 2 x expert width] product."""
    reason = can_fuse(w_gate, w_up, w_down)
    if reason is not None:
        raise UsageError(f"fused=True: {reason}; pass fused=False or None")
    glu = activation_name(activation)
    options = {} if distribution is None else {"distribution": distribution}
    h = gather_gmm(x, token_of_row, (w_gate, w_up), group_sizes, group_offset=offset, glu=glu, **options)
    if glu is None:
        f = w_gate.shape[2]
        h = (activation(h[:, :f]) * h[:, f:]).astype(x.dtype)
    return gmm_combine(h, w_down, group_sizes, token_of_row, row_weights, x.shape[0], group_offset=offset,
                       skip_zero_weights=skip_zero_weights, **options)


def serve_or_train(run: Callable[..., jax.Array], serve: bool, train: bool, *args) -> jax.Array:
    """`run(serve, *args)`; where the result is differentiated, the value and VJP of `run(train, *args)`
    instead: the forward's measured choice for inference, the forward+backward one for a training step.

    The same choice: a plain call. Different ones: a custom VJP whose forward rule (traced only under reverse
    differentiation) runs the training choice and keeps its pullback as the residual; forward-mode (`jax.jvp`)
    of such a layer is not supported (pass `fused=` explicitly there)."""
    if serve == train:
        return run(serve, *args)

    @jax.custom_vjp
    def layer(*operands):
        return run(serve, *operands)

    def forward(*operands):
        return jax.vjp(functools.partial(run, train), *operands)

    layer.defvjp(forward, lambda pullback, cotangent: pullback(cotangent))
    return layer(*args)
