"""One quantization format (`moe_tune.core.quant_format.QuantFormat`): the dtype names and the mxfp4 alias, the
default and fixed blocks, the divisibility rule, scale shapes, bytes per element; every problem holds one, so
`--rhs-quant mxfp4` is the same quantization wherever it is offered (fused_moe included) and a tuned key is
the one the runtime looks up."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

from moe_tune.cli import cli
from moe_tune.core.errors import UsageError
from moe_tune.core.quant import quantize
from moe_tune.core.quant_format import QuantFormat
from moe_tune.kernels import get_op
from moe_tune.kernels.fused_moe.op import _problem as runtime_fused_problem
from moe_tune.kernels.fused_moe.pallas_tpu import shape_error
from moe_tune.kernels.fused_moe.problem import FusedMoeProblem
from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem

FUSED = dict(tokens=8, top_k=2, k=64, n=64, groups=4)


@pytest.mark.parametrize("given, dtype, name, block, qmax, bits", [
    (("int8",), "int8", "int8", None, 127.0, 8),
    ((jnp.int8, 128), "int8", "int8", 128, 127.0, 8),
    (("float8_e4m3fn",), "float8_e4m3fn", "float8_e4m3fn", None, 448.0, 8),
    (("int4", 128), "int4", "int4", 128, 7.0, 4),
    (("mxfp4",), "float4_e2m1fn", "mxfp4", 32, 6.0, 4),
    (("float4_e2m1fn",), "float4_e2m1fn", "mxfp4", 32, 6.0, 4),
    (("mxfp4", np.int64(32)), "float4_e2m1fn", "mxfp4", 32, 6.0, 4),
])
def test_a_format_parses_names_aliases_and_blocks_once(given, dtype, name, block, qmax, bits):
    form = QuantFormat.parse(*given)
    assert (form.dtype, form.name, form.block, form.qmax, form.bits) == (dtype, name, block, qmax, bits)
    assert type(form.block) in (int, type(None))  # a NumPy block is kept as a Python int (keys are JSON)
    assert form.bytes_per_element == bits / 8
    assert form == QuantFormat(form.dtype, form.block)  # the stored name and block make the same format
    assert form.activations == (bits == 8)


def test_a_format_on_an_axis_has_a_concrete_block_its_scale_shape_and_its_bytes():
    per_channel = QuantFormat.parse("int8").along(64)
    assert per_channel.block == 64 and per_channel.label(64) == "int8"
    assert per_channel.scale_shape((4, 64, 8), 1) == (4, 1, 8)
    int4 = QuantFormat.parse("int4", 16).along(64)
    assert int4.scale_shape((4, 64, 8), 1) == (4, 4, 8) and int4.label(64) == "int4/16"
    # 4-bit values: half a byte each on the device, a byte each in NumPy; float32 scales, one per block
    assert int4.stored_bytes(4 * 64 * 8) == 4 * 64 * 8 // 2 + 4 * (4 * 4 * 8)
    assert int4.stored_bytes(4 * 64 * 8, host=True) == 4 * 64 * 8 + 4 * (4 * 4 * 8)
    mx = QuantFormat.parse("mxfp4").along(64)
    assert mx.block == 32 and mx.label(64) == "mxfp4"
    np.testing.assert_array_equal(quantize(np.ones((4, 64, 8), np.float32), "mxfp4", axis=1).scale.shape,
                                  mx.scale_shape((4, 64, 8), 1))


@pytest.mark.parametrize("given, match", [
    (("mxfp4", 64), r"mxfp4 \(float4_e2m1fn\) takes blocks of 32 along k \(OCP MX\), got quant_block 64"),
    (("int8", 16.0), r"quant_block must be a positive integer .* got 16.0 \(float\)"),
    (("int8", True), r"quant_block must be a positive integer .* got True \(bool\)"),
    (("int8", -4), "quant_block -4 does not divide any length"),
    (("int3",), "rhs_quant: cannot quantize to int3; use one of int8, .*, mxfp4"),
    (("bfloat16",), "rhs_quant: cannot quantize to bfloat16"),
])
def test_a_bad_format_is_one_line_naming_the_argument(given, match):
    with pytest.raises(UsageError, match=match) as raised:
        QuantFormat.parse(*given, dtype_arg="rhs_quant", block_arg="quant_block")
    assert "\n" not in str(raised.value)


def test_a_block_that_does_not_divide_the_axis_names_the_rule():
    with pytest.raises(UsageError, match="int4 quantizes blocks of 48 along k: quant_block 48 does not divide its "
                                         "length 64"):
        QuantFormat.parse("int4", 48).along(64, axis="k", block_arg="quant_block")


@pytest.mark.parametrize("rhs_quant", ["mxfp4", "float4_e2m1fn"])
def test_fused_moe_takes_mxfp4_in_the_blocks_a_runtime_call_has(rhs_quant):
    """fused_moe's problem takes "mxfp4" and float4_e2m1fn alike, in blocks of 32 (not one scale per channel,
    rhs_qblock = k): the key a runtime call with an mxfp4 QArray makes."""
    tuned = get_op("fused_moe").problem(**FUSED, rhs_quant=rhs_quant)
    assert (tuned.rhs_qdtype, tuned.rhs_qblock) == ("float4_e2m1fn", 32)
    assert tuned.rhs_format == QuantFormat("mxfp4")
    w = quantize(np.random.default_rng(0).standard_normal((4, 64, 64)).astype(np.float32), "mxfp4", axis=1)
    x, rows = jnp.ones((8, 64), jnp.float32), jnp.arange(16, dtype=jnp.int32) % 8
    runtime = runtime_fused_problem(x, rows, w, jnp.full((4,), 4, jnp.int32), None, stage="dispatch", tokens=None,
                                    glu=None)
    assert runtime.key_fields() == tuned.key_fields()


@pytest.mark.parametrize("make", [
    lambda: get_op("fused_moe").problem(**FUSED, rhs_quant="float4_e2m1fn", quant_block=64),
    lambda: get_op("ragged_dot").problem(m=16, k=64, n=64, groups=4, rhs_quant="mxfp4", quant_block=64),
])
def test_an_mxfp4_block_other_than_32_is_refused_by_every_op(make):
    with pytest.raises(UsageError, match="takes blocks of 32 along k .* got quant_block 64"):
        make()


def test_the_problems_hold_the_format_of_their_key_fields():
    ragged = RaggedDotProblem(m=16, k=64, n=8, groups=2, rhs_qdtype="mxfp4")
    assert ragged.key_fields()["rhs_qdtype"] == "float4_e2m1fn" and ragged.rhs_qblock == 32
    assert ragged.quant_format("rhs") == QuantFormat("float4_e2m1fn", 32) and ragged.quant_format("lhs") is None
    fused = FusedMoeProblem(tokens=8, m=16, k=64, n=64, groups=4, rhs_qdtype="mxfp4")
    assert (fused.rhs_qdtype, fused.rhs_qblock) == ("float4_e2m1fn", 32)
    with pytest.raises(UsageError, match=r"rhs_qblock must be a positive integer .* got 16.0"):
        FusedMoeProblem(tokens=8, m=16, k=64, n=64, groups=4, rhs_qdtype="int8", rhs_qblock=16.0)


def test_fused_moe_counts_4_bit_weights_at_half_a_byte_on_the_device():
    """Its memory estimate counts a 4-bit value at half a byte on the device, a byte in NumPy."""
    op = get_op("fused_moe")
    int8, int4 = (op.memory_estimate(op.problem(**FUSED, rhs_quant=q, quant_block=32)) for q in ("int8", "int4"))
    assert int8 - int4 == 4 * 64 * 64 // 2  # the host copies are a byte a value either way


def test_the_fused_kernels_that_read_1_byte_weights_name_the_4_bit_format_they_leave_to_jax():
    assert "dequantizes 1-byte weights, not mxfp4" in shape_error(get_op("fused_moe").problem(**FUSED, rhs_quant="mxfp4"))
    assert "dequantizes" not in (shape_error(get_op("fused_moe").problem(**FUSED, rhs_quant="int8")) or "")


@pytest.fixture
def run():
    runner = CliRunner()
    return lambda *args: runner.invoke(cli, list(args), catch_exceptions=False)


@pytest.mark.parametrize("args, shown", [
    (("models", "qwen3-30b-a3b", "--tokens", "512", "--rhs-quant", "mxfp4"), "rhs mxfp4"),
    (("sweep", "--model", "qwen3-30b-a3b", "--tokens", "512", "--op", "ragged_dot", "--rhs-quant", "mxfp4",
      "--dry-run"), "ragged_dot fwd m=4096 k=2048 n=768 g=128 float32 rhs mxfp4"),
    (("coverage", "--model", "gpt-oss-20b", "--tokens", "64", "--rhs-quant", "mxfp4", "--direction", "fwd"),
     "fused gate/up fwd"),
])
def test_rhs_quant_mxfp4_works_wherever_it_is_offered(run, args, shown):
    """A model's layer with mxfp4 weights has fused_moe kernel calls too; each command builds them."""
    result = run(*args)
    assert result.exit_code == 0, result.output
    assert shown in result.output


