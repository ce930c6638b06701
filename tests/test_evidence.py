"""The evidence rules: a win needs at least MIN_FINAL_SAMPLES samples per finalist and a gap beyond
the noise; a sweep that cannot apply the rule keeps the default and says `unverified` and why; verdict words
tell the default fastest from a candidate that beat it; the marks readers see (`profiles.verdict`)."""

from __future__ import annotations

import pytest

from moe_tune.kernels import get_op
from moe_tune.profiles.entry import Entry
from moe_tune.profiles.verdict import (BEAT_DEFAULT, DEFAULT_FAILED, DEFAULT_FASTEST, MIN_FINAL_SAMPLES, UNVERIFIED,
                                       WITHIN_NOISE, Verdict, low_budget, marks, weaker_than)
from moe_tune.tuner import measure
from moe_tune.tuner.candidate import Candidate
from moe_tune.tuner.request import SweepSettings
from moe_tune.tuner.timing import summarize

CONFIGS = get_op("ragged_dot").backends.get("tiled").search_space(get_op("ragged_dot").problem(
    m=256, k=128, n=128, groups=4))


def _cand(index: int, samples: list[float], *, default: bool = False, ok: bool = True) -> Candidate:
    c = Candidate(index, CONFIGS[index], is_default=default, timing=summarize(samples, "trace", samples))
    if not ok:
        c.fail("compile", "boom")
    return c


def test_a_clear_win_with_enough_samples_beats_the_default():
    best, default = _cand(1, [1.0, 1.01, 0.99, 1.0, 1.0]), _cand(0, [2.0, 2.02, 1.98, 2.0, 2.0], default=True)
    winner, verdict = measure.decide(best, default, [best, default])
    assert winner is best and verdict.rule == BEAT_DEFAULT and verdict.evidence_problem is None
    assert verdict.text.startswith("beat default by 100%") and verdict.gain == pytest.approx(1.0)


def test_too_few_samples_keep_the_default_unverified():
    """`--samples 1` without the evidence rules: two samples per finalist, no noise estimate can come from them."""
    best, default = _cand(1, [1.0, 1.0]), _cand(0, [2.0, 2.0], default=True)
    winner, verdict = measure.decide(best, default, [best, default])
    assert winner is default and verdict.rule == UNVERIFIED
    assert verdict.reason == f"2 samples per finalist, fewer than {MIN_FINAL_SAMPLES}"
    assert verdict.text == f"unverified: {verdict.reason}; kept default"
    assert verdict.finalists[0]["is_default"]  # the winner first


def test_a_gap_within_the_noise_keeps_the_default():
    best, default = _cand(1, [1.0, 1.5, 0.6, 1.0, 1.4]), _cand(0, [1.1, 1.1, 1.1, 1.1, 1.1], default=True)
    winner, verdict = measure.decide(best, default, [best, default])
    assert winner is default and verdict.rule == WITHIN_NOISE and verdict.noise > 0.1


def test_the_default_fastest_and_the_default_failed_are_told_apart():
    default = _cand(0, [1.0] * 5, default=True)
    assert measure.decide(default, default, [default])[1].rule == DEFAULT_FASTEST
    broken, best = _cand(0, [1.0] * 5, default=True, ok=False), _cand(1, [1.0] * 5)
    winner, verdict = measure.decide(best, broken, [best])
    assert winner is best and verdict.rule == DEFAULT_FAILED


def test_an_interrupt_before_the_final_round_is_unverified():
    best, default = _cand(1, [1.0] * 9), _cand(0, [3.0] * 9, default=True)
    winner, verdict = measure.decide(best, default, [best, default], unverified="interrupted before the final round")
    assert winner is default and verdict.rule == UNVERIFIED and "interrupted" in verdict.text


def test_the_final_round_has_at_least_the_minimum_whatever_samples_says():
    assert measure.final_samples(SweepSettings(samples=1, workers=1)) == MIN_FINAL_SAMPLES
    assert measure.final_samples(SweepSettings(samples=4, workers=1)) == 8


def test_an_old_win_on_two_samples_is_marked_weak():
    """Entries of older sweeps recorded `fastest` for any winner, some from finalists of two samples."""
    old = Verdict.from_json({"rule": "fastest", "noise": 0.01, "finalists": [
        {"config": {"tm": 16}, "is_default": False, "median_s": 1.0, "samples": 2},
        {"config": {"tm": 8}, "is_default": True, "median_s": 2.3, "samples": 2}]})
    assert old.rule == BEAT_DEFAULT
    assert old.evidence_problem == f"2 samples per finalist, fewer than {MIN_FINAL_SAMPLES}"
    assert old.short == "beat default?" and "weak evidence" in old.text
    entry = Entry.from_json({"key": "k", "fields": {}, "config": {"tm": 16}, "verdict": old.to_json(),
                             "search": {"strategy": "grid", "max_candidates": 3, "space": 3, "full_space": 68,
                                        "stopped": "exhausted", "samples": 1},
                             "candidates": {"tried": 3}})
    assert marks(entry) == ["weak evidence", "low budget"]
    assert low_budget(entry) == "low budget: grid, 3 of 68 candidates (--max-candidates 3)"


