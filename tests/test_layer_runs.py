"""Tune what the layer runs: `sweep --model --direction fwd` tunes what serving runs, `all` (the
default) what training runs: the ragged_dot gradients of float operands only (a QArray is a constant: no
drhs for quantized weights) and the backward's gathers (the combine's gradient is a weighted ragged_gather).
A training step of a layer swept this way finds an exact entry for every kernel it traces."""

from __future__ import annotations

import logging

import jax
import pytest
from click.testing import CliRunner
from tiny_layer import FAST, TINY, layer_inputs

import moe_tune
from moe_tune.campaign import runner
from moe_tune.campaign.request import Case
from moe_tune.cli import cli
from moe_tune.core.errors import UsageError
from moe_tune.layer.models import get_preset, layer_runs


def _calls(cases) -> list[tuple[str, str, str]]:
    return [(c.op, c.role, getattr(c.problem, "direction", "fwd")) for c in cases]


def test_serving_runs_the_forward_kernels_only():
    calls = _calls(layer_runs(TINY, 16, dtype="float32", direction="fwd"))
    assert calls == [("ragged_dot", "gate/up", "fwd"), ("ragged_dot", "down", "fwd"),
                     ("ragged_gather", "dispatch", "fwd"), ("dense_gather_reduce", "combine", "fwd"),
                     ("fused_moe", "fused gate/up", "fwd"), ("fused_moe", "fused down", "fwd"),
                     ("moe_fusion", "fused or not", "fwd")]


def test_training_skips_the_gradient_of_quantized_weights_and_adds_the_backward_gathers():
    cases = layer_runs(get_preset("qwen3-30b-a3b"), 64, dtype="bfloat16", ep=4, quant={"rhs_quant": "int8"})
    directions = {c.problem.direction for c in cases if c.op == "ragged_dot"}
    assert directions == {"fwd", "dlhs"}  # int8 weights are constants: their drhs never runs
    backward = {c.role: c for c in cases if c.role.endswith("bwd")}
    assert backward["combine bwd"].op == "ragged_gather" and backward["combine bwd"].problem.weighted
    assert backward["dispatch bwd"].op == "ragged_gather_reduce"
    float_layer = layer_runs(TINY, 16, dtype="float32")
    assert {c.problem.direction for c in float_layer if c.op == "ragged_dot"} == {"fwd", "dlhs", "drhs"}
    with pytest.raises(UsageError, match="serving"):
        layer_runs(TINY, 16, dtype="float32", direction="drhs")


def test_sweep_and_models_take_the_direction_and_lists():
    run = CliRunner().invoke
    serving = run(cli, ["sweep", "--model", "qwen3-30b-a3b", "--tokens", "64", "--direction", "fwd", "--dry-run"])
    assert serving.exit_code == 0 and "7 kernel cases" in serving.output, serving.output
    training = run(cli, ["sweep", "--model", "qwen3-30b-a3b", "--tokens", "64", "--dry-run"])
    # the 16 a training step looks up, and the dispatch the evaluation between steps runs with its activation
    assert "17 kernel cases" in training.output and "combine bwd" in training.output
    listed = run(cli, ["models", "qwen3-30b-a3b", "--tokens", "64,512", "--ep", "1,4", "--direction", "fwd"])
    assert listed.exit_code == 0, listed.output
    assert "tokens=512 ep=4" in listed.output and "dlhs" not in listed.output


@pytest.mark.parametrize("ep", [1, 2])
def test_a_training_step_finds_every_kernel_tuned(ep, isolated_profiles, caplog):
    # the fused path's cases on one shard layout only (test time); ep=2 runs the unfused layer
    fused_too = ep == 1
    cases = [Case(c.op, c.problem, c.role) for c in layer_runs(TINY, 16, ep=ep, dtype="float32")
             if fused_too or c.op not in ("fused_moe", "moe_fusion")]
    outcomes = runner.run_sweeps(runner.prepare(cases, FAST))
    assert [o.error for o in outcomes] == [None] * len(outcomes)

    x, logits, w_gate, w_down = layer_inputs(TINY, 16, ep)
    offset = 0 if ep > 1 else None
    caplog.set_level(logging.INFO, logger="moe_tune")
    for fused in (False, True, None) if fused_too else (False,):  # each path's kernels, and the choice (moe_fusion)
        jax.grad(lambda x, g, d: moe_tune.moe_mlp(x, logits, g, g, d, TINY.top_k, expert_offset=offset,
                                                  fused=fused).sum(), argnums=(0, 1, 2))(x, w_gate, w_down)
    looked_up = [r.getMessage() for r in caplog.records if "backend" in r.getMessage()]
    assert any("'weighted': True" in line for line in looked_up), looked_up  # the backward's weighted gather
    if fused_too:
        assert any("'stage': 'combine'" in line for line in looked_up), looked_up  # the fused kernels
        assert any(line.startswith("moe_fusion") for line in looked_up), looked_up
    assert all("(exact: tuned entry in" in line for line in looked_up), looked_up
