"""`--max-candidates N`: the default and a seeded sample spread across the space, every value of
each tunable shown once N allows it, the same for the same seed (a resumed sweep gets the same candidates)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_tune.kernels import get_op
from moe_tune.tuner.request import SweepPlan, SweepRequest
from moe_tune.tuner.search import spread

GATHER = get_op("ragged_gather").problem(tokens=512, hidden=2048, top_k=8, experts=128, ep=1, dtype="bfloat16")
SPACES = {
    "ragged_dot tiled fwd": get_op("ragged_dot").backends.get("tiled").search_space(
        get_op("ragged_dot").problem(m=2048, k=2048, n=768, groups=16)),
    "ragged_gather tiled": get_op("ragged_gather").backends.get("tiled").search_space(GATHER),
}


def _values(configs) -> set[tuple[str, str]]:
    return {(k, repr(v)) for c in configs for k, v in c.to_dict().items()}


@pytest.mark.parametrize("name", SPACES)
def test_every_value_of_every_tunable_appears_once_n_allows(name):
    space = SPACES[name]
    widest = max(len({repr(getattr(c, f)) for c in space}) for f in space[0].to_dict())
    sample = spread(space, widest + 1, seed=0)
    assert sample[0] == space[0] and len(sample) == len(set(sample)) == widest + 1  # the default first
    assert _values(sample) == _values(space)  # every value of every tunable


def test_the_issue_case_reaches_single_pass():
    """`--max-candidates 3` kept the first three configs (the smallest tiles), never `single_pass=True`."""
    space = SPACES["ragged_gather tiled"]
    assert {c.single_pass for c in space[:3]} != {True, False}
    assert {c.single_pass for c in spread(space, 3, seed=0)} == {True, False}


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 40), seed=st.integers(0, 2**32 - 1))
def test_a_pure_function_of_space_n_and_seed(n, seed):
    space = SPACES["ragged_dot tiled fwd"]
    sample = spread(space, n, seed)
    assert sample == spread(space, n, seed)  # deterministic: resume finds the same candidates
    assert len(sample) == min(n, len(space)) and sample[0] == space[0] and set(sample) <= set(space)
    assert [space.index(c) for c in sample[1:]] == sorted(space.index(c) for c in sample[1:])  # space order


def test_the_sweep_plan_uses_it_and_records_the_whole_space(isolated_profiles):
    request = SweepRequest.make("ragged_gather", GATHER, max_candidates=3, seed=5, workers=1)
    plan = SweepPlan(request)
    assert plan.space == spread(plan.full_space, 3, 5)
    assert plan.search_settings()["space"] == 3 and plan.search_settings()["full_space"] == len(plan.full_space)
