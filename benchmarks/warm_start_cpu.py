"""Warm start against cold on this CPU: what a sweep of a new shape costs to return a config within 1.05x of
the best known, when the nearest shapes are already tuned (a ladder of token counts of the `strategies_cpu.py`
shape, m=2048 k=2048 n=768 groups=16, among them), and what it ends with.

    .venv/bin/python benchmarks/warm_start_cpu.py [--ms 512,1024,2048,4096] [--k 2048 --n 768 --groups 16]
        [--samples 3] [--grids DIR [--grids-only]] [--only M,...] [--json OUT]

1. Every count of the ladder is swept with `grid` (cold, each in its own profile dir `DIR/grid_<m>`; with
   `--grids DIR`, the entries an earlier run left there are used instead): the tuned neighbours of the others.
2. For each count, `coordinate` runs cold (`--cold`, an empty dir) and the default strategy (`grid`) runs warm
   (a dir holding the grid entries of the other counts of the ladder, never its own: with seeds it is the
   warm local search of `tuner/strategies.py`; `coordinate` with seeds runs the same search), alternating
   which goes first.
3. Then every config either run measured, and the grid's winner, are compiled once and timed side by side,
   interleaved in the same trace rounds (`bench.time_variants`): the reference that load drifting between
   runs cannot bias. "Good" = within 1.05x of the fastest of them (the grid winner included).
4. Per run: (a) the whole run's candidates and wall time (a sweep returns its config only at its end: this is
   the cost to a good config when its winner is good); (b) the candidates and wall time until its first
   good config was measured (each candidate's finish is when its line reached the sweep log); its winner's
   side-by-side time over the fastest's and the grid winner's (1.00 = as good as the full grid). The cold
   grid's candidates and wall time are its own run's (step 1; with --grids an earlier run's, under that run's load).

Printed: per count, warm / cold ratios, and over the counts their median and worst: (a) whole sweeps, (b) to
the first good config over the counts where the default is not good already (where it is, both runs reach a
good config with their first candidate, the default: how many such counts is printed), and the winners over
the fastest side by side. Nothing is asserted (a shared machine).
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

import jax

from moe_tune.commands import bench
from moe_tune.core import devices
from moe_tune.kernels import get_op
from moe_tune.profiles import Entry, read_table, write_entries
from moe_tune.tuner import SweepRequest, run_sweep
from moe_tune.tuner import search as warm_start
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
    parser.add_argument("--grids", default=None, help="reuse the grid entries of an earlier run's dir")
    parser.add_argument("--compare-samples", type=int, default=5, help="samples of the side-by-side timing")
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", default=None,
                        help="measure warm and cold at these counts only (the whole ladder still seeds them)")
    parser.add_argument("--grids-only", action="store_true",
                        help="step 1 only: sweep the ladder's grids into --grids DIR (a later run reuses them)")
    args = parser.parse_args()

    op = get_op("ragged_dot")
    ms = [int(v) for v in args.ms.split(",")]
    problems = {m: op.problem(m=m, k=args.k, n=args.n, groups=args.groups, dtype=args.dtype) for m in ms}
    extra = {} if args.workers is None else {"workers": args.workers}
    load = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"ladder m={ms}, k={args.k} n={args.n} groups={args.groups} {args.dtype}, tiled, {args.samples} samples; "
          f"on {devices.device_kind()}; load: {load()}", flush=True)

    root = Path(args.grids or tempfile.mkdtemp(prefix="warm_start_"))
    print(f"profile dirs under {root}", flush=True)
    # Warm the process and the compile workers up, so that the first measured sweep does not pay for it.
    run_sweep(SweepRequest.make("ragged_dot", problems[ms[0]], backend="tiled", max_candidates=1, samples=1,
                                profile_dir=root / "warmup", cold=True, fresh=True, **extra))
    kind = devices.device_kind()
    grids = {}
    for m, problem in problems.items():
        table = root / f"grid_{m}" / kind / "ragged_dot.json"
        started = time.perf_counter()
        if args.grids is None or not table.is_file():
            result, finished = _sweep(problem, root / f"grid_{m}", strategy="grid", samples=args.samples,
                                      cold=True, **extra)
            grids[m] = {"entry": result.entry, "tried": len(finished), "wall_s": time.perf_counter() - started}
        else:
            (entry,) = [Entry.from_json(e, k) for k, e in read_table(table)["entries"].items()]
            grids[m] = {"entry": entry, "tried": entry.count("tried"), "wall_s": entry.sweep_wall_s}
        print(f"  grid m={m}: {grids[m]['tried']} candidates, {grids[m]['wall_s']:.1f} s, winner "
              f"{_label(grids[m]['entry'].config)}", flush=True)

    if args.grids_only:
        print(f"load at the end: {load()}")
        return 0
    rows = []
    impl = op.backends.get("tiled")
    only = ms if args.only is None else [int(v) for v in args.only.split(",")]
    for index, (m, problem) in enumerate(problems.items()):
        if m not in only:
            continue
        grid_winner = _label(grids[m]["entry"].config)
        tables = root / f"tables_{m}"  # the other counts' grid entries: the tuned neighbours
        write_entries(tables / kind / "ragged_dot.json", "ragged_dot", kind, [grids[o]["entry"] for o in ms if o != m])
        plan = SweepPlan(SweepRequest.make("ragged_dot", problem, backend="tiled", profile_dir=tables))
        start = warm_start.find("ragged_dot", plan.device_kind, plan.fields, plan.key, plan.space, own_dir=tables)
        runs, finishes = {}, {}
        for how in (("cold", "warm") if index % 2 == 0 else ("warm", "cold")):
            directory = root / f"{how}_{m}" if how == "cold" else tables
            started = time.perf_counter()
            result, finishes[how] = _sweep(problem, directory, strategy="coordinate" if how == "cold" else "grid",
                                           samples=args.samples, cold=how == "cold", **extra)
            runs[how] = {"tried": len(finishes[how]), "wall_s": time.perf_counter() - started,
                         "winner": _label(result.entry.config), "start": result.entry.search["start"],
                         "local": result.entry.search.get("local"), "stopped": result.entry.search["stopped"],
                         "strategy": result.entry.search["strategy"],
                         "verdict": (result.entry.verdict or {}).get("rule"),
                         "stage_s": dict(result.entry.search.get("stage_s") or {})}
            # the rest of the wall: inputs and reference, finals, entry write (fixed costs of every sweep)
            runs[how]["stage_s"]["other"] = runs[how]["wall_s"] - sum(runs[how]["stage_s"].values())
        # the side-by-side reference: every config either run measured, and the grid's winner
        configs = {_label(c): c for how in finishes for c, _ in finishes[how]}
        configs[grid_winner] = grids[m]["entry"].config
        inputs = jax.device_put(op.make_inputs(problem, "balanced", seed=1))
        variants = {label: (lambda x, c=impl.config_cls(**cfg): op.run(impl, c, problem, x))
                    for label, cfg in configs.items()}
        side = bench.time_variants(variants, inputs, samples=args.compare_samples)["times_s"]
        best = min(side.values())
        good = {label for label, t in side.items() if t <= GOOD * best}
        for how, run in runs.items():
            n, at = _reach(finishes[how], good)
            run.update(reach_candidates=n, reach_s=at, winner_vs_grid_winner=side[run["winner"]] / side[grid_winner],
                       winner_vs_best=side[run["winner"]] / best)
        default_label = _label(plan.space[0].to_dict())
        row = {"m": m, "default": default_label,
               "default_good": default_label in good, "default_vs_best": side.get(default_label, float("nan")) / best,
               "grid_tried": grids[m]["tried"], "grid_wall_s": grids[m]["wall_s"], "grid_winner": grid_winner,
               "grid_winner_vs_best_side_by_side": side[grid_winner] / best, "compared": len(side),
               "good_configs": len(good), "side_by_side_s": side, "seeds": [c.label() for c in start.seeds],
               "seed_sources": list(start.sources), "coordinate": runs, "load": load()}
        rows.append(row)
        c, w = runs["cold"], runs["warm"]
        print(f"  m={m}: seeds {row['seeds'] or 'none (the neighbours won with the default)'}; {len(side)} configs "
              f"side by side, {len(good)} within {GOOD}x of the fastest; grid winner {side[grid_winner] / best:.3f}x\n"
              f"    coordinate cold: good at candidate {c['reach_candidates']} ({_s(c['reach_s'])}), all "
              f"{c['tried']} in {c['wall_s']:.1f} s, winner {c['winner_vs_grid_winner']:.3f}x the grid winner\n"
              f"    grid warm ({'local' if w['local'] else 'whole grid'}): good at candidate {w['reach_candidates']} ({_s(w['reach_s'])}), all "
              f"{w['tried']} in {w['wall_s']:.1f} s, winner {w['winner_vs_grid_winner']:.3f}x the grid winner\n"
              f"    warm / cold grid: candidates {w['tried'] / row['grid_tried']:.2f}, wall "
              f"{w['wall_s'] / row['grid_wall_s']:.2f}; warm / cold coordinate: candidates "
              f"{w['tried'] / c['tried']:.2f}, wall {w['wall_s'] / c['wall_s']:.2f}\n"
              f"    winners over the fastest side by side: warm {w['winner_vs_best']:.3f} ({w['verdict']}), cold "
              f"{c['winner_vs_best']:.3f} ({c['verdict']}), grid {side[grid_winner] / best:.3f}\n"
              f"    where the wall went (s): " + "; ".join(f"{how} " + ", ".join(
                  f"{k} {v:.1f}" for k, v in runs[how]["stage_s"].items()) for how in ("warm", "cold")),
              flush=True)

    def ratio(get, among=None) -> list[float]:
        chosen = rows if among is None else [r for r in rows if among(r)]
        return [get(r, "warm") / get(r, "cold") for r in chosen if get(r, "warm") and get(r, "cold")]

    grid_ratio = lambda name, of: [r["coordinate"]["warm"][name] / r[of] for r in rows]
    not_default = lambda r: not r["default_good"]
    # (a) the whole sweep (a sweep returns its config only at its end), (b) to the first good config, over the
    # cases where the default is not good already (where it is, both reach it with their first candidate)
    costs = {
        "(a) sweep candidates warm/cold": ratio(lambda r, k: r["coordinate"][k]["tried"]),
        "(a) sweep wall warm/cold": ratio(lambda r, k: r["coordinate"][k]["wall_s"]),
        "(b) reach candidates warm/cold, default not good": ratio(
            lambda r, k: r["coordinate"][k]["reach_candidates"], not_default),
        "(b) reach wall warm/cold, default not good": ratio(lambda r, k: r["coordinate"][k]["reach_s"], not_default),
        "(b) reach wall warm/cold, all cases": ratio(lambda r, k: r["coordinate"][k]["reach_s"]),
    }
    never = {how: [r["m"] for r in rows if r["coordinate"][how]["reach_candidates"] is None] for how in ("warm", "cold")}
    print(f"\ndefault within {GOOD}x of the fastest at {sum(r['default_good'] for r in rows)} of {len(rows)} counts "
          f"(there (b) is candidate 1 for both); never reached a good config: warm at {never['warm'] or 'none'}, "
          f"cold at {never['cold'] or 'none'}")
    for name, values in costs.items():
        shown = ", ".join(f"{v:.2f}" for v in values)
        print(f"  {name:<50} {shown}  (median {statistics.median(values):.2f}, worst {max(values):.2f})"
              if values else f"  {name:<50} no case")
    for how in ("warm", "cold"):
        values = [r["coordinate"][how]["winner_vs_best"] for r in rows]
        print(f"  quality: {how} winner over the fastest side by side {', '.join(f'{v:.3f}' for v in values)} "
              f"(median {statistics.median(values):.3f}, worst {max(values):.3f})")
    per_count = {
        "warm_over_cold_grid_candidates": grid_ratio("tried", "grid_tried"),
        "warm_over_cold_grid_wall_s (grid wall from its own run)": grid_ratio("wall_s", "grid_wall_s"),
        "reach_candidates_warm_over_cold": ratio(lambda r, k: r["coordinate"][k]["reach_candidates"]),
        "reach_s_warm_over_cold": ratio(lambda r, k: r["coordinate"][k]["reach_s"]),
        "total_candidates_warm_over_cold": ratio(lambda r, k: r["coordinate"][k]["tried"]),
        "total_s_warm_over_cold": ratio(lambda r, k: r["coordinate"][k]["wall_s"]),
        "winner_vs_grid_winner_cold": [r["coordinate"]["cold"]["winner_vs_grid_winner"] for r in rows],
        "winner_vs_grid_winner_warm": [r["coordinate"]["warm"]["winner_vs_grid_winner"] for r in rows],
        "winner_vs_fastest_warm": [r["coordinate"]["warm"]["winner_vs_best"] for r in rows],
        "winner_vs_fastest_cold": [r["coordinate"]["cold"]["winner_vs_best"] for r in rows],
        "winner_vs_fastest_grid": [r["grid_winner_vs_best_side_by_side"] for r in rows],
    }
    print("\nwarm / cold (cold = coordinate unless it says grid; per count; median):")
    for name, values in per_count.items():
        shown = ", ".join(f"{v:.2f}" for v in values)
        print(f"  {name:<34} {shown}  (median {statistics.median(values):.2f})" if values else f"  {name}: none")
    print(f"load at the end: {load()}")
    summary = {**costs, **per_count, "default_good_at": [r["m"] for r in rows if r["default_good"]],
               "never_reached_good": never}
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
