"""The tuner on tiny real spaces: correctness gate, failure recording, compile-once, keys, tables."""

from __future__ import annotations

import json
import logging
import os

import jax
import numpy as np
import pytest
from faulty_backend import FaultyConfig, FaultyRaggedDot

import moe_tune
from moe_tune.core import distributions
from moe_tune.kernels import get_op
from moe_tune.kernels.ragged_dot import BACKENDS, RaggedDotProblem
from moe_tune.profiles import entry_key, read_table, use_profiles
from moe_tune.profiles.table import SCHEMA_VERSION
from moe_tune.tuner import SweepError, SweepRequest, SweepSettings, measure, run_sweep
from moe_tune.tuner.compiling import backend_compiles
from moe_tune.tuner.timing import _race, cross_check, time_candidates

SMALL = RaggedDotProblem(m=256, k=128, n=128, groups=4)
# Per-candidate deadline where a test needs a hang to be found: the faulty "hang" sleeps for an hour, a good
# tiny candidate compiles and runs in about a second (several on a loaded machine), so only a real hang
# reaches it; it costs its length once per hung candidate.
HANG_DEADLINE_S = 20


@pytest.fixture
def faulty():
    backend = BACKENDS.register(FaultyRaggedDot())
    yield backend
    BACKENDS.unregister(backend.name)


def test_wrong_and_failing_candidates_are_recorded_and_never_win(faulty, tmp_path):
    result = run_sweep(SweepRequest.make("ragged_dot", SMALL, backend=faulty.name, samples=3, workers=2,
                                         profile_dir=tmp_path))
    by_mode = {}
    for cand in result.candidates:
        by_mode.setdefault(cand.config.mode, []).append(cand)
    assert all(c.status == "wrong" and "relative error" in c.reason for c in by_mode["wrong"])
    assert all(c.status == "failed" and c.stage == "compile" and "deliberate compile failure" in c.reason
               for c in by_mode["fail_compile"])
    assert all(c.status == "failed" and c.stage == "run" for c in by_mode["fail_run"])
    assert result.entry.config["mode"] == "good"
    counts = {k: v for k, v in result.entry.candidates.items() if k != "compiles"}
    assert counts == {"tried": 8, "ok": 2, "failed": 4, "wrong": 2}
    assert {f["status"] for f in result.entry.failures} == {"failed", "wrong"}
    assert all(f.get("reason") for f in result.entry.failures)
    # the default config is candidate 0 and was timed, so the speedup is a measurement
    assert result.candidates[0].is_default and result.candidates[0].config == FaultyConfig("good", 64)
    assert result.entry.default["median_s"] > 0
    assert result.entry.speedup_over_default == pytest.approx(
        result.entry.default["median_s"] / result.entry.timing["median_s"])


def test_sweep_with_no_correct_candidate_fails_cleanly(faulty, tmp_path, monkeypatch):
    monkeypatch.setattr(FaultyRaggedDot, "candidate_values", lambda self, p: {"mode": ["wrong"], "tm": [64]})
    monkeypatch.setattr(FaultyRaggedDot, "default_config", lambda self, p: FaultyConfig("fail_compile", 64))
    with pytest.raises(SweepError, match="no candidate"):
        run_sweep(SweepRequest.make("ragged_dot", SMALL, backend=faulty.name, samples=1, profile_dir=tmp_path))
    assert not (tmp_path / "cpu" / "ragged_dot.json").exists()


@pytest.mark.parametrize("workers", [1, 2])
def test_each_candidate_is_compiled_exactly_once(tmp_path, workers):
    """In-process or in worker processes: one XLA compilation per candidate, and the executable compiled
    then is the one checked and timed (nothing is compiled again in this process)."""
    n_candidates = 6
    before = backend_compiles()
    result = run_sweep(SweepRequest.make("ragged_dot", SMALL, backend="tiled", samples=2, workers=workers,
                                         profile_dir=tmp_path, max_candidates=n_candidates))
    here = backend_compiles() - before
    assert len(result.candidates) == n_candidates
    assert [c.compiles for c in result.candidates] == [1] * n_candidates
    assert result.entry.candidates["compiles"] == n_candidates
    assert here == (n_candidates if workers == 1 else 0)


