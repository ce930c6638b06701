"""How fast the tuner itself is on this machine: a 64-candidate ragged_dot sweep (tiled, the default demo
shape) with a cold persistent compilation cache, run with 1 compile worker and with 2, each in a fresh
process; prints the wall time of the sweep and of each stage, the parallel-compile speedup and the XLA
compilations per candidate.

    .venv/bin/python benchmarks/sweep_cpu.py [--candidates 64] [--workers 1,2] [--json OUT]
        [--src old=DIR,new=DIR --repeat N]

`--src`: variants of the tuner to compare, each a copy of `src/` (e.g. `git archive <commit> src | tar -x -C
DIR`), run as `PYTHONPATH=DIR/src`, interleaved (old new old new ...) `--repeat` times.
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


class _Clock:
    """Wall time spent inside wrapped functions, by name (the phases `one_sweep` reports)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self.values: dict[str, float] = {}
        self.chunks: list = []  # per compile chunk: [start, end, [(request start, end), ...]]

    def worker_idle(self, workers: int) -> dict[str, float]:
        """Worker-seconds the compile chunks left idle: after a worker's last request of a chunk until the
        chunk ended (the tail), and between its requests (the rest), from the requests as the pool ran them."""
        tail = total = 0.0
        for start, end, requests in self.chunks:
            if end is None:
                continue
            busy = sum(b - a for a, b in requests)
            total += workers * (end - start) - busy
            # the chunk's requests end in order on `workers` workers: each worker's last one ends at one of
            # the `workers` latest ends
            ends = sorted(b for _, b in requests)[-workers:]
            tail += sum(end - b for b in ends) + (workers - len(ends)) * (end - start)
        return {"idle in the compile chunks (worker-s)": total, TAIL: tail}

    def wrap(self, owner, name: str, phase: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.spent[phase] = self.spent.get(phase, 0.0) + time.perf_counter() - start

        setattr(owner, name, timed)

    def add(self, name: str, value: float) -> None:
        self.values[name] = self.values.get(name, 0.0) + value


def _instrument(clock: _Clock) -> None:
    """Wrap the functions each phase runs in (nothing about the sweep changes: the same calls, timed)."""
    import contextlib

    import jax

    from moe_tune.tuner import compiling, measure, state, timing

    from moe_tune.tuner import state as record, compiling as workers

    clock.wrap(state.SweepState, "prepare_inputs", "inputs and reference")
    try:  # the reference and device copy are made on a thread while the first compiles run
        from moe_tune.tuner import candidate as inputs

        clock.wrap(inputs.SweepInputs, "wait", WAITED)
    except ImportError:  # an older tuner: made in "inputs and reference", before compiling
        pass
    clock.wrap(measure, "check_all", "check (main process)")
    clock.wrap(compiling.serialize_executable, "deserialize_and_load", "load executables (main process)")
    clock.wrap(timing, "parse_profile", "trace parse")
    clock.wrap(timing, "stop_profiler", "profiler stop")  # the xplane, in memory
    clock.wrap(measure, "warm_up", "finalists: one untimed run each")
    clock.wrap(measure, "final_round", "finalists: final round")
    clock.wrap(record, "write", "entry and table write")
    take = compiling._take_result

    def take_result(cand, value):  # what the worker measured of itself
        clock.add("worker compile (sum over workers)", value.get("compile_s") or 0.0)
        clock.add("worker first run (sum over workers)", value.get("run_s") or 0.0)
        clock.add("worker check (sum over workers)", value.get("check_s") or 0.0)
        clock.add("worker compile CPU (sum over workers)", value.get("compile_cpu_s") or 0.0)
        clock.add("worker first run CPU (sum over workers)", value.get("run_cpu_s") or 0.0)
        return take(cand, value)

    compiling._take_result = take_result
    chunk = compiling._compile_in_workers
    run_one = workers.WorkerPool._run

    def compile_chunk(*args, **kwargs):  # each chunk's wall and its requests' (start, end) on the workers
        clock.chunks.append([time.perf_counter(), None, []])
        try:
            return chunk(*args, **kwargs)
        finally:
            clock.chunks[-1][1] = time.perf_counter()

    def run_request(self, *args, **kwargs):
        start = time.perf_counter()
        status, value = "failed", None
        try:
            status, value = run_one(self, *args, **kwargs)
            return status, value
        finally:
            end = time.perf_counter()
            if clock.chunks:
                clock.chunks[-1][2].append((start, end))
            if status == "ok" and isinstance(value, dict):  # the request's wall beyond the worker's own clocks
                beyond = (end - start) - sum(value.get(k) or 0.0 for k in ("compile_s", "run_s", "check_s"))
                clock.add(BEYOND, beyond)
                if len(clock.chunks) == 1 and len(clock.chunks[0][2]) <= self.size:  # a worker's first request
                    clock.add(FIRST_BEYOND, beyond)

    compiling._compile_in_workers = compile_chunk
    workers.WorkerPool._run = run_request
    trace = jax.profiler.trace

    @contextlib.contextmanager
    def timed_trace(*args, **kwargs):
        start = time.perf_counter()
        with trace(*args, **kwargs):
            clock.add("profiler start", time.perf_counter() - start)
            yield
            stop = time.perf_counter()
        clock.add("profiler stop", time.perf_counter() - stop)

    timing.jax.profiler.trace = timed_trace


def one_sweep(workers: int, candidates: int, samples: int, spawned: float | None) -> dict:
    """In this (fresh) process: the sweep and its wall time per stage (with workers, "compile" includes each
    candidate's first run in its worker, which gives the check its output), and per phase inside them."""
    imported = time.time()
    from moe_tune.kernels import get_op
    from moe_tune.tuner import SweepRequest, run_sweep
    from moe_tune.tuner import compiling
    from moe_tune.tuner.compiling import backend_compiles

    compiling.enable_cache()  # the dir is fresh and empty: a cold cache, as a first sweep on a machine has
    clock = _Clock()
    _instrument(clock)

    problem = get_op("ragged_dot").problem(**SHAPE)
    started = time.perf_counter()
    result = run_sweep(SweepRequest.make("ragged_dot", problem, backend="tiled", workers=workers, samples=samples,
                                         max_candidates=candidates, fresh=True,
                                         cold=True))  # the shipped tables hold nearby shapes: no warm start
    ended = time.perf_counter()
    stages = dict(result.entry.search["stage_s"])
    stages["finalists and table"] = (ended - started) - sum(stages.values())
    counts = result.entry.candidates
    # traced calls: the batches' rounds (a finalist's first timing is kept as `first_timing`) and the final round
    first = [getattr(c, "first_timing", None) or c.timing for c in result.candidates if c.timing is not None]
    final = [c.timing for c in result.candidates if getattr(c, "first_timing", None) is not None]
    calls = {"batches": sum(t.samples for t in first), "final round": sum(t.samples for t in final)}
    # what each candidate cost the batches' rounds: its samples, their seconds, its median, the samples
    per_candidate = [[c.index, t.samples, sum(t.samples_s), t.median_s, list(t.samples_s)]
                     for c in result.candidates if (t := getattr(c, "first_timing", None) or c.timing) is not None]
    # a child started by another script (targets_cpu.py) has no spawn time: its start-up is not counted
    start_up = {} if spawned is None else {"process start and imports (before the sweep)": imported - spawned}
    phases = {**start_up, **clock.spent, **clock.values, **clock.worker_idle(workers)}
    return {"workers": workers, "wall_s": ended - started, "stages_s": dict(stages), "phases_s": phases,
            "candidates": counts, "compiles_per_candidate": counts["compiles"] / counts["tried"],
            "main_process_compiles": backend_compiles(), "winner": result.entry.config,
            "timed_calls": calls, "per_candidate": per_candidate}


def _load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


TAIL = "of it at the chunks' ends"
WAITED = "waited for the reference and device copy"
BEYOND = "requests' wall beyond the workers' clocks (sum)"
FIRST_BEYOND = "of it the workers' first requests (their imports)"


def _print_phases(run: dict) -> None:
    """Where the wall time went: the stages, and the phases measured inside them (the worker phases are
    summed over the workers, which run in parallel: divided by the workers they are wall time)."""
    p, st, w = run["phases_s"], run["stages_s"], run["workers"]
    profiler = sum(p.get(k, 0.0) for k in ("profiler start", "profiler stop", "trace parse"))
    final = p.get("finalists: final round", 0.0)
    rows = [
        ("process start and imports", p.get("process start and imports (before the sweep)", 0.0)),
        ("inputs and reference before compiling (made on a thread)", p.get("inputs and reference", 0.0)),
        ("waited for the reference and device copy (sum over threads)", p.get(WAITED, 0.0)),
        (f"compile stage: worker compiles (sum / {w} workers)", p.get("worker compile (sum over workers)", 0) / w),
        (f"compile stage: worker first runs, for the check (sum / {w})", p.get("worker first run (sum over workers)",
                                                                              0) / w),
        (f"compile stage: worker checks (sum / {w})", p.get("worker check (sum over workers)", 0) / w),
        ("compile stage: load executables here", p.get("load executables (main process)", 0.0)),
        ("compile stage: check here", p.get("check (main process)", 0.0)),
        ("time stage + final round: profiler start", p.get("profiler start", 0.0)),
        ("time stage + final round: profiler stop (collect the xplane)", p.get("profiler stop", 0.0)),
        ("time stage + final round: trace parse", p.get("trace parse", 0.0)),
        ("time stage + final round: the timed calls and the rest", st.get("time", 0.0) + final - profiler),
        ("finalists: one untimed run each", p.get("finalists: one untimed run each", 0.0)),
        ("entry and table write", p.get("entry and table write", 0.0)),
    ]
    total = run["wall_s"]
    for name, seconds in rows:
        print(f"    {name:<62} {seconds:6.2f} s  {100 * seconds / total:5.1f}%")
    print(f"    {'(sweep wall time)':<62} {total:6.2f} s", flush=True)
    worker_s = p.get("worker compile (sum over workers)", 0) + p.get("worker first run (sum over workers)", 0) + \
        p.get("worker check (sum over workers)", 0)
    print(f"    worker-seconds {worker_s:.2f}; main process in the compile stage (load + check) "
          f"{p.get('load executables (main process)', 0) + p.get('check (main process)', 0):.2f} s; workers idle in "
          f"the compile chunks {p.get('idle in the compile chunks (worker-s)', 0):.2f} worker-s, of it at the "
          f"chunks' ends {p.get(TAIL, 0):.2f}")
    print(f"    requests' wall beyond the workers' own clocks {p.get(BEYOND, 0):.2f} worker-s, of it the workers' "
          f"first requests {p.get(FIRST_BEYOND, 0):.2f}")
    if p.get("worker first run CPU (sum over workers)"):  # the workers' CPU seconds (all threads) beside the wall
        print(f"    workers' CPU seconds: compiles {p['worker compile CPU (sum over workers)']:.2f} (wall "
              f"{p.get('worker compile (sum over workers)', 0):.2f}), first runs "
              f"{p['worker first run CPU (sum over workers)']:.2f} (wall {p.get('worker first run (sum over workers)', 0):.2f})")
    per = run.get("per_candidate") or []
    if per:
        ranked = sorted(per, key=lambda r: r[3])
        by_samples = {n: sum(1 for r in per if r[1] == n) for n in sorted({r[1] for r in per})}
        top, rest = ranked[:4], ranked[4:]
        print(f"    batch calls per candidate {by_samples}; seconds of calls: fastest 4 "
              f"{sum(r[2] for r in top):.2f} s, "
              f"the other {len(rest)} {sum(r[2] for r in rest):.2f} s (of them beyond their first call "
              f"{sum(r[2] - r[2] / r[1] for r in rest):.2f} s)", flush=True)


def main() -> int:
    from moe_tune.tuner import SweepSettings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", type=int, default=64)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--samples", type=int, default=SweepSettings.samples)
    parser.add_argument("--json", default=None)
    parser.add_argument("--src", default=None, help="NAME=DIR,...: tuner variants (copies of src/), interleaved")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--spawned", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(one_sweep(args.child, args.candidates, args.samples, args.spawned)))
        return 0
    print(f"load before: {_load()}", flush=True)

    runs = []
    variants = [(None, None)] if args.src is None else [tuple(v.split("=", 1)) for v in args.src.split(",")]
    plan = [(name, src, int(w)) for _ in range(args.repeat) for name, src in variants for w in args.workers.split(",")]
    for name, src, workers in plan:
        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, "MOE_TUNE_COMPILE_CACHE_DIR": os.path.join(tmp, "cache"),
                   "MOE_TUNE_PROFILE_DIR": os.path.join(tmp, "profiles")}
            if src is not None:
                env["PYTHONPATH"] = os.path.join(os.path.abspath(src), "src")
            proc = subprocess.run([sys.executable, __file__, "--child", str(workers), "--candidates",
                                   str(args.candidates), "--samples", str(args.samples), "--spawned", str(time.time())],
                                  env=env, capture_output=True, text=True, check=True)
        run = json.loads(proc.stdout.strip().splitlines()[-1])
        run["variant"] = name
        runs.append(run)
        stages = ", ".join(f"{k} {v:.1f} s" for k, v in run["stages_s"].items())
        label = "" if name is None else f"{name}: "
        print(f"{label}workers={workers}: {run['candidates']['tried']} candidates in {run['wall_s']:.1f} s ({stages}); "
              f"{run['compiles_per_candidate']:.2f} XLA compiles per candidate, "
              f"{run['main_process_compiles']} in the main process; winner {run['winner']}; timed calls "
              f"{run['timed_calls']}", flush=True)
        _print_phases(run)
        run["load"] = _load()
    if len(runs) > 1 and args.src is None:
        base = runs[0]["stages_s"].get("compile", 0.0)
        for run in runs[1:]:
            ratio = base / run["stages_s"]["compile"] if run["stages_s"].get("compile") else float("nan")
            print(f"compile stage, {runs[0]['workers']} vs {run['workers']} workers: {ratio:.2f}x faster; "
                  f"whole sweep {runs[0]['wall_s'] / run['wall_s']:.2f}x")
    if args.json:
        from moe_tune.commands import bench

        bench.write_results(args.json, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
