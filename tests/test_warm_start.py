"""Warm start: the nearest tuned shapes' winners (same op and backend) are measured right after the default,
`grid` and `coordinate` then search locally (the configs between the seeds, a descent from the best that
moves only past the noise), `--cold` turns it off (the whole grid), and the log, the entry and the report
say where the search started and that it was local. Proposals with synthetic measurements, then one tiny
real pair of sweeps."""

from __future__ import annotations

import json

import pytest
from test_strategies import BIG, SPACE, TILED, _run, bowl

from moe_tune.kernels.ragged_dot import RaggedDotProblem
from moe_tune.profiles import key_fields, write_entries
from moe_tune.profiles.entry import key_from_fields
from moe_tune.profiles.verdict import PAIRED_MIN_NOISE, budget_text
from moe_tune.tuner import SweepRequest, run_sweep
from moe_tune.tuner import search as warm_start
from moe_tune.tuner import search as S
from moe_tune.tuner.candidate import Candidate, same_rounds
from moe_tune.tuner.timing import summarize

OPTIMUM = {"tm": 256, "tk": 2048, "tn": 512, "tail": 32}


def _entry(problem, config, backend="tiled", distribution="balanced"):
    fields = key_fields(problem, backend, distribution)
    return {"key": key_from_fields("ragged_dot", fields), "fields": fields, "config": config,
            "timing": {"median_s": 1e-3}}


def test_distance_ranks_token_counts_before_other_directions_and_ignores_other_backends_and_dtypes():
    here = key_fields(BIG, "tiled", "balanced")
    twice_m = key_fields(RaggedDotProblem(m=4096, k=2048, n=768, groups=16), "tiled", "balanced")
    dlhs = key_fields(BIG.with_direction("dlhs"), "tiled", "balanced")
    bf16 = key_fields(RaggedDotProblem(m=2048, k=2048, n=768, groups=16, lhs_dtype="bfloat16",
                                            rhs_dtype="bfloat16", out_dtype="bfloat16"), "tiled", "balanced")
    assert warm_start.distance(here, here) == 0
    assert 0 < warm_start.distance(here, twice_m) < warm_start.distance(here, dlhs)
    assert warm_start.distance(here, bf16) is None  # another dtype: no seed (`same_numerics`)
    assert warm_start.distance(here, key_fields(BIG, "xla", "balanced")) is None


def test_project_maps_a_winner_onto_this_space():
    inside = SPACE[5]
    assert warm_start.project(inside.to_dict(), SPACE) == inside
    # another shape's winner with a tile this space lacks: the nearest config of the space
    got = warm_start.project({**OPTIMUM, "tm": 3000}, SPACE)
    assert got in SPACE and got.tk == 2048 and got.tn == 512 and got.tm == max(c.tm for c in SPACE)


def test_strategies_measure_the_seeds_right_after_the_default():
    seeds = [TILED.config_cls(**OPTIMUM), SPACE[0], SPACE[3]]  # the default is not a seed
    grid = S.make("grid", SPACE, seeds=seeds)
    first = grid.next_round({})
    assert grid.local and first[:3] == [SPACE[0], seeds[0], SPACE[3]]
    assert first[3:] == S.bracket(SPACE, [seeds[0], SPACE[3]]) and len(first) < len(SPACE)  # not the whole grid
    assert not S.make("grid", SPACE).local  # cold (`--cold`, or nothing tuned nearby): every candidate
    rnd = S.make("random", SPACE, budget=5, seed=3, seeds=seeds).next_round({})
    assert rnd[:3] == [SPACE[0], seeds[0], SPACE[3]] and len(rnd) == 5
    assert S.make("grid", SPACE, budget=2, seeds=seeds).next_round({}) == [SPACE[0], seeds[0]]