class _FailsAfterCalls:
    """An executable that runs `working` times (the check) and then fails, as a worker-compiled executable
    did on XLA CPU when run in the main process (`NOT_FOUND: Function wrapped_iota not found`)."""

    def __init__(self, executable, working: int):
        self.executable, self.working, self.calls = executable, working, 0

    def __call__(self, inputs):
        self.calls += 1
        if self.calls > self.working:
            raise RuntimeError("NOT_FOUND: Function wrapped_iota not found (type id: 1)")
        return self.executable(inputs)


def test_an_executable_that_fails_here_is_compiled_again_or_recorded(tmp_path, monkeypatch):
    """A candidate whose executable stops working before timing is compiled again in this process and timed;
    one that fails again is recorded as failed with both reasons, and the sweep goes on."""
    from moe_tune.tuner import measure

    real_compile_all = measure.compile_all
    compiled = {}  # candidate index -> how many times compile_all built it

    def flaky_compile_all(kernel, cands, inputs, *args, **kwargs):
        real_compile_all(kernel, cands, inputs, *args, **kwargs)
        for c in cands:
            compiled[c.index] = compiled.get(c.index, 0) + 1
            # candidate 1 breaks once (its recompile works); candidate 2's recompile is broken too
            if c.executable is not None and compiled[c.index] == 1 and c.index in (1, 2):
                c.executable = _FailsAfterCalls(c.executable, working=1)
            elif c.executable is not None and c.index == 2:
                c.executable = _FailsAfterCalls(c.executable, working=0)

    monkeypatch.setattr(measure, "compile_all", flaky_compile_all)
    result = run_sweep(SweepRequest.make("ragged_dot", SMALL, backend="tiled", samples=1, workers=1,
                                         profile_dir=tmp_path))
    by_index = {c.index: c for c in result.candidates}
    assert compiled[1] == 2 and by_index[1].status == "ok" and by_index[1].timing is not None
    assert by_index[1].compiles == 2  # counted: the recompile is a second XLA compilation
    assert by_index[2].status == "failed" and by_index[2].stage == "run"
    assert "wrapped_iota" in by_index[2].reason and "compiled again in this process" in by_index[2].reason
    assert by_index[0].status == "ok" and result.entry.candidates["failed"] >= 1


def test_worker_outputs_are_checked_as_they_arrive(tmp_path, monkeypatch):
    """With workers, each candidate is judged when its worker answers, not once the whole chunk is back, and
    by the error the worker computed against the reference: no output (drhs: groups x k x n) comes back."""
    from moe_tune.tuner import measure

    real_check_all, held = measure.check_all, []

    def check_all(cands, *args, **kwargs):
        held.append(sum(c.worker_error is not None for c in cands))
        real_check_all(cands, *args, **kwargs)
        assert all(c.worker_error is None and c.error is not None for c in cands)

    monkeypatch.setattr(measure, "check_all", check_all)
    result = run_sweep(SweepRequest.make("ragged_dot", SMALL, backend="tiled", samples=1, workers=2, max_candidates=4,
                                         profile_dir=tmp_path))
    assert result.entry.candidates["ok"] == 4
    assert max(held) == 1 and held.count(1) == 4


def test_entry_records_what_design_requires(tmp_path):
    result = run_sweep(SweepRequest.make("ragged_dot", SMALL, backend="tiled", distribution="skewed", seed=3,
                                         samples=3, profile_dir=tmp_path, max_candidates=4))
    table = read_table(tmp_path / "cpu" / "ragged_dot.json")
    assert table["schema_version"] == SCHEMA_VERSION == 3 and table["op"] == "ragged_dot" and table["device_kind"] == "cpu"
    entry = table["entries"][result.key]
    assert entry["fields"]["distribution"] == "skewed" and entry["fields"]["backend"] == "tiled"
    assert entry["distribution"]["seed"] == 3
    assert entry["distribution"]["group_sizes"] == distributions.group_sizes("skewed", 256, 4, 3).tolist()
    timing = entry["timing"]  # from the finalists' round: twice the samples, more for short calls (final_time_s)
    slowest = max(f["first_median_s"] for f in entry["verdict"]["finalists"])
    planned = measure.final_samples(SweepSettings(samples=3), slowest)  # fewer once the default is settled
    assert planned >= 6 and (timing["samples"] == planned or measure.earliest_stop(planned) <= timing["samples"] <
                             planned and entry["verdict"]["rule"] != "beat_default")
    assert len(timing["samples_s"]) == timing["samples"]
    assert timing["min_s"] <= timing["median_s"] <= timing["max_s"]
    assert timing["method"] in ("trace", "wall")
    assert set(entry["versions"]) == {"jax", "jaxlib", "moe-tune", "tune-jax", "backend_revision"}
    assert entry["hostname"]
    assert entry["tuned_at"] and entry["candidates"]["tried"] == len(result.candidates)


