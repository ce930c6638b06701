"""What a ladder rung's sweep decides, against a long side-by-side run of the same configs
(FINDINGS.md: final round budget).

    .venv/bin/python benchmarks/finals_cpu.py --kernel "deepseek-v2-lite down fwd
        bfloat16" --m 32,43,64 [--samples 61] [--repeat 1] [--json OUT]

For each count m of one of `heldout_cpu.py`'s kernels, over heldout_cpu's small space (the default and tm x tk):

1. the tuner's sweep (cold, grid, a fresh profile dir, as heldout_cpu's ladder sweeps run): its verdict (rule,
   noise threshold), each finalist's median, spread ((max - min) / median) and samples, and the sweep's wall time;
2. then every config of the space checked and timed side by side in one interleaved run of `--samples` samples
   (`crossover.time_side_by_side`): each config's median over the default's, the reference the sweep's choice is
   held to.

`--repeat N` runs the two N times, alternating (sweep, long run, sweep, ...), so that how often a sweep keeps the
default shows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import heldout_cpu
from moe_tune.kernels import get_op


def sweep_once(problem: Any, final_time_s: float) -> dict[str, Any]:
    """The tuner's cold grid sweep of `problem` in a fresh profile dir, its final round given `final_time_s`
    seconds of calls per finalist (0: the samples alone, without the time budget): its verdict and wall time."""
    from moe_tune.core import devices
    from moe_tune.profiles.table import table_path
    from moe_tune.profiles.table import read_table
    from moe_tune.tuner import SweepSettings

    with tempfile.TemporaryDirectory(prefix="finals_cpu_") as tmp:
        settings = SweepSettings(profile_dir=Path(tmp), workers=1, cold=True, final_time_s=final_time_s)
        start = time.perf_counter()
        heldout_cpu.sweep_all([problem], settings)
        wall = time.perf_counter() - start
        entry = next(iter(read_table(table_path(Path(tmp), devices.device_kind(), "ragged_dot"))["entries"]
                          .values()))
    verdict = entry["verdict"]
    return {"final_time_s": final_time_s, "wall_s": wall, "rule": verdict["rule"], "noise": verdict.get("noise"), "config": entry["config"],
            "finalists": [{"config": f["config"], "is_default": f.get("is_default", False),
                           "median_s": f["median_s"], "samples": f.get("samples"),
                           "spread": f.get("spread"),
                           "first_median_s": f.get("first_median_s")} for f in verdict["finalists"]]}


def long_run(problem: Any, samples: int) -> dict[str, Any]:
    """Every config of the small space timed side by side, `samples` each (the default twice: `s0` and its
    copy `aa`, compiled apart): medians, spreads, ratio to the default; and for each config against the
    default, the gain and the noise threshold the finals' rule would set with all of these samples (the
    copy's gain is the rule's false-win check: it must stay under its threshold)."""
    from moe_tune.profiles.verdict import noise_threshold
    from moe_tune.tuner.crossover import time_side_by_side

    impl = get_op("ragged_dot").backends.get("tiled")
    space = [c.to_dict() for c in impl.search_space(problem)]
    named = {f"s{i}": c for i, c in enumerate(space)} | {"aa": space[0]}
    timed = time_side_by_side("ragged_dot", "tiled", problem, named, distribution="balanced", samples=samples)
    default = timed.median_s.get("s0")

    def row(name: str) -> dict[str, Any]:
        ok = default and name in timed.median_s
        return {"name": name, "config": named[name], "median_s": timed.median_s.get(name),
                "spread": timed.spread.get(name), "over_default": timed.median_s[name] / default if ok else None,
                "gain": default / timed.median_s[name] - 1 if ok else None,
                "threshold": noise_threshold(timed.samples_s[name], timed.samples_s["s0"]) if ok else None}

    return {"configs": [row(n) for n in named], "unusable": timed.unusable, "samples": samples}


def label(config: dict[str, Any]) -> str:
    return f"tm={config['tm']} tk={config['tk']} tail={config['tail']}"


def lines_of(m: int, sweep: dict[str, Any], long: dict[str, Any] | None) -> list[str]:
    out = [f"m={m} sweep, final_time_s={sweep['final_time_s']} ({sweep['wall_s']:.1f} s): {sweep['rule']}"
           + (f" (noise +-{sweep['noise']:.1%})" if sweep["noise"] is not None else "") + f" -> {label(sweep['config'])}"]
    for f in sweep["finalists"]:
        out.append(f"    finalist {label(f['config'])}{' (default)' if f['is_default'] else ''}: "
                   f"{f['median_s'] * 1e3:.2f} ms, spread {f['spread']:.0%}, {f['samples']} samples")
    if long is None:
        return out
    best = min((c for c in long["configs"] if c["median_s"]), key=lambda c: c["median_s"])
    out.append(f"  long run ({long['samples']} samples): best {label(best['config'])} {best['median_s'] * 1e3:.2f} ms")
    for c in long["configs"]:
        if c["median_s"]:
            name = " (copy of the default)" if c["name"] == "aa" else ""
            out.append(f"    {label(c['config'])}{name}: {c['median_s'] * 1e3:.2f} ms, {c['over_default']:.3f}x the "
                       f"default, spread {c['spread']:.0%}, gain {c['gain']:+.1%} vs threshold {c['threshold']:.1%}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", default="deepseek-v2-lite down fwd bfloat16", help="a heldout_cpu kernel label")
    parser.add_argument("--m", default="32,43,64", help="token counts (comma-separated)")
    parser.add_argument("--samples", type=int, default=61, help="samples of the long side-by-side run")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--final-time", default="0,0.3", help="the sweeps' final_time_s values, interleaved")
    parser.add_argument("--no-long", action="store_true", help="the sweeps only")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--text", type=Path, default=None)
    args = parser.parse_args()
    heldout_cpu.restrict_space()
    problem = dict(heldout_cpu.kernels())[args.kernel]
    load = [subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()]
    results, lines = [], [f"# benchmarks/finals_cpu.py {args.kernel}, counts {args.m}, {args.samples} samples"]
    times = [float(x) for x in args.final_time.split(",")]
    for m in (int(x) for x in args.m.split(",")):
        for r in range(args.repeat):
            for final_time_s in times:  # interleaved: each setting's sweeps see the same load
                sweep = sweep_once(heldout_cpu.at(problem, m), final_time_s)
                results.append({"m": m, "repeat": r, "sweep": sweep})
                lines += lines_of(m, sweep, None)
                print("\n".join(lines_of(m, sweep, None)), flush=True)
            if not args.no_long:
                long = long_run(heldout_cpu.at(problem, m), args.samples)
                results.append({"m": m, "repeat": r, "long": long})
                shown = lines_of(m, sweep, long)[len(sweep["finalists"]) + 1:]
                lines += shown
                print("\n".join(shown), flush=True)
    for t in times:
        walls = [r["sweep"]["wall_s"] for r in results if "sweep" in r and r["sweep"]["final_time_s"] == t]
        kept = sum(r["sweep"]["rule"] in ("default_fastest", "within_noise", "unverified")
                   for r in results if "sweep" in r and r["sweep"]["final_time_s"] == t)
        lines.append(f"final_time_s={t}: sweep wall time median {statistics.median(walls):.1f} s, total "
                     f"{sum(walls):.1f} s over {len(walls)} sweeps; kept the default in {kept}")
    load.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    lines += [f"load before: {load[0]}", f"load after: {load[1]}"]
    print("\n".join(lines[-2 - len(times):]))
    if args.json:
        args.json.write_text(json.dumps({"kernel": args.kernel, "results": results, "load": load}, indent=1) + "\n")
    if args.text:
        args.text.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
