"""The MoE layer across devices (`moe_mlp(expert_axis=, tensor_axis=)`, `sharded_moe_mlp`).

The multi-device checks run in a subprocess on 8 host devices (`sharded_layer_checks.py`: XLA's device
count is fixed when JAX starts) against a float64 NumPy dense reference; the tests here assert on its JSON
(once per test run, xdist's workers splitting the cases: tests/run_once.py). The argument checks run in this
process.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from run_once import once_per_run, script_json

import moe_tune
from moe_tune.core.errors import UsageError
from moe_tune.layer import exchange, sharded
from moe_tune.layer.sharding_choice import ShardingConfig

SCRIPT = Path(__file__).with_name("sharded_layer_checks.py")
TOKENS_PER_DEVICE, TOP_K, EXPERTS = 4, 2, 16  # as the script's cases
WITH_GRADS = ["ep8_all_gather_f32", "ep8_all_to_all_f32", "ep8_all_to_all_ragged_f32", "ep4_tp2_all_gather_f32",
              "ep4_tp2_all_to_all_ragged_capacity", "replicated_ep4_tp2_f32",
              "ep8_all_gather_bf16", "ep4_tp2_all_to_all_bf16", "skew_all_gather_capacity",
              "skew_all_to_all_capacity", "ep8_all_to_all_int8_qat", "skew_top3_all_to_all",
              "ep8_default_backends", "ep4_tp2_default_fused", "ep4_tp2_all_to_all_default_capacity",
              "ep8_all_gather_chunks2", "ep8_all_to_all_chunks4_fixed", "skew_all_gather_chunks2_capacity",
              "skew_all_to_all_chunks4_capacity", "ep4_tp2_all_to_all_ragged_chunks2_capacity"]
WITH_INPUT_GRADS = ["ep4_tp2_all_gather_int8", "ep8_all_to_all_int8"]  # QArray weights: constants
FORWARD = ["ep8_all_gather_fused_f32", "replicated_ep8_all_to_all_f32", "skew_all_gather", "skew_all_to_all",
           "skew_replicated_capacity"]
REFUSED = ["all_to_all_fused_refused"]
CASES = WITH_GRADS + WITH_INPUT_GRADS + FORWARD


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    def make(part: int, parts: int) -> dict:
        return script_json(SCRIPT, "--part", f"{part}/{parts}", profiles=tmp_path_factory.mktemp("profiles"))

    # once per test run, its cases split between the xdist workers (each worker otherwise runs them all)
    return once_per_run(tmp_path_factory, "sharded_layer_checks", make, split=True)


def test_every_case_ran(results):
    """The script ran exactly the cases asserted on here."""
    assert sorted(results) == sorted(CASES + REFUSED + ["refusals"])


def test_sharded_moe_mlp_refuses_what_does_not_split(results):
    """Tokens, experts or the intermediate dimension that do not divide over their mesh axis, and QArray
    scale blocks that would not fall whole on each device, are one-line UsageErrors naming the numbers."""
    assert results["refusals"] == {
        "tokens": "x's 20 tokens do not split over the 8 devices of expert_axis 'expert'",
        "experts": "the 16 experts do not split over the 3 devices of expert_axis 'expert'",
        "intermediate": "the intermediate dimension 8 does not split over the 3 devices of tensor_axis 'tensor'",
        "scale_blocks": "w_down: its 2 scale blocks along axis 1 do not split over the 4 devices of mesh axis "
                        "'tensor'"}


@pytest.mark.parametrize("case", CASES)
def test_matches_float64_reference(results, case):
    """Output (in x's dtype), gradients and dropped count equal the dense float64 reference's within the
    dtype's tolerance."""
    got = results[case]
    assert "error" not in got, got.get("error")
    tolerance = got["tolerance"]
    assert got["out"] <= tolerance
    assert got["dtype_out"] == ("bfloat16" if "bf16" in case else "float32")
    assert got["logged"] == ([] if "capacity" not in case else [
        f"moe_mlp capacity_factor {factor} ({cap} entries {per}): {got['dropped']} of {entries} (token, k) "
        "entries dropped" for factor, cap, entries, per in [_capacity_of(case)]])
    assert got["dropped"] == got["want_dropped"]
    grads = {"WITH_GRADS": ["dx", "dlogits", "dw_gate", "dw_up", "dw_down"], "WITH_INPUT_GRADS": ["dx", "dlogits"],
             "FORWARD": []}
    expected = grads["WITH_GRADS" if case in WITH_GRADS else "WITH_INPUT_GRADS" if case in WITH_INPUT_GRADS
                     else "FORWARD"]
    assert sorted(name for name in got if name.startswith("d") and name not in ("dropped", "dtype_out")) == sorted(
        expected)
    for name in expected:
        assert got[name] <= tolerance, (name, got[name])


def _chunks_of(case: str) -> int:
    """The token chunks of a case of the script (named `chunksC`; 1 otherwise)."""
    return int(case.split("chunks")[1][0]) if "chunks" in case else 1


def _capacity_of(case: str) -> tuple[float, int, int, str]:
    """(capacity_factor, entries per device and token chunk, entries in all, how the log line says per what) of
    a capacity case of the script."""
    factor = 0.5 if "replicated" in case else 1.3 if "chunks" in case else 1.5
    devices = 1 if "replicated" in case else 4 if "ep4" in case else 8
    chunks = _chunks_of(case)
    per = "per device" if chunks == 1 else f"per device in each of {chunks} token chunks"
    return (factor, math.ceil(factor * (TOKENS_PER_DEVICE // chunks) * TOP_K), devices * TOKENS_PER_DEVICE * TOP_K,
            per)


def test_worst_case_buffer_is_filled(results):
    """top_k 3 over 2 experts per device, every token's experts 0-2: device 0 receives 2 entries of every
    token of the 8 devices, exactly the receive buffer's exchange.worst_rows(4, 3, 8, 2) = 64 rows; the
    layer still equals the reference (one row fewer would lose an entry)."""
    assert exchange.worst_rows(TOKENS_PER_DEVICE, 3, 8, 2) == 8 * TOKENS_PER_DEVICE * 2
    assert results["skew_top3_all_to_all"]["dropped"] == 0


def test_all_to_all_refuses_fused(results):
    """fused=True with all_to_all (the combine runs on another device than the experts) is one UsageError."""
    assert results["all_to_all_fused_refused"]["error"].startswith("UsageError: fused=True")


def test_skewed_routing_drops_exactly_past_capacity(results):
    """Every token routed to device 0's experts: without a capacity nothing is dropped; with capacity_factor
    1.5 device 0 keeps ceil(1.5 x 4 x 2) = 12 of the 8 x 4 x 2 entries, under both strategies; replicated
    tokens (4 in all) with 0.5 keep ceil(0.5 x 4 x 2) = 4 of 8."""
    for case in ("skew_all_gather", "skew_all_to_all"):
        assert results[case]["dropped"] == 0
    entries = 8 * TOKENS_PER_DEVICE * TOP_K
    for case in ("skew_all_gather_capacity", "skew_all_to_all_capacity"):
        assert results[case]["dropped"] == entries - math.ceil(1.5 * TOKENS_PER_DEVICE * TOP_K) == 52
    assert results["skew_replicated_capacity"]["dropped"] == TOKENS_PER_DEVICE * TOP_K - math.ceil(
        0.5 * TOKENS_PER_DEVICE * TOP_K)
    assert results["ep4_tp2_all_to_all_ragged_capacity"]["dropped"] > 0


def test_token_chunks_cap_each_chunk_on_its_own(results):
    """Every token routed to device 0's experts, capacity_factor 1.3: each chunk of 4 / C tokens per device
    keeps ceil(1.3 x 4 / C x 2) of the 8 x 4 / C x 2 entries bound for device 0, the dropped counts summed
    over the chunks (52 with 2 and with 4 chunks; one cap over the 4 tokens would drop 64 - 11 = 53)."""
    entries = 8 * TOKENS_PER_DEVICE * TOP_K
    for case, chunks in (("skew_all_gather_chunks2_capacity", 2), ("skew_all_to_all_chunks4_capacity", 4)):
        part = TOKENS_PER_DEVICE // chunks
        assert results[case]["dropped"] == chunks * (8 * part * TOP_K - math.ceil(1.3 * part * TOP_K)) == 52
    assert entries - math.ceil(1.3 * TOKENS_PER_DEVICE * TOP_K) == 53


@pytest.mark.parametrize("chunked,whole", [("ep8_all_gather_chunks2", "ep8_all_gather_f32"),
                                           ("ep8_all_to_all_chunks4_fixed", "ep8_all_to_all_f32")])
def test_each_token_chunk_runs_its_own_collectives(results, chunked, whole):
    """The forward with C token chunks lowers C times the collectives of the layer in one piece: each chunk
    its own gather or exchange (what lets XLA overlap one chunk's collectives with another's matmuls)."""
    one, many = results[whole]["collectives"], results[chunked]["collectives"]
    assert any(one.values()) and many == {op: _chunks_of(chunked) * count for op, count in one.items()}


@pytest.mark.parametrize("tokens,top_k,devices,local", [(4, 2, 8, 2), (4, 2, 8, 1), (16, 8, 4, 32), (3, 4, 2, 3)])
def test_worst_case_rows_is_maxtext_bound(tokens, top_k, devices, local):
    """The receive buffer without a capacity holds local tokens x min(EP, E / top_k) x top_k rows."""
    experts = devices * local
    assert exchange.worst_rows(tokens, top_k, devices, local) == round(tokens * min(devices, experts / top_k) * top_k)


def test_default_strategy():
    """None: where nothing is exchanged (replicated tokens, one device on the axis) all_to_all over the
    ragged exchange where ragged_all_to_all exists (TPU, GPU) and all_gather on CPU, tokens in one piece; with
    tokens split over the axis one of the strategies (the tables' measured choice or the default); a named
    one stays, with the platform's exchange; another name is refused; a ShardingConfig is taken as given
    where the layer can run it."""
    shape = dict(tokens=8, hidden=8, intermediate=8, experts=16, top_k=2, ep=8, tp=1, dtype=jnp.float32)
    for platform, default, kind in (("cpu", "all_gather", "fixed"), ("tpu", "all_to_all", "ragged"),
                                    ("gpu", "all_to_all", "ragged")):
        assert sharded.resolve_strategy(None, platform=platform, tokens_replicated=True, **shape) == ShardingConfig(
            strategy=default, token_chunks=1, exchange=kind)
        given = sharded.resolve_strategy("all_gather", platform=platform, tokens_replicated=False, **shape)
        assert given == ShardingConfig(strategy="all_gather", token_chunks=1, exchange=kind)
    assert sharded.resolve_strategy(None, platform="cpu", tokens_replicated=False, **shape).strategy in (
        sharded.STRATEGIES)
    for strategy in sharded.STRATEGIES:
        assert sharded.resolve_strategy(strategy, platform="cpu", tokens_replicated=False, **shape).strategy == strategy
    with pytest.raises(UsageError, match="ep_strategy"):
        sharded.resolve_strategy("ring", platform="cpu", tokens_replicated=False, **shape)
    # a whole config: as given where the layer runs it (the ragged exchange where the platform has one)
    chunked = ShardingConfig(strategy="all_to_all", token_chunks=4, exchange="ragged")
    assert sharded.resolve_strategy(chunked, platform="gpu", tokens_replicated=False, **shape) == chunked
    with pytest.raises(UsageError, match="needs jax.lax.ragged_all_to_all"):
        sharded.resolve_strategy(chunked, platform="cpu", tokens_replicated=False, **shape)


def _operands(experts=4, local=4, tokens=4, hidden=8, intermediate=8):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(tokens, hidden)), jnp.float32)
    logits = jnp.asarray(rng.normal(size=(tokens, experts)), jnp.float32)
    w_gate = jnp.asarray(rng.normal(size=(local, hidden, intermediate)), jnp.float32)
    w_down = jnp.asarray(rng.normal(size=(local, intermediate, hidden)), jnp.float32)
    return x, logits, w_gate, w_gate, w_down


def _in_shard_map(**options):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("expert",))
    body = lambda *a: moe_tune.moe_mlp(*a, 2, **options)  # noqa: E731
    return jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P())(*_operands())


