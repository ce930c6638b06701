"""Sweeping a whole model preset: every kernel case gets an entry, and a MoE block of that model then runs
every forward kernel on an exact tuned entry."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import numpy as np
import pytest

import moe_tune
from moe_tune.errors import UsageError
from moe_tune.models import ModelPreset
from moe_tune.tuner.model_sweep import model_cases, sweep_model

TINY = ModelPreset(name="tiny", hidden=128, expert_intermediate=64, experts=4, top_k=2, shared_experts=0)
FAST = {"samples": 1, "max_candidates": 2, "workers": 1, "finalists": 1}


@pytest.mark.parametrize("ep", [1, 2])
def test_model_sweep_entries_are_what_moe_mlp_looks_up(ep, caplog):
    results = sweep_model(TINY, [16], ep=ep, dtype="float32", sweep_options=FAST)
    assert [r.error for r in results] == [None] * 8
    ops = [r.case.op for r in results]
    assert ops.count("ragged_dot") == 6 and "ragged_gather" in ops
    assert ("ragged_gather_reduce" if ep > 1 else "dense_gather_reduce") in ops

    rng = np.random.default_rng(0)
    local = TINY.experts // ep
    x = jnp.asarray(rng.standard_normal((16, TINY.hidden)), jnp.float32)
    logits = jnp.asarray(rng.standard_normal((16, TINY.experts)), jnp.float32)
    w_gate = jnp.asarray(rng.standard_normal((local, TINY.hidden, TINY.expert_intermediate)), jnp.float32)
    w_down = jnp.asarray(rng.standard_normal((local, TINY.expert_intermediate, TINY.hidden)), jnp.float32)
    caplog.set_level(logging.INFO, logger="moe_tune")
    moe_tune.moe_mlp(x, logits, w_gate, w_gate, w_down, TINY.top_k, expert_offset=0 if ep > 1 else None)
    sources = [r.getMessage() for r in caplog.records if "backend" in r.getMessage()]
    assert len(sources) == 5  # dispatch, gate, up, down, combine
    assert all("(exact: tuned entry in" in line for line in sources), sources


@pytest.mark.parametrize("error", [
    "SweepError: no candidate compiled",
    "RuntimeError: NOT_FOUND: Function wrapped_iota not found",  # not a moe-tune error: recorded all the same
])
def test_a_failing_case_is_recorded_and_the_rest_go_on(monkeypatch, error):
    from moe_tune.tuner import model_sweep
    from moe_tune.tuner import SweepError

    real = model_sweep.run_sweep
    kind, message = error.split(": ", 1)

    def flaky(spec, reporter=None):
        if spec.op == "ragged_gather":
            raise {"SweepError": SweepError, "RuntimeError": RuntimeError}[kind](message)
        return real(spec, reporter)

    monkeypatch.setattr(model_sweep, "run_sweep", flaky)
    results = sweep_model(TINY, [8], ep=2, dtype="float32", sweep_options=FAST)
    failed = [r for r in results if r.error]
    assert [r.case.op for r in failed] == ["ragged_gather"] and message in failed[0].error
    assert all(r.result is not None for r in results if not r.error) and len(results) == 8


def test_a_kernel_the_layer_repeats_is_swept_once(monkeypatch):
    """With hidden == expert width (gpt-oss), the down projection's problems are the gate/up ones."""
    from moe_tune.tuner import model_sweep

    square = ModelPreset(name="square", hidden=64, expert_intermediate=64, experts=4, top_k=2, shared_experts=0)
    swept, real = [], model_sweep.run_sweep

    def counted(spec, reporter=None):
        swept.append(spec)
        return real(spec, reporter)

    monkeypatch.setattr(model_sweep, "run_sweep", counted)
    results = sweep_model(square, [8], ep=2, dtype="float32", sweep_options=FAST)
    assert len(results) == 8 and [r.error for r in results] == [None] * 8
    assert len(swept) == 5  # fwd, dlhs, drhs once; dispatch; combine
    gate, down = results[0], results[3]
    assert (gate.case.role, down.case.role) == ("gate/up", "down") and down.result is gate.result


def test_bad_token_counts_fail_before_any_sweep():
    with pytest.raises(UsageError):
        model_cases(TINY, [16, 0], ep=1, dtype="float32")
    with pytest.raises(UsageError, match="divide"):
        model_cases(TINY, [16], ep=3, dtype="float32")