def test_bracket_is_what_a_ladder_implies_between_the_seeds():
    at = lambda **kw: TILED.config_cls(**{**OPTIMUM, **kw})
    low, high = at(tm=64), at(tm=256)  # m/2 won tm=64, 2m won tm=256: tm=128 lies between
    assert at(tm=128) in SPACE and S.bracket(SPACE, [low, high]) == [at(tm=128)]
    assert S.bracket(SPACE, [at(tm=32), at(tm=512)])[0] == at(tm=128)  # the geometric middle first
    assert set(S.bracket(SPACE, [at(tm=32), at(tm=512)])) == {at(tm=64), at(tm=128), at(tm=256)}
    two_ways = S.bracket(SPACE, [at(tm=64, tail=16), at(tm=256, tail=64)])  # a box, not a line: nothing
    assert two_ways == [] and S.bracket(SPACE, [low]) == []


def test_warm_local_search_reaches_the_optimum_in_a_fraction_of_the_grid():
    near = TILED.config_cls(**{**OPTIMUM, "tm": 64})
    far = TILED.config_cls(**{**OPTIMUM, "tm": 1024})  # the bracket holds tm=128 and 256, the optimum among them
    for name in ("grid", "coordinate"):
        strategy = S.make(name, SPACE, backend=TILED, problem=BIG, seeds=[near, far])
        rounds, measured = _run(strategy, bowl(OPTIMUM))
        assert min(measured.values(), key=lambda c: c.timing.median_s).config == TILED.config_cls(**OPTIMUM)
        assert strategy.stopped == "converged" and len(measured) * 3 < len(SPACE), (name, len(measured))
    assert _run(S.make("grid", SPACE, backend=TILED, problem=BIG, seeds=[near, far]), bowl(OPTIMUM))[0] == rounds


def test_warm_descent_moves_only_past_the_noise():
    start, step = TILED.config_cls(**OPTIMUM), TILED.config_cls(**{**OPTIMUM, "tm": 128})
    slightly = lambda c: 1.0 if c == start else (1 - S.NOISE / 2 if c == step else 2.0)  # a gain within noise
    strategy = S.make("coordinate", SPACE, backend=TILED, problem=BIG, seeds=[start])
    _, measured = _run(strategy, slightly)
    assert strategy.path[-1] == start and strategy.stopped == "converged"
    assert step in measured  # measured (a finalist when it is fast), not descended from
    clearly = lambda c: 1.0 if c == start else (1 - 2 * S.NOISE if c == step else 2.0)
    strategy = S.make("coordinate", SPACE, backend=TILED, problem=BIG, seeds=[start])
    _run(strategy, clearly)
    assert strategy.path[-1] == step


def test_warm_descent_walks_only_the_tunables_the_default_and_seeds_disagree_on():
    default = SPACE[0]
    at = lambda **kw: TILED.config_cls(**{**default.to_dict(), **kw})
    assert S.open_tunables(default, [at(tm=64)]) == {"tm"}  # one seed: what it changed from the default
    assert S.open_tunables(default, [at(tm=64), at(tm=64, tk=512)]) == {"tm", "tk"}
    seeds = [at(tm=64), at(tm=512)]  # the neighbours agree with the default on tk, tn and tail: only tm is open
    for name in ("coordinate", "grid"):
        strategy = S.make(name, SPACE, backend=TILED, problem=BIG, seeds=seeds)
        rounds, measured = _run(strategy, bowl({"tm": 256, "tk": 512, "tn": default.tn, "tail": default.tail}))  # tk is off too
        assert rounds[0][0] == default and strategy.stopped == "converged"  # the default first, always
        assert all((c.tk, c.tn, c.tail) == (default.tk, default.tn, default.tail) for c in measured)
        best = min(measured.values(), key=lambda c: c.timing.median_s).config
        assert best == at(tm=256) and len(measured) <= 5, [c.label() for c in measured]  # seeds, default, bracket


def test_coordinate_descends_from_the_best_seed_and_needs_fewer_candidates():
    near = TILED.config_cls(**{**OPTIMUM, "tm": 128})  # one step from the optimum
    cold_rounds, cold = _run(S.make("coordinate", SPACE, backend=TILED, problem=BIG), bowl(OPTIMUM))
    warm_strategy = S.make("coordinate", SPACE, backend=TILED, problem=BIG, seeds=[SPACE[7], near])
    warm_rounds, warm = _run(warm_strategy, bowl(OPTIMUM))
    # the default, the seeds and the configs between the seeds, side by side
    assert warm_rounds[0] == [SPACE[0], SPACE[7], near, *S.bracket(SPACE, [SPACE[7], near])]
    assert warm_strategy.path[0] == near  # the descent starts from the best of them
    best = lambda measured: min(measured.values(), key=lambda c: c.timing.median_s).config
    assert best(warm) == best(cold) == TILED.config_cls(**OPTIMUM)
    assert len(warm) < len(cold) and warm_strategy.stopped == "converged"


