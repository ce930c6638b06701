"""The finals' verdict, paired per round against two medians apart, on repeated final rounds
(FINDINGS.md: paired finals).

    .venv/bin/python benchmarks/finals_paired_cpu.py --m 1024 --k 7168 --n 2048 \
        --groups 4 --dtype bfloat16 --other tm=128,tk=512,tail=64 [--repeat 20] [--json OUT]

Compiles the default, a copy of the default (compiled apart) and the `--other` configs once (each checked
against the reference), then runs `--repeat` final rounds as the tuner's finals run them (`time_candidates`,
every config once per round, shuffled, `measure.final_samples` samples from the configs' first-call times),
and for each round applies both rules to every config against the default: the two medians with their MADs
(`verdict.noise_threshold`, the rule the paired one replaced) and the paired rule (`verdict.paired`). A win of the
copy is a false win; the others' wins are counted against their long-run median ratio over the default (all
the rounds' samples pooled). Nothing is asserted (a shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax

from moe_tune.core import devices
from moe_tune.kernels import get_op
from moe_tune.kernels.kernel_op import relative_error
from moe_tune.profiles.verdict import noise_threshold, paired
from moe_tune.tuner import measure
from moe_tune.tuner.compiling import Kernel
from moe_tune.tuner.request import SweepSettings
from moe_tune.tuner.timing import time_candidates


def _config(text: str, default: dict) -> dict:
    out = dict(default)
    for part in filter(None, text.split(",")):
        name, value = part.split("=")
        out[name] = type(default[name])(value) if not isinstance(default[name], bool) else value == "True"
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=1024)
    parser.add_argument("--k", type=int, default=7168)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--other", action="append", default=[], help="tunables of another finalist: tm=128,tk=512")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    load = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()

    op = get_op("ragged_dot")
    impl = op.backends.get("tiled")
    problem = op.problem(m=args.m, k=args.k, n=args.n, groups=args.groups, dtype=args.dtype)
    default = impl.default_config(problem).to_dict()
    named = {"default": default, "copy": default} | {o: _config(o, default) for o in args.other}
    kernel = Kernel(op, impl, problem)
    host = op.make_inputs(problem, "balanced", 0)
    expected = op.reference(problem, host)
    inputs = jax.device_put(host)
    calls, first_s = {}, 0.0
    for index, (name, config) in enumerate(named.items()):
        compiled, _ = kernel.compile(impl.coerce_config(dict(config), problem), index, inputs)
        start = time.perf_counter()
        out = jax.block_until_ready(compiled(inputs))
        first_s = max(first_s, time.perf_counter() - start)
        error = relative_error(jax.device_get(out), expected)
        if not error <= op.tolerance(problem):
            print(f"  {name}: wrong, relative error {error:.3g}")
            return 1
        calls[index] = lambda compiled=compiled: compiled(inputs)
        print(f"  {name}: {impl.config_cls(**config).label()} first call {first_s * 1e3:.1f} ms", flush=True)
    samples = measure.final_samples(SweepSettings(samples=3, workers=1), first_s)
    print(f"m={args.m} k={args.k} n={args.n} groups={args.groups} {args.dtype}: {args.repeat} final rounds of "
          f"{samples} samples, {len(named)} configs; load: {load()}", flush=True)
    names = list(named)
    rounds, pooled = [], {n: [] for n in names}
    for r in range(args.repeat):
        timings, fallback = time_candidates(calls, samples=samples, platform=devices.platform(), seed=r, warmup=0)
        d = timings[0].samples_s
        row = {"fallback": fallback}
        for i, name in enumerate(names[1:], 1):
            s = timings[i].samples_s
            pooled[name].extend(s)
            apart_gain = timings[0].median_s / timings[i].median_s - 1
            apart_noise = noise_threshold(s, d)
            gain, noise = paired(d, s)
            row[name] = {"apart": [apart_gain, apart_noise, apart_gain > apart_noise],
                         "paired": [gain, noise, gain > noise]}
        pooled["default"].extend(d)
        rounds.append(row)
        print(f"  round {r}: " + "; ".join(
            f"{n} apart {row[n]['apart'][0]:+.0%}/{row[n]['apart'][1]:.0%}{' WIN' if row[n]['apart'][2] else ''}"
            f" paired {row[n]['paired'][0]:+.0%}/{row[n]['paired'][1]:.0%}{' WIN' if row[n]['paired'][2] else ''}"
            for n in names[1:]), flush=True)
    base = statistics.median(pooled["default"])
    summary = {}
    print(f"\nover {args.repeat} final rounds (wins: gain > noise; long run: all rounds' samples pooled):")
    for name in names[1:]:
        wins = {rule: sum(r[name][rule][2] for r in rounds) for rule in ("apart", "paired")}
        noise = {rule: statistics.median(r[name][rule][1] for r in rounds) for rule in ("apart", "paired")}
        summary[name] = {"wins": wins, "median_noise": noise, "long_run_over_default": statistics.median(
            pooled[name]) / base}
        print(f"  {name}: long run {summary[name]['long_run_over_default']:.3f}x the default; wins apart "
              f"{wins['apart']}/{args.repeat} (median noise {noise['apart']:.0%}), paired {wins['paired']}/"
              f"{args.repeat} (median noise {noise['paired']:.0%})")
    print(f"load at the end: {load()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "samples": samples, "configs": named,
                                               "rounds": rounds, "summary": summary}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("MOE_TUNE_COMPILE_CACHE_DIR", "off")  # the copy compiles apart from the default
    sys.exit(main())
