"""Search strategies on one real ragged_dot space on this CPU: how close `random` and `coordinate` come to the
exhaustive (`grid`) best, and at what fraction of its cost.

    .venv/bin/python benchmarks/strategies_cpu.py [--m 2048 --k 2048 --n 768 --groups 16] [--samples 3]
        [--random-budgets 8,16] [--coordinate-budgets none,8] [--seeds 0,1,2] [--json OUT]

1. `grid` sweeps the whole space once (the reference: its winner is "the exhaustive best").
2. `random` (each budget x seed) and `coordinate` (each budget x seed; the seed changes only the inputs and
   so the measurement noise, the search itself is deterministic) sweep the same space, each from scratch
   (a temporary profile dir; no sweep resumes another).
3. Every distinct winner and the grid's winner are then compiled once and timed side by side, interleaved
   in the same trace rounds (`moe_tune.commands.bench.time_variants`), so that "winner time / grid-best time" is not
   run-to-run noise between sweeps.

Printed per run: candidates tried and sweep wall time, both as fractions of grid's, the winner, and its
side-by-side time over the grid best's (1.00 = as good as exhaustive). Nothing is asserted: machines are
shared and noisy. Run it at full size rarely (it takes minutes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import jax

from moe_tune.commands import bench
from moe_tune.core import devices
from moe_tune.kernels import get_op
from moe_tune.tuner import SweepRequest, run_sweep


def _ints(text: str) -> list[int | None]:
    return [None if v.strip().lower() == "none" else int(v) for v in text.split(",") if v.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=2048)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--n", type=int, default=768)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--samples", type=int, default=3, help="timing samples per candidate in each sweep")
    parser.add_argument("--workers", type=int, default=None, help="compile workers (default: CPU count)")
    parser.add_argument("--random-budgets", default="8,16")
    parser.add_argument("--coordinate-budgets", default="none,8", help="'none': until it converges")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--compare-samples", type=int, default=7, help="samples of the side-by-side timing")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    spec = get_op("ragged_dot")
    problem = spec.problem(m=args.m, k=args.k, n=args.n, groups=args.groups, dtype=args.dtype)
    seeds = [s for s in _ints(args.seeds) if s is not None]
    plan = [("grid", None, seeds[0])]
    plan += [("random", b, s) for b in _ints(args.random_budgets) for s in seeds]
    plan += [("coordinate", b, s) for b in _ints(args.coordinate_budgets) for s in seeds]
    extra = {} if args.workers is None else {"workers": args.workers}

    print(f"{spec.describe(problem)} on {devices.device_kind()}, backend tiled, {args.samples} samples per "
          f"candidate; {len(plan)} sweeps", flush=True)
    runs = []
    with tempfile.TemporaryDirectory() as profile_dir:
        # Start the compile workers and warm this process up first, so that grid (the first sweep) does not
        # pay for it in its wall time.
        run_sweep(SweepRequest.make("ragged_dot", problem, backend="tiled", max_candidates=1, samples=1,
                                    profile_dir=profile_dir, **extra))
        for strategy, budget, seed in plan:
            started = time.perf_counter()
            result = run_sweep(SweepRequest.make("ragged_dot", problem, backend="tiled", strategy=strategy,
                                                 budget=budget, seed=seed, samples=args.samples,
                                                 profile_dir=profile_dir, fresh=True, **extra))
            wall = time.perf_counter() - started
            runs.append({"strategy": strategy, "budget": budget, "seed": seed, "wall_s": wall,
                         "tried": result.entry.candidates["tried"], "space": result.entry.search["space"],
                         "stopped": result.entry.search["stopped"], "winner": result.entry.config,
                         "within_noise_of_default": result.entry.within_noise_of_default,
                         "sweep_median_s": result.entry.timing["median_s"]})
            if strategy == "grid":  # how much choosing matters here: the space's times, from the grid's batches
                medians = sorted(r["median_s"] for r in result.entry.results)
                space = {"candidates_ok": len(medians), "median_vs_best": statistics.median(medians) / medians[0],
                         "worst_vs_best": medians[-1] / medians[0], "default_vs_best":
                         result.entry.default["median_s"] / medians[0] if result.entry.default["median_s"] else None}
            print(f"  {strategy:<10} budget {str(budget):<5} seed {seed}: {runs[-1]['tried']:3d} candidates, "
                  f"{wall:6.1f} s, winner {_label(result.entry.config)}", flush=True)

    grid = runs[0]
    configs = {_label(r["winner"]): r["winner"] for r in runs}
    impl = spec.backends.get("tiled")
    inputs = jax.device_put(spec.make_inputs(problem, "balanced", seed=1))
    variants = {label: (lambda x, c=impl.config_cls(**cfg): spec.run(impl, c, problem, x)) for label, cfg in configs.items()}
    side = bench.time_variants(variants, inputs, samples=args.compare_samples)
    times = side["times_s"]
    best_t = times[_label(grid["winner"])]
    for r in runs:
        r["side_by_side_s"] = times[_label(r["winner"])]
        r["vs_grid_best"] = r["side_by_side_s"] / best_t
        r["candidates_fraction"] = r["tried"] / grid["tried"]
        r["wall_fraction"] = r["wall_s"] / grid["wall_s"]

    print(f"\nSide by side ({args.compare_samples} samples, timed by {side['timing_method']}); grid best "
          f"{_label(grid['winner'])} {best_t * 1e3:.3f} ms")
    print(f"  {'strategy':<10} {'budget':>6} {'seed':>4} {'tried':>5} {'cand.frac':>9} {'wall.frac':>9} "
          f"{'winner/grid best':>16}  winner")
    for r in runs:
        print(f"  {r['strategy']:<10} {str(r['budget']):>6} {r['seed']:>4} {r['tried']:>5} "
              f"{r['candidates_fraction']:>9.2f} {r['wall_fraction']:>9.2f} {r['vs_grid_best']:>16.3f}  "
              f"{_label(r['winner'])} ({r['stopped']})")
    summary = []
    for strategy, budget in dict.fromkeys((r["strategy"], r["budget"]) for r in runs[1:]):
        group = [r for r in runs[1:] if (r["strategy"], r["budget"]) == (strategy, budget)]
        summary.append({
            "strategy": strategy, "budget": budget, "runs": len(group),
            "vs_grid_best_mean": statistics.mean(r["vs_grid_best"] for r in group),
            "vs_grid_best_worst": max(r["vs_grid_best"] for r in group),
            "candidates_fraction_mean": statistics.mean(r["candidates_fraction"] for r in group),
            "wall_fraction_mean": statistics.mean(r["wall_fraction"] for r in group),
        })
    print(f"\nThe space as the grid measured it (its batches): median candidate {space['median_vs_best']:.2f}x, "
          f"worst {space['worst_vs_best']:.2f}x the fastest")
    print("Per strategy and budget (mean over seeds): winner time / grid best, worst; cost fractions")
    for s in summary:
        print(f"  {s['strategy']:<10} budget {str(s['budget']):<5} {s['vs_grid_best_mean']:.3f} "
              f"(worst {s['vs_grid_best_worst']:.3f}), candidates {s['candidates_fraction_mean']:.2f}, "
              f"wall {s['wall_fraction_mean']:.2f} of grid's ({grid['tried']} candidates, {grid['wall_s']:.0f} s)")
    if args.json:
        bench.write_results(args.json, runs)
        with open(args.json) as f:
            data = json.load(f)
        data.update(problem=problem.key_fields(), samples=args.samples, summary=summary, grid_space=space,
                    side_by_side={k: v for k, v in side.items()})
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def _label(config: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in config.items())


if __name__ == "__main__":
    sys.exit(main())
