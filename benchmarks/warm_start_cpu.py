"""Warm start against cold on this CPU: what a sweep of a new shape costs to reach a config within 1.05x of the
grid's best, when the nearest shapes are already tuned (a ladder of token counts of the `strategies_cpu.py`
shape), and what it ends with.

    .venv/bin/python benchmarks/warm_start_cpu.py [--ms 512,1024,2048,4096] [--k 2048 --n 768 --groups 16]
        [--samples 3] [--json OUT]

1. Every count of the ladder is swept with `grid` (cold, each in its own empty profile dir): the reference.
   Its candidates' medians say which configs are "good" (within 1.05x of the fastest), and its entries are
   the tuned neighbours of the others.
2. For each count, `coordinate` runs cold (`--cold`, an empty dir) and warm (a dir holding the grid entries of
   the other counts of the ladder, never its own), alternating which goes first.
3. Per run: the candidates and wall time until the first good config was measured (each candidate's finish
   is when its line reached the sweep log), the whole run's candidates and wall time, and its winner's
   reference median over the grid best (1.00 = as good as the grid). For `grid` itself the candidates until
   the first good config follow from the order alone: cold = the space's order, warm = the default, the
   seeds, then the rest (the seeds are those `warm_start.find` picks from the same tables).

Printed: per count and in all, warm / cold ratios of those costs. Nothing is asserted (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moe_tune import bench, devices
from moe_tune.kernels import get_op
from moe_tune.profiles import write_entries
from moe_tune.tuner import SweepRequest, run_sweep, strategies, warm_start
from moe_tune.tuner.request import SweepPlan

GOOD = 1.05


def _label(config: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in config.items())


def _sweep(problem, profile_dir: Path, **settings) -> tuple[object, list[tuple[dict, float]]]:
    """One sweep, fresh; returns (result, [(config, seconds since the start when its log line was written)])."""
    finished: list[tuple[dict, float]] = []
    started = time.perf_counter()

    def on_log(data: bytes) -> None:
        now = time.perf_counter() - started
        for raw in data.splitlines():
            line = json.loads(raw)
            if line.get("type") == "candidate" and not line.get("recompiled"):
                finished.append((line["config"], now))

    request = SweepRequest.make("ragged_dot", problem, backend="tiled", profile_dir=profile_dir, fresh=True,
                                **settings)
    result = run_sweep(request, on_log=on_log)
    return result, finished


def _reach(finished: list[tuple[dict, float]], good: set[str]) -> tuple[int | None, float | None]:
    """(candidates, seconds) until the first good config was finished, or (None, None)."""
    for n, (config, at) in enumerate(finished, 1):
        if _label(config) in good:
            return n, at
    return None, None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", default="512,1024,2048,4096", help="the ladder of token counts (m)")
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--n", type=int, default=768)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    op = get_op("ragged_dot")
    ms = [int(v) for v in args.ms.split(",")]
    problems = {m: op.problem(m=m, k=args.k, n=args.n, groups=args.groups, dtype=args.dtype) for m in ms}
    extra = {} if args.workers is None else {"workers": args.workers}
    load = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"ladder m={ms}, k={args.k} n={args.n} groups={args.groups} {args.dtype}, tiled, {args.samples} samples; "
          f"on {devices.device_kind()}; load: {load()}", flush=True)

    root = Path(tempfile.mkdtemp(prefix="warm_start_"))
    # Warm the process and the compile workers up, so that the first measured sweep does not pay for it.
    run_sweep(SweepRequest.make("ragged_dot", problems[ms[0]], backend="tiled", max_candidates=1, samples=1,
                                profile_dir=root / "warmup", cold=True, **extra))
    grids = {}
    for m, problem in problems.items():
        started = time.perf_counter()
        result, finished = _sweep(problem, root / f"grid_{m}", strategy="grid", samples=args.samples, cold=True,
                                  **extra)
        medians = {_label(r["config"]): r["median_s"] for r in result.entry.results}
        best = min(medians.values())
        grids[m] = {"entry": result.entry, "medians": medians, "best_s": best, "order": [c for c, _ in finished],
                    "good": {c for c, t in medians.items() if t <= GOOD * best}, "wall_s": time.perf_counter() - started,
                    "tried": len(finished)}
        print(f"  grid m={m}: {len(finished)} candidates, {grids[m]['wall_s']:.1f} s, best "
              f"{best * 1e3:.3f} ms, {len(grids[m]['good'])} configs within {GOOD}x", flush=True)

    rows = []
    for index, (m, problem) in enumerate(problems.items()):
        ref = grids[m]
        tables = root / f"tables_{m}"  # the other counts' grid entries: the tuned neighbours
        write_entries(tables / devices.device_kind() / "ragged_dot.json", "ragged_dot", devices.device_kind(),
                      [grids[o]["entry"] for o in ms if o != m])
        plan = SweepPlan(SweepRequest.make("ragged_dot", problem, backend="tiled", profile_dir=tables))
        start = warm_start.find("ragged_dot", plan.device_kind, plan.fields, plan.key, plan.space, own_dir=tables)
        # grid's candidates until a good config, by order alone (cold: the space's; warm: seeds first)
        warm_order = strategies.make("grid", plan.space, seeds=start.seeds).next_round({})
        grid_cold_n, _ = _reach([(c, 0.0) for c in ref["order"]], ref["good"])
        grid_warm_n, _ = _reach([(c.to_dict(), 0.0) for c in warm_order], ref["good"])
        runs = {}
        for kind in (("cold", "warm") if index % 2 == 0 else ("warm", "cold")):
            directory = root / f"{kind}_{m}" if kind == "cold" else tables
            started = time.perf_counter()
            result, finished = _sweep(problem, directory, strategy="coordinate", samples=args.samples,
                                      cold=kind == "cold", **extra)
            wall = time.perf_counter() - started
            n, at = _reach(finished, ref["good"])
            winner = _label(result.entry.config)
            runs[kind] = {"tried": len(finished), "wall_s": wall, "reach_candidates": n, "reach_s": at,
                          "winner": winner, "winner_vs_grid_best": ref["medians"].get(winner, float("nan")) /
                          ref["best_s"], "start": result.entry.search["start"]}
        row = {"m": m, "grid_tried": ref["tried"], "grid_wall_s": ref["wall_s"], "grid_best_s": ref["best_s"],
               "good_configs": len(ref["good"]), "seeds": [c.label() for c in start.seeds],
               "seed_sources": list(start.sources), "grid_reach_cold": grid_cold_n, "grid_reach_warm": grid_warm_n,
               "coordinate": runs, "load": load()}
        rows.append(row)
        c, w = runs["cold"], runs["warm"]
        print(f"  m={m}: seeds {row['seeds']}\n"
              f"    grid order: good config at candidate {grid_cold_n} cold, {grid_warm_n} warm\n"
              f"    coordinate cold: good at {c['reach_candidates']} ({_s(c['reach_s'])}), all {c['tried']} in "
              f"{c['wall_s']:.1f} s, winner {c['winner_vs_grid_best']:.3f}x grid best\n"
              f"    coordinate warm: good at {w['reach_candidates']} ({_s(w['reach_s'])}), all {w['tried']} in "
              f"{w['wall_s']:.1f} s, winner {w['winner_vs_grid_best']:.3f}x grid best", flush=True)

    def ratio(get) -> list[float]:
        return [get(r, "warm") / get(r, "cold") for r in rows if get(r, "warm") and get(r, "cold")]

    summary = {
        "reach_candidates_warm_over_cold": ratio(lambda r, k: r["coordinate"][k]["reach_candidates"]),
        "reach_s_warm_over_cold": ratio(lambda r, k: r["coordinate"][k]["reach_s"]),
        "total_candidates_warm_over_cold": ratio(lambda r, k: r["coordinate"][k]["tried"]),
        "total_s_warm_over_cold": ratio(lambda r, k: r["coordinate"][k]["wall_s"]),
        "grid_reach_warm_over_cold": [r["grid_reach_warm"] / r["grid_reach_cold"] for r in rows
                                      if r["grid_reach_warm"] and r["grid_reach_cold"]],
        "winner_vs_grid_best_cold": [r["coordinate"]["cold"]["winner_vs_grid_best"] for r in rows],
        "winner_vs_grid_best_warm": [r["coordinate"]["warm"]["winner_vs_grid_best"] for r in rows],
    }
    print("\nwarm / cold (per count; median):")
    for name, values in summary.items():
        shown = ", ".join(f"{v:.2f}" for v in values)
        print(f"  {name:<34} {shown}  (median {statistics.median(values):.2f})" if values else f"  {name}: none")
    print(f"load at the end: {load()}")
    if args.json:
        bench.write_results(args.json, rows)
        data = json.loads(Path(args.json).read_text())
        data.update(summary=summary, good=GOOD, samples=args.samples,
                    shape={"k": args.k, "n": args.n, "groups": args.groups, "dtype": args.dtype, "ms": ms})
        Path(args.json).write_text(json.dumps(data, indent=1, default=str))
        print(f"wrote {args.json}")
    return 0


def _s(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.1f} s"


if __name__ == "__main__":
    os.environ.setdefault("MOE_TUNE_COMPILE_CACHE_DIR", "off")  # cold compiles: no sweep reuses another's
    sys.exit(main())
