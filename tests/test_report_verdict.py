"""The verdict in every view: how each entry's winner was chosen, recorded by new sweeps and derived for the
shipped tables (written before it was recorded), in the report's frame and the sweep log's final round."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
from plot_checks import check_plot, drawn  # noqa: F401 (a fixture)

from moe_tune.commands import report
from moe_tune.commands.plots import plot_entries
from moe_tune.kernels import get_op
from moe_tune.profiles.entry import Entry
from moe_tune.profiles.verdict import (BEAT_DEFAULT, DEFAULT_FAILED, DEFAULT_FASTEST, FASTEST, MIN_FINAL_SAMPLES,
                                       ONLY_CANDIDATE, RULES, WITHIN_NOISE, Verdict, verdict_of)
from moe_tune.tuner import SweepRequest, SweepSettings, run_sweep
from moe_tune.tuner.measure import earliest_stop, final_samples

SHIPPED = Path(report.__file__).parents[1] / "profiles" / "data"
ISSUE_CASE = {"direction": "dlhs", "m": 1024, "k": 2880, "n": 2880, "groups": 8}  # default kept within noise


def shipped_entries() -> list[dict]:
    return [entry for path in sorted(SHIPPED.glob("*/*.json"))
            for entry in json.loads(path.read_text())["entries"].values()]


def test_every_shipped_entry_records_its_verdict_and_still_round_trips():
    entries = shipped_entries()
    assert len(entries) >= 45  # 45 ragged_dot and gather entries and the fused_moe ones
    for data in entries:
        entry = Entry.from_json(data)
        assert entry.to_json() == data
        verdict = verdict_of(entry)
        assert not verdict.derived and verdict.rule in RULES and verdict.finalists
        assert (verdict.rule == WITHIN_NOISE) == data["within_noise_of_default"]
        assert [f["config"] for f in verdict.finalists][0] == data["config"]  # the winner first
        # `fastest` (what older entries recorded) reads as what it meant: the default fastest, or a win
        is_default = data["config"] == data["default"]["config"]
        if data["verdict"]["rule"] == FASTEST:
            assert verdict.rule == (DEFAULT_FASTEST if is_default else BEAT_DEFAULT)
    frame = report.entries_frame(SHIPPED)
    assert len(frame) == len(entries) and frame["verdict_detail"].str.len().gt(0).all()
    kept = sum(e["within_noise_of_default"] for e in entries)
    assert frame["verdict_detail"].str.startswith("kept default: within noise").sum() == kept


def test_the_issue_case_is_a_default_kept_within_noise(drawn, tmp_path):
    """ragged_dot dlhs m=1024 k=2880 n=2880 (ISSUE_CASE), as an older shipped table held it (a fixed copy: the
    shipped tables are re-swept, and their verdicts change with the machine's noise): the final round
    re-timed the fastest three and the default; the fastest beat the default by less than the noise
    threshold, so the default was kept, and the plot shows that band and the re-timed medians."""
    data = json.loads((Path(__file__).parent / "data" / "entry_kept_within_noise.json").read_text())
    assert all(data["fields"].get(k) == v for k, v in ISSUE_CASE.items())
    entry = Entry.from_json(data)
    verdict = verdict_of(entry)
    assert verdict.rule == WITHIN_NOISE and entry.config == entry.default_config
    default, *others = verdict.finalists
    assert default["is_default"] and default["median_s"] == entry.median_s and others
    fastest = min(f["median_s"] for f in others)
    assert 0 < default["median_s"] / fastest - 1 <= verdict.noise  # faster, but within the noise
    plot_entries([entry], tmp_path / "issue.png")
    (fig,) = drawn
    check_plot(fig, [entry])
    band = [p for p in fig.axes[0].patches if p.get_facecolor()[:3] == pytest.approx((0.85,) * 3)]
    assert len(band) == 1  # the band of times within noise of the default


def test_an_entry_written_before_verdicts_gets_a_derived_one():
    """The issue case as the tables held it before verdicts were recorded: the verdict is derived
    from the kept default's re-timed samples, a lower bound of the sweep's threshold (+-31% here), and the
    fastest recorded median (255 ms against the default's 328 ms) lies within it."""
    data = json.loads((Path(__file__).parent / "data" / "entry_before_verdicts.json").read_text())
    entry = Entry.from_json(data)
    assert entry.to_json() == data and "verdict" not in entry.to_json()  # an old entry stays as it was
    verdict = verdict_of(entry)
    assert verdict.derived and verdict.rule == WITHIN_NOISE
    assert verdict.label == f"kept default: within noise (+-{verdict.noise:.0%}) (derived)"
    samples = entry.timing["samples_s"]
    median = statistics.median(samples)
    assert verdict.noise == pytest.approx(2 * statistics.median(abs(x - median) for x in samples) / median)
    fastest = min(r["median_s"] for r in entry.results)
    assert entry.default_median_s / fastest - 1 <= verdict.noise
    assert [f["is_default"] for f in verdict.finalists] == [True]  # the winner is the default


def _entry(**changes) -> Entry:
    base = {"key": "k", "fields": {"m": 1}, "config": {"tm": 8}, "default": {"config": {"tm": 8}, "status": "ok",
                                                                             "median_s": 1.0},
            "timing": {"median_s": 1.0, "samples_s": [1.0, 1.1, 0.9]}, "candidates": {"ok": 3},
            "within_noise_of_default": False}
    return Entry.from_json({**base, **changes})


def test_derived_rules():
    assert verdict_of(_entry()).label == "default fastest (derived)"  # the winner is the default
    assert verdict_of(_entry(candidates={"ok": 1})).rule == ONLY_CANDIDATE
    kept = verdict_of(_entry(within_noise_of_default=True))
    assert kept.rule == WITHIN_NOISE and kept.noise == pytest.approx(0.2)
    faster = verdict_of(_entry(config={"tm": 16}))  # a win: the winner's and the default's re-timed medians
    assert [f["config"] for f in faster.finalists] == [{"tm": 16}, {"tm": 8}]
    assert faster.rule == BEAT_DEFAULT and faster.evidence_problem  # no noise estimate: weak evidence
    assert verdict_of(_entry(config={"tm": 16}, default={"config": {"tm": 8}, "status": "failed"})).rule == (
        DEFAULT_FAILED)
    assert verdict_of(_entry(verdict=Verdict(ONLY_CANDIDATE).to_json())) == Verdict(ONLY_CANDIDATE)


def test_a_new_sweep_records_its_verdict_and_the_final_round(isolated_profiles):
    problem = get_op("ragged_dot").problem(m=256, k=128, n=128, groups=4)
    result = run_sweep(SweepRequest.make("ragged_dot", problem, samples=2, max_candidates=4, workers=1))
    entry = Entry.from_json(json.loads(result.table_path.read_text())["entries"][result.entry.key])
    assert entry.to_json() == result.entry.to_json()
    verdict = verdict_of(entry)
    assert not verdict.derived and verdict.rule in (BEAT_DEFAULT, DEFAULT_FASTEST, WITHIN_NOISE)
    assert (verdict.rule == WITHIN_NOISE) == entry.within_noise_of_default
    # the default is held to the noise threshold unless it was the fastest finalist itself
    default_fastest = verdict.rule == DEFAULT_FASTEST
    assert default_fastest == (entry.config == entry.default_config and verdict.rule != WITHIN_NOISE)
    assert (verdict.noise is None) == default_fastest and (default_fastest or verdict.noise >= 0)
    finalists = verdict.finalists
    assert finalists[0]["config"] == entry.config and finalists[0]["median_s"] == entry.median_s
    # --samples 2: the final round takes twice as many, never fewer than the rule's minimum, and for short calls
    # about final_time_s of calls each (tuner.measure.final_samples, from the slowest finalist's sweep round)
    assert sum(f["is_default"] for f in finalists) == 1
    expected = final_samples(SweepSettings(samples=2), max(f["first_median_s"] for f in finalists))
    assert expected >= max(4, MIN_FINAL_SAMPLES) and len({f["samples"] for f in finalists}) == 1
    # all of them, or fewer once no finalist could beat the default (`finals.settled`), or, where the
    # clock switched between the trace and the wall (a loaded machine: `timing_fallback` says why), fewer: each
    # switch drops the other clock's rounds, and the round ends after as many calls as it would have made
    assert finalists[0]["samples"] == expected or (verdict.rule != BEAT_DEFAULT and
                                                   earliest_stop(expected) <= finalists[0]["samples"] < expected) or (
        entry.timing_fallback is not None and finalists[0]["samples"] < expected)
    assert all(f["min_s"] <= f["median_s"] <= f["max_s"] for f in finalists)
    first_round = {json.dumps(r["config"]): r["median_s"] for r in entry.results}
    assert all(first_round[json.dumps(f["config"])] == f["first_median_s"] for f in finalists)
    row = report.entries_frame().iloc[0]
    assert row["verdict_detail"] == verdict.text
    # the sweep log: the final round beside the first, the winner marked
    _, frame, finals = report.sweep_log_frame(result.log_path)
    assert finals[-1]["verdict"] == verdict.text
    timed = frame[frame["final_ms"].notna()]
    assert len(timed) == len(finalists) and frame["winner"].sum() == 1
    assert sorted(timed["final_ms"]) == pytest.approx(sorted(f["median_s"] * 1e3 for f in finalists))
    assert all(not math.isnan(x) for x in timed["median_ms"])
