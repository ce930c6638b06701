"""How a timing round's trace is collected (`timing.collect`): in memory by default, through a file when the
traces are kept; both read the same events (one per run of each candidate)."""

from __future__ import annotations

import jax
import pytest

from moe_tune.tuner import timing
from moe_tune.tuner.timing import collect, traceable


def _calls() -> dict:
    x = jax.numpy.ones((64, 64))
    fns = {i: traceable(lambda x, i=i: x @ x + i, i) for i in (3, 7)}
    for f in fns.values():
        jax.block_until_ready(f(x))
    return {i: (lambda f=f: jax.block_until_ready(f(x))) for i, f in fns.items()}


def _twice(calls: dict):
    def run() -> None:
        for _ in range(2):
            for call in calls.values():
                call()
    return run


def test_the_trace_is_read_in_memory_with_one_event_per_run(monkeypatch):
    assert timing._session_type() is not None  # this jaxlib hands the XSpace over in memory
    stopped = []
    real_stop = timing.stop_profiler
    monkeypatch.setattr(timing, "stop_profiler", lambda s: stopped.append(s) or real_stop(s))
    monkeypatch.setattr(timing, "parse_trace", lambda *a: (_ for _ in ()).throw(AssertionError("went to a file")))
    found = collect(_twice(_calls()), "cpu")
    assert len(stopped) == 1
    assert sorted(found) == [3, 7] and all(len(v) == 2 and min(v) > 0 for v in found.values())


def test_a_kept_trace_goes_through_a_file_and_reads_the_same_events(tmp_path, monkeypatch):
    monkeypatch.setattr(timing, "stop_profiler", lambda s: (_ for _ in ()).throw(AssertionError("in memory")))
    found = collect(_twice(_calls()), "cpu", tmp_path / "kept")
    assert sorted(found) == [3, 7] and all(len(v) == 2 and min(v) > 0 for v in found.values())
    assert timing.xplane_file(tmp_path / "kept") is not None


def test_a_profiler_already_running_is_an_error_not_an_empty_trace(tmp_path):
    calls = _calls()
    jax.profiler.start_trace(str(tmp_path))
    try:
        with pytest.raises(Exception, match="(?i)another profiling session"):
            collect(_twice(calls), "cpu")
    finally:
        jax.profiler.stop_trace()
    assert sorted(collect(_twice(calls), "cpu")) == [3, 7]  # usable again afterwards