@pytest.mark.parametrize("options,message", [
    (dict(expert_axis="expert", expert_offset=0), "expert_offset is not taken"),
    (dict(capacity_factor=1.0), "need an expert_axis"),
    (dict(ep_strategy="all_gather"), "need an expert_axis"),
    (dict(tokens_replicated=True), "need an expert_axis"),
    (dict(expert_axis="expert"), "not a mesh axis bound here"),
])
def test_usage_errors_outside_shard_map(options, message):
    """Sharded arguments without an expert axis, or an axis no shard_map binds, are one-line UsageErrors."""
    with pytest.raises(UsageError, match=message):
        moe_tune.moe_mlp(*_operands(), 2, **options)


@pytest.mark.parametrize("options,message", [
    (dict(expert_axis="expert", ep_strategy="ring"), "ep_strategy must be one of"),
    (dict(expert_axis="expert", capacity_factor=-1.0), "capacity_factor must be a positive"),
    (dict(expert_axis="expert", tensor_axis="expert"), "must be different mesh axes"),
    (dict(expert_axis="expert", tensor_axis="model"), "tensor_axis 'model' is not a mesh axis"),
    (dict(expert_axis="expert", ep_strategy=2), "ep_strategy must be one of"),
    (dict(expert_axis="expert", ep_strategy=ShardingConfig(token_chunks=3)),
     "token_chunks 3 does not divide the 4 tokens of one device"),
    (dict(expert_axis="expert", ep_strategy=ShardingConfig(token_chunks=0)), "token_chunks must be a positive"),
    (dict(expert_axis="expert", ep_strategy=ShardingConfig(strategy="all_to_all", exchange="ragged")),
     "exchange 'ragged' needs jax.lax.ragged_all_to_all"),
])
def test_usage_errors_inside_shard_map(options, message):
    with pytest.raises(UsageError, match=message):
        _in_shard_map(**options)


def test_sharded_moe_mlp_argument_errors():
    """A mesh axis the mesh lacks, experts or tokens that do not split, expert_offset: one line each."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("expert",))
    operands = _operands()
    with pytest.raises(UsageError, match="not an axis of the mesh"):
        moe_tune.sharded_moe_mlp(*operands, 2, mesh=mesh, expert_axis="experts")
    with pytest.raises(UsageError, match="expert_offset"):
        moe_tune.sharded_moe_mlp(*operands, 2, mesh=mesh, expert_offset=0)
    with pytest.raises(UsageError, match="jax.sharding.Mesh"):
        moe_tune.sharded_moe_mlp(*operands, 2, mesh="expert")