def test_find_takes_the_nearest_entries_of_the_same_backend(isolated_profiles):
    m = lambda m: RaggedDotProblem(m=m, k=2048, n=768, groups=16)
    here = key_fields(BIG, "tiled", "balanced")
    write_entries(isolated_profiles / "cpu" / "ragged_dot.json", "ragged_dot", "cpu", [
        _entry(m(4096), OPTIMUM),  # the nearest
        _entry(m(256), {**OPTIMUM, "tm": 32}),
        _entry(m(1024), {**OPTIMUM, "tn": 768}, backend="xla"),  # another backend: never a seed
        _entry(BIG, {**OPTIMUM, "tm": 64}),  # this sweep's own key: not a seed
    ])
    found = warm_start.find("ragged_dot", "cpu", here, key_from_fields("ragged_dot", here), SPACE, limit=1)
    assert found.seeds == (TILED.config_cls(**OPTIMUM),) and "m=4096" in found.sources[0]["key"]
    found = warm_start.find("ragged_dot", "cpu", here, key_from_fields("ragged_dot", here), SPACE)
    assert [s["key"].split("|")[2] for s in found.sources] == ["m=4096", "m=256"]
    assert "warm start from 2 tuned entries" in found.describe()
    assert warm_start.find("ragged_dot", "tpu_v5_lite", here, "k", SPACE).describe().startswith("cold start")
    only_default = warm_start.find("ragged_dot", "cpu", key_fields(m(256), "tiled", "balanced"), "k",
                                   [TILED.config_cls(**{**OPTIMUM, "tm": 32})], limit=1)  # a one-config space
    assert not only_default.seeds and only_default.describe().endswith("(each the default here: no seed to add)")


SMALL = RaggedDotProblem(m=256, k=384, n=192, groups=4)


@pytest.mark.slow
def test_a_sweep_starts_from_the_nearest_winner_and_says_so(isolated_profiles):
    quick = dict(backend="tiled", samples=1, workers=1, race=None, profile_dir=isolated_profiles)
    tuned = run_sweep(SweepRequest.make("ragged_dot", SMALL, strategy="grid", budget=3, **quick))
    first_winner = TILED.config_cls(**tuned.entry.config)
    assert tuned.entry.search["start"].startswith("cold start (no tuned entry")

    other = RaggedDotProblem(m=512, k=384, n=192, groups=4)
    warm = run_sweep(SweepRequest.make("ragged_dot", other, strategy="coordinate", budget=2, **quick))
    space = TILED.search_space(other)
    expected = warm_start.project(tuned.entry.config, space)
    if expected != space[0]:  # the winner (mapped onto this space) right after the default
        assert [c.config for c in warm.candidates] == [space[0], expected]
    assert "m=256" in warm.entry.search["start"] and warm.entry.search["seeds"] == (
        [] if expected == space[0] else [expected.to_dict()])
    if expected != space[0]:  # seeds: a local search, which the entry and the report's budget column say
        assert warm.entry.search["local"] and warm.entry.search["start"].startswith("warm local search from 1")
        assert budget_text(warm.entry.search, 2).endswith(", warm local search")
    lines = [json.loads(line) for line in warm.log_path.read_text().splitlines()]
    (final,) = [line for line in lines if line["type"] == "final"]  # the run's last line says where it started
    assert final["sources"][0]["config"] == first_winner.to_dict() and not final["cold"]
    assert final["start"] == warm.entry.search["start"]

    cold = run_sweep(SweepRequest.make("ragged_dot", other, strategy="coordinate", budget=2, cold=True, fresh=True,
                                       **quick))
    assert cold.entry.search["start"] == "cold start (--cold)" and cold.entry.search["seeds"] == []
    assert not cold.entry.search["local"] and "warm" not in budget_text(cold.entry.search, 2)


