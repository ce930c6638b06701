"""Dispatch and combine on this machine: the ragged `tiled` kernels (tuned and default) vs the plain-JAX
fallback, at valid fractions 1, 1/4 and 1/16 (expert-parallel sizes 1, 4, 16), against this machine's copy
bandwidth measured in the same rounds.

    .venv/bin/python benchmarks/gather_cpu.py [--tokens 2048 --hidden 2048 --top-k 6 --experts 64]
                                              [--ep 1,4,16] [--json OUT]

For each op and fraction it sweeps `tiled` (into a temporary profile dir), then times tuned, default,
fallback and a copy of the output's size interleaved (`moe_tune.bench.compare_gather`). The ragged time
should fall with the valid fraction; the fallback's should not. Nothing is asserted: machines are noisy.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

from moe_tune import bench
from moe_tune.kernels import get_op
from moe_tune.tuner import SweepSpec, run_sweep


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--ep", default="1,4,16", help="comma-separated expert-parallel sizes")
    parser.add_argument("--ops", default="ragged_gather,ragged_gather_reduce,dense_gather_reduce")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--samples", type=int, default=7)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    results = []
    with tempfile.TemporaryDirectory() as profile_dir:
        for op in args.ops.split(","):
            spec = get_op(op)
            eps = [int(e) for e in args.ep.split(",")] if "ep" in spec.options else [1]
            for ep in eps:
                problem = spec.problem(tokens=args.tokens, hidden=args.hidden, top_k=args.top_k,
                                       experts=args.experts, ep=ep, dtype=args.dtype)
                started = time.perf_counter()
                sweep = run_sweep(SweepSpec(op, problem, backend="tiled", profile_dir=profile_dir))
                sweep_s = time.perf_counter() - started
                r = bench.compare_gather(op, problem, "tiled", sweep.best.config, samples=args.samples)
                r.update(shape=problem.key_fields(), ep=ep, sweep_s=sweep_s, sweep_candidates=len(sweep.candidates))
                results.append(r)
                t, ratio = r["times_s"], r["ratios"]
                print(f"\n{spec.describe(problem)}: valid fraction {r['valid_fraction']:.3f} (timed by "
                      f"{r['timing_method']}; sweep of {len(sweep.candidates)} candidates, {sweep_s:.1f} s)")
                print(f"  tuned {r['tuned_config']}, default {r['default_config']}")
                for name, seconds in t.items():
                    print(f"  {name:<9}{seconds * 1e3:10.3f} ms  (spread {r['spread'][name]:.0%})")
                print(f"  copy bandwidth {r['copy_gbps']:.1f} GB/s; roofline {r['roofline_s'] * 1e3:.3f} ms "
                      f"({r['least_bytes'] / 2**20:.0f} MiB moved at least)")
                print(f"  ratios: fallback/tuned {ratio['fallback_vs_tuned']:.2f}, default/tuned "
                      f"{ratio['default_vs_tuned']:.2f}, tuned/roofline {ratio['tuned_vs_roofline']:.2f}")
        print("\nRagged time vs the same op at valid fraction 1 (tuned; fallback in brackets):")
        for op in args.ops.split(","):
            rows = [r for r in results if r["op"] == op]
            full = rows[0]["times_s"]
            print(f"  {op:<22}" + "  ".join(
                f"1/{r['ep']}: {r['times_s']['tuned'] / full['tuned']:.2f} "
                f"[{r['times_s']['fallback'] / full['fallback']:.2f}]" for r in rows))
    if args.json:
        bench.write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
