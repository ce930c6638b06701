"""The dispatch wire of the MoE layer across devices (`ShardingConfig.wire`): the dtype token rows travel in
to the devices holding their experts.

- `native`: rows travel in the activations' dtype (the layer as it always ran).
- `fp8`: each token row is quantized on its own device to float8_e4m3fn, symmetric absmax (`core.quant`),
  with float32 scales in blocks along hidden by `quant_plan.paired_lhs_block` (the rule the quantized
  ragged_dot already serves for activations meeting weights): the weights' own scale block along k where it
  is sub-channel, else one scale per row. The fp8 values and their scales travel as one float8_e4m3fn
  message a row (`pack`: the scales' bytes behind the values; all_gather: the all_gather of x; all_to_all:
  the fixed or the ragged exchange), are gathered into expert order with XLA's gather (the `ragged_gather`
  kernels take float rows), and the receiving device hands them (`unpack`), as a `QArray` lhs, straight to
  the gate and up grouped matmuls. The bytes a row costs on the wire: hidden + 4 x hidden / block instead of
  hidden x itemsize (about half for bfloat16, a quarter for float32; as compiled for 8 H100s and for
  v5e:2x2: FINDINGS.md, fp8 dispatch wire).

Where the fp8 rows meet the kernel (`kernels/ragged_dot/quant_plan.py`, `quantized.py`): `tiled` (CPU),
`megablox` (TPU: `megablox_quant`) and `triton` (GPU) load the 1-byte blocks as they are and apply the row
scale after the k loop (OUTPUT; per 128-block: STEP), with bfloat16 or float32 weights as the dot's other
dtype (the fp8 values converted exactly per block), with int8 or fp8 weights both in bfloat16
(`quantized.dot_dtypes`); no dequantized copy of the rows is made. Where a backend cannot take a quantized
lhs, the op's own rule applies: `mosaic_gpu` refuses quantized operands (`chip_error`) and the call runs
on the plain-JAX fallback `xla`, which dequantizes both operands (float32) before `lax.ragged_dot_general`;
so does `triton` on a GPU below compute capability 8.9.

Gradients: the wire's rounding is straight-through (a custom VJP: the gradient of identity). The rows'
cotangent is the gate/up dlhs of the weights (what the float rows would get), carried back over the
transpose of the dispatch in the activations' dtype; the weights' gradients are the drhs kernels run on the
fp8 rows that were multiplied. The return path (expert outputs back to the tokens) stays native.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from moe_tune.core.quant import AsQArray, QArray, quantize, scale_layout
from moe_tune.kernels.gather.op import ragged_gather_reduce
from moe_tune.kernels.ragged_dot.op import ragged_dot
from moe_tune.kernels.ragged_dot.quant_plan import paired_lhs_block

WIRES = ("native", "fp8")
WIRE_QDTYPE = "float8_e4m3fn"
# float8_e4m3fn keeps 3 mantissa bits: a rounded row value is within 2**-4 of itself, relative (half an ulp)
FP8_ROUNDING = float(jnp.finfo(jnp.float8_e4m3fn).eps) / 2
# The layer's relative error (max |got - want| / max |want|) a float64 check allows the fp8 wire: the rows'
# rounding enters both the gate and the up product, twice FP8_ROUNDING (the float8 eps, 0.125); measured at
# hidden 8 (no averaging over k): up to 0.06 forward, 0.1 in the gradients (tests/test_fp8_wire.py)
FP8_WIRE_TOLERANCE = 2 * FP8_ROUNDING


def weight_block(w) -> int | None:
    """Elements along k per scale of a `[g, k, n]` expert weight: a QArray's (k: per channel), an
    AsQArray's block (k when None), None for float weights."""
    if isinstance(w, AsQArray):
        return w.block_size or w.shape[1]
    if isinstance(w, QArray):
        axis, block = scale_layout(w)
        return block if axis == 1 else w.shape[1]
    return None


def row_block(hidden: int, w_gate) -> int:
    """Elements of hidden per float32 scale of one fp8 wire row, for rows that meet `w_gate` (and w_up, of
    the same format): `quant_plan.paired_lhs_block`."""
    return paired_lhs_block(hidden, weight_block(w_gate))


