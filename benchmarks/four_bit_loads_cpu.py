"""How the tiled kernel should load 4-bit weight blocks on XLA CPU (FINDINGS.md: 4-bit on XLA CPU).

A loop over groups, each iteration a [4, k] x [k, n] dot of one group's weights (the decode shape of
quant_cpu.py: 4 rows a group), the weights loaded five ways, timed interleaved in one run:
- int8: the int8 block sliced and converted to f32 (the 1-byte path, the baseline);
- int4 convert: the int4 block sliced and converted by XLA (s4 -> f32);
- int4 bytes: the int4 array bitcast to its bytes outside the loop, each block's bytes sliced and unpacked
  with 32-bit integer ops (`pallas_util.load_nibbles`), the even and odd columns as two dots;
- fp8 bits: float8_e4m3fn by `loop_dtypes.e4m3fn_to_float32`; e2m1 convert / e2m1 bytes as for int4.

    PYTHONPATH=src .venv/bin/python benchmarks/four_bit_loads_cpu.py [--groups 32] [--samples 15] [--json OUT]
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from moe_tune.commands import bench
from moe_tune.kernels.pallas_util import e4m3fn_to_float32, load_nibbles, packed_bytes, per_iteration

K, N, ROWS = 2048, 768, 4  # qwen3-30b-a3b's gate/up expert, 4 rows a group


def _dot(x, w):
    return jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def converted(name: str, decode):
    """Each group's block sliced from the stored array (per iteration) and decoded by `decode`."""
    def run(d):
        body = lambda i, acc: acc + _dot(d["x"][i], decode(per_iteration(d[name], i)[i]))
        return jax.lax.fori_loop(0, d["x"].shape[0], body, jnp.zeros((ROWS, N), jnp.float32))
    return run


def unpacked(name: str, dtype: str):
    """Each group's bytes sliced from the bitcast array and unpacked: even and odd columns, a dot each."""
    def run(d):
        stored = packed_bytes(d[name])  # outside the loop: a bitcast

        def body(i, acc):
            block = per_iteration(stored, i)[i]
            even, odd = (load_nibbles(block, half, dtype, jnp.float32) for half in (False, True))
            return acc + jnp.stack([_dot(d["x"][i], even), _dot(d["x"][i], odd)], -1).reshape(ROWS, N)
        return jax.lax.fori_loop(0, d["x"].shape[0], body, jnp.zeros((ROWS, N), jnp.float32))
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    ints = rng.integers(-7, 8, (args.groups, K, N))
    floats = rng.standard_normal((args.groups, K, N)).astype(np.float32)
    inputs = {"x": jnp.asarray(rng.standard_normal((args.groups, ROWS, K)), jnp.float32),
              "int8": jnp.asarray(ints, jnp.int8), "int4": jnp.asarray(ints, jnp.int4),
              "fp8": jnp.asarray(floats, jnp.float8_e4m3fn), "e2m1": jnp.asarray(floats, jnp.float4_e2m1fn)}
    f32 = lambda w: w.astype(jnp.float32)
    variants = {"int8": converted("int8", f32), "int4 convert": converted("int4", f32),
                "int4 bytes": unpacked("int4", "int4"), "fp8 bits": converted("fp8", e4m3fn_to_float32),
                "e2m1 convert": converted("e2m1", f32), "e2m1 bytes": unpacked("e2m1", "float4_e2m1fn")}
    outs = {name: np.asarray(jax.jit(f)(inputs)) for name, f in variants.items()}
    for a, b in (("int4 convert", "int8"), ("int4 bytes", "int8"), ("e2m1 bytes", "e2m1 convert")):
        np.testing.assert_allclose(outs[a], outs[b], rtol=1e-4, atol=1e-3)  # the same products
    measured = bench.time_variants(variants, inputs, samples=args.samples)
    times = measured["times_s"]
    print(f"{args.groups} groups x [{ROWS}, {K}] @ [{K}, {N}] (timed by {measured['timing_method']}, medians of "
          f"{args.samples}, interleaved):")
    for name, t in times.items():
        print(f"  {name:<13} {t * 1e3:8.2f} ms  {times['int8'] / t:5.2f}x int8's speed  spread {measured['spread'][name]:.2f}")
    if args.json:
        bench.write_results(args.json, [{"times_s": times, "spread": measured["spread"], "groups": args.groups}])
    return 0


if __name__ == "__main__":
    sys.exit(main())
