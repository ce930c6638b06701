"""Tuning quantized ragged_dot problems: the key rule (quantization fields only when an operand is quantized),
seeded QArray inputs and the dequantized reference, a real quantized sweep through the CLI that the runtime
finds, report / lookup / bench with the flags, and a whole layer quantized for `--model`."""

from __future__ import annotations

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

import moe_tune
from moe_tune.cli import cli
from moe_tune.commands.options import model_only, quant_options
from moe_tune.core.errors import UsageError
from moe_tune.core.quant import QArray, dequantize_host
from moe_tune.kernels import get_op
from moe_tune.kernels.ragged_dot import RaggedDotProblem
from moe_tune.layer.models import get_preset, kernel_problems
from moe_tune.profiles.entry import Entry

OP = get_op("ragged_dot")
SHAPE = ["--m", "64", "--k", "64", "--n", "32", "--groups", "4"]
QUANT = ["--rhs-quant", "int8", "--quant-block", "16"]


def test_float_keys_are_unchanged_and_quantized_keys_gain_the_fields():
    plain = OP.problem(m=64, k=64, n=32, groups=4, dtype="bfloat16")
    assert list(plain.key_fields()) == ["direction", "m", "k", "n", "groups", "lhs_dtype", "rhs_dtype", "out_dtype"]
    assert OP.key_field_names == (*plain.key_fields(), "backend", "distribution")
    quant = OP.problem(m=64, k=64, n=32, groups=4, dtype="bfloat16", rhs_quant="int8", direction="dlhs")
    fields = quant.key_fields()
    # a quantized operand counts as float32 (what it dequantizes to), as in RaggedDotProblem.from_arrays
    assert (fields["lhs_dtype"], fields["rhs_dtype"], fields["out_dtype"]) == ("bfloat16", "float32", "bfloat16")
    assert (fields["rhs_qdtype"], fields["rhs_qblock"]) == ("int8", 64) and "lhs_qdtype" not in fields
    w8a8 = OP.problem(m=64, k=64, n=32, groups=4, rhs_quant="int8", lhs_quant="float8_e4m3fn", quant_block=16)
    assert (w8a8.lhs_qdtype, w8a8.lhs_qblock, w8a8.rhs_qblock) == ("float8_e4m3fn", 16, 16)
    assert OP.tolerance(w8a8) == OP.tolerance(OP.problem(m=64, k=64, n=32, groups=4))  # exact products
    with pytest.raises(UsageError, match="needs rhs_quant or lhs_quant"):
        OP.problem(m=64, k=64, n=32, groups=4, quant_block=16)


@pytest.mark.parametrize("direction", ["fwd", "dlhs", "drhs"])
def test_inputs_are_seeded_qarrays_and_the_reference_is_of_the_dequantized_operands(direction):
    problem = OP.problem(m=16, k=32, n=8, groups=2, rhs_quant="int8", lhs_quant="int8", quant_block=8,
                           direction=direction)
    inputs = OP.make_inputs(problem, "balanced", seed=3)
    quantized = {"fwd": (True, True), "dlhs": (False, True), "drhs": (True, False)}[direction]
    assert tuple(isinstance(inputs[name], QArray) for name in ("a", "b")) == quantized
    again = OP.make_inputs(problem, "balanced", seed=3)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(inputs), jax.tree.leaves(again)))
    floats = {name: dequantize_host(x) if isinstance(x, QArray) else x for name, x in inputs.items()}
    np.testing.assert_array_equal(OP.reference(problem, inputs), OP.reference(problem, floats))
    record = OP.distribution_record(problem, "balanced", 3, inputs)
    assert 0 < record["quantization_error"] < 0.05  # int8 with 8-wide blocks: about 1%


@pytest.fixture
def run():
    runner = CliRunner()
    return lambda *args: runner.invoke(cli, list(args), catch_exceptions=False)


def test_quantized_sweep_is_found_by_the_runtime(run, isolated_profiles, caplog):
    result = run("sweep", *SHAPE, *QUANT, "--backend", "tiled", "--max-candidates", "2", "--samples", "1",
                 "--workers", "1")
    assert result.exit_code == 0, result.output
    table = json.loads((isolated_profiles / "cpu" / "ragged_dot.json").read_text())
    (key, data), = table["entries"].items()
    entry = Entry.from_json(data)
    assert entry.fields["rhs_qdtype"] == "int8" and entry.fields["rhs_qblock"] == 16 and "rhs_qdtype=int8" in key
    assert 0 < entry.quantization_error < 0.05 and entry.to_json() == data
    assert run("validate").exit_code == 0

    rng = np.random.default_rng(0)
    lhs, sizes = jnp.asarray(rng.standard_normal((64, 64), np.float32)), jnp.asarray([16] * 4, jnp.int32)
    weights = moe_tune.quantize(jnp.asarray(rng.standard_normal((4, 64, 32), np.float32)), "int8", axis=1,
                                block_size=16)
    problem = RaggedDotProblem.from_arrays(lhs, weights, sizes)
    assert OP.lookup(problem, backend="tiled").source == "exact"
    with caplog.at_level(logging.INFO, logger="moe_tune"):
        moe_tune.ragged_dot(lhs, weights, sizes, backend="tiled")
    assert any("rhs_qdtype" in r.getMessage() and "(exact:" in r.getMessage() for r in caplog.records)

    looked_up = run("lookup", *SHAPE, *QUANT, "--backend", "tiled")
    assert looked_up.exit_code == 0 and "source: exact" in looked_up.output, looked_up.output
    assert "rhs int8/16" in looked_up.output
    report = run("report", "--format", "csv")
    header, row = report.output.strip().splitlines()[:2]
    assert ",quant,quant_error," in header and ",rhs int8/16," in row
    assert "quant_error" in run("report", "--columns", "kernel,quant,quant_error").output  # for a quantized entry
    assert "float32 x int8/16" in run("report").output  # the compact table: int8 weights, not rhs_dtype=float32


def test_bench_takes_the_quantization_flags(run):
    result = run("bench", *SHAPE, *QUANT, "--backend", "tiled", "--samples", "1")
    assert result.exit_code == 0, result.output
    assert "rhs int8/16" in result.output and "default" in result.output


def test_a_layer_is_quantized_in_its_ragged_dots_only():
    shape = {"tokens": 64, "ep": None, "dtype": None, "rhs_quant": "int8", "lhs_quant": None, "quant_block": 32,
             "m": None}
    model_only(shape, explicit=[])  # the quantization flags shape a --model run
    quant = quant_options(shape)
    assert quant == {"rhs_quant": "int8", "quant_block": 32}
    cases = kernel_problems(get_preset("mixtral-8x7b"), 64, ep=2, quant=quant)
    matmuls = [c.problem for c in cases if c.op == "ragged_dot"]
    assert len(matmuls) == 6 and all(p.rhs_qdtype == "int8" and p.rhs_qblock == 32 for p in matmuls)
    assert all("qdtype" not in " ".join(c.problem.key_fields()) for c in cases if c.op != "ragged_dot")
    with pytest.raises(UsageError, match="--m does not apply"):
        model_only({**shape, "m": 8}, explicit=[])
