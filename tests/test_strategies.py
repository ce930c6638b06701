"""Search strategies: grid, seeded random, coordinate descent. Proposals on a real search space with
synthetic measurements, then real sweeps at tiny sizes. No timing is asserted."""

from __future__ import annotations

import math

import pytest

from moe_tune.cli import sweep as sweep_command
from moe_tune.core.errors import UsageError
from moe_tune.kernels.ragged_dot import BACKENDS, RaggedDotProblem
from moe_tune.tuner import STRATEGIES, SweepRequest, run_sweep
from moe_tune.tuner import search as S
from moe_tune.tuner.candidate import Candidate
from moe_tune.tuner.compiling import OK
from moe_tune.tuner.timing import Timing

TILED = BACKENDS.get("tiled")
BIG = RaggedDotProblem(m=2048, k=2048, n=768, groups=16)  # the demo shape: a few dozen candidates
SPACE = TILED.search_space(BIG)


def _timing(seconds: float) -> Timing:
    return Timing(seconds, seconds, seconds, 0.0, 1, "trace", seconds, (seconds,))


def _measure(configs, measured, cost):
    """Finish `configs` as the sweep would, with a synthetic time (None: the candidate failed)."""
    for config in configs:
        cand = Candidate(len(measured), config, is_default=config == SPACE[0])
        t = cost(config)
        if t is None:
            cand.status, cand.stage, cand.reason = "failed", "compile", "synthetic"
        else:
            cand.timing = _timing(t)
        measured[config] = cand


def _run(strategy, cost, max_rounds=100):
    """Drive a strategy to the end; returns the rounds it proposed and everything measured."""
    measured, rounds = {}, []
    for _ in range(max_rounds):
        proposal = strategy.next_round(measured)
        if not proposal:
            return rounds, measured
        assert not any(c in measured for c in proposal), "proposed a config twice"
        rounds.append(proposal)
        _measure(proposal, measured, cost)
    raise AssertionError("no end")


def bowl(best):
    """A convex cost in log2 of each tunable, lowest at `best`."""
    return lambda c: 1 + sum(abs(math.log2(getattr(c, f)) - math.log2(v)) for f, v in best.items())


def test_cli_offers_every_strategy():
    option = next(p for p in sweep_command.params if p.name == "strategy")
    assert list(option.type.choices) == list(STRATEGIES) == ["grid", "random", "coordinate"]


def test_grid_is_the_whole_space_in_order_and_budget_keeps_its_first_n():
    rounds, _ = _run(S.make("grid", SPACE), bowl({"tm": 128}))
    assert [c for r in rounds for c in r] == SPACE and rounds[0][0] == TILED.default_config(BIG)
    capped = S.make("grid", SPACE, budget=5)
    rounds, measured = _run(capped, bowl({"tm": 128}))
    assert [c for r in rounds for c in r] == SPACE[:5] and capped.stopped == "budget"


def test_random_is_seeded_starts_at_the_default_and_respects_the_budget():
    def picks(seed, budget=10):
        rounds, measured = _run(S.make("random", SPACE, budget=budget, seed=seed), bowl({"tm": 128}))
        return [c for r in rounds for c in r]

    a, b, c = picks(0), picks(0), picks(1)
    assert a == b and a != c
    assert a[0] == c[0] == SPACE[0] and len(a) == len(set(a)) == 10 and set(a) <= set(SPACE)
    assert len(picks(3, budget=1000)) == len(SPACE)
    with pytest.raises(UsageError, match="needs a budget"):
        S.check_strategy("random", None, None)
    S.check_strategy("random", None, 30.0)


@pytest.mark.parametrize("optimum", [{"tm": 32, "tk": 512, "tn": 512, "tail": 16},
                                     {"tm": 1024, "tk": 2048, "tn": 768, "tail": 64},
                                     {"tm": 256, "tk": 2048, "tn": 512, "tail": 32}])
