"""The `moe_fusion` choice's training (`bwd`) check (kernels/fused_moe/layer_reference.py): its float64
reference against JAX's gradients of the layer, wrong gradients rejected and right ones accepted, every weight
gradient kept in the timed step, and the memory model against what the sweep really allocates."""

from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_tune import moe_mlp
from moe_tune.kernels.kernel_op import relative_error
from moe_tune.layer import fusion_choice as choice
from moe_tune.layer.fusion_choice import FusionConfig, FusionProblem, LayerChoice, memory_parts, training_check
from moe_tune.layer.fusion_op import MOE_FUSION
from moe_tune.layer.reference import check_size, training_reference
from moe_tune.profiles import key_fields, write_entries
from moe_tune.profiles.entry import key_from_fields

# 8 local experts at ep 1: the check's 4 are a strict subset
PROBLEM = FusionProblem(tokens=16, hidden=32, intermediate=12, experts=8, top_k=2, direction="bwd")


@pytest.fixture(scope="module")
def case():
    """PROBLEM's inputs at skewed routing (16 tokens leave experts empty), its reference, JAX's float32
    gradients of moe_mlp (every expert, unfused), and the compiled timed step (fused)."""
    inputs = MOE_FUSION.make_inputs(PROBLEM, "skewed", 1)
    layer = lambda *a: moe_mlp(*a, PROBLEM.top_k, fused=False)
    grads = jax.jit(lambda ops, ct: jax.vjp(layer, *ops)[1](ct))(
        [inputs[n] for n in choice.LAYER_OPERANDS], inputs["cotangent"])
    step = jax.jit(lambda i: MOE_FUSION.run(LayerChoice(), FusionConfig(fused=True), PROBLEM, i))
    return inputs, MOE_FUSION.reference(PROBLEM, inputs), grads, step.lower(inputs).compile()


def test_reference_is_the_layers_gradients(case):
    """The float64 gradients, asked for every expert, equal JAX's float32 ones of moe_mlp (loss
    sum(out * cotangent)), each to 1e-5 of its own scale; the light reference holds the checked experts'
    slices of them, the checked experts the most and the fewest loaded (here an empty one) and 2 others."""
    inputs, _, grads, _ = case
    want = training_reference(PROBLEM, inputs, experts=np.arange(PROBLEM.local_experts))
    for g, w in zip(grads, want):
        assert relative_error(np.asarray(g), w) < 1e-5
    rows = np.bincount(np.argsort(-inputs["router_logits"], axis=1)[:, :PROBLEM.top_k].ravel(), minlength=8)
    checked = inputs["checked_experts"]
    assert len(set(checked.tolist())) == len(checked) == 4
    assert rows[checked[0]] == rows.max() and rows[checked[1]] == rows.min() == 0
    for full, part in zip(want[2:], training_reference(PROBLEM, inputs)[2:]):
        np.testing.assert_array_equal(full[checked], part)


def _swap(g, a, b):
    return g.at[a].set(g[b]).at[b].set(g[a])


def test_check_rejects_a_wrong_gradient_and_accepts_the_right_one(case):
    """The timed step (fused) and the unfused layer's gradients pass well within the sweep's float32
    tolerance; each of these
    mistakes in otherwise right gradients fails it: two checked experts' w_gate gradients swapped, a checked
    expert's w_down gradient with its rows reversed, one token's dx halved, dx uniformly 10% off (seen by its
    scale entry), a gradient written into the expert routed no rows. (Uniform errors of a part are caught
    above tolerance / (its max over the largest part's): in float32 above 1% for dx here.)"""
    inputs, expected, grads, step = case
    tolerance = MOE_FUSION.tolerance(PROBLEM)
    assert relative_error(np.asarray(step(inputs)), expected) < tolerance / 10
    checked = jnp.asarray(inputs["checked_experts"])
    most, empty, other = (int(e) for e in checked[:3])
    assert relative_error(np.asarray(training_check(grads, checked)), expected) < tolerance / 10
    mistakes = {
        "swapped experts": lambda dx, dl, g, u, d: (dx, dl, _swap(g, most, other), u, d),
        "rows reversed": lambda dx, dl, g, u, d: (dx, dl, g, u, d.at[other].set(d[other, ::-1])),
        "one token's dx": lambda dx, dl, g, u, d: (dx.at[3].multiply(0.5), dl, g, u, d),
        "dx scaled": lambda dx, dl, g, u, d: (dx * 1.1, dl, g, u, d),
        "empty expert written": lambda dx, dl, g, u, d: (dx, dl, g, u.at[empty].set(1e-3), d),
    }
    for name, mistake in mistakes.items():
        error = relative_error(np.asarray(training_check(mistake(*grads), checked)), expected)
        assert error > tolerance, (name, error)


_NAME_SHAPE = re.compile(r"%(\S+) = \w+\[([\d,]*)\]")
_GATHER = re.compile(r"= \w+\[[\d,]*\]\S* gather\(%(\S+?),.*slice_sizes=\{([\d,]+)\}")


