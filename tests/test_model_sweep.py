"""Sweeping a whole model preset's layer (a campaign of its kernel cases, run here): every kernel case gets an
entry, and a MoE block of that model then runs every forward kernel on an exact tuned entry."""

from __future__ import annotations

import logging

import pytest
from tiny_layer import FAST, TINY, layer_inputs

import moe_tune
from moe_tune.campaign import runner
from moe_tune.campaign.request import Case
from moe_tune.core.errors import UsageError
from moe_tune.layer.models import ModelPreset, layer_cases


def sweep_layer(preset: ModelPreset, tokens: int, ep: int) -> list:
    """Every kernel case of one layer of `preset`, planned and run here as `sweep --model` runs them."""
    cases = [Case(c.op, c.problem, f"{c.role} tokens={count}")
             for count, c in layer_cases(preset, [tokens], ep=ep, dtype="float32")]
    planned = runner.prepare(cases, FAST, skip_done=False)
    runner.preflight(planned)
    return runner.run_sweeps(planned)


@pytest.mark.parametrize("ep", [1, 2])
def test_model_sweep_entries_are_what_moe_mlp_looks_up(ep, caplog):
    outcomes = sweep_layer(TINY, 16, ep)
    assert [o.error for o in outcomes] == [None] * 8
    ops = [o.sweep.op for o in outcomes]
    assert ops.count("ragged_dot") == 6 and "ragged_gather" in ops
    assert ("ragged_gather_reduce" if ep > 1 else "dense_gather_reduce") in ops

    x, logits, w_gate, w_down = layer_inputs(TINY, 16, ep)
    caplog.set_level(logging.INFO, logger="moe_tune")
    # the unfused block: these are its kernels (test_layer_runs checks the fused kernels and the choice)
    moe_tune.moe_mlp(x, logits, w_gate, w_gate, w_down, TINY.top_k, expert_offset=0 if ep > 1 else None,
                     fused=False)
    sources = [r.getMessage() for r in caplog.records if "backend" in r.getMessage()]
    assert len(sources) == 5  # dispatch, gate, up, down, combine
    assert all("(exact: tuned entry in" in line for line in sources), sources


@pytest.mark.parametrize("error", [
    "SweepError: no candidate compiled",
    "RuntimeError: NOT_FOUND: Function wrapped_iota not found",  # not a moe-tune error: recorded all the same
])
def test_a_failing_case_is_recorded_and_the_rest_go_on(monkeypatch, error):
    from moe_tune.tuner import SweepError

    real = runner.run_sweep
    kind, message = error.split(": ", 1)

    def flaky(request, reporter=None):
        if request.op == "ragged_gather":
            raise {"SweepError": SweepError, "RuntimeError": RuntimeError}[kind](message)
        return real(request, reporter)

    monkeypatch.setattr(runner, "run_sweep", flaky)
    outcomes = sweep_layer(TINY, 8, 2)
    failed = [o for o in outcomes if o.error]
    assert [o.sweep.op for o in failed] == ["ragged_gather"] and message in failed[0].error
    assert all(o.result is not None and o.entry is not None for o in outcomes if not o.error)
    assert len(outcomes) == 8


def test_a_kernel_the_layer_repeats_is_swept_once(monkeypatch):
    """With hidden == expert width (gpt-oss), the down projection's problems are the gate/up ones: the plan
    holds one sweep per table key."""
    square = ModelPreset(name="square", hidden=64, expert_intermediate=64, experts=4, top_k=2, shared_experts=0)
    swept, real = [], runner.run_sweep

    def counted(request, reporter=None):
        swept.append(request)
        return real(request, reporter)

    monkeypatch.setattr(runner, "run_sweep", counted)
    outcomes = sweep_layer(square, 8, 2)
    assert len(outcomes) == 5 and [o.error for o in outcomes] == [None] * 5
    assert len(swept) == 5  # fwd, dlhs, drhs once; dispatch; combine
    gate_up = [o.sweep.label for o in outcomes if o.sweep.op == "ragged_dot"]
    assert all("gate/up" in label for label in gate_up)  # named by the first case of its key


def test_bad_token_counts_fail_before_any_sweep():
    with pytest.raises(UsageError):
        layer_cases(TINY, [16, 0], ep=1, dtype="float32")
    with pytest.raises(UsageError, match="divide"):
        layer_cases(TINY, [16], ep=3, dtype="float32")
