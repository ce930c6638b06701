"""The sharded layer's strategy as a tuned choice (`moe_sharding`), and the kernel calls of the layer across
devices: the problem, key and config rules here; a sweep of the tiny preset's sharded layer on 4 of 8 host
devices, the layer's lookups after it and the coverage of the same layer in one subprocess
(`sharding_sweep_checks.py`: the device count is fixed when JAX starts)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from run_once import once_per_run, script_json
from tiny_layer import TINY

from moe_tune.cli import cli
from moe_tune.core.errors import UsageError
from moe_tune.kernels import get_op
from moe_tune.layer import models
from moe_tune.layer.exchange import worst_rows
from moe_tune.layer.sharded import resolve_strategy
from moe_tune.layer.sharding_choice import ShardingConfig
from moe_tune.layer.sharding_op import left_out_here

SCRIPT = Path(__file__).with_name("sharding_sweep_checks.py")
OP = get_op("moe_sharding")
SHAPE = dict(tokens=8, hidden=16, intermediate=8, experts=8, top_k=2)


def test_the_problem_is_keyed_by_layer_mesh_dtype_and_quantization():
    p = OP.problem(**SHAPE, ep=4, tp=2)
    assert p.key_fields() == {"direction": "fwd", "tokens": 8, "hidden": 16, "intermediate": 8, "experts": 8,
                              "top_k": 2, "ep": 4, "tp": 2, "dtype": "float32"}
    quantized = OP.problem(**SHAPE, ep=4, rhs_quant="int8", direction="bwd").key_fields()
    assert quantized["rhs_qdtype"] == "int8" and quantized["rhs_qblock"] is None and quantized["direction"] == "bwd"
    whole = p.whole_layer()  # the reference's layer: every device's tokens and experts on one device
    assert (whole.tokens, whole.experts, whole.local_experts, whole.intermediate) == (32, 8, 8, 8)
    for bad, match in ((dict(ep=1), "at least 2"), (dict(ep=3), "divide experts"), (dict(ep=2, tp=3), "tp"),
                       (dict(ep=2, direction="dlhs"), "directions")):
        with pytest.raises(UsageError, match=match):
            OP.problem(**SHAPE, **bad)


def test_the_candidates_are_strategies_token_chunks_and_the_platforms_exchanges():
    from moe_tune.core import devices

    backend = OP.backends.get("mesh")
    candidates = lambda tokens: [(c.strategy, c.token_chunks, c.exchange)
                                 for c in backend.search_space(OP.problem(**dict(SHAPE, tokens=tokens), ep=4))
                                 if c.wire == "native"]  # each again with the fp8 wire: tests/test_fp8_wire.py
    # CPU: the fixed exchange only (XLA:CPU has no ragged all-to-all); chunks of 8 tokens or more that divide
    # the tokens; the default first
    assert candidates(32) == [(s, c, "fixed") for s in ("all_gather", "all_to_all") for c in (1, 2, 4)]
    assert candidates(24) == [(s, c, "fixed") for s in ("all_gather", "all_to_all") for c in (1, 2)]
    assert candidates(8) == [("all_gather", 1, "fixed"), ("all_to_all", 1, "fixed")]
    p = OP.problem(**dict(SHAPE, tokens=32), ep=4)
    for config, reason in ((ShardingConfig(strategy="all_to_all", exchange="ragged"), "needs jax.lax.ragged"),
                           (ShardingConfig(token_chunks=3), "token_chunks 3 does not divide the 32 tokens"),
                           (ShardingConfig(token_chunks=0), "positive"), (ShardingConfig(exchange="ring"), "exchange"),
                           (ShardingConfig(strategy="in_kernel"), "strategy")):
        assert reason in backend.config_error(config, p), config
    assert backend.config_error(ShardingConfig(token_chunks=16), p) is None  # valid, if not a candidate
    # a GPU (likewise a TPU): both exchanges for all_to_all, all_gather with the default (ragged) alone
    with devices.judging(devices.Device("gpu", "nvidia_h100_80gb_hbm3")):
        got = candidates(16)
        assert backend.config_error(ShardingConfig(strategy="all_gather", exchange="fixed"), p)
    assert got == [("all_to_all", 1, "ragged"), ("all_gather", 1, "ragged"), ("all_gather", 2, "ragged"),
                   ("all_to_all", 1, "fixed"), ("all_to_all", 2, "fixed"), ("all_to_all", 2, "ragged")]
    assert len(set(got)) == len(got)


def test_row_tile_is_in_kernels_knob_offered_only_where_the_rules_accept_it():
    """`row_tile` (0: the VMEM rules' largest) reads as 0 from an entry written before it; other strategies take
    0 only; on a TPU v5e the in_kernel candidates hold 0 and each row tile that runs other tiles than 0's."""
    from moe_tune.core import devices
    from moe_tune.layer.in_kernel_rules import ROW_TILES
    from moe_tune.layer.sharding_choice import layer_config_error

    old = ShardingConfig.from_dict({"strategy": "in_kernel", "token_chunks": 1, "exchange": "ragged", "wire": "native"})
    assert old.row_tile == 0
    assert "row_tile=0" in layer_config_error(ShardingConfig(strategy="all_to_all", row_tile=64), tokens=8)
    assert "row_tile must be 0" in layer_config_error(ShardingConfig(strategy="in_kernel", row_tile=48), tokens=8)
    backend = OP.backends.get("mesh")
    p = OP.problem(tokens=64, hidden=2048, intermediate=768, experts=128, top_k=8, ep=4, dtype="bfloat16")
    assert backend.candidate_values(p)["row_tile"] == [0]  # the CPU: no in_kernel candidates
    with devices.judging(devices.Device("tpu", "tpu_v5_lite")):
        space = backend.search_space(p)
        twice = backend.config_error(ShardingConfig(strategy="in_kernel", exchange="ragged", row_tile=512), p)
    assert {c.row_tile for c in space if c.strategy != "in_kernel"} == {0}
    tiles = sorted(c.row_tile for c in space if c.strategy == "in_kernel" and c.token_chunks == 1
                   and c.exchange == "ragged")
    assert tiles[0] == 0 and set(tiles[1:]) < set(ROW_TILES) and len(set(tiles)) == len(tiles) > 2
    assert 512 not in tiles and twice == "row_tile 512 runs the tiles row_tile 0 runs"


def test_resolve_strategy_asks_the_tables_for_split_tokens_only(isolated_profiles):
    local = dict(tokens=8, hidden=16, intermediate=4, experts=8, top_k=2, tp=2, dtype="float32", platform="cpu")
    # no entry: the default; given: as given; replicated tokens or one device: nothing travels, the default
    assert resolve_strategy(None, ep=4, tokens_replicated=False, **local) == ShardingConfig(
        strategy="all_gather", token_chunks=1, exchange="fixed")
    assert resolve_strategy("all_to_all", ep=4, tokens_replicated=False, **local) == ShardingConfig(
        strategy="all_to_all", token_chunks=1, exchange="fixed")
    assert resolve_strategy(None, ep=4, tokens_replicated=True, **local) == ShardingConfig(strategy="all_gather")
    chunked = ShardingConfig(strategy="all_to_all", token_chunks=2)  # a whole config: as given
    assert resolve_strategy(chunked, ep=4, tokens_replicated=False, **local) is chunked
    with pytest.raises(UsageError, match="ep_strategy"):
        resolve_strategy("ring", ep=4, tokens_replicated=False, **local)
    with pytest.raises(UsageError, match="token_chunks 3 does not divide the 8 tokens"):
        resolve_strategy(ShardingConfig(token_chunks=3), ep=4, tokens_replicated=False, **local)
    # the lookup's problem: the whole width (intermediate x tp) on the ep x tp mesh
    found = OP.lookup(OP.problem(**SHAPE, ep=4, tp=2))
    assert found.source == "default" and "tp=2" in found.key


def test_the_sharded_layer_lists_each_strategys_calls_from_the_layers_own_rules():
    cases = models.sharded_runs(TINY, 8, ep=4, dtype="float32", direction="fwd")
    by_role = {c.role: c.problem for c in cases}
    # all_gather: the shard layer on every device's tokens; all_to_all: the matmuls on the receive buffer
    assert by_role["all_gather gate/up"].m == 8 * 4 * TINY.top_k
    assert by_role["all_to_all gate/up"].m == worst_rows(8, TINY.top_k, 4, 1) == 32
    assert by_role["dispatch"].tokens == 8 and by_role["gate/up"].m == 8 * TINY.top_k  # replicated tokens
    assert by_role["ep strategy"] == OP.problem(tokens=8, hidden=128, intermediate=64, experts=4, top_k=2, ep=4)
    keys = [(c.op, tuple(c.problem.key_fields().items())) for c in cases]
    assert len(keys) == len(set(keys))  # each call once
    # a tensor axis splits every expert's width; the strategy's key keeps the whole width
    split = {c.role: c.problem for c in models.sharded_runs(TINY, 8, ep=2, tp=2, dtype="float32", direction="fwd")}
    assert split["all_gather gate/up"].n == 32 and split["ep strategy"].intermediate == 64
    with pytest.raises(UsageError, match="tp"):
        models.sharded_runs(TINY, 8, ep=2, tp=3, dtype="float32")
    # a layer's cases at ep > 1 are the layer across devices, tp 1 unless given; its first group is the shard
    # layer on these tokens (what tables swept for the shard layer answer); ep 1 is the one-device layer
    assert models.layer_cases(TINY, [8], ep=4, dtype="float32", direction="fwd") == [(8, c) for c in cases]
    assert models.layer_cases(TINY, [8], ep=4, tp=1, dtype="float32", direction="fwd") == [(8, c) for c in cases]
    shard = models.layer_runs(TINY, 8, ep=4, dtype="float32", direction="fwd")
    assert cases[:len(shard)] == shard
    assert models.layer_cases(TINY, [8], ep=1, dtype="float32", direction="fwd") == [
        (8, c) for c in models.layer_runs(TINY, 8, dtype="float32", direction="fwd")]
    assert models.layer_cases(TINY, [8], ep=1, tp=2, dtype="float32", direction="fwd") == [
        (8, c) for c in models.sharded_runs(TINY, 8, ep=1, tp=2, dtype="float32", direction="fwd")]


def test_collectives_are_sized_by_the_layers_buffers():
    rows = dict(models.collectives(TINY, 8, ep=4, dtype="bfloat16"))
    assert rows["all_gather: all_gather x"] == 8 * 128 * 2
    assert rows["all_gather: psum_scatter partial outputs"] == 8 * 4 * 128 * 2
    assert rows["all_to_all: ragged_all_to_all rows back"] == worst_rows(8, 2, 4, 1) * 128 * 2
    assert "psum outputs over the tensor axis" in dict(models.collectives(TINY, 8, ep=2, tp=2, dtype="float32"))


def test_a_sweep_with_fewer_devices_than_the_mesh_leaves_the_strategy_out_with_a_note():
    assert "needs 8 devices" in left_out_here(OP.problem(**SHAPE, ep=8))
    for mesh in ([], ["--tp", "1"]):  # --tp defaults to 1
        result = CliRunner().invoke(cli, ["sweep", "--model", "qwen3-30b-a3b", "--tokens", "16", "--ep", "8", *mesh,
                                          "--direction", "fwd", "--dry-run"])
        assert result.exit_code == 0, result.output
        assert "xla_force_host_platform_device_count=8" in result.output and "left out" in result.output
        assert "ep strategy" not in result.output and "all_gather dispatch" in result.output


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    def make(part: int, parts: int) -> dict:
        scratch = tmp_path_factory.mktemp("sharding")
        return script_json(SCRIPT, str(scratch), profiles=scratch / "profiles")

    # once per test run (a sweep, then what the layer looks up after it: one piece, not split)
    return once_per_run(tmp_path_factory, "sharding_sweep_checks", make)


def test_every_kernel_of_the_sharded_layer_is_exact_after_its_sweep(checked):
    assert checked["sweep_exit"] == 0, checked["sweep_tail"]
    looked = checked["looked_up"]
    assert any(line.startswith("moe_sharding") for line in looked), looked  # ep_strategy=None asked the tables
    assert any(line.startswith("ragged_dot") and "'m': 32," in line for line in looked), looked  # all_to_all's
    # a forward-only sweep leaves the training step's fused-or-not choice (moe_fusion bwd) to its default
    forward = [line for line in looked if "'direction': 'bwd'" not in line]
    assert forward and all("(exact: tuned entry in" in line for line in forward), forward


def test_coverage_lists_the_sharded_layers_calls_and_collectives(checked):
    assert checked["coverage_exit"] == 0, checked["coverage"]
    kernels, collectives = checked["coverage"]["calls"], checked["coverage"]["collectives"]
    assert kernels and all(c["source"] == "exact" for c in kernels), kernels
    assert {"moe_sharding", "ragged_dot", "ragged_gather", "ragged_gather_reduce"} <= {c["op"] for c in kernels}
    assert {c["op"] for c in collectives} == {"collective"}
    assert any("ragged_all_to_all" in c["call"] for c in collectives)
    assert all(not c["to_tune"] and "bytes per device" in c["reason"] for c in collectives)
    assert checked["coverage"]["summary"].startswith(f"0 of {len(kernels)} kernel calls to tune")


def test_a_ray_task_of_one_device_is_never_given_the_strategys_sweep():
    """A Ray task holds one device: a --model campaign on Ray leaves the strategy's sweep out with a note (its
    kernels still run there), and `--op moe_sharding --ray` is refused in one line."""
    cases = models.sharded_runs(TINY, 8, ep=4, dtype="float32", direction="fwd")
    kept, notes = models.runnable_here(cases, 1)
    assert [c.op for c in cases if c not in kept] == ["moe_sharding"]
    assert len(notes) == 1 and "a Ray task holds 1" in notes[0]
    result = CliRunner().invoke(cli, ["sweep", "--op", "moe_sharding", "--tokens", "8", "--hidden", "16",
                                      "--intermediate", "8", "--experts", "8", "--top-k", "2", "--ep", "4",
                                      "--ray", "local", "--dry-run"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "needs 4 devices in one process, a Ray task holds 1" in result.output