def test_the_timed_step_computes_every_weight_gradient(case):
    """The check returns 4 of the 8 experts' weight gradients, gathered by traced indices: in the compiled
    step each gather takes a whole [8, ...] gradient, so XLA computes all of them (the timed work). (The
    unfused step's gathers are the same `training_check`.)"""
    p, hlo = PROBLEM, case[3].as_text()
    shapes = {m.group(1): tuple(int(v) for v in m.group(2).split(",") if v) for m in _NAME_SHAPE.finditer(hlo)}
    taken = sorted(shapes[m.group(1)] for m in _GATHER.finditer(hlo) if m.group(2).startswith("1,")
                   and len(shapes.get(m.group(1), ())) == 3)
    assert taken == sorted([(8, p.hidden, p.intermediate)] * 2 + [(8, p.intermediate, p.hidden)]), taken


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_memory_parts_count_the_real_arrays(case, direction):
    """`memory_parts`' host inputs and reference are the bytes `make_inputs` and `reference` allocate, and a
    candidate's check output is `check_size` float32s and one scale per part."""
    problem = FusionProblem(**{**PROBLEM.key_fields(), "direction": direction, "dtype": "bfloat16"})
    inputs = MOE_FUSION.make_inputs(problem, "balanced", 0)
    parts = memory_parts(problem)
    assert parts["host"] == sum(a.nbytes for a in inputs.values())
    assert parts["reference"] == MOE_FUSION.reference(problem, inputs).nbytes
    assert case[1].size == check_size(PROBLEM)


def test_fused_none_under_grad_follows_the_tables_bwd_entry(isolated_profiles, caplog):
    """Tables whose fwd entry says fused and whose bwd entry says unfused (at a shape no other test traces):
    moe_mlp(fused=None) traced for a forward runs the fused kernels, traced under jax.grad the unfused ones,
    each from its exact entry."""
    shape = {"tokens": 10, "hidden": 32, "intermediate": 12, "experts": 8, "top_k": 2}
    entries = []
    for direction, fused in (("fwd", True), ("bwd", False)):
        fields = key_fields(FusionProblem(**shape, direction=direction), "layer", "balanced")
        entries.append({"key": key_from_fields("moe_fusion", fields), "fields": fields, "config": {"fused": fused},
                        "timing": {"median_s": 1e-3}})
    write_entries(isolated_profiles / "cpu" / "moe_fusion.json", "moe_fusion", "cpu", entries)
    rng = np.random.default_rng(0)
    x, logits = rng.standard_normal((10, 32), np.float32), rng.standard_normal((10, 8), np.float32)
    gate, up = rng.standard_normal((2, 8, 32, 12), np.float32) / 6
    down = rng.standard_normal((8, 12, 32), np.float32) / 4
    caplog.set_level(logging.INFO, logger="moe_tune")
    traced = {}
    for name, fn in (("fwd", lambda x: moe_mlp(x, logits, gate, up, down, 2)),
                     ("bwd", jax.grad(lambda x: moe_mlp(x, logits, gate, up, down, 2).sum()))):
        caplog.clear()
        jax.make_jaxpr(fn)(x)  # traced only: the choice is made at trace time
        traced[name] = [r.getMessage() for r in caplog.records]
    ops = {name: {line.split(" ")[0] for line in lines} for name, lines in traced.items()}
    assert "fused_moe" in ops["fwd"] and "ragged_gather" not in ops["fwd"], traced["fwd"]
    assert "ragged_gather" in ops["bwd"] and "fused_moe" not in ops["bwd"], traced["bwd"]
    for direction, fused in (("fwd", True), ("bwd", False)):  # (each trace looks both up: layer.serve_or_train)
        assert any(line.startswith(f"moe_fusion {{'direction': '{direction}'") and f"fused={fused} (exact" in line
                   for line in traced[direction]), traced[direction]


def test_the_sweeps_memory_check_counts_its_compile_workers(monkeypatch):
    """A training-step sweep of deepseek-v2-lite's prefill layer fits with one process but not with two
    compile workers each holding the layer: the refusal says so before anything is allocated."""
    from moe_tune.core.errors import UsageError
    from moe_tune.tuner import request

    problem = FusionProblem(tokens=4096, hidden=2048, intermediate=1408, experts=64, top_k=6, direction="bwd")
    alone, with_two = MOE_FUSION.sweep_memory(problem, 1), MOE_FUSION.sweep_memory(problem, 2)
    assert alone == MOE_FUSION.memory_estimate(problem) < with_two
    monkeypatch.setattr(request, "available_bytes", lambda: (alone + with_two) // 2)
    request.check_fits(MOE_FUSION, problem, workers=1)
    with pytest.raises(UsageError, match=r"--workers 2; .*fewer --workers need less"):
        request.check_fits(MOE_FUSION, problem, workers=2)