def quantize_rows(x: jax.Array, block: int) -> QArray:
    """x [t, d] float -> QArray(values float8_e4m3fn [t, d], scale float32 [t, d / block]): what travels."""
    return quantize(x, WIRE_QDTYPE, axis=1, block_size=block)


def pack(q: QArray) -> jax.Array:
    """The message of quantized rows: values float8_e4m3fn [t, d] and their float32 scales [t, nb] as one
    float8_e4m3fn [t, d + 4 nb] array, each scale's 4 bytes bit-cast behind its row's values: one collective
    per exchange instead of two (FINDINGS.md, fp8 dispatch wire)."""
    scale_bytes = jax.lax.bitcast_convert_type(q.scale, jnp.uint8)  # [t, nb, 4]
    scale_bytes = scale_bytes.reshape(q.scale.shape[0], -1)
    return jnp.concatenate([q.qvalue, jax.lax.bitcast_convert_type(scale_bytes, q.qvalue.dtype)], axis=1)


def unpack(message: jax.Array, hidden: int) -> tuple[jax.Array, jax.Array]:
    """`pack`'s inverse: float8_e4m3fn [r, hidden + 4 nb] -> (values [r, hidden], scale float32 [r, nb]),
    bit for bit (the collectives and gathers between move bytes and never convert them)."""
    scale_bytes = jax.lax.bitcast_convert_type(message[:, hidden:], jnp.uint8)
    scale = jax.lax.bitcast_convert_type(scale_bytes.reshape(message.shape[0], -1, 4), jnp.float32)
    return message[:, :hidden], scale


def take_rows(a: jax.Array, index: jax.Array, start, end) -> jax.Array:
    """[rows, c] of any dtype -> [len(index), c]: row i = a[index[i]] for i in [start, end), 0 elsewhere
    (`ragged_gather`'s contract, for the fp8 rows' messages)."""
    i = jnp.arange(index.shape[0], dtype=jnp.int32)
    rows = jnp.take(a, index, axis=0, mode="fill", fill_value=0)
    return jnp.where(((i >= start) & (i < end))[:, None], rows, jnp.zeros((), a.dtype))


