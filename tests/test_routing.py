"""Routing per call: the distribution a lookup assumes comes from the call's `distribution=`, else the innermost
`moe_tune.use_distribution` block, else $MOE_TUNE_DISTRIBUTION, else balanced; for every op, every direction
of ragged_dot (the gradients are traced later, outside the call) and every kernel of moe_mlp."""

from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import pytest

import moe_tune
from moe_tune.core import contexts
from moe_tune.core.errors import UsageError
from moe_tune.kernels import get_op
from moe_tune.kernels.gather.problem import GatherProblem
from moe_tune.kernels.ragged_dot import RaggedDotProblem
from moe_tune.profiles import key_fields, write_entries
from moe_tune.profiles.entry import key_from_fields

DOT = RaggedDotProblem(m=64, k=32, n=16, groups=4)
# the tm each distribution's entries hold (one per direction), and the gather's rows_per_chunk
TM = {"balanced": 16, "skewed": 32, "single": 48}
CHUNK = {"balanced": 8, "skewed": 16, "single": 32}


def _entry(op, problem, config, distribution):
    fields = key_fields(problem, "tiled", distribution)
    return {"key": key_from_fields(op, fields), "fields": fields, "config": config, "timing": {"median_s": 1e-3}}


@pytest.fixture
def tables(isolated_profiles):
    dots = [_entry("ragged_dot", DOT.with_direction(d), {"tm": tm, "tk": 32, "tn": 16, "tail": 16}, dist)
            for dist, tm in TM.items() for d in ("fwd", "dlhs", "drhs")]
    write_entries(isolated_profiles / "cpu" / "ragged_dot.json", "ragged_dot", "cpu", dots)
    gather = GatherProblem(tokens=16, rows=32, hidden=8, dtype="float32", weighted=False)
    reduce = GatherProblem(tokens=16, rows=32, hidden=8, dtype="float32")
    for op, problem in (("ragged_gather", gather), ("dense_gather_reduce", reduce)):
        write_entries(isolated_profiles / "cpu" / f"{op}.json", op, "cpu",
                      [_entry(op, problem, {"rows_per_chunk": c}, dist) for dist, c in CHUNK.items()])
    return isolated_profiles


def _traced(caplog, fn, *args) -> dict[str, set[int]]:
    """op name (with direction) -> the tm / rows_per_chunk of the configs traced for it."""
    caplog.clear()
    jax.make_jaxpr(fn)(*args)
    found: dict[str, set[int]] = {}
    for record in caplog.records:
        line = record.getMessage()
        value = re.search(r"config (?:tm|rows_per_chunk)=(\d+)", line)
        if value is None or "(exact: " not in line:
            continue
        direction = re.search(r"'direction': '(\w+)'", line)
        name = line.split()[0]
        name += f".{direction[1]}" if name == "ragged_dot" and direction else ""
        found.setdefault(name, set()).add(int(value[1]))
    return found