def test_trace_timing_parses_one_event_per_run_and_the_method_is_recorded(tmp_path, monkeypatch):
    """On CPU the profiler trace parses: every timed run of every candidate has its trace event, of a positive
    duration. Which clock timed the sweep is recorded: the trace, unless the wall-clock cross-check refused
    a parse (on a loaded machine it may), and then the wall clock with the reason. No timing ratio is
    asserted here (`test_cross_check_catches_broken_parses` checks the cross-check on given numbers)."""
    from moe_tune.tuner import timing as timing_module

    real = timing_module.cross_check
    checked = []
    monkeypatch.setattr(timing_module, "cross_check",
                        lambda trace, wall, expected: checked.append((list(trace), list(wall), expected))
                        or real(trace, wall, expected))
    result = run_sweep(SweepRequest.make("ragged_dot", RaggedDotProblem(m=512, k=256, n=256, groups=8), backend="tiled",
                                         samples=3, profile_dir=tmp_path, max_candidates=4))
    assert checked and all(len(trace) == expected == len(wall) and min(trace) > 0
                           for trace, wall, expected in checked)
    refused = [why for why in (real(*args) for args in checked) if why]
    timed = [c.timing for c in result.candidates if c.timing is not None]
    assert len(timed) == 4
    if refused:  # some batch or final-round chunk on the wall clock: the entry says why, its own clock is its rounds'
        assert "cross-check" in result.entry.timing_fallback
        assert {t.method for t in timed} <= {"wall", "trace"}
        assert result.entry.timing["method"] == result.best.timing.method
    else:
        assert result.entry.timing["method"] == "trace" and result.entry.timing_fallback is None
        assert {t.method for t in timed} == {"trace"}
        assert all(t.wall_median_s > 0 for t in timed)


def test_wall_clock_timing_when_the_trace_cannot_be_parsed(tmp_path, monkeypatch):
    """A trace that yields no events: every candidate is timed by the wall clock, and the entry (in the table
    too) says so and why."""
    from moe_tune.tuner import timing as timing_module

    monkeypatch.setattr(timing_module, "parse_profile", lambda profile, platform: {})
    result = run_sweep(SweepRequest.make("ragged_dot", SMALL, backend="tiled", samples=2, profile_dir=tmp_path,
                                         max_candidates=2))
    entry = read_table(tmp_path / "cpu" / "ragged_dot.json")["entries"][result.key]
    assert entry["timing"]["method"] == "wall"
    assert "found 0 trace events" in entry["timing_fallback"]
    assert entry["timing_fallback"] == result.entry.timing_fallback
    assert [c.timing.method for c in result.candidates] == ["wall", "wall"]
    assert all(c.timing.median_s > 0 for c in result.candidates)


def test_cross_check_catches_broken_parses():
    assert cross_check([0.010] * 3, [0.011] * 3, 3) is None
    assert "exceeds wall" in cross_check([0.020] * 3, [0.010] * 3, 3)
    assert "under" in cross_check([0.0001] * 3, [0.010] * 3, 3)
    assert "found 2 trace events" in cross_check([0.010] * 2, [0.011] * 3, 3)


def _three_calls():
    x = jax.numpy.ones((64, 64))
    fns = {i: jax.jit(lambda x, i=i: x @ x + i) for i in range(3)}
    return {i: (lambda f=f: f(x)) for i, f in fns.items()}


def test_racing_stops_timing_calls_slower_than_the_best_known():
    """After the first round only calls within `race` of the fastest time known are timed again; with a
    best time known from before that every call is far above, none is (deterministic: no timing asserted)."""
    calls, rounds = _three_calls(), []
    timings, _ = time_candidates(calls, samples=3, platform="cpu", race=1.5, best_s=1e-12, on_round=rounds.append)
    assert {i: t.samples for i, t in timings.items()} == {0: 1, 1: 1, 2: 1}
    assert sum(rounds) == 3 * 3  # the skipped samples count as done, so progress reaches the end
    timings, _ = time_candidates(calls, samples=3, platform="cpu", race=1e9, on_round=rounds.append)
    assert {t.samples for t in timings.values()} == {3}
    timings, _ = time_candidates(calls, samples=3, platform="cpu")  # no racing: every call, every round
    assert {t.samples for t in timings.values()} == {3}


