"""Weight-only int8 (and fp8) ragged_dot on CPU at the memory-bound decode shapes, beside float32 and bfloat16.

    PYTHONPATH=src .venv/bin/python benchmarks/quant_cpu.py [--cases qwen3-30b-a3b:16,...] [--samples 7]

The tiled backend's gmm is called directly (fwd: lhs [m, k] x rhs [g, k, n]) with float weights and with
QArray weights from `moe_tune.quant.quantize` (one scale per output channel). Each variant gets the best
config of a small grid (the backend's default tm and tail, tk in {512, k}, tn in {512, n}), timed in a
first round; the winners are then timed side by side in one round. Target (issue 14): int8 weight-only
at least 1.5x faster than the tuned float32 kernel. Nothing is asserted (the machine is shared).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from moe_tune import bench, distributions
from moe_tune.kernels import get_op
from moe_tune.kernels.ragged_dot import BACKENDS
from moe_tune.quant import quantize

M = 256  # decode: routed rows per shard
SHAPES = {"qwen3-30b-a3b": (2048, 768), "deepseek-v2-lite": (2048, 1408)}  # expert gate/up: k = hidden, n
TARGET = 1.5  # float32 / int8 weight-only
# name -> (activation dtype, weight dtype or None for float weights of the activation dtype)
VARIANTS = {"f32": ("float32", None), "bf16": ("bfloat16", None), "w8 a32": ("float32", "int8"),
            "w8 a16": ("bfloat16", "int8"), "fp8 a16": ("bfloat16", "float8_e4m3fn")}


def grid(problem) -> list:
    impl = BACKENDS.get("tiled")
    base = impl.default_config(problem)
    configs = [dataclasses.replace(base, tk=tk, tn=tn)
               for tk, tn in itertools.product(sorted({512, problem.k}), sorted({512, problem.n}))]
    return [c for c in configs if impl.config_error(c, problem) is None]


def case(name: str, groups: int, samples: int) -> dict:
    k, n = SHAPES[name]
    impl = BACKENDS.get("tiled")
    problem = get_op("ragged_dot").problem(m=M, k=k, n=n, groups=groups, dtype="float32")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((M, k), np.float32)
    w = rng.standard_normal((groups, k, n), np.float32) / np.sqrt(k)
    inputs = {"gs": distributions.group_sizes("balanced", M, groups, 0)}
    for v, (act, wq) in VARIANTS.items():
        inputs[v] = {"x": jnp.asarray(x, act),
                     "w": jnp.asarray(w, act) if wq is None else quantize(jnp.asarray(w), wq, axis=1)}
    inputs = jax.device_put(inputs)
    run = lambda v, c: lambda d: impl.gmm(d[v]["x"], d[v]["w"], d["gs"], config=c, out_dtype=d[v]["x"].dtype)
    best = {}
    for v in VARIANTS:  # first round: each variant's grid
        configs = grid(problem)
        t = bench.time_variants({str(i): run(v, c) for i, c in enumerate(configs)}, inputs, samples=3)["times_s"]
        best[v] = configs[int(min(t, key=t.get))]
    t = bench.time_variants({v: run(v, best[v]) for v in VARIANTS}, inputs, samples=samples)["times_s"]
    weight_mib = {v: groups * k * n * (jnp.dtype(wq or act).itemsize) / 2**20 for v, (act, wq) in VARIANTS.items()}
    print(f"\n{name} m={M} k={k} n={n} g={groups}:")
    for v in VARIANTS:
        print(f"  {v:<8} {t[v] * 1e3:8.3f} ms  f32/this {t['f32'] / t[v]:5.2f}  weights {weight_mib[v]:6.1f} MiB "
              f"at {weight_mib[v] * 2**20 / t[v] / 1e9:5.1f} GB/s  config {best[v].to_dict()}", flush=True)
    return {"name": name, "groups": groups, "times_s": t, "configs": {v: c.to_dict() for v, c in best.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="qwen3-30b-a3b:16,qwen3-30b-a3b:64,deepseek-v2-lite:16,deepseek-v2-lite:64")
    parser.add_argument("--samples", type=int, default=7)
    args = parser.parse_args()
    results = []
    for spec in args.cases.split(","):
        name, groups = spec.split(":")
        results.append(case(name, int(groups), args.samples))
        jax.clear_caches()
    print("\nSummary (f32 time / int8 weight-only time, target >= 1.5):")
    for r in results:
        t = r["times_s"]
        for v in ("w8 a32", "w8 a16"):
            ratio = t["f32"] / t[v]
            print(f"  {r['name']} g={r['groups']} f32/{v}: {ratio:.2f}  {'met' if ratio >= TARGET else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