def test_coordinate_descent_walks_valid_neighbours_downhill_to_the_optimum(optimum):
    strategy = S.make("coordinate", SPACE, backend=TILED, problem=BIG)
    rounds, measured = _run(strategy, bowl(optimum))
    assert rounds[0][0] == SPACE[0]  # starts at the heuristic default, timed with its neighbours
    proposed = [c for r in rounds for c in r]
    assert all(c in SPACE and TILED.config_error(c, BIG) is None for c in proposed)
    one_apart = lambda a, b: sum(x != y for x, y in zip(a.to_dict().values(), b.to_dict().values())) == 1
    assert all(one_apart(c, SPACE[0]) for c in rounds[0][1:])
    seen = set(rounds[0])
    for r in rounds[1:]:  # each round: neighbours (one tunable changed) of a config measured before
        assert all(any(one_apart(c, m) for m in seen) for c in r)
        seen |= set(r)
    times = [measured[c].timing.median_s for c in strategy.path]
    assert times == sorted(times, reverse=True)  # the best so far never gets slower
    best = min(measured.values(), key=lambda c: c.timing.median_s).config
    assert best == TILED.config_cls(**optimum) and strategy.stopped == "converged"
    assert len(proposed) < len(SPACE)  # and it did not need the whole space


def test_coordinate_descent_respects_the_budget_and_survives_failures():
    strategy = S.make("coordinate", SPACE, backend=TILED, problem=BIG, budget=6)
    rounds, measured = _run(strategy, bowl({"tm": 32, "tk": 512, "tn": 512, "tail": 16}))
    assert len(measured) == 6 and strategy.stopped == "budget"
    # a failing default: it goes on from whatever ran
    fails = lambda c: None if c == SPACE[0] else bowl({"tm": 32})(c)
    rounds, measured = _run(S.make("coordinate", SPACE, backend=TILED, problem=BIG), fails)
    assert measured[SPACE[0]].status == "failed"
    assert min((c for c in measured.values() if c.status == OK), key=lambda c: c.timing.median_s).config.tm == 32


def test_budget_validation():
    for bad, message in [(dict(budget=0), "budget must be at least 1"), (dict(time_budget_s=-1), "time budget"),
                         (dict(strategy="annealing"), "unknown strategy 'annealing'")]:
        with pytest.raises(UsageError, match=message):
            SweepRequest.make("ragged_dot", BIG, **bad)


SMALL_REAL = RaggedDotProblem(m=256, k=384, n=192, groups=4)  # 16 candidates


@pytest.mark.slow
def test_real_coordinate_and_random_sweeps(tmp_path):
    space = TILED.search_space(SMALL_REAL)
    result = run_sweep(SweepRequest.make("ragged_dot", SMALL_REAL, backend="tiled", strategy="coordinate", samples=2,
                                         workers=2, profile_dir=tmp_path))
    tried = [c.config for c in result.candidates]
    assert tried[0] == space[0] and result.candidates[0].is_default
    assert all(c in space for c in tried) and len(set(tried)) == len(tried)
    search = result.entry.search
    assert search["strategy"] == "coordinate" and search["stopped"] in ("converged", "exhausted")
    assert search["space"] == len(space) and result.entry.candidates["tried"] == len(tried)
    # no slower than the default, as the two were measured side by side in the final round
    assert result.entry.timing["median_s"] <= result.entry.default["median_s"]
    assert result.entry.config in [c.to_dict() for c in tried]

    budgeted = run_sweep(SweepRequest.make("ragged_dot", SMALL_REAL, backend="tiled", strategy="coordinate", budget=3,
                                           samples=2, workers=2, profile_dir=tmp_path))
    assert len(budgeted.candidates) == 3 and budgeted.log_path != result.log_path

    picks = [c.config for c in run_sweep(SweepRequest.make("ragged_dot", SMALL_REAL, backend="tiled", strategy="random",
                                                           budget=4, seed=7, samples=2, workers=2,
                                                           profile_dir=tmp_path)).candidates]
    expected = S.make("random", space, budget=4, seed=7).next_round({})
    assert picks == expected and picks[0] == space[0]