def test_race_keeps_the_calls_within_the_factor_of_the_fastest():
    first = {0: [1.0], 1: [1.4], 2: [1.6], 3: [3.0]}
    assert _race([0, 1, 2, 3], first, 1.5, None) == [0, 1]
    assert _race([1, 2, 3], first, 1.5, None) == [1, 2]  # the fastest of these is 1.4
    assert _race([1, 2, 3], first, 1.5, 1.0) == [1]  # a faster time from before counts


def test_a_sweep_times_raced_out_candidates_once_and_the_finalists_fully(tmp_path):
    """With racing a candidate has one sample (raced out), `samples` or, as a finalist, twice as many (without
    racing every call gets every round: `test_racing_stops_timing_calls_slower_than_the_best_known`)."""
    result = run_sweep(SweepRequest.make("ragged_dot", SMALL, backend="tiled", samples=3, race=1.5, max_candidates=4,
                                         workers=1, profile_dir=tmp_path))
    final = result.entry.timing["samples"]  # twice the samples, more for short calls (final_time_s)
    slowest = max(f["first_median_s"] for f in result.entry.verdict["finalists"])
    planned = measure.final_samples(SweepSettings(samples=3), slowest)  # or fewer once the default is settled
    assert planned >= 6 and (final == planned or measure.earliest_stop(planned) <= final < planned and
                             result.entry.verdict["rule"] != "beat_default")
    assert {c.timing.samples for c in result.candidates if c.status == "ok"} <= {1, 3, final}
    header = json.loads(next((tmp_path / "cpu" / "sweeps").rglob("*.jsonl")).read_text().splitlines()[0])
    assert header["identity"]["race"] == 1.5  # a sweep raced differently is another sweep (not resumed)


def test_race_must_be_above_one():
    with pytest.raises(moe_tune.core.errors.UsageError, match="race must be > 1"):
        SweepSettings(race=1.0)
    assert SweepSettings(race=None).race is None


def test_tuner_key_equals_runtime_key(tmp_path, caplog):
    """A table written by the tuner is found by the runtime for the same call: the one shared key."""
    problem = RaggedDotProblem(m=384, k=128, n=64, groups=6)
    result = run_sweep(SweepRequest.make("ragged_dot", problem, samples=2, max_candidates=3, profile_dir=tmp_path))
    lhs = jax.numpy.ones((384, 128)); rhs = jax.numpy.ones((6, 128, 64))
    sizes = jax.numpy.full((6,), 64, jax.numpy.int32)
    runtime_problem = RaggedDotProblem.from_arrays(lhs, rhs, sizes)
    assert entry_key("ragged_dot", runtime_problem, "tiled", "balanced") == result.key
    with use_profiles(tmp_path), caplog.at_level(logging.INFO, logger="moe_tune"):
        jax.jit(moe_tune.ragged_dot)(lhs, rhs, sizes)
        found = get_op("ragged_dot").lookup(runtime_problem)  # the platform default backend, as the runtime
    assert found.source == "exact" and found.key == result.key
    assert found.config.to_dict() == result.entry.config
    assert any("exact" in r.getMessage() and found.config.label() in r.getMessage() for r in caplog.records)


def test_concurrent_writers_keep_every_entry(tmp_path):
    import multiprocessing as mp

    path = tmp_path / "cpu" / "ragged_dot.json"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_write_many, args=(str(path), w)) for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert len(read_table(path)["entries"]) == 2 * 15


def _write_many(path: str, writer: int) -> None:
    from moe_tune.profiles import write_entries

    for i in range(15):
        write_entries(path, "ragged_dot", "cpu", [{"key": f"w{writer}-{i}", "fields": {}, "config": {}}])


