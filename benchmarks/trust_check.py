"""Can a sweep's claim be trusted at any budget? Sweeps on noisy shapes at `--samples 1` and at the default,
then every entry's winner and default (and, where the default was kept, the fastest other finalist) re-timed
side by side in 15 interleaved rounds.

    .venv/bin/python benchmarks/trust_check.py [--rounds 15] [--max-candidates 8] [--workers 1]
        [--json OUT.json] [--text OUT.txt]

The shapes are small (a few ms or less per call): near-equal candidates whose sweep-round medians are mostly
noise on a shared machine, the case that started it (`ragged_gather` at 512 tokens: a "win" of 2.3x at
`--samples 1` whose re-timed winner was slower than its default).

The check (FINDINGS.md: timing trust): no entry claims a win (`beat_default`) whose re-timed winner is slower
than its default beyond the noise of the re-timing (`profiles.verdict.noise_threshold` of the two re-timed
sample sets). Each row also shows what a kept default gave up: the fastest other finalist re-timed against
the default (a "missed" win would be one beyond the noise there). Exit status 1 when the check fails.
Timing only: nothing here is a unit test, and machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import jax

from moe_tune.core import devices
from moe_tune.kernels import get_op
from moe_tune.profiles.entry import Entry
from moe_tune.profiles.verdict import BEAT_DEFAULT, noise_threshold, verdict_of
from moe_tune.tuner import SweepRequest, run_sweep
from moe_tune.tuner.timing import time_candidates, traceable

# (op, problem options): small, noisy shapes (near-equal candidates, sub-millisecond to a few ms per call)
SHAPES = [
    ("ragged_gather", {"tokens": 512, "hidden": 2048, "top_k": 8, "experts": 128, "ep": 1, "dtype": "bfloat16"}),
    ("ragged_gather_reduce", {"tokens": 512, "hidden": 1024, "top_k": 8, "experts": 64, "ep": 4,
                              "dtype": "float32"}),
    ("ragged_dot", {"m": 512, "k": 256, "n": 256, "groups": 8, "dtype": "float32", "direction": "fwd"}),
    ("ragged_dot", {"m": 256, "k": 512, "n": 128, "groups": 16, "dtype": "bfloat16", "direction": "drhs"}),
]


def retime(entry: Entry, configs: dict[str, dict[str, Any]], rounds: int) -> dict[str, list[float]]:
    """Each named config of `entry` compiled once and timed in `rounds` interleaved (shuffled) rounds on the
    entry's inputs; returns name -> samples (s)."""
    op = get_op(entry.op)
    backend = op.backends.get(entry.backend)
    problem = op.problem_class.from_key_fields(entry.fields)
    recorded = entry.distribution or {}
    inputs = jax.device_put(op.make_inputs(problem, recorded.get("name", "balanced"), recorded.get("seed", 0)))
    calls = {}
    for i, (name, raw) in enumerate(configs.items()):
        config = backend.coerce_config(raw, problem)
        compiled = traceable(lambda x, c=config: op.run(backend, c, problem, x), i).lower(inputs).compile()
        calls[i] = lambda c=compiled: c(inputs)
    timings, _ = time_candidates(calls, samples=rounds, platform=devices.platform(), seed=7)
    return {name: list(timings[i].samples_s) for i, name in enumerate(configs)}


def check_entry(entry: Entry, rounds: int) -> dict[str, Any]:
    """The entry's claim and its re-timing: the winner (or the fastest other finalist, for a kept default)
    against the default."""
    verdict = verdict_of(entry)
    rivals = [f for f in verdict.finalists if not f.get("is_default")]
    challenger = entry.config if entry.config != entry.default_config else (
        min(rivals, key=lambda f: f["median_s"])["config"] if rivals else None)
    row = {"key": entry.key, "op": entry.op, "rule": verdict.rule, "verdict": verdict.text,
           "claimed_speedup": entry.speedup, "challenger": challenger, "default": entry.default_config,
           "samples_final": [f.get("samples") for f in verdict.finalists]}
    if challenger is None or challenger == entry.default_config:
        return {**row, "retimed_ratio": None, "noise": None, "ok": True}
    samples = retime(entry, {"challenger": challenger, "default": entry.default_config}, rounds)
    ratio = _median(samples["challenger"]) / _median(samples["default"])  # > 1: the challenger is slower
    noise = noise_threshold(samples["challenger"], samples["default"])
    wrong_win = verdict.rule == BEAT_DEFAULT and ratio - 1 > noise
    missed_win = verdict.rule != BEAT_DEFAULT and 1 / ratio - 1 > noise
    return {**row, "retimed_ratio": ratio, "noise": noise, "ok": not wrong_win, "missed_win": missed_win}


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return (s[len(s) // 2] + s[(len(s) - 1) // 2]) / 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--max-candidates", type=int, default=8)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--samples", default="1,3", help="the sweeps' --samples values (3: the default)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--text", default=None)
    args = parser.parse_args()
    rows, lines = [], []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    say(f"trust check on {devices.device_kind()} ({os.cpu_count()} cpus), jax {jax.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}; sweeps: grid --max-candidates {args.max_candidates}, re-timed in "
        f"{args.rounds} interleaved rounds")
    for op, options in SHAPES:
        problem = get_op(op).problem(**options)
        for samples in (int(s) for s in args.samples.split(",")):
            with tempfile.TemporaryDirectory() as tmp:
                started = time.perf_counter()
                result = run_sweep(SweepRequest.make(op, problem, samples=samples, workers=args.workers,
                                                     max_candidates=args.max_candidates, profile_dir=tmp))
                row = {**check_entry(result.entry, args.rounds), "samples": samples,
                       "sweep_s": time.perf_counter() - started}
            rows.append(row)
            ratio = "-" if row["retimed_ratio"] is None else f"{row['retimed_ratio']:.3f}"
            noise = "-" if row["noise"] is None else f"+-{row['noise']:.1%}"
            say(f"{'ok  ' if row['ok'] else 'FAIL'} {get_op(op).describe(problem)} --samples {samples}: "
                f"{row['verdict']} (claimed {row['claimed_speedup'] or 0:.2f}x, finalists' samples "
                f"{row['samples_final']}); re-timed challenger/default {ratio} (noise {noise})"
                + ("; a missed win" if row.get("missed_win") else ""))
    wins = [r for r in rows if r["rule"] == BEAT_DEFAULT]
    failed = [r for r in rows if not r["ok"]]
    say(f"{len(rows)} entries, {len(wins)} claimed a win, {len(failed)} of them re-timed slower than the default "
        f"beyond the noise; {sum(bool(r.get('missed_win')) for r in rows)} kept defaults beaten beyond the noise "
        "when re-timed")
    meta = {"device_kind": devices.device_kind(), "cpus": os.cpu_count(), "jax": jax.__version__,
            "date": time.strftime("%Y-%m-%d"), "rounds": args.rounds, "max_candidates": args.max_candidates}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1, default=str)
    if args.text:
        with open(args.text, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