def _dot_inputs():
    lhs, rhs = jnp.ones((DOT.m, DOT.k)), jnp.ones((DOT.groups, DOT.k, DOT.n))
    return lhs, rhs, jnp.full((DOT.groups,), DOT.m // DOT.groups, jnp.int32)


def test_ragged_dot_argument_then_block_then_environment(tables, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="moe_tune")
    lhs, rhs, sizes = _dot_inputs()

    def loss(dist):
        return lambda a, b: jax.grad(lambda a, b: moe_tune.ragged_dot(a, b, sizes, backend="tiled",
                                                                      distribution=dist).sum(), (0, 1))(a, b)

    every = {"ragged_dot.fwd", "ragged_dot.dlhs", "ragged_dot.drhs"}
    assert _traced(caplog, loss(None), lhs, rhs) == {d: {TM["balanced"]} for d in every}
    assert _traced(caplog, loss("skewed"), lhs, rhs) == {d: {TM["skewed"]} for d in every}
    monkeypatch.setenv("MOE_TUNE_DISTRIBUTION", "single")
    assert _traced(caplog, loss(None), lhs, rhs) == {d: {TM["single"]} for d in every}
    with moe_tune.use_distribution("skewed"):  # the block beats the environment ...
        assert _traced(caplog, loss(None), lhs, rhs) == {d: {TM["skewed"]} for d in every}
        # ... and the call's own argument beats the block
        assert _traced(caplog, loss("balanced"), lhs, rhs) == {d: {TM["balanced"]} for d in every}
        assert get_op("ragged_dot").lookup(DOT).config.tm == TM["skewed"]  # lookup() sees the block too


def test_gradient_traced_after_the_block_keeps_the_blocks_choice(tables, caplog):
    """`jax.grad` traces the backward rule after the forward returns: the block's choice travels with the call."""
    caplog.set_level(logging.INFO, logger="moe_tune")
    lhs, rhs, sizes = _dot_inputs()

    def vjp(a, b):
        with moe_tune.use_distribution("single"):
            out, pullback = jax.vjp(lambda a, b: moe_tune.ragged_dot(a, b, sizes, backend="tiled"), a, b)
        return pullback(out)  # traced outside the block

    assert _traced(caplog, vjp, lhs, rhs) == {d: {TM["single"]} for d in ("ragged_dot.fwd", "ragged_dot.dlhs",
                                                                          "ragged_dot.drhs")}


def test_gathers_and_moe_mlp_take_the_argument(tables, caplog):
    caplog.set_level(logging.INFO, logger="moe_tune")
    x, idx = jnp.ones((16, 8)), jnp.arange(32, dtype=jnp.int32) // 2
    gather = lambda x: moe_tune.ragged_gather(x, idx, 0, 32, backend="tiled", distribution="skewed")
    assert _traced(caplog, gather, x)["ragged_gather"] == {CHUNK["skewed"]}
    combine = lambda y: moe_tune.dense_gather_reduce(y, jnp.arange(32, dtype=jnp.int32), jnp.ones(32), 2,
                                                     backend="tiled", distribution="single")
    assert _traced(caplog, combine, jnp.ones((32, 8)))["dense_gather_reduce"] == {CHUNK["single"]}
    with moe_tune.use_distribution("single"):  # the argument wins over the block
        balanced = lambda x: moe_tune.ragged_gather(x, idx, 0, 32, backend="tiled", distribution="balanced")
        assert _traced(caplog, balanced, x)["ragged_gather"] == {CHUNK["balanced"]}

    # moe_mlp: tokens 16, hidden 8, 4 experts, top-2 -> 32 rows; every kernel asks for the same distribution
    w_gate, w_down = jnp.ones((4, 8, 4)), jnp.ones((4, 4, 8))
    mlp = lambda x, logits: moe_tune.moe_mlp(x, logits, w_gate, w_gate, w_down, 2, distribution="skewed",
                                             fused=False)
    seen = _traced(caplog, mlp, x, jnp.ones((16, 4)))
    assert seen["ragged_gather"] == {CHUNK["skewed"]} and seen["dense_gather_reduce"] == {CHUNK["skewed"]}


def test_unknown_distribution_is_a_usage_error(tables):
    lhs, rhs, sizes = _dot_inputs()
    with pytest.raises(UsageError, match="unknown distribution 'lopsided'"):
        moe_tune.ragged_dot(lhs, rhs, sizes, distribution="lopsided")
    with pytest.raises(UsageError, match="unknown distribution"):
        with moe_tune.use_distribution("lopsided"):
            pass
    with pytest.raises(UsageError, match="unknown distribution"):
        moe_tune.moe_mlp(jnp.ones((16, 8)), jnp.ones((16, 4)), jnp.ones((4, 8, 4)), jnp.ones((4, 8, 4)),
                         jnp.ones((4, 4, 8)), 2, distribution="lopsided")
    assert contexts.current_distribution() is None  # a failed block leaves nothing behind


def test_blocks_nest_and_restore():
    assert contexts.current_distribution() is None
    with moe_tune.use_distribution("skewed"):
        with moe_tune.use_distribution("single"):
            assert contexts.distribution_for_call(None) == "single" and contexts.distribution_for_call("uniform") == "uniform"
        assert contexts.current_distribution() == "skewed"
    assert contexts.current_distribution() is None and contexts.distribution_for_call(None) is None
