"""Sub-channel fwd on the tiled kernel: a dot per scale block vs dequantized weights (TiledConfig.dequantize),
and fp8 loaded by XLA's convert vs the bit-built one (loop_dtypes.e4m3fn_to_float32); one time_variants call."""
import contextlib, sys
import jax, jax.numpy as jnp, numpy as np
from unittest import mock
from moe_tune import quantize
from moe_tune.commands import bench
from moe_tune.kernels import loop_dtypes
from moe_tune.kernels.ragged_dot.tiled import TiledRaggedDot, TiledConfig

groups = int(sys.argv[1]); m = int(sys.argv[2]) if len(sys.argv) > 2 else 256
k, n = 2048, 768
tail = 4 if m // groups <= 4 else 16
tm = 32 if m <= 256 else 256
rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
w = jnp.asarray(rng.standard_normal((groups, k, n)), jnp.float32)
gs = jnp.asarray(np.bincount(rng.integers(0, groups, m), minlength=groups), jnp.int32)
be = TiledRaggedDot()
inputs = {"x": x, "x16": x.astype(jnp.bfloat16), "w": w, "gs": gs,
          "i8": quantize(w, jnp.int8, axis=1, block_size=128),
          "f8": quantize(w, jnp.float8_e4m3fn, axis=1, block_size=128)}
def native(b): return b.astype(jnp.float32)
def variant(q, act, deq, xla_convert=False):
    cfg = TiledConfig(tm=tm, tail=tail, tk=k, tn=n, dequantize=deq)
    def f(d):
        patch = mock.patch.object(loop_dtypes, "e4m3fn_to_float32", native) if xla_convert else contextlib.nullcontext()
        with patch:
            return be.gmm(d[act], d[q], d["gs"], config=cfg, out_dtype=d[act].dtype)
    return f
variants = {"f32": lambda d: be.gmm(d["x"], d["w"], d["gs"], config=TiledConfig(tm=tm, tail=tail, tk=k, tn=n), out_dtype=jnp.float32)}
for deq in (False, True):
    variants[f"int8/128 deq={deq}"] = variant("i8", "x", deq)
for deq in (False, True):
    for xc in (True, False):
        variants[f"fp8/128 deq={deq} {'xla' if xc else 'bits'}"] = variant("f8", "x", deq, xc)
for deq in (False, True):
    variants[f"fp8/128 a16 deq={deq} bits"] = variant("f8", "x16", deq)
variants["fp8/128 a16 deq=True xla"] = variant("f8", "x16", True, True)
r = bench.time_variants(variants, jax.device_put(inputs), samples=9)
ref = r["times_s"]["f32"]
for name, t in r["times_s"].items():
    print(f"g={groups} m={m} {name:<26} {t*1e3:8.2f} ms  f32/this {ref/t:5.2f}  spread {r['spread'][name]:.2f}", flush=True)
