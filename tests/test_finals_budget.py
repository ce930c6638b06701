"""The final round's time budget (FINDINGS.md: final round budget): a short call's finalists get about `final_time_s`
seconds of calls each (at most MAX_FINAL_SAMPLES samples), and the noise rule holds a median of many samples to
its standard error (sqrt(6 / n) of the 6-sample threshold, never below one MAD), so that a gap six samples
call noise can be a win once the samples resolve it; a copy of the default still never wins. The final round
compares the finalists paired, round by round (FINDINGS.md: paired finals): load both calls of a round share cancels."""

from __future__ import annotations

import math

import pytest
from test_evidence import CONFIGS

from moe_tune.core.errors import UsageError
from moe_tune.kernels import get_op
from moe_tune.profiles.verdict import (BEAT_DEFAULT, DEFAULT_FASTEST, MIN_FINAL_SAMPLES, MIN_NOISE_SCALE, NOISE_FACTOR,
                                       NOISE_SAMPLES, PAIRED_MIN_NOISE, WITHIN_NOISE, Verdict, noise_threshold, paired,
                                       relative_mad)
from moe_tune.tuner import Reporter, measure
from moe_tune.tuner.candidate import Candidate
from moe_tune.tuner.crossover import SideBySide
from moe_tune.tuner.request import SweepSettings
from moe_tune.tuner.timing import summarize


