"""ragged_dot on this machine, all three directions (fwd, dlhs, drhs): tuned `tiled` vs default `tiled` vs
XLA's ragged dot (`jax.lax.ragged_dot_general`) vs a dense matmul of the same FLOPs, timed side by side in
one run (profiler trace, median of samples).

    .venv/bin/python benchmarks/ragged_dot_cpu.py [--groups 8,32] [--directions fwd,dlhs,drhs]
                                                  [--m 4096 --k 1024 --n 1024] [--json OUT]

For each group count and direction it first sweeps `tiled` (into a temporary profile dir), then times the
four variants interleaved, and prints times and ratios. Nothing is asserted: machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time

import jax

from moe_tune import devices
from moe_tune.kernels import get_op
from moe_tune.kernels.ragged_dot import BACKENDS
from moe_tune.tuner import SweepSpec, run_sweep
from moe_tune.tuner.timing import CANDIDATE_PREFIX, time_candidates

# A dense matmul with the FLOPs of each direction: [m,k]x[k,n], [m,n]x[n,k], [k,m]x[m,n].
DENSE = {
    "fwd": lambda a, b: a @ b[0],
    "dlhs": lambda a, b: a @ b[0].T,
    "drhs": lambda a, b: a.T @ b,
}


def _named(fn, index: int):
    fn.__name__ = fn.__qualname__ = f"{CANDIDATE_PREFIX}{index}"  # so the trace parser finds it
    return jax.jit(fn)


def bench_one(problem, samples: int, profile_dir: str) -> dict:
    spec = get_op("ragged_dot")
    started = time.perf_counter()
    sweep = run_sweep(SweepSpec("ragged_dot", problem, backend="tiled", samples=3, profile_dir=profile_dir))
    sweep_s = time.perf_counter() - started
    tiled, xla = BACKENDS.get("tiled"), BACKENDS.get("xla")
    tuned, default = sweep.best.config, tiled.default_config(problem)
    inputs = jax.device_put(spec.make_inputs(problem, "balanced", seed=1))
    run = lambda backend, config: lambda x: backend.run(problem, config, x["a"], x["b"], x["group_sizes"])
    variants = {
        "tiled tuned": run(tiled, tuned),
        "tiled default": run(tiled, default),
        "xla ragged dot": run(xla, xla.default_config(problem)),
        "dense matmul": lambda x: DENSE[problem.direction](x["a"], x["b"]),
    }
    names = list(variants)
    compiled = {i: _named(variants[name], i).lower(inputs).compile() for i, name in enumerate(names)}
    for c in compiled.values():
        jax.block_until_ready(c(inputs))
    timings, fallback = time_candidates({i: (lambda c=c: c(inputs)) for i, c in compiled.items()},
                                        samples=samples, platform=devices.platform())
    times = {name: timings[i].median_s for i, name in enumerate(names)}
    return {
        "shape": {"direction": problem.direction, "m": problem.m, "k": problem.k, "n": problem.n,
                  "groups": problem.groups, "dtype": problem.lhs_dtype},
        "tuned_config": tuned.to_dict(), "default_config": default.to_dict(),
        "times_s": times, "timing_method": timings[0].method, "timing_fallback": fallback,
        "spread": {name: timings[i].spread for i, name in enumerate(names)},
        "sweep_s": sweep_s, "sweep_candidates": len(sweep.candidates),
        "ratios": {
            "tuned_vs_dense": times["tiled tuned"] / times["dense matmul"],
            "default_vs_dense": times["tiled default"] / times["dense matmul"],
            "xla_vs_dense": times["xla ragged dot"] / times["dense matmul"],
            "xla_vs_tuned": times["xla ragged dot"] / times["tiled tuned"],
            "default_vs_tuned": times["tiled default"] / times["tiled tuned"],
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=4096)
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--groups", default="8,32", help="comma-separated group counts")
    parser.add_argument("--directions", default="fwd,dlhs,drhs")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--samples", type=int, default=7)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    spec = get_op("ragged_dot")
    results = []
    with tempfile.TemporaryDirectory() as profile_dir:
        for groups in (int(g) for g in args.groups.split(",")):
            for direction in args.directions.split(","):
                problem = spec.problem(m=args.m, k=args.k, n=args.n, groups=groups, dtype=args.dtype,
                                       direction=direction)
                r = bench_one(problem, args.samples, profile_dir)
                results.append(r)
                t, ratio = r["times_s"], r["ratios"]
                print(f"\n{spec.describe(problem)} on {devices.device_kind()} (timed by {r['timing_method']}; "
                      f"sweep of {r['sweep_candidates']} candidates took {r['sweep_s']:.1f} s)")
                print(f"  tuned config {r['tuned_config']}, default {r['default_config']}")
                for name, seconds in t.items():
                    print(f"  {name:<16} {seconds * 1e3:9.2f} ms  {seconds / t['dense matmul']:6.2f}x dense"
                          f"  (spread {r['spread'][name]:.0%})")
                same = " (the same config: any difference is noise)" if r["tuned_config"] == r["default_config"] else ""
                print(f"  time ratios: default/tuned {ratio['default_vs_tuned']:.2f}{same}, "
                      f"xla/tuned {ratio['xla_vs_tuned']:.2f}, tuned/dense {ratio['tuned_vs_dense']:.2f}")
    if args.json:
        meta = {"device_kind": devices.device_kind(), "machine": platform.machine(), "cpus": __import__("os").cpu_count(),
                "jax": jax.__version__, "date": time.strftime("%Y-%m-%d")}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
