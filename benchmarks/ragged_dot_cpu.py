"""ragged_dot on this machine: tuned `tiled` vs default `tiled` vs `jax.lax.ragged_dot` vs a dense matmul of
the same FLOPs, all timed side by side in one run (profiler trace, median of samples).

    .venv/bin/python benchmarks/ragged_dot_cpu.py [--groups 8,32] [--m 4096 --k 1024 --n 1024] [--json OUT]

For each group count it first sweeps `tiled` (into a temporary profile dir), then times the four variants
interleaved, and prints times and ratios. Nothing here is asserted: machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

from moe_tune import devices
from moe_tune.kernels import get_op
from moe_tune.kernels.ragged_dot import BACKENDS
from moe_tune.tuner import SweepSpec, run_sweep
from moe_tune.tuner.timing import CANDIDATE_PREFIX, time_candidates


def _named(fn, index: int):
    fn.__name__ = fn.__qualname__ = f"{CANDIDATE_PREFIX}{index}"  # so the trace parser finds it
    return jax.jit(fn)


def bench_one(m: int, k: int, n: int, groups: int, dtype: str, samples: int, profile_dir: str) -> dict:
    spec = get_op("ragged_dot")
    problem = spec.problem(m=m, k=k, n=n, groups=groups, dtype=dtype)
    started = time.perf_counter()
    sweep = run_sweep(SweepSpec("ragged_dot", problem, backend="tiled", samples=3, profile_dir=profile_dir))
    sweep_s = time.perf_counter() - started
    tiled = BACKENDS.get("tiled")
    tuned, default = sweep.best.config, tiled.default_config(problem)
    inputs = jax.device_put(spec.make_inputs(problem, "balanced", seed=1))
    out_dtype = jnp.dtype(problem.out_dtype)
    variants = {
        "tiled tuned": lambda x: tiled(x["lhs"], x["rhs"], x["group_sizes"], config=tuned, out_dtype=out_dtype),
        "tiled default": lambda x: tiled(x["lhs"], x["rhs"], x["group_sizes"], config=default, out_dtype=out_dtype),
        "jax.lax.ragged_dot": lambda x: jax.lax.ragged_dot(x["lhs"], x["rhs"], x["group_sizes"]),
        "dense matmul": lambda x: x["lhs"] @ x["rhs"][0],  # [m,k] x [k,n]: the same FLOPs
    }
    names = list(variants)
    compiled = {i: _named(variants[name], i).lower(inputs).compile() for i, name in enumerate(names)}
    for c in compiled.values():
        jax.block_until_ready(c(inputs))
    timings, fallback = time_candidates({i: (lambda c=c: c(inputs)) for i, c in compiled.items()},
                                        samples=samples, platform=devices.platform())
    times = {name: timings[i].median_s for i, name in enumerate(names)}
    return {
        "shape": {"m": m, "k": k, "n": n, "groups": groups, "dtype": dtype},
        "tuned_config": tuned.to_dict(), "default_config": default.to_dict(),
        "times_s": times, "timing_method": next(iter(timings.values())).method, "timing_fallback": fallback,
        "spread": {name: timings[i].spread for i, name in enumerate(names)},
        "sweep_s": sweep_s, "sweep_candidates": len(sweep.candidates),
        "ratios": {
            "tuned_vs_dense": times["tiled tuned"] / times["dense matmul"],
            "default_vs_dense": times["tiled default"] / times["dense matmul"],
            "xla_vs_dense": times["jax.lax.ragged_dot"] / times["dense matmul"],
            "xla_vs_tuned": times["jax.lax.ragged_dot"] / times["tiled tuned"],
            "default_vs_tuned": times["tiled default"] / times["tiled tuned"],
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=4096)
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--groups", default="8,32", help="comma-separated group counts")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--samples", type=int, default=7)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    results = []
    with tempfile.TemporaryDirectory() as profile_dir:
        for groups in (int(g) for g in args.groups.split(",")):
            r = bench_one(args.m, args.k, args.n, groups, args.dtype, args.samples, profile_dir)
            results.append(r)
            t, ratio = r["times_s"], r["ratios"]
            print(f"\nragged_dot fwd m={args.m} k={args.k} n={args.n} g={groups} {args.dtype} on {devices.device_kind()}"
                  f" (timed by {r['timing_method']}, sweep of {r['sweep_candidates']} candidates took {r['sweep_s']:.1f} s)")
            print(f"  tuned config {r['tuned_config']}, default {r['default_config']}")
            for name, seconds in t.items():
                print(f"  {name:<20} {seconds * 1e3:9.2f} ms   {seconds / t['dense matmul']:6.2f}x dense"
                      f"   spread {r['spread'][name]:.1%}")
            print(f"  tuned is {ratio['default_vs_tuned']:.2f}x faster than default, "
                  f"{ratio['xla_vs_tuned']:.2f}x faster than jax.lax.ragged_dot")
    if args.json:
        meta = {"device_kind": devices.device_kind(), "machine": platform.machine(), "jax": jax.__version__,
                "date": time.strftime("%Y-%m-%d")}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