def _searched(tried: int | None = None, **search) -> Entry:
    base = {"strategy": "grid", "budget": None, "time_budget_s": None, "max_candidates": None, "space": 68,
            "full_space": 68, "samples": 3, "stopped": "exhausted"}
    return Entry.from_json({"key": "k", "fields": {}, "config": {}, "search": {**base, **search},
                            "candidates": {"tried": tried or search.get("space", 68)}})


def test_an_entry_tuned_with_less_than_asked_is_weaker():
    full = {"strategy": "grid", "budget": None, "time_budget_s": None, "max_candidates": None, "samples": 3}
    assert weaker_than(_searched(), full) is None
    smoke = _searched(max_candidates=3, space=3)
    assert weaker_than(smoke, full) == "tuned with grid, 3 of 68 candidates (--max-candidates 3)"
    assert weaker_than(smoke, {**full, "max_candidates": 3}) is None  # asked the same
    assert weaker_than(smoke, {**full, "max_candidates": 8}) is not None
    assert weaker_than(_searched(samples=1), full) == "tuned with --samples 1 (asked 3)"
    assert weaker_than(_searched(stopped="time budget", space=68), full) is not None
    descent = _searched(16, strategy="coordinate", stopped="converged")
    assert weaker_than(descent, {**full, "strategy": "coordinate"}) is None  # whole by its own rule
    assert weaker_than(descent, full) == "tuned with coordinate, 16 of 68 candidates"  # a grid asks all
    assert weaker_than(Entry.from_json({"key": "k", "fields": {}, "config": {}}), full) is None


def test_the_breakdown_says_when_it_contradicts_a_claimed_win():
    """A `ragged_gather` "win" of 2.3x whose breakdown measured the winner at 14.9 ms of op time
    per run against the default's 6.7 ms, without pointing at the contradiction."""
    from moe_tune.commands.breakdown import Breakdown, OpTime
    from moe_tune.commands.report import breakdown_check, breakdown_frame

    def broken(label: str, seconds: float) -> Breakdown:
        return Breakdown(label, {"rows_per_chunk": 8}, "trace", 5, (OpTime("fusion", seconds, 79.0, 1.0),))

    win = Verdict(BEAT_DEFAULT, 0.05, (
        {"config": {"rows_per_chunk": 8}, "is_default": False, "median_s": 1.0, "samples": 5},
        {"config": {"rows_per_chunk": 64}, "is_default": True, "median_s": 2.3, "samples": 5}))
    entry = Entry.from_json({"key": "k", "fields": {}, "config": {"rows_per_chunk": 8}, "verdict": win.to_json(),
                             "speedup_over_default": 2.298})
    found = [broken("winner", 14.9e-3), broken("default", 6.7e-3)]
    ratio, warning = breakdown_check(entry, found)
    assert ratio.startswith("winner/default op time: 2.22")
    assert warning.startswith("warning:") and "2.30x faster" in warning and "2.22x the default" in warning
    assert breakdown_check(entry, [broken("winner", 6e-3), broken("default", 6.7e-3)])[1:] == []  # agrees
    assert breakdown_check(entry, found[:1]) == []  # the default won: one config, nothing to compare
    assert list(breakdown_frame(found)["calls_per_run"]) == [79, 79]  # counts, not 79.000


def test_bench_flags_the_default_as_tuned_and_a_faster_fallback_with_the_next_step():
    """`bench` showed tuned 18.78 vs default 20.12 ms for the identical config, and `fallback/tuned
    0.39` (the plain path 2.5x faster), with no flag and no advice."""
    from moe_tune.commands.bench import Comparison
    from moe_tune.kernels import get_op

    op = get_op("ragged_gather")
    problem, backend = op.problem(tokens=32, hidden=128, top_k=4), op.backends.get("tiled")
    plan = op.bench_plan(problem, backend, backend.default_config(problem), {}, distribution="balanced", seed=1)
    same = {"rows_per_chunk": 64}
    c = Comparison(op="ragged_gather", backend="tiled", tuned_config=same, default_config=same,
                   times_s={"tuned": 18.78e-3, "default": 20.12e-3, "fallback": 7.3e-3}, spread={},
                   timing_method="trace", timing_fallback=None, copy_gbps=1.0, roofline_s=1e-3,
                   ratios={"fallback_vs_tuned": 0.39}, baseline=plan.baseline, advice=plan.advice,
                   lookup_marks=("low budget",))
    same_note, fallback_note, marks_note = c.notes()
    assert same_note.startswith("tuned = default")
    assert fallback_note.startswith("fallback is 2.56x faster") and "ragged_gather_fallback=True" in fallback_note
    assert marks_note.startswith("entry low budget")
