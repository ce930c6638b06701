"""Checks of the MoE layer across 8 host devices, run as one process (the device count is fixed when JAX
starts): `python tests/sharded_layer_checks.py [--part I/N] [CASE ...]` prints one JSON object, case name -> result.

Each case runs the layer (inside its own `jax.shard_map` or through `sharded_moe_mlp`) under jit, forward
and, where asked, the gradients in x, router_logits and the float weights, and compares them with a float64
NumPy dense reference that applies the same capacity rule (rank in (global token, k) order among the entries
bound for a device, per token chunk: a `ShardingConfig` with token_chunks C runs each device's tokens as C
chunks, each capped on its own). A result holds the relative errors (max |got - want| / max |want|), the dropped counts
(got and wanted) and the tolerance the dtype allows; tests/test_sharded_layer.py asserts on them.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import contextlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import moe_tune  # noqa: E402
from moe_tune.core.errors import UsageError  # noqa: E402
from moe_tune.layer.sharding_choice import ShardingConfig  # noqa: E402

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 16, 8, 8, 2
COLLECTIVES = ("all_to_all", "all_gather", "reduce_scatter")  # counted in a case's lowered forward
TOLERANCE = {"float32": 2e-5, "bfloat16": 3e-2, "int8": 2e-5, "int8_qat": 2e-5}


def plain_backends() -> contextlib.ExitStack:
    """XLA's ragged dot and the plain-JAX gathers and fused path."""
    stack = contextlib.ExitStack()
    stack.enter_context(moe_tune.use_backend("ragged_dot", "xla"))
    for op in ("ragged_gather", "ragged_gather_reduce", "dense_gather_reduce", "fused_moe"):
        stack.enter_context(moe_tune.use_backend(op, "jax"))
    return stack


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name, axis_index_groups=None):
    """`jax.lax.ragged_all_to_all`'s documented semantics from all-gathers, gathers and a scatter (XLA:CPU
    lacks the op), so the layer's segment offsets run here; NaN everywhere when `recv_sizes` is not what
    the peers send."""
    assert axis_index_groups is None
    devices, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    per = input_offsets.shape[0] // devices
    every = [jax.lax.all_gather(a, axis_name) for a in (operand, input_offsets, send_sizes, output_offsets)]
    peer_rows, starts, sizes, lands = every[0], *(jax.lax.dynamic_slice_in_dim(a, me * per, per, axis=1)
                                                   for a in every[1:])
    r = jnp.arange(operand.shape[0])
    valid = r < sizes[:, :, None]  # [peers, segments, rows]
    source = jnp.minimum(starts[:, :, None] + r, operand.shape[0] - 1)
    values = peer_rows[jnp.arange(devices)[:, None, None], source]
    target = jnp.where(valid, lands[:, :, None] + r, output.shape[0]).reshape(-1)
    result = output.at[target].set(values.reshape((-1,) + operand.shape[1:]), mode="drop")
    return jnp.where(jnp.all(recv_sizes == sizes.reshape(-1)), result, jnp.nan)


@contextlib.contextmanager
def emulated_ragged():
    """The platform taken to have ragged_all_to_all (the layer's default exchange, and `exchange="ragged"`
    accepted), run by `emulated_ragged_all_to_all`."""
    from moe_tune.layer import exchange

    saved = jax.lax.ragged_all_to_all, exchange.has_ragged_all_to_all
    jax.lax.ragged_all_to_all = emulated_ragged_all_to_all
    exchange.has_ragged_all_to_all = lambda platform=None: True
    try:
        yield
    finally:
        jax.lax.ragged_all_to_all, exchange.has_ragged_all_to_all = saved


