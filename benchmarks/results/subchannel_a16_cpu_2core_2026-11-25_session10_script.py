"""A/B: bf16 activations, fp8/int8 sub-channel, dequantized: blocks in the dot's dtype (bf16) vs f32 (old)."""
import sys
import jax, jax.numpy as jnp, numpy as np
from unittest import mock
from moe_tune import quantize
from moe_tune.commands import bench
from moe_tune.kernels.ragged_dot import tiled as T

groups, m, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
k = 2048
tail = int(sys.argv[4]); tm = int(sys.argv[5])
rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
w = jnp.asarray(rng.standard_normal((groups, k, n)), jnp.float32)
gs = jnp.asarray(np.bincount(rng.integers(0, groups, m), minlength=groups), jnp.int32)
be = T.TiledRaggedDot()
inputs = {"x": x, "x32": x.astype(jnp.float32), "w": w, "gs": gs,
          "i8": quantize(w, jnp.int8, axis=1, block_size=128), "f8": quantize(w, jnp.float8_e4m3fn, axis=1, block_size=128)}
f32_dots = lambda a, b, min_rows=None: (jnp.dtype(jnp.float32), jnp.dtype(jnp.float32))
def variant(act, q, deq=True, old=False):
    cfg = T.TiledConfig(tm=tm, tail=tail, tk=k, tn=n, dequantize=deq)
    def f(d):
        with mock.patch.object(T, "_dot_dtypes", f32_dots) if old else mock.patch.object(T, "F32_DOT_MAX_ROWS", T.F32_DOT_MAX_ROWS):
            return be.gmm(d[act], d[q], d["gs"], config=cfg, out_dtype=d[act].dtype)
    return f
variants = {"f32": variant("x32", "w", False)}
for q in ("i8", "f8"):
    variants[f"{q}/128 a16 per block"] = variant("x", q, False)
    variants[f"{q}/128 a16 deq f32 (old)"] = variant("x", q, True, True)
    variants[f"{q}/128 a16 deq bf16 (new)"] = variant("x", q, True, False)
r = bench.time_variants(variants, jax.device_put(inputs), samples=9)
ref = r["times_s"]["f32"]
for name, t in r["times_s"].items():
    print(f"g={groups} m={m} n={n} tail={tail} tm={tm} {name:<26} {t*1e3:8.2f} ms  f32/this {ref/t:5.2f}  spread {r['spread'][name]:.2f}", flush=True)