def _dots(lhs, w_gate, w_up, group_sizes, group_offset, *, distribution: str, dtype: str):
    run = functools.partial(ragged_dot, group_offset=group_offset, distribution=distribution,
                            preferred_element_type=dtype)
    return run(lhs, w_gate, group_sizes), run(lhs, w_up, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gate_up(distribution: str, x, values, scale, w_gate, w_up, group_sizes, group_offset, pull_x):
    return _gate_up_fwd(distribution, x, values, scale, w_gate, w_up, group_sizes, group_offset, pull_x)[0]


def _gate_up_fwd(distribution, x, values, scale, w_gate, w_up, group_sizes, group_offset, pull_x):
    rows = QArray(values, scale)  # x itself is not read: it is the operand the straight-through gradient reaches
    out = _dots(rows, w_gate, w_up, group_sizes, group_offset, distribution=distribution, dtype=x.dtype.name)
    return out, (rows, w_gate, w_up, group_sizes, group_offset, pull_x, x[:0])


def _gate_up_bwd(distribution, residuals, cotangents):
    rows, w_gate, w_up, group_sizes, group_offset, pull_x, like = residuals
    dots = functools.partial(_dots, group_sizes=group_sizes, group_offset=group_offset, distribution=distribution,
                             dtype=like.dtype.name)
    # the weights': drhs on the fp8 rows the forward multiplied (nothing runs for QArray weights: constants)
    _, pull_w = jax.vjp(lambda wg, wu: dots(rows, wg, wu), w_gate, w_up)
    dw_gate, dw_up = pull_w(cotangents)
    # the rows': straight through the rounding, the dlhs of the weights (the primal here is zeros: only the
    # pullback is used), then back over the dispatch's transpose to x
    _, pull_rows = jax.vjp(lambda r: dots(r, w_gate, w_up), jnp.zeros_like(rows.qvalue, dtype=like.dtype))
    (drows,) = pull_rows(cotangents)
    (dx,) = pull_x(drows.astype(like.dtype))
    none_if_constant = lambda w, dw: None if isinstance(w, QArray) else dw
    return (dx, None, None, none_if_constant(w_gate, dw_gate), none_if_constant(w_up, dw_up), None, None,
            jax.tree.map(lambda _: None, pull_x))


_gate_up.defvjp(_gate_up_fwd, _gate_up_bwd)


def fp8_gate_up(x: jax.Array, move: Callable[[jax.Array], jax.Array], w_gate, w_up, group_sizes: jax.Array,
                group_offset: jax.Array | None, *, distribution: str) -> tuple[jax.Array, jax.Array]:
    """The gate and up projections of rows dispatched over the fp8 wire: x [t, d] float (this device's
    tokens) is quantized here (`quantize_rows`), `move` (linear in its argument, any dtype: [t, c] ->
    [rows, c] in local-expert order on the receiver, the collectives inside) carries the fp8 rows with their
    scales (`pack`), and the received QArray is the lhs of both grouped matmuls (`group_sizes` / `group_offset` as
    `ragged_dot`'s). Returns (gate, up) [rows, f] in x.dtype; differentiable in x (straight through the
    rounding: x's cotangent is the rows' carried back by `move`'s transpose) and in float / AsQArray
    weights."""
    sent = quantize_rows(jax.lax.stop_gradient(x), row_block(x.shape[1], w_gate))
    values, scale = unpack(move(pack(sent)), x.shape[1])
    # the dispatch's transpose for x's cotangent, built here where the routing it closes over is traced (its
    # forward, on zeros, is dead code)
    _, pull_x = jax.vjp(move, jnp.zeros_like(x))
    return _gate_up(distribution, x, values, scale, w_gate, w_up, group_sizes, group_offset, pull_x)


def fp8_experts(x, move, group_sizes, w_gate, w_up, w_down, *, group_offset=None, activation,
                distribution: str) -> jax.Array:
    """The three grouped matmuls of rows dispatched over the fp8 wire (`fp8_gate_up`), in x.dtype (the
    dtype they travel back in): [rows, d], rows past the local groups 0."""
    gate, up = fp8_gate_up(x, move, w_gate, w_up, group_sizes, group_offset, distribution=distribution)
    out = ragged_dot(activation(gate) * up, w_down, group_sizes, group_offset=group_offset,
                     distribution=distribution, preferred_element_type=x.dtype)
    return out.astype(x.dtype)


def gathered_experts(x, weights, w_gate, w_up, w_down, entry_of_row, row_of_entry, group_sizes, offset, *, axis: str,
                     top_k: int, activation, skip_zero_weights: bool, flags: dict) -> jax.Array:
    """The all_gather strategy's experts over the fp8 wire: x [t, d] this device's tokens (not yet gathered),
    the routing of every device's tokens (weights float32 [T, top_k], entry_of_row / row_of_entry int32
    [T x top_k], group_sizes int32 [experts], offset int32 this device's first expert) -> this device's
    partial output [T, d] in x.dtype (to be reduce-scattered)."""
    local, entries = w_gate.shape[0], entry_of_row.shape[0]
    ends = jnp.cumsum(group_sizes)
    start, end = ends[offset] - group_sizes[offset], ends[offset + local - 1]
    index = entry_of_row // top_k

    def move(a):  # [t, c] of this device -> its experts' rows [entries, c] of every device's tokens
        return take_rows(jax.lax.all_gather(a, axis, tiled=True), index, start, end)

    expert_out = fp8_experts(x, move, group_sizes, w_gate, w_up, w_down, group_offset=offset,
                             activation=activation, distribution=flags["distribution"])
    valid = (row_of_entry >= start) & (row_of_entry < end)
    out = ragged_gather_reduce(expert_out, row_of_entry, weights.reshape(entries), valid, top_k,
                               skip_zero_weights=skip_zero_weights, **flags)
    return out.astype(x.dtype)