class Collected(logging.Handler):
    """The layer's INFO log lines (the dropped counts) while the block runs."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self):
        logger = logging.getLogger("moe_tune.layer.sharded")
        self.saved = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        logger = logging.getLogger("moe_tune.layer.sharded")
        logger.removeHandler(self)
        logger.setLevel(self.saved)


def inputs(tokens: int, seed: int = 0, skew_to: int | None = None, top_k: int = TOP_K):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(tokens, HIDDEN))
    logits = rng.normal(size=(tokens, EXPERTS))
    if skew_to is not None:  # every token's top_k: experts [skew_to, skew_to + top_k)
        logits[:, skew_to:skew_to + top_k] += 20.0
    w_gate = rng.normal(size=(EXPERTS, HIDDEN, INTERMEDIATE)) / math.sqrt(HIDDEN)
    w_up = rng.normal(size=(EXPERTS, HIDDEN, INTERMEDIATE)) / math.sqrt(HIDDEN)
    w_down = rng.normal(size=(EXPERTS, INTERMEDIATE, HIDDEN)) / math.sqrt(INTERMEDIATE)
    cotangent = rng.normal(size=(tokens, HIDDEN))
    return x, logits, w_gate, w_up, w_down, cotangent


def capped_order(tokens: int, per_device: int, chunks: int) -> list[list[int]]:
    """The tokens each capacity counts over, in the order it ranks them: per token chunk, the chunk's
    tokens of every device's block of `per_device` (device order, then token order)."""
    part = per_device // chunks
    return [[block * per_device + c * part + j for block in range(tokens // per_device) for j in range(part)]
            for c in range(chunks)]


def reference(x, logits, w_gate, w_up, w_down, cotangent, *, devices: int, cap: int | None, top_k: int = TOP_K,
              per_device: int | None = None, chunks: int = 1):
    """float64: the layer's output, the gradients of sum(out * cotangent) in (x, logits, w_gate, w_up,
    w_down) and the number of (token, k) entries dropped (`cap` per device and token chunk of
    `per_device` / `chunks` tokens)."""
    tokens = x.shape[0]
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    chosen = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]
    picked = np.take_along_axis(probs, chosen, 1)
    total = picked.sum(1, keepdims=True)
    weights = picked / total
    keep = np.ones((tokens, top_k), bool)
    for order in [] if cap is None else capped_order(tokens, per_device or tokens, chunks):
        seen = np.zeros(devices, int)
        for t in order:
            for k in range(top_k):
                dest = chosen[t, k] // (EXPERTS // devices)
                keep[t, k] = seen[dest] < cap
                seen[dest] += 1
    gate = np.einsum("td,tkdf->tkf", x, w_gate[chosen])
    up = np.einsum("td,tkdf->tkf", x, w_up[chosen])
    sig = 1 / (1 + np.exp(-gate))
    act = gate * sig * up
    y = np.einsum("tkf,tkfd->tkd", act, w_down[chosen])
    mw = keep * weights
    out = np.einsum("tk,tkd->td", mw, y)
    dy = mw[:, :, None] * cotangent[:, None, :]
    dweights = keep * np.einsum("tkd,td->tk", y, cotangent)
    dact = np.einsum("tkd,tkfd->tkf", dy, w_down[chosen])
    dup = dact * gate * sig
    dgate = dact * up * (sig + gate * sig * (1 - sig))
    dx = np.einsum("tkf,tkdf->td", dgate, w_gate[chosen]) + np.einsum("tkf,tkdf->td", dup, w_up[chosen])
    grads_w = [np.zeros_like(w) for w in (w_gate, w_up, w_down)]
    for k in range(top_k):
        np.add.at(grads_w[0], chosen[:, k], np.einsum("td,tf->tdf", x, dgate[:, k]))
        np.add.at(grads_w[1], chosen[:, k], np.einsum("td,tf->tdf", x, dup[:, k]))
        np.add.at(grads_w[2], chosen[:, k], np.einsum("tf,td->tfd", act[:, k], dy[:, k]))
    dpicked = (dweights - (dweights * weights).sum(1, keepdims=True)) / total
    dprobs = np.zeros_like(probs)
    np.put_along_axis(dprobs, chosen, dpicked, 1)
    dlogits = probs * (dprobs - (dprobs * probs).sum(1, keepdims=True))
    return out, (dx, dlogits, *grads_w), int((~keep).sum())


def relative(got, want) -> float:
    got = getattr(got, "value", got)  # an AsQArray's gradient is an AsQArray of its value's
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def run_case(*, strategy: str, ep: int, tp: int = 1, dtype: str = "float32", replicated: bool = False,
             grads: bool = True, capacity_factor: float | None = None, skew_to: int | None = None,
             own_shard_map: bool = False, fused: bool | None = False, plain: bool = True,
             ragged: bool = False, quant_block: int | None = None, top_k: int = TOP_K, token_chunks: int = 1,
             exchange: str | None = None, collectives: bool = False) -> dict:
    devices = np.array(jax.devices()[:ep * tp]).reshape(ep, tp)
    mesh = jax.sharding.Mesh(devices, ("expert", "tensor"))
    tensor_axis = "tensor" if tp > 1 else None
    tokens_per_device = 4
    tokens = tokens_per_device * (1 if replicated else ep)
    x, logits, w_gate, w_up, w_down, cotangent = inputs(tokens, skew_to=skew_to, top_k=top_k)
    cap = None if capacity_factor is None else math.ceil(capacity_factor * (tokens_per_device // token_chunks) * top_k)
    weights64 = (w_gate, w_up, w_down)
    float_dtype = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    if dtype in ("int8", "int8_qat"):  # QArrays (constants) or AsQArrays (straight-through gradients)
        quantized = [moe_tune.quantize(jnp.asarray(w, jnp.float32), "int8", axis=1, block_size=quant_block)
                     for w in weights64]
        weights64 = tuple(np.asarray(moe_tune.dequantize(q), np.float64) for q in quantized)
        weights = quantized if dtype == "int8" else [
            moe_tune.AsQArray(jnp.asarray(w, jnp.float32), "int8", block_size=quant_block) for w in weights64]
    else:
        weights = [jnp.asarray(w, float_dtype) for w in weights64]
    want, want_grads, want_dropped = reference(x, logits, *weights64, cotangent, devices=ep, cap=cap, top_k=top_k,
                                               per_device=tokens_per_device, chunks=token_chunks)
    if token_chunks != 1 or exchange is not None:  # a whole config (the fixed exchange unless named)
        strategy = ShardingConfig(strategy=strategy, token_chunks=token_chunks, exchange=exchange or "fixed")
    options = dict(ep_strategy=strategy, capacity_factor=capacity_factor, fused=fused, return_stats=True,
                   tokens_replicated=replicated)
    if own_shard_map:
        token = P() if replicated else P("expert")

        def layer(x, logits, w_gate, w_up, w_down):
            return jax.shard_map(
                lambda *a: moe_tune.moe_mlp(*a, top_k, expert_axis="expert", tensor_axis=tensor_axis, **options),
                mesh=mesh, in_specs=(token, token, P("expert", None, tensor_axis), P("expert", None, tensor_axis),
                                     P("expert", tensor_axis, None)),
                out_specs=(token, {"dropped": P(), "entries": P()}))(x, logits, w_gate, w_up, w_down)
    else:
        def layer(x, logits, w_gate, w_up, w_down):
            return moe_tune.sharded_moe_mlp(x, logits, w_gate, w_up, w_down, top_k, mesh=mesh,
                                            tensor_axis=tensor_axis, **options)

    xs, ls = jnp.asarray(x, float_dtype), jnp.asarray(logits, jnp.float32)
    cot = jnp.asarray(cotangent, jnp.float32)
    logged = Collected()
    with plain_backends() if plain else contextlib.nullcontext(), (
            emulated_ragged() if ragged else contextlib.nullcontext()), logged:
        if grads:  # the forward and the gradients of sum(out * cotangent) from one compile
            argnums = (0, 1) if dtype == "int8" else (0, 1, 2, 3, 4)

            def loss(*a):
                out, stats = layer(*a)
                return jnp.sum(out.astype(jnp.float32) * cot), (out, stats)

            (_, (out, stats)), got = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(
                xs, ls, *weights)
            names = ("dx", "dlogits", "dw_gate", "dw_up", "dw_down")
            result = {names[i]: relative(g, want_grads[i]) for i, g in zip(argnums, got)}
        else:
            out, stats = jax.jit(layer)(xs, ls, *weights)
            result = {}
        result.update({"out": relative(out, want), "dtype_out": str(out.dtype), "dropped": int(stats["dropped"]),
                       "want_dropped": want_dropped, "tolerance": TOLERANCE[dtype]})
        if collectives or token_chunks != 1:  # the forward's collectives, as lowered
            text = jax.jit(layer).lower(xs, ls, *weights).as_text()
            result["collectives"] = {op: len(re.findall(rf"\bstablehlo\.{op}\b", text)) for op in COLLECTIVES}
        jax.effects_barrier()
    result["logged"] = logged.messages
    return result


CASES = {
    "ep8_all_gather_f32": dict(strategy="all_gather", ep=8, collectives=True),
    "ep8_all_to_all_f32": dict(strategy="all_to_all", ep=8, own_shard_map=True, collectives=True),
    "ep4_tp2_all_gather_f32": dict(strategy="all_gather", ep=4, tp=2, own_shard_map=True),
    "ep8_all_to_all_ragged_f32": dict(strategy="all_to_all", ep=8, ragged=True),
    "ep4_tp2_all_to_all_ragged_capacity": dict(strategy="all_to_all", ep=4, tp=2, ragged=True, skew_to=4,
                                               capacity_factor=1.5),
    "ep8_all_gather_fused_f32": dict(strategy="all_gather", ep=8, fused=True, grads=False),
    "replicated_ep4_tp2_f32": dict(strategy="all_gather", ep=4, tp=2, replicated=True),
    "replicated_ep8_all_to_all_f32": dict(strategy="all_to_all", ep=8, replicated=True, own_shard_map=True,
                                          grads=False),
    "ep8_all_gather_bf16": dict(strategy="all_gather", ep=8, dtype="bfloat16"),
    "ep4_tp2_all_to_all_bf16": dict(strategy="all_to_all", ep=4, tp=2, dtype="bfloat16"),
    "ep4_tp2_all_gather_int8": dict(strategy="all_gather", ep=4, tp=2, dtype="int8", quant_block=4),
    "ep8_all_to_all_int8_qat": dict(strategy="all_to_all", ep=8, dtype="int8_qat"),
    "all_to_all_fused_refused": dict(strategy="all_to_all", ep=8, fused=True, grads=False),
    "ep8_all_to_all_int8": dict(strategy="all_to_all", ep=8, dtype="int8"),
    "skew_all_gather": dict(strategy="all_gather", ep=8, skew_to=0, grads=False),
    "skew_all_to_all": dict(strategy="all_to_all", ep=8, skew_to=0, grads=False),
    # top_k 3 over 2 experts per device, skewed to experts 0-2: device 0 receives the worst case, 2 per token
    "skew_top3_all_to_all": dict(strategy="all_to_all", ep=8, skew_to=0, top_k=3),
    "skew_all_gather_capacity": dict(strategy="all_gather", ep=8, skew_to=0, capacity_factor=1.5, fused=True),
    "skew_all_to_all_capacity": dict(strategy="all_to_all", ep=8, skew_to=0, capacity_factor=1.5),
    "skew_replicated_capacity": dict(strategy="all_gather", ep=8, skew_to=0, capacity_factor=0.5,
                                     replicated=True, grads=False),
    # the platform's default kernels (tiled on CPU), fused and unfused, inside the default shard_map
    "ep8_default_backends": dict(strategy=None, ep=8, fused=None, plain=False),
    "ep4_tp2_default_fused": dict(strategy="all_gather", ep=4, tp=2, fused=True, plain=False),
    "ep4_tp2_all_to_all_default_capacity": dict(strategy="all_to_all", ep=4, tp=2, fused=None, plain=False,
                                                capacity_factor=1.5, skew_to=4),
    # token chunks (ShardingConfig): each chunk its own exchange, experts, combine and capacity (factor 1.3:
    # the per-chunk caps, ceil(1.3 x 4 / C x 2), drop other counts than one cap over the whole 4 tokens)
    "ep8_all_gather_chunks2": dict(strategy="all_gather", ep=8, token_chunks=2),
    "ep8_all_to_all_chunks4_fixed": dict(strategy="all_to_all", ep=8, token_chunks=4, exchange="fixed"),
    "skew_all_gather_chunks2_capacity": dict(strategy="all_gather", ep=8, skew_to=0, capacity_factor=1.3,
                                             token_chunks=2),
    "skew_all_to_all_chunks4_capacity": dict(strategy="all_to_all", ep=8, skew_to=0, capacity_factor=1.3,
                                             token_chunks=4, exchange="fixed"),
    "ep4_tp2_all_to_all_ragged_chunks2_capacity": dict(strategy="all_to_all", ep=4, tp=2, ragged=True,
                                                       exchange="ragged", token_chunks=2, skew_to=4,
                                                       capacity_factor=1.3),
}


def refusals() -> dict:
    """sharded_moe_mlp's one-line refusals of arrays that do not split over the mesh: name -> message."""
    x, logits, w_gate, w_up, w_down, _ = inputs(24)
    floats = [jnp.asarray(a, jnp.float32) for a in (x, logits, w_gate, w_up, w_down)]
    blocked = [moe_tune.quantize(w, "int8", axis=1, block_size=4) for w in floats[2:]]
    calls = {
        "tokens": ((8, 1), lambda mesh: moe_tune.sharded_moe_mlp(floats[0][:20], floats[1][:20], *floats[2:],
                                                                  TOP_K, mesh=mesh)),
        "experts": ((3, 1), lambda mesh: moe_tune.sharded_moe_mlp(*floats, TOP_K, mesh=mesh)),
        "intermediate": ((2, 3), lambda mesh: moe_tune.sharded_moe_mlp(*floats[:2], *floats[2:], TOP_K, mesh=mesh,
                                                                        tensor_axis="tensor")),
        "scale_blocks": ((2, 4), lambda mesh: moe_tune.sharded_moe_mlp(*floats[:2], *blocked, TOP_K, mesh=mesh,
                                                                        tensor_axis="tensor")),
    }
    found = {}
    for name, (shape, call) in calls.items():
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:shape[0] * shape[1]]).reshape(shape), ("expert", "tensor"))
        try:
            call(mesh)
            found[name] = None
        except UsageError as error:
            found[name] = str(error)
    return found


def main(names: list[str]) -> None:
    """`CASE ...`: those cases; none: the refusals and every case; `--part I/N`: every N-th of those from the
    I-th (0-based), so N processes run them all between them."""
    part, parts = 0, 1
    if names[:1] == ["--part"]:
        part, parts = map(int, names[1].split("/"))
        names = names[2:]
    results = {}
    for name in (names or ["refusals", *CASES])[part::parts]:
        if name == "refusals":
            results[name] = refusals()
            continue
        try:
            results[name] = run_case(**CASES[name])
        except Exception as error:  # reported, so one failing case does not hide the others
            results[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:400]}"}
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
