"""How fast the tuner itself is on this machine: a 64-candidate ragged_dot sweep (tiled, the default demo
shape) with a cold persistent compilation cache, run with 1 compile worker and with 2, each in a fresh
process; prints the wall time of the sweep and of each stage, the parallel-compile speedup and the XLA
compilations per candidate.

    .venv/bin/python benchmarks/sweep_cpu.py [--candidates 64] [--workers 1,2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SHAPE = dict(m=2048, k=2048, n=768, groups=16, dtype="float32")  # the demo shape: 66 tiled candidates


def one_sweep(workers: int, candidates: int, samples: int) -> dict:
    """In this (fresh) process: the sweep and its wall time per stage (with workers, "compile" includes each
    candidate's first run in its worker, which gives the check its output)."""
    from moe_tune.kernels import get_op
    from moe_tune.tuner import SweepRequest, compile_cache, run_sweep
    from moe_tune.tuner.compile_count import backend_compiles

    compile_cache.enable()  # the dir is fresh and empty: a cold cache, as a first sweep on a machine has

    problem = get_op("ragged_dot").problem(**SHAPE)
    started = time.perf_counter()
    result = run_sweep(SweepRequest.make("ragged_dot", problem, backend="tiled", workers=workers, samples=samples,
                                         max_candidates=candidates, fresh=True))
    ended = time.perf_counter()
    stages = dict(result.entry.search["stage_s"])
    stages["finalists and table"] = (ended - started) - sum(stages.values())
    counts = result.entry.candidates
    return {"workers": workers, "wall_s": ended - started, "stages_s": dict(stages), "candidates": counts,
            "compiles_per_candidate": counts["compiles"] / counts["tried"],
            "main_process_compiles": backend_compiles(), "winner": result.entry.config}


def main() -> int:
    from moe_tune.tuner import SweepSettings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", type=int, default=64)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--samples", type=int, default=SweepSettings.samples)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(one_sweep(args.child, args.candidates, args.samples)))
        return 0

    runs = []
    for workers in (int(w) for w in args.workers.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, "MOE_TUNE_COMPILE_CACHE_DIR": os.path.join(tmp, "cache"),
                   "MOE_TUNE_PROFILE_DIR": os.path.join(tmp, "profiles")}
            proc = subprocess.run([sys.executable, __file__, "--child", str(workers), "--candidates",
                                   str(args.candidates), "--samples", str(args.samples)],
                                  env=env, capture_output=True, text=True, check=True)
        run = json.loads(proc.stdout.strip().splitlines()[-1])
        runs.append(run)
        stages = ", ".join(f"{k} {v:.1f} s" for k, v in run["stages_s"].items())
        print(f"workers={workers}: {run['candidates']['tried']} candidates in {run['wall_s']:.1f} s ({stages}); "
              f"{run['compiles_per_candidate']:.2f} XLA compiles per candidate, "
              f"{run['main_process_compiles']} in the main process", flush=True)
    if len(runs) > 1:
        base = runs[0]["stages_s"].get("compile", 0.0)
        for run in runs[1:]:
            ratio = base / run["stages_s"]["compile"] if run["stages_s"].get("compile") else float("nan")
            print(f"compile stage, {runs[0]['workers']} vs {run['workers']} workers: {ratio:.2f}x faster; "
                  f"whole sweep {runs[0]['wall_s'] / run['wall_s']:.2f}x")
    if args.json:
        from moe_tune import bench

        bench.write_results(args.json, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