def test_models_show_the_fused_calls_in_mxfp4(run):
    result = run("models", "qwen3-30b-a3b", "--tokens", "512", "--rhs-quant", "mxfp4")
    fused = [line for line in result.output.splitlines() if "fused_moe dispatch" in line]
    assert fused and all("rhs mxfp4" in line for line in fused)


def test_a_fused_sweep_of_float4_e2m1fn_runs_and_is_keyed_in_blocks_of_32(run, isolated_profiles):
    """A float4_e2m1fn sweep of fused_moe (k=64) quantizes in mxfp4's blocks of 32 and stores that block in
    its key, not k."""
    result = run("sweep", "--op", "fused_moe", "--tokens", "8", "--top-k", "2", "--k", "64", "--n", "64",
                 "--groups", "4", "--rhs-quant", "float4_e2m1fn", "--max-candidates", "2", "--samples", "1",
                 "--workers", "1", "--cold")
    assert result.exit_code == 0, result.output
    (table,) = isolated_profiles.rglob("fused_moe.json")
    entries = json.loads(table.read_text())["entries"]
    fields = [entry["fields"] for entry in (entries.values() if isinstance(entries, dict) else entries)]
    assert [(f["rhs_qdtype"], f["rhs_qblock"]) for f in fields] == [("float4_e2m1fn", 32)]


def test_a_bad_fused_block_is_refused_before_the_sweep_header(run):
    result = run("sweep", "--op", "fused_moe", "--tokens", "8", "--top-k", "2", "--k", "64", "--n", "64",
                 "--groups", "4", "--rhs-quant", "mxfp4", "--quant-block", "64", "--samples", "1", "--cold")
    assert result.exit_code == 2
    assert "Sweeping" not in result.output
    assert "takes blocks of 32 along k (OCP MX), got quant_block 64" in result.output
