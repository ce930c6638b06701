"""Checks of the MoE layer's fp8 dispatch wire across 8 host devices, run as one process (the device count is
fixed when JAX starts): `python tests/fp8_wire_checks.py` prints one JSON object, check name -> result;
tests/test_fp8_wire.py asserts on them.

Each layer case runs `sharded_moe_mlp` with a `ShardingConfig(wire="fp8")` under jit on the platform's
default kernels (the `tiled` ragged_dot takes the fp8 rows as a quantized lhs), forward and the gradients in
x, router_logits and the float weights, against the float64 reference of `sharded_layer_checks.py` (the
weights as the layer holds them: bf16-rounded, or dequantized int8). `hlo` reads the dispatch collectives'
element types off the compiled programs of both wires; `export` lowers the ragged exchange with `jax.export`
for cuda and tpu (XLA:CPU has no ragged_all_to_all to run it).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from sharded_layer_checks import HIDDEN, TOLERANCE, inputs, reference, relative  # noqa: E402

import moe_tune  # noqa: E402
from moe_tune.core.errors import UsageError  # noqa: E402
from moe_tune.layer.sharding_choice import ShardingConfig  # noqa: E402
from moe_tune.layer.wire import FP8_WIRE_TOLERANCE, quantize_rows, row_block  # noqa: E402

EP, TOKENS_PER_DEVICE, TOP_K = 8, 4, 2


def mesh() -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(jax.devices()[:EP]), ("expert",))


def operands(weights: str, dtype=jnp.bfloat16):
    """(x, logits, w_gate, w_up, w_down, cotangent) as the layer takes them, and the float64 weights they hold."""
    x, logits, *w64, cot = inputs(TOKENS_PER_DEVICE * EP, seed=1)
    if weights == "int8":
        ws = [moe_tune.quantize(jnp.asarray(w, jnp.float32), "int8", axis=1) for w in w64]
        held = [np.asarray(moe_tune.dequantize(q), np.float64) for q in ws]
    else:
        ws = [jnp.asarray(w, dtype) for w in w64]
        held = [np.asarray(jnp.asarray(w, jnp.float32), np.float64) for w in ws]
    xs = jnp.asarray(x, dtype)
    return (xs, jnp.asarray(logits, jnp.float32), *ws, jnp.asarray(cot, jnp.float32)), (
        np.asarray(jnp.asarray(xs, jnp.float32), np.float64), logits, *held, cot)


def layer_fn(config: ShardingConfig, **options):
    return lambda x, logits, *ws: moe_tune.sharded_moe_mlp(x, logits, *ws, TOP_K, mesh=mesh(), ep_strategy=config,
                                                           **options)


def layer_case(strategy: str, chunks: int, weights: str) -> dict:
    config = ShardingConfig(strategy=strategy, token_chunks=chunks, exchange="fixed", wire="fp8")
    args, held = operands(weights)
    *layer_args, cot = args
    want, want_grads, _ = reference(*held, devices=EP, cap=None)
    # the same layer on the rows as the wire rounds them (per row, `wire.row_block`): the straight-through
    # gradients are this reference's exactly, up to the dtype's own rounding
    rounded = np.asarray(moe_tune.dequantize(quantize_rows(args[0], row_block(HIDDEN, args[2]))), np.float64)
    want_r, want_r_grads, _ = reference(rounded, *held[1:], devices=EP, cap=None)
    layer = layer_fn(config)
    argnums = (0, 1) if weights == "int8" else (0, 1, 2, 3, 4)  # QArray weights are constants

    def loss(*a):
        out = layer(*a)
        return jnp.sum(out.astype(jnp.float32) * cot), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(*layer_args)
    names = ("dx", "dlogits", "dw_gate", "dw_up", "dw_down")
    result = {names[i]: relative(g, want_grads[i]) for i, g in zip(argnums, grads)}
    result["rounded"] = {names[i]: relative(g, want_r_grads[i]) for i, g in zip(argnums, grads)}
    result["rounded"]["out"] = relative(out, want_r)
    result["finite"] = bool(all(np.isfinite(np.asarray(jnp.asarray(g, jnp.float32))).all() for g in grads))
    result.update(out=relative(out, want), dtype_out=str(out.dtype), tolerance=FP8_WIRE_TOLERANCE,
                  rounded_tolerance=TOLERANCE["bfloat16"])
    return result


DISPATCH = {"all_gather": "all_gather", "all_to_all": "all_to_all"}


def element_types(text: str, op: str) -> list[str]:
    """The element types of the 2-D-or-more float results of every `stablehlo.<op>` in a lowered module (the
    rows; the routing's int collectives and 1-D counts left out)."""
    types = set()
    for line in text.splitlines():
        if f'"stablehlo.{op}"' in line:
            types.update(t for t in re.findall(r"-> tensor<\d+x\d+(?:x\d+)?x([a-zA-Z0-9]+)>", line) if t[0] in "bfF")
    return sorted(types)


def hlo() -> dict:
    """Per strategy and wire: the element types the forward's dispatch collective carries (all_gather for
    all_gather, all_to_all for all_to_all), as lowered. (XLA:CPU's compiled program widens 8- and 16-bit
    collectives, fp8 to f16 and bf16 to f32, so the compiled CPU text does not show what a chip sends.)"""
    args, _ = operands("bfloat16")
    found = {}
    for strategy, op in DISPATCH.items():
        for wire in ("native", "fp8"):
            config = ShardingConfig(strategy=strategy, exchange="fixed", wire=wire)
            found[f"{strategy}_{wire}"] = element_types(jax.jit(layer_fn(config)).lower(*args[:5]).as_text(), op)
    return found


def export() -> dict:
    """The fp8 all_to_all with the ragged exchange exported for cuda and tpu: whether it lowered, and the
    element types `ragged_all_to_all` carries in the exported module."""
    from moe_tune.layer import exchange

    args, _ = operands("bfloat16")
    config = ShardingConfig(strategy="all_to_all", exchange="ragged", wire="fp8")
    saved = exchange.has_ragged_all_to_all
    exchange.has_ragged_all_to_all = lambda platform=None: True  # the layer as it runs on those platforms
    unchecked = (jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all"),)  # XLA's own collective
    found = {}
    try:
        for platform in ("cuda", "tpu"):
            try:
                exported = jax.export.export(jax.jit(layer_fn(config)), platforms=[platform],
                                             disabled_checks=unchecked)(*args[:5])
                calls = [line for line in exported.mlir_module().splitlines() if "@ragged_all_to_all" in line]
                types = sorted({t for line in calls for t in re.findall(r"tensor<\d+x\d+x([a-zA-Z0-9]+)>", line)})
                found[platform] = {"ok": True, "platforms": list(exported.platforms), "calls": len(calls),
                                   "ragged_types": types}
            except Exception as error:  # noqa: BLE001 (reported)
                found[platform] = {"ok": False, "error": f"{type(error).__name__}: {str(error)[:300]}"}
    finally:
        exchange.has_ragged_all_to_all = saved
    return found


def pack_roundtrip() -> dict:
    """`wire.pack` / `unpack` through the collectives the layer sends them by, with scales whose bytes are
    float8_e4m3fn's NaN patterns (0x7F, 0xFF: 0.99999994 is 0x3F7FFFFF), on XLA:CPU, which widens fp8
    collectives to f16 and back: whether every scale comes back bit for bit."""
    from jax.sharding import PartitionSpec as P

    from moe_tune.core.quant import QArray
    from moe_tune.layer.wire import pack, unpack

    rows = EP * EP  # EP rows a device: one to each peer in the all_to_all
    scale = jnp.full((rows, 2), np.float32(0.99999994)).at[::3].set(np.float32(-3.5e-9))
    values = jnp.asarray(np.random.default_rng(0).normal(size=(rows, 8)), jnp.float8_e4m3fn)

    def body(values, scale):
        message = pack(QArray(values, scale))
        gathered = jax.lax.all_gather(message, "expert", tiled=True)
        swapped = jax.lax.all_to_all(message.reshape(EP, 1, -1), "expert", 0, 0).reshape(message.shape)
        return (*unpack(gathered, 8), *unpack(swapped, 8))

    out = jax.jit(jax.shard_map(body, mesh=mesh(), in_specs=(P("expert"), P("expert")),
                                out_specs=(P(), P(), P("expert"), P("expert")), check_vma=False))(values, scale)
    as_bits = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint32 if a.dtype == jnp.float32
                                                                else jnp.uint8))
    # device i receives row i of every device j: global row i * EP + j is input row j * EP + i
    swap = lambda a: a.reshape(EP, EP, -1).transpose(1, 0, 2).reshape(a.shape)
    return {"all_gather": bool((as_bits(out[0]) == as_bits(values)).all()
                               and (as_bits(out[1]) == as_bits(scale)).all()),
            "all_to_all": bool((as_bits(out[2]) == swap(as_bits(values))).all()
                               and (as_bits(out[3]) == swap(as_bits(scale))).all())}


