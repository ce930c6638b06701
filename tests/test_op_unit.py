"""The op object answers every op-specific question generic code asks: its inputs' shapes (targets, the
sweep's inputs thread), what `bench` compares a kernel with, the report's kernel label, and the calls one
`moe_mlp` layer makes. The layer's calls are exactly what `moe_mlp` looks up when it is evaluated (serving)
and when it is differentiated (training), glu and quantization included; `moe_fusion` has quantized-weight
problems whose keys say so."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from tiny_layer import TINY, layer_inputs

import moe_tune
from moe_tune.cli import cli
from moe_tune.commands import bench
from moe_tune.core.errors import UsageError
from moe_tune.core.quant import quantize
from moe_tune.kernels import get_op, op_names
from moe_tune.kernels.kernel_op import KernelOp, relative_error
from moe_tune.layer.models import layer_runs


def _run(*args):
    result = CliRunner().invoke(cli, list(args))
    assert "Traceback" not in result.output, result.output
    return result


@pytest.mark.parametrize("extra", [(), ("--stage", "combine", "--rhs-quant", "int4", "--quant-block", "32")])
def test_bench_times_a_fused_kernel_against_its_plain_jax_fallback(extra):
    result = _run("bench", "--op", "fused_moe", "--tokens", "32", "--top-k", "2", "--k", "64", "--n", "64",
                  "--groups", "4", "--samples", "1", *extra)
    assert result.exit_code == 0, result.output
    assert "fallback/tuned" in result.output and "(default)" in result.output


def _benched(monkeypatch, *args) -> list[tuple[str, dict]]:
    """What `bench --model ...` benches (the op and key fields of each case), without timing them."""
    seen = []

    def fake(op, problem, **_):
        seen.append((op, problem.key_fields()))
        return bench.Comparison(backend="b", tuned_config={}, default_config={}, times_s={"tuned": 1.0, "default": 1.0,
                                "fallback": 1.0}, spread={}, timing_method="trace", timing_fallback=None,
                                copy_gbps=0.0, roofline_s=0.0, ratios={"fallback_vs_tuned": 1.0}, lookup_source="default")

    monkeypatch.setattr(bench, "bench_case", fake)
    result = _run("bench", "--model", *args, "--samples", "1")
    assert result.exit_code == 0, result.output
    return seen


def test_bench_of_a_model_takes_the_op_and_the_direction(monkeypatch):
    seen = _benched(monkeypatch, "deepseek-v2-lite", "--tokens", "16", "--op", "fused_moe", "--direction", "fwd")
    assert [(op, fields["stage"], fields["direction"], fields["glu"]) for op, fields in seen] == [
        ("fused_moe", "dispatch", "fwd", "silu"), ("fused_moe", "combine", "fwd", "none")]
    none = _run("bench", "--model", "deepseek-v2-lite", "--op", "ragged_gather_reduce", "--direction", "fwd",
                "--tokens", "16")  # ep 1: the combine is dense_gather_reduce's
    assert none.exit_code == 2 and "runs no ragged_gather_reduce kernel" in none.output


def test_bench_of_a_quantized_model_benches_what_the_layer_runs(monkeypatch):
    seen = _benched(monkeypatch, "deepseek-v2-lite", "--tokens", "16", "--rhs-quant", "int8")
    ops = {op for op, _ in seen}
    assert {"fused_moe", "moe_fusion"} <= ops
    assert not any(op == "ragged_dot" and fields["direction"] == "drhs" for op, fields in seen)  # no weight gradient
    assert all(fields.get("rhs_qdtype") == "int8" for op, fields in seen if op in ("fused_moe", "moe_fusion"))
    assert len({(op, tuple(fields.items())) for op, fields in seen}) == len(seen)  # once per key


def _looked_up(monkeypatch) -> list[tuple[str, tuple]]:
    found = []
    resolve = KernelOp.resolve_config

    def recording(self, backend, problem, given=None, **options):
        found.append((self.name, tuple(problem.key_fields().items())))
        return resolve(self, backend, problem, given, **options)

    monkeypatch.setattr(KernelOp, "resolve_config", recording)
    return found


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("quant", [None, {"rhs_quant": "int8"}])
def test_the_layers_calls_are_what_moe_mlp_looks_up(monkeypatch, ep, quant):
    """Serving (`fwd`): the lookups of the layer evaluated; training (`all`): of a training step and of the
    evaluation between steps; fused, unfused and the tables' choice, as the same sets. (An evaluated layer also
    reads the training step's choice, to know whether a differentiated one would run the other path: that
    answer never changes what the evaluation runs, so serving does not tune it.)"""
    found = _looked_up(monkeypatch)
    x, logits, w_gate, w_down = layer_inputs(TINY, 16, ep)
    if quant:
        w_gate, w_down = (quantize(w, "int8", axis=1) for w in (w_gate, w_down))
    offset = 0 if ep > 1 else None
    layer = lambda x, fused: moe_tune.moe_mlp(x, logits, w_gate, w_gate, w_down, TINY.top_k, expert_offset=offset,
                                               fused=fused)
    for fused in (True, False, None):
        jax.make_jaxpr(lambda x: layer(x, fused))(x)
    serving = set(found)
    for fused in (True, False, None):
        jax.make_jaxpr(jax.grad(lambda x: layer(x, fused).sum()))(x)
    training = set(found)
    calls = lambda direction: {(c.op, tuple(c.problem.key_fields().items()))
                               for c in layer_runs(TINY, 16, ep=ep, dtype="float32", quant=quant, direction=direction)}
    training_choice = {(op, fields) for op, fields in serving if op == "moe_fusion" and dict(fields)["direction"] == "bwd"}
    assert len(training_choice) == 1
    assert calls("fwd") == serving - training_choice
    assert calls("all") == training


def test_training_tunes_the_dispatch_evaluation_runs_with_its_activation():
    dispatches = [c.problem for c in layer_runs(TINY, 16, dtype="float32") if c.op == "fused_moe"
                  and c.problem.stage == "dispatch"]
    assert sorted((p.direction, p.glu or "none") for p in dispatches) == [("bwd", "silu"), ("fwd", "none"),
                                                                           ("fwd", "silu")]


def test_moe_fusion_has_quantized_weight_problems_keyed_on_their_quantization():
    op = get_op("moe_fusion")
    shape = dict(tokens=16, hidden=128, intermediate=64, experts=4, top_k=2)
    assert "rhs_qdtype" not in op.problem(**shape).key_fields()  # float keys unchanged
    fields = op.problem(**shape, rhs_quant="int8", quant_block=32).key_fields()
    assert (fields["rhs_qdtype"], fields["rhs_qblock"]) == ("int8", 32)
    assert op.problem(**shape, rhs_quant="mxfp4").key_fields()["rhs_qblock"] == 32
    with pytest.raises(UsageError, match="does not divide"):
        op.problem(**shape, rhs_quant="int8", quant_block=48)
    for direction in ("fwd", "bwd"):
        problem = op.problem(**shape, rhs_quant="int8", direction=direction)
        inputs = op.make_inputs(problem, "balanced", 0)
        backend = op.backends.get("layer")
        for fused in (True, False):
            out = jax.jit(lambda x: op.run(backend, backend.config_cls(fused=fused), problem, x))(
                jax.device_put(inputs))
            assert relative_error(np.asarray(out), op.reference(problem, inputs)) < op.tolerance(problem)


def test_moe_mlp_looks_the_choice_up_with_the_weights_quantization(monkeypatch):
    found = _looked_up(monkeypatch)
    x, logits, w_gate, w_down = layer_inputs(TINY, 16, 1)
    q_gate, q_down = (quantize(w, "int8", axis=1, block_size=32) for w in (w_gate, w_down))
    jax.make_jaxpr(lambda x: moe_tune.moe_mlp(x, logits, q_gate, q_gate, q_down, TINY.top_k))(x)
    choices = [dict(fields) for op, fields in found if op == "moe_fusion"]
    assert sorted(c["direction"] for c in choices) == ["bwd", "fwd"]  # evaluation's and a training step's
    assert all((c["rhs_qdtype"], c["rhs_qblock"]) == ("int8", 32) for c in choices)


def test_sweep_takes_quantized_weights_for_moe_fusion():
    result = _run("sweep", "--op", "moe_fusion", "--tokens", "16", "--hidden", "128", "--intermediate", "64",
                  "--experts", "4", "--top-k", "2", "--rhs-quant", "int8", "--dry-run")
    assert result.exit_code == 0, result.output


def test_every_kernel_op_describes_its_inputs_and_the_choice_does_not():
    described = {name for name in op_names() if get_op(name).has_input_shapes}
    kernels = {"ragged_dot", "ragged_gather", "ragged_gather_reduce", "dense_gather_reduce", "fused_moe"}
    assert kernels <= described and "moe_fusion" not in described
    problem = get_op("ragged_dot").problem(m=64, k=128, n=64, groups=4, rhs_quant="int8", direction="drhs")
    shapes = get_op("ragged_dot").abstract_inputs(problem)
    assert shapes["a"].shape == (64, 128) and shapes["b"].shape == (64, 64)  # drhs: lhs and dout
    with pytest.raises(ValueError, match="moe_fusion"):
        get_op("moe_fusion").abstract_inputs(None)


def test_the_report_labels_a_kernel_as_its_op_says():
    assert get_op("ragged_dot").kernel_label("fwd") == "ragged_dot fwd"
    assert get_op("ragged_gather").kernel_label("fwd") == "ragged_gather"
    assert get_op("fused_moe").kernel_label("bwd") == "fused_moe bwd"


def test_bench_compares_each_op_with_its_own_baseline():
    """The plan of each op names variants that exist and ratios of them."""
    for name in op_names():
        op = get_op(name)
        problem = op.problem(**op.default_problem_options())
        backend = op.backend(None)
        plan = op.bench_plan(problem, backend, backend.default_config(problem), {}, distribution="balanced", seed=1)
        names = {"tuned", "default", *plan.variants, *(("copy",) if plan.copy_bytes else ())}
        assert plan.baseline in names and set(plan.same_as) <= {"tuned", "default"}
        assert all(a in names and b in names for a, b in plan.ratios.values())