def test_failed_write_leaves_the_old_table_intact(tmp_path):
    from moe_tune.profiles import write_entries

    path = tmp_path / "cpu" / "ragged_dot.json"
    write_entries(path, "ragged_dot", "cpu", [{"key": "a", "fields": {}, "config": {}}])
    before = path.read_text()
    with pytest.raises(TypeError):
        write_entries(path, "ragged_dot", "cpu", [{"key": "b", "fields": {}, "config": {"x": object()}}])
    assert path.read_text() == before
    assert json.loads(before)["entries"].keys() == {"a"}
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_distributions_are_seeded_and_sum_to_rows():
    for name in distributions.DISTRIBUTIONS:
        a = distributions.group_sizes(name, 1000, 16, seed=5)
        assert a.sum() == 1000 and a.dtype == np.int32 and (a >= 0).all()
        assert (a == distributions.group_sizes(name, 1000, 16, seed=5)).all()
    skewed = distributions.group_sizes("skewed", 10000, 32, seed=0)
    assert skewed.max() > 4 * 10000 / 32  # a hot expert
    assert (distributions.group_sizes("single", 100, 8, seed=1) > 0).sum() == 1


def test_every_direction_sweeps_and_the_vjp_uses_each_entry(tmp_path, caplog):
    """Sweeps of fwd, dlhs and drhs write three entries; jax.grad traces all three with exact configs."""
    problem = RaggedDotProblem(m=256, k=64, n=32, groups=4)
    keys = {}
    for direction in ("fwd", "dlhs", "drhs"):
        result = run_sweep(SweepRequest.make("ragged_dot", problem.with_direction(direction), samples=2,
                                             max_candidates=3, profile_dir=tmp_path))
        keys[direction] = result
    assert len({r.key for r in keys.values()}) == 3
    lhs = jax.numpy.ones((256, 64)); rhs = jax.numpy.ones((4, 64, 32))
    sizes = jax.numpy.full((4,), 64, jax.numpy.int32)
    loss = lambda x, w: moe_tune.ragged_dot(x, w, sizes).sum()
    with use_profiles(tmp_path), caplog.at_level(logging.INFO, logger="moe_tune"):
        jax.jit(jax.grad(loss, argnums=(0, 1)))(lhs, rhs)
    messages = [r.getMessage() for r in caplog.records]
    for direction, result in keys.items():
        label = BACKENDS.get("tiled").config_cls.from_dict(result.entry.config).label()
        assert any(f"'direction': '{direction}'" in msg and "exact" in msg and label in msg for msg in messages), (
            direction, messages)


def _timing(samples):
    from moe_tune.tuner.timing import Timing

    med = float(np.median(samples))
    return Timing(med, min(samples), max(samples), (max(samples) - min(samples)) / med, len(samples), "trace",
                  med, tuple(samples))


@pytest.mark.parametrize("best_samples, kept_default", [
    ([0.99, 1.04, 0.95, 1.01, 0.97, 1.03], True),  # 2% faster, about 3% noise: not a win
    ([0.50, 0.52, 0.49, 0.51, 0.50, 0.50], False),  # 2x faster: a win
])
def test_finalists_decide_and_a_win_within_noise_keeps_the_default(monkeypatch, best_samples, kept_default):
    from moe_tune.profiles.verdict import PAIRED_MIN_NOISE
    from moe_tune.tuner import Reporter, measure
    from moe_tune.tuner.candidate import Candidate

    default = Candidate(0, FaultyConfig("good", 64), is_default=True)
    other = Candidate(1, FaultyConfig("good", 32))
    slow = Candidate(2, FaultyConfig("good", 16))
    for c, t in ((default, 1.0), (other, 0.9), (slow, 3.0)):
        c.timing = _timing([t] * 3)
    final = {0: _timing([1.02, 0.98, 1.0, 1.05, 0.96, 1.01]), 1: _timing(best_samples), 2: _timing([3.0] * 6)}
    monkeypatch.setattr(measure, "time_candidates", lambda calls, **kw: ({i: final[i] for i in calls}, None))
    settings = SweepSettings(finalists=1)
    winner, verdict, _ = measure.final_round(settings, [default, other, slow], default, {}, "cpu", Reporter())
    assert (verdict.rule == "within_noise") is kept_default
    assert winner is (default if kept_default else other)
    # the verdict records the noise rule's threshold and both finalists' rounds, the winner first
    # the paired rule (FINDINGS.md: paired finals): per round the default's time over the other's
    ratios = np.array(final[0].samples_s) / np.array(best_samples)
    assert verdict.noise == pytest.approx(max(PAIRED_MIN_NOISE, 2 * float(
        np.median(np.abs(ratios - np.median(ratios))) / np.median(ratios))))
    assert verdict.gain == pytest.approx(float(np.median(ratios)) - 1)
    assert verdict.text == (f"kept default: within noise (+-{verdict.noise:.0%})" if kept_default else
                            f"beat default by {verdict.gain:.0%} (noise +-{verdict.noise:.0%})")
    loser = other if kept_default else default
    assert [f["config"] for f in verdict.finalists] == [winner.config.to_dict(), loser.config.to_dict()]
    assert [f["median_s"] for f in verdict.finalists] == [winner.timing.median_s, loser.timing.median_s]
    assert verdict.finalists[0]["first_median_s"] == (1.0 if kept_default else 0.9)
    assert default.record()["median_s"] == 1.0  # an entry's results keep the sweep round's timing
    assert slow.timing.samples == 3  # only the finalists (the fastest one and the default) were re-timed


