"""The sweep's clock (issue 32, tuner speed): long CPU calls are timed by the wall clock without the profiler,
short ones and other platforms by the profiler trace; the choice is made once per sweep and recorded."""

from __future__ import annotations

import contextlib

import jax
import pytest

from moe_tune.kernels.ragged_dot import RaggedDotProblem
from moe_tune.profiles import read_table
from moe_tune.tuner import SweepRequest, run_sweep
from moe_tune.tuner import timing


def test_the_wall_clock_is_chosen_only_for_long_cpu_calls():
    long = timing.WALL_CLOCK_MIN_S * 2
    method, why = timing.clock_for("cpu", long)
    assert method == "wall" and "wall clock chosen" in why and f"{long * 1e3:.1f} ms" in why
    assert timing.clock_for("cpu", timing.WALL_CLOCK_MIN_S / 2) == ("trace", None)
    assert timing.clock_for("gpu", long) == ("trace", None)
    assert timing.clock_for("tpu", long) == ("trace", None)


@pytest.fixture
def no_profiler(monkeypatch):
    """jax.profiler.trace, as the timing module sees it, fails: a test passes only if it is never started."""

    @contextlib.contextmanager
    def refuse(*args, **kwargs):
        raise AssertionError("the profiler was started")
        yield

    monkeypatch.setattr(timing.jax.profiler, "trace", refuse)


def test_wall_clock_timing_never_starts_the_profiler(no_profiler):
    x = jax.numpy.ones((32, 32))
    fns = {i: jax.jit(lambda x, i=i: x @ x + i) for i in range(2)}
    calls = {i: (lambda f=f: f(x)) for i, f in fns.items()}
    timings, why = timing.time_candidates(calls, samples=3, platform="cpu", clock="wall", warmup=1)
    assert why is None and set(timings) == {0, 1}
    assert all(t.method == "wall" and t.samples == 3 and len(t.samples_s) == 3 and t.min_s > 0
               for t in timings.values())


def test_a_sweep_of_long_calls_is_timed_by_the_wall_clock_and_says_why(tmp_path, monkeypatch, no_profiler):
    """Every call counts as long here (threshold 0): the sweep never starts the profiler, every candidate and
    the finalists are timed by the wall clock, and the entry records why."""
    monkeypatch.setattr(timing, "WALL_CLOCK_MIN_S", 0.0)
    result = run_sweep(SweepRequest.make("ragged_dot", RaggedDotProblem(m=256, k=128, n=128, groups=4),
                                         backend="tiled", samples=2, profile_dir=tmp_path, max_candidates=3,
                                         workers=1))
    entry = read_table(tmp_path / "cpu" / "ragged_dot.json")["entries"][result.key]
    assert entry["timing"]["method"] == "wall" and entry["timing_fallback"].startswith("wall clock chosen")
    timed = [c for c in result.candidates if c.timing is not None]
    assert len(timed) == 3 and {c.timing.method for c in timed} == {"wall"}