def _noisy(median: float, n: int, mad: float) -> list[float]:
    """n samples around `median`, all but one (odd n) off by `mad` (relative), half each way: relative MAD `mad`."""
    offsets = [0.0] * (n % 2) + [mad] * (n // 2) + [-mad] * (n // 2)
    return [median * (1 + o) for o in offsets]


def _cand(index: int, samples: list[float], *, default: bool = False) -> Candidate:
    return Candidate(index, CONFIGS[index], is_default=default, timing=summarize(samples, "trace", samples))


def test_short_calls_get_about_the_time_budget_in_samples_capped():
    settings = SweepSettings(samples=3, workers=1, final_time_s=0.3)
    assert measure.final_samples(settings, 0.010) == 30  # 0.3 s of 10 ms calls
    assert measure.final_samples(settings, 1e-6) == measure.MAX_FINAL_SAMPLES
    assert measure.final_samples(settings, 0.2) == 6  # a long call: twice the sweep round's, as before
    assert measure.final_samples(settings) == 6  # no median known: the samples alone
    assert measure.final_samples(SweepSettings(samples=3, workers=1, final_time_s=0), 0.001) == 6
    assert measure.final_samples(SweepSettings(samples=1, workers=1, final_time_s=0), 1e-6) == MIN_FINAL_SAMPLES
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
    assert measure.decide(best, default, [best, default])[1].rule == rule


def test_a_copy_of_the_default_does_not_beat_it_however_many_samples():
    """Two timings of one config differ by their noise alone: a gap of half a MAD is no win at any count."""
    for n in (6, 24, 40):
        best, default = _cand(1, _noisy(1.0, n, 0.1)), _cand(0, _noisy(1.05, n, 0.1), default=True)
        assert measure.decide(best, default, [best, default])[1].rule == WITHIN_NOISE


def test_the_final_round_times_short_finalists_for_the_budget(monkeypatch):
    asked = []

    def fake(calls, *, samples, **kw):
        asked.append(samples)
        return {i: summarize(_noisy(t, samples, 0.01), "trace", [t]) for i, t in ((0, 0.012), (1, 0.010))
                if i in calls}, None

    monkeypatch.setattr(measure, "time_candidates", fake)
    default, other = _cand(0, [0.012] * 3, default=True), _cand(1, [0.010] * 3)
    settings = SweepSettings(samples=3, workers=1, finalists=1, final_time_s=0.3)
    winner, verdict, _ = measure.final_round(settings, [default, other], default, {}, "cpu", Reporter())
    assert sum(asked) == 25  # 0.3 s over the slower finalist's 12 ms sweep-round median (in chunks: `settled`)
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
    assert budget.samples == measure.MAX_FINAL_SAMPLES  # microsecond calls: the cap
    assert {len(s) for s in budget.samples_s.values()} == {measure.MAX_FINAL_SAMPLES}


# Per-round load on a shared machine: each round's calls all run slower or faster together (made up, 1x-2x).
LOAD = [1.0, 1.7, 1.1, 2.0, 1.3, 1.6, 1.05, 1.9]


def test_a_clear_win_under_shared_load_is_a_win_paired_and_noise_apart():
    """1.2x faster in every round while the load doubles some rounds: two medians with their MADs call it
    noise (the k=7168 m=1024 case of FINDINGS.md: paired finals); the per-round ratios are all 1.2 and it wins."""
    best, default = _cand(1, list(LOAD)), _cand(0, [1.2 * x for x in LOAD], default=True)
    assert measure.decide(best, default, [best, default])[1].rule == WITHIN_NOISE
    winner, verdict = measure.decide(best, default, [best, default], pair=True)
    assert winner is best and verdict.rule == BEAT_DEFAULT
    assert verdict.gain == pytest.approx(0.2) and verdict.paired_gain == pytest.approx(0.2)
    assert Verdict.from_json(verdict.to_json()).paired_gain == pytest.approx(0.2)


def test_a_copy_of_the_default_under_shared_load_does_not_win_paired():
    """The same config twice: per round within +-4% of each other whatever the load, no gain beyond it."""
    jitter = [0.04, -0.03, 0.02, -0.04, 0.03, -0.02, 0.01, -0.01]
    copy = _cand(1, [x * (1 + j) for x, j in zip(LOAD, jitter)])
    default = _cand(0, [x * (1 - j / 2) for x, j in zip(LOAD, jitter)], default=True)
    gain, noise = paired(default.timing.samples_s, copy.timing.samples_s)
    assert abs(gain) <= noise
    assert measure.decide(copy, default, [copy, default], pair=True)[1].rule == WITHIN_NOISE
    # two compiles of one config can differ by a few percent in every round: below the floor, no win
    steady = _cand(1, [x / (1 + 0.9 * PAIRED_MIN_NOISE) for x in LOAD])
    _, verdict = measure.decide(steady, _cand(0, list(LOAD), default=True), pair=True)
    assert verdict.rule == WITHIN_NOISE and verdict.noise == PAIRED_MIN_NOISE


def test_the_final_round_picks_by_paired_gain(monkeypatch):
    """The finalist faster round by round wins, though another's median is lower (its fast samples fell in
    the quiet rounds); none faster in the median round: the default."""
    final = {0: summarize([1.2 * x for x in LOAD], "trace", LOAD),
             1: summarize([x / 1.0 for x in LOAD], "trace", LOAD),  # 1.2x faster in every round
             # 1.05x slower than 1 in six rounds, 2-3x faster in two: a lower median, a smaller median gain
             2: summarize([1.05 * x for x in LOAD[:4]] + [0.5, 0.5] + [1.05 * x for x in LOAD[6:]], "trace", LOAD)}
    monkeypatch.setattr(measure, "time_candidates", lambda calls, **kw: ({i: final[i] for i in calls}, None))
    default, a, b = _cand(0, [1.2] * 3, default=True), _cand(1, [1.0] * 3), _cand(2, [1.0] * 3)
    assert final[2].median_s < final[1].median_s
    settings = SweepSettings(samples=3, workers=1, finalists=2, final_time_s=0)
    winner, verdict, _ = measure.final_round(settings, [default, a, b], default, {}, "cpu", Reporter())
    assert winner is a and verdict.rule == BEAT_DEFAULT and verdict.paired_gain == pytest.approx(0.2)
    final[1] = final[2] = final[0]
    winner, verdict, _ = measure.final_round(settings, [default, a, b], default, {}, "cpu", Reporter())
    assert winner is default and verdict.rule == DEFAULT_FASTEST


def test_finalists_timed_in_one_batch_keep_its_rounds_as_the_first_final_rounds(monkeypatch):
    """The default and a seed timed in the same batch rounds (a warm sweep's first round): the final
    round times only the rounds still missing and decides paired over all of them; finalists of different
    batches (or restored from the log: no batch) get the whole final round."""
    asked = []

    def fake(calls, *, samples, **kw):
        asked.append(samples)
        return {i: summarize([t] * samples, "trace", [t]) for i, t in ((0, 1.2), (1, 1.0)) if i in calls}, None

    monkeypatch.setattr(measure, "time_candidates", fake)
    settings = SweepSettings(samples=3, workers=1, finalists=1, final_time_s=0)
    for batches, reused in (((0, 0), True), ((0, 1), False), ((None, None), False)):
        default, seed = _cand(0, [1.2, 2.4, 1.2], default=True), _cand(1, [1.0, 2.0, 1.0])
        default.batch, seed.batch = batches
        winner, verdict, _ = measure.final_round(settings, [default, seed], default, {}, "cpu", Reporter())
        assert sum(asked) == (measure.final_samples(settings) - 3 if reused else measure.final_samples(settings))
        asked.clear()
        assert winner is seed and verdict.rule == BEAT_DEFAULT and verdict.paired_gain == pytest.approx(0.2)
        assert {f["samples"] for f in verdict.finalists} == {measure.final_samples(settings)}
        assert seed.first_timing.samples_s == (1.0, 2.0, 1.0)  # the sweep round, as recorded before
        assert (seed.timing.samples_s[:3] == (1.0, 2.0, 1.0)) == reused


def test_a_resumed_run_numbers_its_batches_after_the_logged_ones():
    """A batch number names one batch of one run of the sweep: a resumed run's first batch comes after the log's
    (whose candidates keep their numbers), so its rounds never pair with a restored batch's."""
    from types import SimpleNamespace

    from moe_tune.tuner.state import SweepState

    log = SimpleNamespace(restored={"a": {"batch": 0}, "b": {"batch": 3}, "c": {"batch": None}})
    assert next(SweepState(None, log, Reporter(), 0.0).batch_numbers) == 4
    assert next(SweepState(None, SimpleNamespace(restored={}), Reporter(), 0.0).batch_numbers) == 0


def test_the_final_round_stops_once_no_finalist_can_beat_the_default(monkeypatch):
    """A win needs most rounds' ratios past the 10% floor: once more than half of the planned rounds are at or
    below it for every finalist, the rest cannot change the winner, and the round stops (the default kept, as
    the whole round would); a finalist faster in every round gets every round."""
    asked, per_round = [], {0: 1.0, 1: 1.2, 2: 0.8}  # 1 is slower than the default, 2 is faster

    def fake(calls, *, samples, **kw):
        asked.append(samples)
        return {i: summarize([per_round[i]] * samples, "trace", [per_round[i]]) for i in calls}, None

    monkeypatch.setattr(measure, "time_candidates", fake)
    settings = SweepSettings(samples=3, workers=1, finalists=2, final_time_s=0.3)  # 0.3 s of 20 ms calls: 15 rounds
    default, slower = _cand(0, [0.02] * 3, default=True), _cand(1, [0.02] * 3)
    winner, verdict, _ = measure.final_round(settings, [default, slower], default, {}, "cpu", Reporter())
    assert asked == [15 // 2 + 1] and winner is default and verdict.rule == DEFAULT_FASTEST
    asked.clear()
    default, faster = _cand(0, [0.02] * 3, default=True), _cand(2, [0.016] * 3)
    winner, verdict, _ = measure.final_round(settings, [default, faster], default, {}, "cpu", Reporter())
    assert sum(asked) == 15 and winner is faster and verdict.rule == BEAT_DEFAULT
    # settled after 4 of 6 rounds: 4 ratios at or below 1.1 (more than 3) can no longer give a median above it;
    # 3 can (the median of 6 is the mean of the 3rd and 4th)
    d = _cand(0, [1.0] * 4, default=True)
    at = lambda samples: measure.settled({0: d.timing, 1: _cand(1, samples).timing}, d, [d, _cand(1, [1.0])], 6)
    assert at([1.0, 1.0, 1.0, 0.95]) and not at([1.0, 1.0, 1.0, 0.5]) and not at([1.0, 1.0, 0.5, 0.5])


def test_a_final_round_whose_clock_keeps_switching_ends(monkeypatch):
    """Each switch between the trace and the wall clock drops the other clock's rounds; a round whose every
    chunk switches (a timer that refuses every other trace, whatever `wall_only` asks) still ends, after twice as
    many chunks as its rounds, and reports the wall clock's reason."""
    calls = []

    def fake(timed_calls, *, samples, **kw):
        method = ("trace", "wall")[len(calls) % 2]
        calls.append(samples)
        return ({i: summarize([t] * samples, method, [t]) for i, t in ((0, 1.2), (1, 1.0)) if i in timed_calls},
                "cross-check refused" if method == "wall" else None)

    monkeypatch.setattr(measure, "time_candidates", fake)
    settings = SweepSettings(samples=3, workers=1, finalists=1, final_time_s=0)
    default, seed = _cand(0, [1.2] * 3, default=True), _cand(1, [1.0] * 3)
    winner, verdict, fallback = measure.final_round(settings, [default, seed], default, {}, "cpu", Reporter())
    assert len(calls) == 2 * measure.final_samples(settings) and fallback == "cross-check refused"
    assert winner.timing.method == ("trace", "wall")[(len(calls) - 1) % 2]