def test_compile_worker_hang_and_crash_are_recorded_and_the_sweep_goes_on(faulty, tmp_path, monkeypatch):
    monkeypatch.setattr(FaultyRaggedDot, "candidate_values",
                        lambda self, p: {"mode": ["hang", "crash", "good"], "tm": [32]})
    result = run_sweep(SweepRequest.make("ragged_dot", SMALL, backend=faulty.name, samples=1, workers=2,
                                         compile_timeout_s=HANG_DEADLINE_S, profile_dir=tmp_path))
    status = {c.config.mode: (c.status, c.reason) for c in result.candidates if c.config.tm == 32}
    assert status["hang"][0] == "failed" and f"hung: timed out after {HANG_DEADLINE_S} s" in status["hang"][1]
    assert status["crash"][0] == "failed" and "died" in status["crash"][1] and "signal" in status["crash"][1]
    assert status["good"][0] == "ok"
    assert result.entry.config["mode"] == "good"


def test_resuming_in_a_process_that_ran_the_sweep_with_the_compile_cache(tmp_path):
    """The XLA CPU failure this guards against, reproduced: with the persistent compilation cache on, the
    finalists of a resumed sweep, compiled in workers (cache hits) and loaded into a process that loaded the
    same programs before, failed to run (`NOT_FOUND: Function wrapped_iota not found`). The sweep compiles
    such a candidate again in its own process instead of failing."""
    import subprocess
    import sys

    code = """
import json, sys
from moe_tune.kernels import get_op
from moe_tune.tuner import SweepRequest, run_sweep
from moe_tune.tuner import compiling
compiling.enable_cache()
out = []
for fresh in (True, False, False):
    for direction in ("fwd", "drhs"):
        problem = get_op("ragged_dot").problem(m=512, k=256, n=256, groups=8, dtype="bfloat16", direction=direction)
        r = run_sweep(SweepRequest.make("ragged_dot", problem, backend="tiled", samples=1, workers=2,
                                        strategy="coordinate", profile_dir=sys.argv[1], fresh=fresh))
        out.append([direction, r.entry.search["resumed"], r.entry.candidates["ok"]])
print(json.dumps(out))
"""
    env = {**os.environ, "MOE_TUNE_COMPILE_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "profiles")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(runs) == 6 and all(ok >= 1 for _, _, ok in runs)
    assert all(resumed > 0 for _, resumed, _ in runs[2:])  # the second and third rounds resumed


def test_median_floor_bounds_the_median_whatever_the_samples_left():
    from moe_tune.tuner.timing import _median_floor

    assert _median_floor([5.0], 3) == 0.0  # one of three: the other two may be anything
    assert _median_floor([5.0, 2.0], 3) == 2.0  # two of three: the median is at least the smaller
    assert _median_floor([5.0, 2.0, 9.0, 4.0], 5) == 4.0
    assert _median_floor([5.0, 2.0, 9.0], 4) == 2.0  # even: at least the lower middle


def test_a_call_that_cannot_be_a_finalist_gets_no_more_samples():
    """With a cutoff every call is far above, each stops once its median is certain to be above it: after
    two of three samples (deterministic: the cutoff is below any real time)."""
    calls, rounds = _three_calls(), []
    timings, _ = time_candidates(calls, samples=3, platform="cpu", race=1e9, cutoff_s=1e-12, on_round=rounds.append)
    assert {t.samples for t in timings.values()} == {2}
    assert sum(rounds) == 3 * 3
    timings, _ = time_candidates(calls, samples=3, platform="cpu", race=1e9, cutoff_s=1e9)
    assert {t.samples for t in timings.values()} == {3}