def _kept(problem, config, default):
    """A tuned entry whose default was `default` (kept when it is the winner `config`)."""
    return {**_entry(problem, config), "default": {"config": default, "status": "ok"}}


def test_neighbours_that_all_kept_their_defaults_seed_the_nearest_one_only(isolated_profiles):
    """Every tuned neighbour's winner was its own default (the heuristic held there): one seed,
    the nearest; one neighbour that beat its default: every seed."""
    m = lambda m: RaggedDotProblem(m=m, k=2048, n=768, groups=16)
    here = key_fields(BIG, "tiled", "balanced")
    table = isolated_profiles / "cpu" / "ragged_dot.json"
    held = [_kept(m(4096), OPTIMUM, OPTIMUM), _kept(m(512), {**OPTIMUM, "tm": 64}, {**OPTIMUM, "tm": 64})]
    write_entries(table, "ragged_dot", "cpu", held)
    found = warm_start.find("ragged_dot", "cpu", here, key_from_fields("ragged_dot", here), SPACE)
    assert found.defaults_held and len(found.sources) == 2
    assert found.seeds == (TILED.config_cls(**OPTIMUM),)  # m=4096's, the nearest
    assert found.describe().endswith("(each kept its default: the nearest seed only)")
    beat = _kept(m(8192), {**OPTIMUM, "tm": 128}, OPTIMUM)  # beat its default
    write_entries(table, "ragged_dot", "cpu", [*held, beat])
    found = warm_start.find("ragged_dot", "cpu", here, key_from_fields("ragged_dot", here), SPACE)
    assert not found.defaults_held and len(found.seeds) == 3
    assert not warm_start.kept_default(_entry(m(4096), OPTIMUM))  # no default recorded: not known to be kept


def test_one_seed_that_does_not_beat_the_default_ends_the_search_at_two_candidates():
    seed = TILED.config_cls(**OPTIMUM)
    for name in ("coordinate", "grid"):
        strategy = S.make(name, SPACE, backend=TILED, problem=BIG, seeds=[seed])
        rounds, measured = _run(strategy, lambda c: 1.0 if c == SPACE[0] else 1.0 / (1 + S.NOISE / 2))
        assert rounds == [[SPACE[0], seed]] and strategy.stopped == "converged"  # within noise: no descent
        strategy = S.make(name, SPACE, backend=TILED, problem=BIG, seeds=[seed])  # past 3%, short of the floor
        rounds, measured = _run(strategy, lambda c: 1.0 if c == SPACE[0] else 1.0 / (1 + PAIRED_MIN_NOISE / 2))
        assert rounds == [[SPACE[0], seed]] and strategy.stopped == "converged"
        strategy = S.make(name, SPACE, backend=TILED, problem=BIG, seeds=[seed])
        rounds, measured = _run(strategy, lambda c: 1.0 if c == SPACE[0] else 0.5)
        assert len(rounds) > 1 and len(measured) > 2  # it beat the default: a descent from it


def test_a_move_within_one_batch_is_judged_round_by_round():
    """The default and the seed timed in the same rounds: the seed's median is 40% lower (two rounds where the
    default ran slow), but it is slower in three of five rounds: no move. Apart (two batches): the medians say
    move."""
    seed = TILED.config_cls(**OPTIMUM)
    rounds = {SPACE[0]: [1.0, 2.0, 1.9, 1.8, 1.25], seed: [1.05, 2.1, 0.9, 0.95, 1.3]}

    def measured(batches):
        out = {}
        for (config, samples), batch in zip(rounds.items(), batches):
            out[config] = Candidate(len(out), config, is_default=config == SPACE[0],
                                    timing=summarize(samples, "trace", samples), batch=batch)
        return out

    together, apart = measured([0, 0]), measured([0, 1])
    assert same_rounds(list(together.values())) and not same_rounds(list(apart.values()))
    assert S.speedup(together[SPACE[0]], together[seed]) < 1 < S.speedup(apart[SPACE[0]], apart[seed])
    for got, moves in ((together, False), (apart, True)):
        strategy = S.make("coordinate", SPACE, backend=TILED, problem=BIG, seeds=[seed])
        strategy.next_round({})
        assert bool(strategy.next_round(got)) == moves
