"""Held-out token counts: does the config lookup picks between tuned counts come close to the best there?

    .venv/bin/python benchmarks/heldout_cpu.py [--profile-dir DIR] [--phase all] [--kernels TEXT]
        [--time-limit S] [--json OUT] [--text OUT]

Kernels (the issue's "two presets' kernels, fwd, f32 and bf16"; chosen as the presets' smallest fwd ragged_dot
kernels so that a 2-core CPU can afford it): the `down` projection of qwen3-30b-a3b (k=768, n=2048, 16 groups)
and of deepseek-v2-lite (k=1408, n=2048, 8 groups) at ep=8, each in float32 and bfloat16, on the CPU backend
(`tiled`), balanced routing. The token count is the kernel's m (rows: tokens x top_k of the layer).

Every sweep here searches the same small space, in full (`small_space`: what the tiled backend's sweep
searches, cut to tn = n, tm <= 512 and, per tm, the default's tail rule: at most 10 configs), so that the
held-out comparison measures lookup, not which configs two random samples happened to hold (a sample of
12 of ~68 per sweep, and a "best" outside the ladder's samples could not be looked up at all).

1. `sweeps`: the ladder m = 16, 32, ..., 8192 of each kernel, cold grid sweeps over the small space (the
   tuner's rules: checks, 3-sample first round, finalists re-timed side by side).
2. `ladder`: `campaign.ladder` times neighbouring winners between their counts and writes the intervals
   (into a view holding only the ladder's entries).
3. `compare`: at 12 counts not on the ladder, drawn log-uniformly in [16, 8192] with a fixed seed, for each
   kernel: (a) the full sweep: every config of the small space checked and timed side by side (interleaved,
   `--sweep-samples` each); (b) in ONE second interleaved run (`--samples` each, every distinct config once):
   (a)'s two fastest, the config lookup picks (interval), the config nearest in log space picks (lookup before
   intervals) and the default. The best is the fastest of (b); each ratio is its time over the best's in (b),
   so a ratio is never two runs' noise.

Every phase resumes: sweeps write their logs and entries under the profile dir, a finished sweep (or ladder
boundary) is not run again, and a case already in `--json` is not compared again. `--kernels` and
`--time-limit` split the work into short runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from moe_tune.kernels import get_op
from moe_tune.layer import models

PRESETS = ("qwen3-30b-a3b", "deepseek-v2-lite")
DTYPES = ("float32", "bfloat16")
EP = 8
LADDER = [2**i for i in range(4, 14)]  # 16 .. 8192
HELDOUT_SEED = 32
MAX_SAMPLES = 61  # of one config in the comparison (short calls: see compare)
TM_MAX = 512  # the small space's largest row tile (the default's cap; sampled sweeps' winners never took 1024)


SMALL_LADDER = [8, 16]  # --small (tests/test_heldout_benchmark.py): a toy kernel, one held-out count


def kernels(small: bool = False) -> list[tuple[str, Any]]:
    """(label, problem at m=1) of each kernel: the `down` fwd ragged_dot of each preset, per dtype."""
    if small:
        from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem

        return [("toy fwd float32", RaggedDotProblem(m=1, k=64, n=128, groups=2))]
    found = []
    for name in PRESETS:
        for dtype in DTYPES:
            cases = models.layer_runs(models.get_preset(name), 1, dtype=dtype, ep=EP, direction="fwd")
            down = next(c for c in cases if c.op == "ragged_dot" and c.role == "down")
            found.append((f"{name} down fwd {dtype}", down.problem))
    return found


def small_space(impl: Any, problem: Any) -> list[Any]:
    """The default, then the configs of the tiled backend's full space (`_FULL_SPACE`) with tn = n, tm <=
    TM_MAX and the tail the default's rule gives that tm (a small group's tail, else max(16, tm / 8)): the
    space that decides here, tm and tk, in full, for the ladder's and the held-out counts alike."""
    from moe_tune.kernels.ragged_dot.tiled import SMALL_GROUP_TAIL_SIZES

    full = _FULL_SPACE(impl, problem)
    if problem.direction == "drhs":
        return full
    m, _, n = problem.matmul_dims()
    rows = max(m // problem.groups, 1)
    small = [t for t in SMALL_GROUP_TAIL_SIZES if t >= rows]

    def tail(tm: int) -> int:
        return min(small[0] if small else max(16, tm // 8), tm)

    return [full[0], *(c for c in full[1:] if c.tn == n and c.tm <= TM_MAX and c.tail == tail(c.tm))]


def restrict_space() -> None:
    """Every sweep in this process (the ladder's, through the tuner) searches `small_space`."""
    from moe_tune.kernels.ragged_dot.tiled import TiledRaggedDot

    global _FULL_SPACE
    if _FULL_SPACE is None:
        _FULL_SPACE = TiledRaggedDot.search_space
        TiledRaggedDot.search_space = small_space


_FULL_SPACE: Any = None


def heldout_counts(n: int = 12, seed: int = HELDOUT_SEED, ladder: list[int] = LADDER) -> list[int]:
    """`n` distinct counts between the ladder's ends, none on it, drawn log-uniformly with `seed`."""
    lo, hi = ladder[0], ladder[-1]
    rng = np.random.default_rng(seed)
    counts: list[int] = []
    while len(counts) < n:
        m = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
        if lo <= m <= hi and m not in ladder and m not in counts:
            counts.append(m)
    return sorted(counts)


def at(problem: Any, m: int) -> Any:
    return dataclasses.replace(problem, m=m)


def sweep_all(problems: list[Any], settings: Any, share: tuple[int, int] | None = None) -> None:
    """Sweep every problem not yet complete in the table (a finished sweep is skipped, a started one resumes);
    `share`: only the I-th of N disjoint shares of them (`--shard`: several processes at once)."""
    from moe_tune.campaign import runner
    from moe_tune.campaign.request import op_cases
    from moe_tune.tuner import compiling

    compiling.enable_cache()
    planned = runner.prepare(op_cases("ragged_dot", problems), settings, share=share)
    print(f"  {len(planned.todo)} sweeps to run, {len(planned.done)} done", flush=True)
    for i, outcome in enumerate(runner.run_here(planned.todo, settings)):
        state = outcome.error or f"{outcome.wall_s:.0f} s"
        print(f"  swept {get_op('ragged_dot').describe(outcome.sweep.problem)}: {state}", flush=True)


def ladder_view(profile_dir: Path, problems: list[Any]) -> Path:
    """A profile dir holding only the ladder's entries (copied from the sweeps' table) and the intervals measured
    from them: what lookup answers from, so that the held-out counts' own entries cannot answer themselves."""
    from moe_tune.core import devices
    from moe_tune.profiles.table import table_path
    from moe_tune.profiles.entry import entry_key
    from moe_tune.profiles.table import read_table, update_table

    view = profile_dir / "ladder_view"
    source = read_table(table_path(profile_dir, devices.device_kind(), "ragged_dot"))["entries"]
    keys = {entry_key("ragged_dot", p, "tiled", "balanced") for p in problems}
    update_table(table_path(view, devices.device_kind(), "ragged_dot"), "ragged_dot", devices.device_kind(),
                 lambda t: t["entries"].update({k: source[k] for k in keys if k in source}))
    return view


def measure_ladders(view: Path, problems: list[Any], settings: Any) -> list[dict[str, Any]]:
    """Every kernel's ladder boundaries, measured (or reused) into `view`; returns the intervals."""
    from moe_tune.campaign import ladder
    from moe_tune.campaign.request import op_cases, plan
    from moe_tune.core import devices

    planned = plan(op_cases("ragged_dot", problems), platform=devices.platform(), distribution="balanced")
    found = []
    for one in ladder.ladders(planned, "balanced"):
        print(f"ladder {one.label()}", flush=True)
        outcome = ladder.measure(one, dataclasses.replace(settings, profile_dir=view), devices.device_kind(),
                                 on_boundary=lambda text: print(f"  {text}", flush=True))
        print(f"  {outcome.measured} boundaries measured, {outcome.reused} reused", flush=True)
        found += outcome.intervals
    return found


def held_intervals(view: Path) -> list[dict[str, Any]]:
    """The intervals the ladder view holds (measured by an earlier `ladder` phase)."""
    from moe_tune.core import devices
    from moe_tune.profiles.table import table_path
    from moe_tune.profiles.table import read_table

    return list(read_table(table_path(view, devices.device_kind(), "ragged_dot"))["intervals"].values())


def pick(view: Path, problem: Any) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(the config lookup picks from the ladder view, the config nearest in log space picks, lookup's source)."""
    from moe_tune.core import devices
    from moe_tune.profiles import use_profiles
    from moe_tune.profiles.table import table_path
    from moe_tune.profiles.table import read_table

    with use_profiles(view):
        found = get_op("ragged_dot").lookup(problem, backend="tiled", distribution="balanced")
    entries = read_table(table_path(view, devices.device_kind(), "ragged_dot"))["entries"].values()
    family = {k: v for k, v in problem.key_fields().items() if k != "m"}
    same = [e for e in entries if {k: v for k, v in e["fields"].items() if k not in ("m", "backend", "distribution")}
            == family]
    nearest = min(same, key=lambda e: abs(math.log(e["fields"]["m"] / problem.m)))
    return found.config.to_dict(), dict(nearest["config"]), f"{found.source} ({found.path})"


def compare(view: Path, label: str, problem: Any, samples: int, sweep_samples: int,
            timing_s: float = 0.0) -> dict[str, Any]:
    """One held-out case: the full sweep of the small space (side by side), then its two fastest, lookup's
    pick, nearest's pick and the default re-timed in one interleaved run (module docstring, compare), with
    at least `samples` samples each and more for short calls: about `timing_s` seconds of calls per config
    (at most MAX_SAMPLES), since the fewer the samples of a short noisy call, the more the fastest of several
    equal configs flatters the best."""
    from moe_tune.tuner.crossover import time_side_by_side

    impl = get_op("ragged_dot").backends.get("tiled")
    space = [c.to_dict() for c in impl.search_space(problem)]
    swept_all = time_side_by_side("ragged_dot", "tiled", problem, {f"s{i}": c for i, c in enumerate(space)},
                                  distribution="balanced", samples=sweep_samples)
    ranked = sorted(swept_all.median_s, key=swept_all.median_s.__getitem__)
    samples = max(samples, min(MAX_SAMPLES, math.ceil(timing_s / swept_all.median_s[ranked[0]])))
    interval, nearest, source = pick(view, problem)
    chosen = {"sweep_best": space[int(ranked[0][1:])], "lookup": interval, "nearest": nearest,
              "default": space[0]}
    if len(ranked) > 1:
        chosen["sweep_second"] = space[int(ranked[1][1:])]
    distinct: dict[str, dict[str, Any]] = {}
    for config in chosen.values():
        distinct.setdefault(json.dumps(config, sort_keys=True), config)
    labels = {key: f"c{i}" for i, key in enumerate(distinct)}
    timed = time_side_by_side("ragged_dot", "tiled", problem, {labels[k]: c for k, c in distinct.items()},
                              distribution="balanced", samples=samples)
    by_key = {k: timed.median_s.get(labels[k]) for k in distinct}
    best_key = min((k for k, t in by_key.items() if t is not None), key=by_key.__getitem__)
    chosen["best"] = distinct[best_key]
    times = {name: by_key[json.dumps(c, sort_keys=True)] for name, c in chosen.items()}
    best = times["best"]
    return {"kernel": label, "m": problem.m, "configs": chosen, "lookup_source": source, "times_s": times,
            "ratio": {name: (t / best if t and best else None) for name, t in times.items()},
            "in_space": {name: c in space for name, c in chosen.items()}, "space": len(space),
            "sweep_median_s": {json.dumps(space[int(n[1:])], sort_keys=True): t
                               for n, t in swept_all.median_s.items()},
            "sweep_unusable": swept_all.unusable, "spread": timed.spread, "unusable": timed.unusable,
            "method": timed.method, "samples": samples, "sweep_samples": sweep_samples, "timing_s": timing_s}


def case_line(result: dict[str, Any]) -> str:
    r = {k: "n/a" if v is None else f"{v:.3f}x" for k, v in result["ratio"].items()}
    return (f"{result['kernel']} m={result['m']}: lookup {r['lookup']}, nearest {r['nearest']}, default "
            f"{r['default']} the best ({result['lookup_source'].split(' (')[0]})"
            + (f" unusable: {result['unusable']}" if result["unusable"] else ""))


def summary(results: list[dict[str, Any]]) -> list[str]:
    lines = []
    for name in ("lookup", "nearest", "default"):
        ratios = [r["ratio"][name] for r in results if r["ratio"].get(name) is not None]
        if ratios:
            lines.append(f"{name:>8} / best over {len(ratios)} cases: median {statistics.median(ratios):.3f}x, "
                         f"worst {max(ratios):.3f}x, within 1.05x: {sum(r <= 1.05 for r in ratios)}")
    differ = [r for r in results if r["configs"]["lookup"] != r["configs"]["nearest"]
              and None not in (r["ratio"].get("lookup"), r["ratio"].get("nearest"))]
    if differ:
        lines.append(f"lookup and nearest pick different configs in {len(differ)} cases: lookup / best median "
                     f"{statistics.median(r['ratio']['lookup'] for r in differ):.3f}x (worst "
                     f"{max(r['ratio']['lookup'] for r in differ):.3f}x), nearest / best median "
                     f"{statistics.median(r['ratio']['nearest'] for r in differ):.3f}x (worst "
                     f"{max(r['ratio']['nearest'] for r in differ):.3f}x)")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile-dir", type=Path,
                        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "moe-tune-heldout13")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--samples", type=int, default=9, help="samples of the side-by-side comparison")
    parser.add_argument("--sweep-samples", type=int, default=3, help="samples of a held-out count's full sweep")
    parser.add_argument("--timing-s", type=float, default=1.0, help="comparison: more samples for short calls, "
                        f"about this many seconds of calls per config (at most {MAX_SAMPLES} samples)")
    parser.add_argument("--again", action="store_true", help="compare the --counts again (replacing results "
                        "measured with another --timing-s; a rerun resumes)")
    parser.add_argument("--phase", choices=["sweeps", "ladder", "compare", "all"], default="all",
                        help="compare: only the held-out comparisons, from the intervals measured before")
    parser.add_argument("--small", action="store_true", help="a toy run: one tiny kernel, ladder 8, 16, one count")
    parser.add_argument("--kernels", default=None, help="only the kernels whose label holds this text "
                        "(e.g. 'float32', 'qwen3')")
    parser.add_argument("--counts", default=None, help="compare only these held-out counts (comma-separated)")
    parser.add_argument("--time-limit", type=float, default=None, metavar="S",
                        help="start no new sweep or comparison after S seconds (rerun to go on)")
    parser.add_argument("--json", type=Path, default=None, help="the results (also read back to resume)")
    parser.add_argument("--text", type=Path, default=None, help="also write the printed summary here")
    args = parser.parse_args()

    from moe_tune.tuner import SweepSettings

    restrict_space()
    start = time.monotonic()

    def out_of_time() -> bool:
        return args.time_limit is not None and time.monotonic() - start > args.time_limit

    settings = SweepSettings(profile_dir=args.profile_dir, workers=args.workers, cold=True)
    ladder = SMALL_LADDER if args.small else LADDER
    held = heldout_counts(1, ladder=ladder) if args.small else heldout_counts()
    chosen = [(label, p) for label, p in kernels(args.small) if args.kernels is None or args.kernels in label]
    print(f"held-out counts: {held}; kernels: {[label for label, _ in chosen]}", flush=True)
    rungs = [at(p, m) for _, p in chosen for m in ladder]
    if args.phase in ("sweeps", "all"):
        for problem in rungs:  # one at a time, smallest counts first, so that --time-limit can stop between
            if out_of_time():
                print("time limit: stopping before the next sweep (rerun to go on)", flush=True)
                return 0
            sweep_all([problem], settings)
    if args.phase == "sweeps":
        return 0
    view = ladder_view(args.profile_dir, rungs)
    if args.phase != "compare":
        measure_ladders(view, rungs, settings)
    if args.phase == "ladder":
        return 0
    done = json.loads(args.json.read_text())["results"] if args.json is not None and args.json.exists() else []
    # a case compared before its ladder was complete (lookup had no interval for it then) is compared again
    results = [r for r in done if r["lookup_source"].startswith("interval")]
    if args.again and args.counts:  # measured again: those counts' results (chosen kernels) of another method
        again = {int(c) for c in args.counts.split(",")}
        results = [r for r in results if not (r["m"] in again and r["kernel"] in {k for k, _ in chosen}
                                              and r.get("timing_s") != args.timing_s)]
    seen = {(r["kernel"], r["m"]) for r in results}
    wanted = [int(c) for c in args.counts.split(",")] if args.counts else held
    # smallest counts first, every kernel at each: an interrupted run has covered all kernels evenly
    for m in sorted(wanted):
        for label, problem in chosen:
            if (label, m) in seen:
                continue
            if out_of_time():
                print("time limit: stopping before the next comparison (rerun to go on)", flush=True)
                break
            result = compare(view, label, at(problem, m), args.samples, args.sweep_samples, args.timing_s)
            print(case_line(result), flush=True)
            results.append(result)
            if args.json is not None:
                _write(args.json, results, held_intervals(view), held, args)
    header = (f"# benchmarks/heldout_cpu.py: ladder {ladder[0]}..{ladder[-1]}, held-out counts {held}; every sweep "
              f"over the small full space (tn=n, tm<={TM_MAX} x tk, the default's tail rule); per case a full sweep "
              f"side by side ({args.sweep_samples} samples), then best/lookup/nearest/default re-timed in one "
              f"interleaved run (>= {args.samples} samples, ~{args.timing_s} s of calls per config, <= {MAX_SAMPLES})")
    lines = [header] + [case_line(r) for r in sorted(results, key=lambda r: (r["m"], r["kernel"]))] + summary(results)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    lines.append(f"load: {load}")
    print("\n".join(lines))
    if args.json is not None:  # every kernel's intervals the view holds (a --kernels run measured only its own)
        _write(args.json, results, held_intervals(view), held, args)
    if args.text is not None:
        args.text.write_text("\n".join(lines) + "\n")
    return 0


def _write(path: Path, results: list[dict[str, Any]], intervals: list[dict[str, Any]], held: list[int],
           args: argparse.Namespace) -> None:
    payload = {"heldout_counts": held, "ladder": SMALL_LADDER if args.small else LADDER, "tm_max": TM_MAX,
               "samples": args.samples, "sweep_samples": args.sweep_samples, "intervals": [{k: r[k] for k in ("key", "lo", "hi", "config")}
                                                      for r in intervals],
               "written": time.strftime("%Y-%m-%dT%H:%M:%S"), "results": results}
    path.write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
