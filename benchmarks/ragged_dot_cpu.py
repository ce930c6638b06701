"""ragged_dot on this machine, all three directions (fwd, dlhs, drhs): tuned `tiled` vs default `tiled` vs
XLA's ragged dot (`jax.lax.ragged_dot_general`) vs a dense matmul of the same FLOPs, timed side by side in
one run (profiler trace, median of samples).

    .venv/bin/python benchmarks/ragged_dot_cpu.py [--groups 8,32] [--directions fwd,dlhs,drhs]
                                                  [--m 4096 --k 1024 --n 1024] [--json OUT]

For each group count and direction it first sweeps `tiled` (into a temporary profile dir), then times the
four variants interleaved (`moe_tune.bench.compare`). Nothing is asserted: machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

from moe_tune import bench, devices
from moe_tune.kernels import get_op
from moe_tune.tuner import SweepSpec, run_sweep


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
                started = time.perf_counter()
                sweep = run_sweep(SweepSpec("ragged_dot", problem, backend="tiled",
                                            profile_dir=profile_dir))
                sweep_s = time.perf_counter() - started
                r = bench.compare(problem, "tiled", sweep.best.config, samples=args.samples)
                r.update(shape=problem.key_fields(), sweep_s=sweep_s, sweep_candidates=len(sweep.candidates))
                results.append(r)
                print(f"\n{spec.describe(problem)} on {devices.device_kind()}, backend tiled (timed by "
                      f"{r['timing_method']}; sweep of {len(sweep.candidates)} candidates took {sweep_s:.1f} s)")
                print("\n".join(bench.format_comparison(r)))
    if args.json:
        bench.write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
