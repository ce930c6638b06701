"""The final round's progress stage (`finalists`) counts the rounds it times against the rounds it compares: it
never reads past its total (a clock switch that drops rounds starts it over), and a round that stops early
(`settled`) or runs all its rounds ends it complete."""

from __future__ import annotations

import pytest
from test_evidence import CONFIGS

from moe_tune.tuner import measure
from moe_tune.tuner.candidate import Candidate
from moe_tune.tuner.request import SweepSettings
from moe_tune.tuner.timing import summarize


class Stages:
    """A `tuner.Reporter` that keeps each stage's (total, completed), a stage started again starting over."""

    def __init__(self):
        self.bars: list[list[float]] = []  # [total, completed] per start of `finalists`

    def stage(self, name, total):
        assert name == "finalists"
        self.bars.append([total, 0])

    def advance(self, name, amount=1):
        bar = self.bars[-1]
        bar[1] += amount
        assert bar[1] <= bar[0], f"{bar[1]}/{bar[0]}"


def _cand(index: int, median: float, *, default: bool = False) -> Candidate:
    cand = Candidate(index, CONFIGS[index], is_default=default, timing=summarize([median] * 3, "trace", [median]))
    cand.batch = 0  # timed in one batch: its rounds are the final round's first
    return cand


@pytest.mark.parametrize("times, switch_at", [
    ({0: 1.0, 1: 1.2}, None),  # the default is faster: the round settles early
    ({0: 1.2, 1: 1.0}, None),  # a finalist beats it: every round
    ({0: 1.2, 1: 1.0}, 1),  # the first chunk switches the clock: the batch's rounds are dropped
])
def test_the_finalists_stage_never_passes_its_total_and_ends_complete(monkeypatch, times, switch_at):
    chunks = []

    def fake(calls, *, samples, on_round=None, **kw):
        chunks.append(samples)
        method = "wall" if switch_at is not None and len(chunks) >= switch_at else "trace"
        for r in range(samples):
            on_round(len(calls) * (r + 1))
        return {i: summarize([t] * samples, method, [t]) for i, t in times.items() if i in calls}, None

    monkeypatch.setattr(measure, "time_candidates", fake)
    settings = SweepSettings(samples=1, workers=1, finalists=2, final_time_s=0.3)
    default, other = _cand(0, times[0], default=True), _cand(1, times[1])
    shown = Stages()
    measure.final_round(settings, [default, other], default, {}, "cpu", shown)
    assert shown.bars and all(completed <= total for total, completed in shown.bars)
    total, completed = shown.bars[-1]
    assert completed == total > 0
    assert len(shown.bars) == (1 if switch_at is None else 2)
