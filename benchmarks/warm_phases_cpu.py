"""Where a warm sweep's wall goes, against a cold one: `sweep_cpu.py`'s phase clock around `run_sweep`
(FINDINGS.md: warm start).

    .venv/bin/python benchmarks/warm_phases_cpu.py --m 1024 --tables DIR \
        [--k 2048 --n 768 --groups 16 --dtype float32] [--runs warm,cold,warm]

`DIR/tables_<m>` holds the tuned neighbours (as `warm_start_cpu.py` leaves them): a `warm` run is the default
strategy there (the warm local search), a `cold` run is `coordinate --cold` in a fresh dir. Each run prints
its wall time, its stages (compile, check, time) and the phases inside (inputs and reference, profiler, the
final round, the workers' compile and first run summed over the workers), in one process whose compile
workers an untimed tiny sweep started first. Nothing is asserted (a shared machine).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import sweep_cpu  # noqa: E402 - the phase clock

from moe_tune.kernels import get_op  # noqa: E402
from moe_tune.tuner import SweepRequest, run_sweep  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, required=True)
    parser.add_argument("--tables", required=True, help="the dir holding tables_<m> (warm_start_cpu.py's --grids)")
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--n", type=int, default=768)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--runs", default="warm,cold,warm")
    args = parser.parse_args()
    clock = sweep_cpu._Clock()
    sweep_cpu._instrument(clock)
    op = get_op("ragged_dot")
    scratch = Path(tempfile.mkdtemp(prefix="warm_phases_"))
    run_sweep(SweepRequest.make("ragged_dot", op.problem(m=64, k=64, n=64, groups=4), backend="tiled",
                                max_candidates=1, samples=1, profile_dir=scratch / "warmup", cold=True, fresh=True))
    problem = op.problem(m=args.m, k=args.k, n=args.n, groups=args.groups, dtype=args.dtype)
    for how in args.runs.split(","):
        clock.spent.clear()
        clock.values.clear()
        warm = how == "warm"
        started = time.perf_counter()
        result = run_sweep(SweepRequest.make(
            "ragged_dot", problem, backend="tiled", fresh=True, samples=3, cold=not warm,
            profile_dir=Path(args.tables) / f"tables_{args.m}" if warm else scratch / f"cold_{args.m}",
            strategy="grid" if warm else "coordinate"))
        wall = time.perf_counter() - started
        stages = {k: round(v, 2) for k, v in result.entry.search["stage_s"].items()}
        print(how, f"wall {wall:.2f}", "tried", result.entry.count("tried"), "stages", stages)
        print("  ", {k: round(v, 3) for k, v in {**clock.spent, **clock.values}.items()})
        verdict = result.entry.verdict or {}
        print("  verdict", verdict.get("rule"), verdict.get("noise"), verdict.get("paired_gain"), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("MOE_TUNE_COMPILE_CACHE_DIR", "off")  # cold compiles, as warm_start_cpu.py
    sys.exit(main())