def refusals() -> dict:
    """The one-line refusals of an fp8 wire that cannot serve: name -> message (None: not refused)."""
    args, _ = operands("bfloat16")
    calls = {
        "fused": lambda: layer_fn(ShardingConfig(strategy="all_gather", wire="fp8"), fused=True)(*args[:5]),
        "replicated": lambda: layer_fn(ShardingConfig(strategy="all_gather", wire="fp8"),
                                       tokens_replicated=True)(*args[:5]),
        "wire_name": lambda: layer_fn(ShardingConfig(strategy="all_gather", wire="int4"))(*args[:5]),
    }
    found = {}
    for name, call in calls.items():
        try:
            call()
            found[name] = None
        except UsageError as error:
            found[name] = str(error)
    # the tables' fp8 choice (ep_strategy=None) under the caller's fused=True: the native wire, no refusal
    from moe_tune.layer import sharded

    saved = sharded.config_for
    sharded.config_for = lambda **_: ShardingConfig(strategy="all_gather", wire="fp8")
    try:
        jax.eval_shape(layer_fn(None, fused=True), *args[:5])
        found["tables_fp8_fused"] = None
    except UsageError as error:
        found["tables_fp8_fused"] = str(error)
    finally:
        sharded.config_for = saved
    return found


LAYER_CASES = {f"{s}_chunks{c}_{w}": (s, c, w) for s, c, w in (
    ("all_gather", 1, "bfloat16"), ("all_gather", 2, "int8"), ("all_to_all", 1, "int8"), ("all_to_all", 2, "bfloat16"))}


def main(names: list[str]) -> None:
    checks = {**{name: (lambda case=case: layer_case(*case)) for name, case in LAYER_CASES.items()},
              "hlo": hlo, "export": export, "refusals": refusals, "pack_roundtrip": pack_roundtrip}
    results = {}
    for name in names or list(checks):
        try:
            results[name] = checks[name]()
        except Exception as error:  # noqa: BLE001 (reported, so one failing check does not hide the others)
            results[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:400]}"}
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
