"""The final round's time budget (issue 32, session 14): a short call's finalists get about `final_time_s`
seconds of calls each (at most MAX_FINAL_SAMPLES samples), and the noise rule holds a median of many samples to
its standard error (sqrt(6 / n) of the 6-sample threshold, never below one MAD), so that a gap six samples
call noise can be a win once the samples resolve it; a copy of the default still never wins."""

from __future__ import annotations

import math

import pytest

from moe_tune.errors import UsageError
from moe_tune.kernels import get_op
from moe_tune.profiles.verdict import (
    MIN_FINAL_SAMPLES, MIN_NOISE_SCALE, NOISE_FACTOR, NOISE_SAMPLES, BEAT_DEFAULT, WITHIN_NOISE, noise_threshold,
    relative_mad,
)
from moe_tune.tuner import Reporter, finals
from moe_tune.tuner.candidate import Candidate
from moe_tune.tuner.crossover import SideBySide
from moe_tune.tuner.sweep_settings import SweepSettings
from moe_tune.tuner.timing import _summarize
from test_evidence import CONFIGS


def _noisy(median: float, n: int, mad: float) -> list[float]:
    """n samples around `median`, all but one (odd n) off by `mad` (relative), half each way: relative MAD `mad`."""
    offsets = [0.0] * (n % 2) + [mad] * (n // 2) + [-mad] * (n // 2)
    return [median * (1 + o) for o in offsets]


def _cand(index: int, samples: list[float], *, default: bool = False) -> Candidate:
    return Candidate(index, CONFIGS[index], is_default=default, timing=_summarize(samples, "trace", samples))


def test_short_calls_get_about_the_time_budget_in_samples_capped():
    settings = SweepSettings(samples=3, workers=1, final_time_s=0.3)
    assert finals.final_samples(settings, 0.010) == 30  # 0.3 s of 10 ms calls
    assert finals.final_samples(settings, 1e-6) == finals.MAX_FINAL_SAMPLES
    assert finals.final_samples(settings, 0.2) == 6  # a long call: twice the sweep round's, as before
    assert finals.final_samples(settings) == 6  # no median known: the samples alone
    assert finals.final_samples(SweepSettings(samples=3, workers=1, final_time_s=0), 0.001) == 6
    assert finals.final_samples(SweepSettings(samples=1, workers=1, final_time_s=0), 1e-6) == MIN_FINAL_SAMPLES
    with pytest.raises(UsageError, match="final_time_s"):
        SweepSettings(final_time_s=-1)


def test_the_noise_of_a_median_narrows_with_samples_down_to_one_mad():
    for n, scale in ((5, 1.0), (NOISE_SAMPLES, 1.0), (12, math.sqrt(0.5)), (24, 0.5), (40, MIN_NOISE_SCALE)):
        samples = _noisy(1.0, n, 0.1)
        assert relative_mad(samples) == pytest.approx(0.1)
        assert noise_threshold(samples, samples) == pytest.approx(NOISE_FACTOR * scale * 0.1)
    # the fewer samples of the two set the scale
    assert noise_threshold(_noisy(1.0, 40, 0.1), _noisy(1.0, 6, 0.1)) == pytest.approx(0.2)


@pytest.mark.parametrize("n, rule", [(6, WITHIN_NOISE), (40, BEAT_DEFAULT)])
def test_a_gap_six_samples_call_noise_is_a_win_with_forty(n, rule):
    """12% faster with 8% noise per sample: within 6 samples' threshold (16%), beyond 40's (8%)."""
    best, default = _cand(1, _noisy(1.0, n, 0.08)), _cand(0, _noisy(1.12, n, 0.08), default=True)
    assert finals.decide(best, default, [best, default])[1].rule == rule


def test_a_copy_of_the_default_does_not_beat_it_however_many_samples():
    """Two timings of one config differ by their noise alone: a gap of half a MAD is no win at any count."""
    for n in (6, 24, 40):
        best, default = _cand(1, _noisy(1.0, n, 0.1)), _cand(0, _noisy(1.05, n, 0.1), default=True)
        assert finals.decide(best, default, [best, default])[1].rule == WITHIN_NOISE


def test_the_final_round_times_short_finalists_for_the_budget(monkeypatch):
    asked = {}

    def fake(calls, *, samples, **kw):
        asked["samples"] = samples
        return {i: _summarize(_noisy(t, samples, 0.01), "trace", [t]) for i, t in ((0, 0.012), (1, 0.010))
                if i in calls}, None

    monkeypatch.setattr(finals, "time_candidates", fake)
    default, other = _cand(0, [0.012] * 3, default=True), _cand(1, [0.010] * 3)
    settings = SweepSettings(samples=3, workers=1, finalists=1, final_time_s=0.3)
    winner, verdict, _ = finals.final_round(settings, [default, other], default, {}, "cpu", Reporter())
    assert asked["samples"] == 25  # 0.3 s over the slower finalist's 12 ms sweep-round median
    assert winner is other and verdict.rule == BEAT_DEFAULT
    assert {f["samples"] for f in verdict.finalists} == {25}
    assert {f["first_median_s"] for f in verdict.finalists} == {0.010, 0.012}


def test_side_by_side_keeps_its_samples_out_of_the_json():
    timed = SideBySide({"a": 1.0}, {"a": 0.1}, 3, "trace", None, {}, {"a": (1.0, 1.1, 0.9)})
    assert timed.samples_s["a"] == (1.0, 1.1, 0.9) and "samples_s" not in timed.to_json()
    assert timed.to_json()["median_s"] == {"a": 1.0}


def test_side_by_side_gives_short_calls_the_time_budget_too():
    """A ladder's boundary is one side-by-side comparison: with `time_s`, its short calls get more samples."""
    from moe_tune.tuner.crossover import time_side_by_side

    problem = get_op("ragged_dot").problem(m=32, k=32, n=32, groups=2)
    configs = {"a": {"tm": 16, "tk": 32, "tn": 32}, "b": {"tm": 32, "tk": 32, "tn": 32}}
    plain = time_side_by_side("ragged_dot", "tiled", problem, configs, distribution="balanced", samples=2)
    budget = time_side_by_side("ragged_dot", "tiled", problem, configs, distribution="balanced", samples=2,
                               time_s=1.0)
    assert plain.samples == 2 and {len(s) for s in plain.samples_s.values()} == {2}
    assert budget.samples == finals.MAX_FINAL_SAMPLES  # microsecond calls: the cap
    assert {len(s) for s in budget.samples_s.values()} == {finals.MAX_FINAL_SAMPLES}
