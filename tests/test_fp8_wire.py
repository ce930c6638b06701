"""The MoE layer's fp8 dispatch wire (`layer/wire.py`, `ShardingConfig.wire`): the config and its place in the
tuned space here; the layer itself on 8 host devices in one module-scoped subprocess (`fp8_wire_checks.py`:
the device count is fixed when JAX starts)."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import pytest
from run_once import once_per_run, script_json

from moe_tune.core import devices
from moe_tune.core.errors import UsageError
from moe_tune.core.quant import AsQArray, quantize
from moe_tune.kernels import get_op
from moe_tune.kernels.ragged_dot.quant_plan import paired_lhs_block
from moe_tune.layer.sharded import resolve_strategy
from moe_tune.layer.sharding_choice import ShardingConfig
from moe_tune.layer.wire import FP8_WIRE_TOLERANCE, quantize_rows, row_block

SCRIPT = Path(__file__).with_name("fp8_wire_checks.py")
OP = get_op("moe_sharding")
SHAPE = dict(tokens=32, hidden=16, intermediate=8, experts=8, top_k=2)


def test_wire_is_part_of_the_config_and_old_entries_read_as_native():
    config = ShardingConfig(strategy="all_to_all", token_chunks=2, wire="fp8")
    assert "wire=fp8" in config.label()
    assert ShardingConfig.from_dict(config.to_dict()) == config
    old = {"strategy": "all_gather", "token_chunks": 1, "exchange": "fixed"}  # a table entry without the field
    assert ShardingConfig.from_dict(old).wire == "native"
    local = dict(tokens=8, hidden=16, intermediate=4, experts=8, top_k=2, ep=4, tp=1, dtype="float32",
                 tokens_replicated=False, platform="cpu")
    assert resolve_strategy(ShardingConfig(wire="fp8"), **local).wire == "fp8"
    with pytest.raises(UsageError, match="wire must be one of native, fp8"):
        resolve_strategy(ShardingConfig(wire="bf16"), **local)
    with pytest.raises(UsageError, match="wire 'fp8' quantizes the rows"):
        resolve_strategy(ShardingConfig(strategy="in_kernel", wire="fp8"), **local)


def test_the_space_enumerates_strategy_chunks_exchange_and_wire_once_each():
    backend = OP.backends.get("mesh")
    problem = OP.problem(**SHAPE, ep=4)
    for judged in (None, devices.Device("gpu", "nvidia_h100_80gb_hbm3")):
        with devices.judging(judged):  # None: this machine (CPU)
            space = backend.search_space(problem)
            exchanges = ["fixed", "ragged"] if judged else ["fixed"]
            default_exchange = "ragged" if judged else "fixed"
        got = [(c.strategy, c.token_chunks, c.exchange, c.wire) for c in space]
        assert len(got) == len(set(got))
        want = {("all_gather", c, default_exchange, w) for c in (1, 2, 4) for w in ("native", "fp8")} | {
            ("all_to_all", c, e, w) for c in (1, 2, 4) for e in exchanges for w in ("native", "fp8")}
        assert set(got) == want, judged


def test_only_the_fp8_wire_candidates_are_checked_at_the_wires_tolerance():
    problem = OP.problem(**SHAPE, ep=4, dtype="bfloat16")
    native = OP.tolerance(problem, ShardingConfig(strategy="all_to_all", wire="native"))
    fp8 = OP.tolerance(problem, ShardingConfig(strategy="all_to_all", wire="fp8"))
    assert native == get_op("moe_fusion").tolerance(problem.whole_layer()) < FP8_WIRE_TOLERANCE
    assert fp8 == FP8_WIRE_TOLERANCE == OP.tolerance(problem)  # no config: any of the problem's candidates


def test_the_rows_scale_block_is_the_quantized_ragged_dots_rule():
    w = jnp.ones((2, 256, 8), jnp.float32)
    assert row_block(256, w) == 256 == paired_lhs_block(256, None)  # float weights: one scale per row
    assert row_block(256, quantize(w, "int8", axis=1)) == 256  # per channel
    assert row_block(256, quantize(w, "int8", axis=1, block_size=128)) == 128  # sub-channel: its blocks
    assert row_block(256, AsQArray(w, "int8", block_size=64)) == 64
    q = quantize_rows(jnp.arange(512, dtype=jnp.bfloat16).reshape(2, 256), 128)
    assert q.qvalue.dtype == jnp.float8_e4m3fn and q.scale.shape == (2, 2) and q.scale.dtype == jnp.float32
    assert OP.tolerance(OP.problem(**SHAPE, ep=4)) == FP8_WIRE_TOLERANCE == 0.125


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    def make(part: int, parts: int) -> dict:
        return script_json(SCRIPT, cwd=SCRIPT.parent)

    return once_per_run(tmp_path_factory, "fp8_wire_checks", make)  # one subprocess per test run


@pytest.mark.parametrize("case", ["all_gather_chunks1_bfloat16", "all_gather_chunks2_int8",
                                  "all_to_all_chunks1_int8", "all_to_all_chunks2_bfloat16"])
def test_the_layer_over_the_fp8_wire_matches_the_float64_reference(checked, case):
    result = checked[case]
    assert "error" not in result, result
    assert result["finite"] and result["dtype_out"] == "bfloat16"
    # against the exact rows: within the fp8 rule; against the rows as the wire rounds them: the
    # straight-through gradients are that reference's, within bf16's own tolerance
    exact = {k: v for k, v in result.items() if k in ("out", "dx", "dlogits", "dw_gate", "dw_up", "dw_down")}
    assert exact and all(v <= result["tolerance"] for v in exact.values()), result
    assert set(result["rounded"]) == set(exact)
    assert all(v <= result["rounded_tolerance"] for v in result["rounded"].values()), result


def test_the_dispatch_collectives_carry_fp8_rows(checked):
    types = checked["hlo"]
    assert "f8E4M3FN" not in types["all_gather_native"] and "bf16" in types["all_gather_native"]
    assert "f8E4M3FN" in types["all_gather_fp8"] and "bf16" not in types["all_gather_fp8"]  # scales: f32
    assert types["all_to_all_native"] == ["bf16"]
    assert types["all_to_all_fp8"] == ["bf16", "f8E4M3FN"]  # fp8 rows with their scales' bytes out, bf16 back


def test_the_scales_travel_bit_for_bit_in_the_rows_message(checked):
    # scale bytes that read as fp8 NaNs, through XLA:CPU's fp8 collectives (widened to f16 and back)
    assert checked["pack_roundtrip"] == {"all_gather": True, "all_to_all": True}


def test_the_ragged_exchange_of_fp8_rows_exports_for_cuda_and_tpu(checked):
    for platform in ("cuda", "tpu"):
        found = checked["export"][platform]
        assert found["ok"], found
        assert found["platforms"] == [platform] and found["calls"] == 2  # fp8 rows (with scales) there, bf16 back
        assert {"f8E4M3FN", "bf16"} <= set(found["ragged_types"]) and "f32" not in found["ragged_types"]


def test_an_fp8_wire_that_cannot_serve_is_one_line(checked):
    refused = checked["refusals"]
    assert "fused kernels take float rows" in refused["fused"]
    assert "replicated tokens send none" in refused["replicated"]
    assert "wire must be one of" in refused["wire_name"]
    assert all("\n" not in message for message in refused.values() if message is not None)
    assert refused["tables_fp8_fused"] is None  # the tables' fp8 choice yields to fused=True: native wire
