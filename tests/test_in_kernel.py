"""The MoE layer's `in_kernel` strategy: rows moved by remote DMA inside a Pallas TPU kernel (interpret mode on
the host devices of one subprocess, `in_kernel_checks.py`), forward and gradients against the float64 reference;
its refusals and the tuner's candidates in this process."""

from __future__ import annotations

from pathlib import Path

import pytest
from run_once import once_per_run, script_json

from moe_tune.core.errors import UsageError
from moe_tune.layer import sharded
from moe_tune.layer.sharding_choice import (
    MeshChoice,
    ShardingConfig,
    ShardingProblem,
    layer_config_error,
)

SCRIPT = Path(__file__).with_name("in_kernel_checks.py")
WITH_GRADS = ["ep4_f32", "ep4_skew", "ep4_skew_capacity", "ep8_f32_races", "ep4_chunks2_skew_capacity",
              "ep4_tp2_bf16", "ep4_skew_unfused"]
WITH_INPUT_GRADS = ["ep4_int8"]  # QArray weights: constants
FORWARD = ["ep2_tp2_f32", "ep4_skew_capacity_all_to_all", "ep4_bf16_tiles16"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    def make(part: int, parts: int) -> dict:
        return script_json(SCRIPT, profiles=tmp_path_factory.mktemp("profiles"))

    return once_per_run(tmp_path_factory, "in_kernel_checks", make)  # one subprocess per test run


@pytest.mark.parametrize("case", WITH_GRADS + WITH_INPUT_GRADS + FORWARD)
def test_matches_float64_reference(results, case):
    """Output (in x's dtype), the gradients in x, router logits and float weights, and the dropped count equal
    the dense float64 reference's within the dtype's tolerance."""
    got = results[case]
    assert "error" not in got, got.get("error")
    assert got["out"] <= got["tolerance"]
    assert got["dtype_out"] == ("bfloat16" if "bf16" in case else "float32")
    assert got["dropped"] == got["want_dropped"]
    names = {"dx", "dlogits"} | ({"dw_gate", "dw_up", "dw_down"} if case in WITH_GRADS else set())
    assert names <= set(got) if case not in FORWARD else not names & set(got)
    for name in names & set(got):
        assert got[name] <= got["tolerance"], name


@pytest.mark.parametrize("case", [c for c in WITH_GRADS + WITH_INPUT_GRADS + FORWARD
                                  if c not in ("ep4_skew_unfused", "ep4_skew_capacity_all_to_all")])
def test_fused_kernels_ran(results, case):
    """Every layer case ran the fused pair (the dispatch in the gate/up matmul, the return in the down
    projection's epilogue) once per token chunk and trace (the gradient's trace runs the forward again), and no
    `scatter_rows`."""
    kernels = results[case]["kernels"]
    chunks = 2 if "chunks2" in case else 1
    assert kernels["dispatch_gate_up"] == kernels["down_return"] >= chunks
    assert kernels["down_return"] % chunks == 0
    assert kernels["scatter_rows"] == 0


def test_unfused_path_ran_scatter_rows(results):
    """With the fused dispatch refused the layer runs scatter_rows twice (dispatch and return), no fused kernel,
    and still matches the reference (test_matches_float64_reference)."""
    kernels = results["ep4_skew_unfused"]["kernels"]
    assert kernels["dispatch_gate_up"] == kernels["down_return"] == 0
    assert kernels["scatter_rows"] >= 2 and kernels["scatter_rows"] % 2 == 0


def test_small_tiles_ran_with_them(results):
    """The small-tile case ran the fused kernels with 16-row tiles (two per device's receive buffer) and the
    return with two n tiles of 4 columns."""
    assert results["ep4_bf16_tiles16"]["tm"] == [16]
    assert results["ep4_bf16_tiles16"]["return_tn"] == [4]


def test_capacity_drops_what_all_to_all_drops(results):
    """capacity_factor drops entries (skewed routing overflows device 1) and the same count as all_to_all."""
    mine, theirs = results["ep4_skew_capacity"], results["ep4_skew_capacity_all_to_all"]
    assert mine["dropped"] > 0
    assert mine["dropped"] == theirs["dropped"] == mine["want_dropped"]
    assert mine["logged"] == theirs["logged"]


def test_no_token_rows_in_xla_collectives(results):
    """The forward's only XLA collectives are all-gathers of int32 metadata: no all-to-all, no float rows."""
    for case in ("ep4_f32", "ep2_tp2_f32"):
        got = results[case]
        assert got["collectives"]["all_to_all"] == 0 and got["collectives"]["reduce_scatter"] == 0
        assert got["row_collectives"] and set(got["row_collectives"]) == {"i32"}


def test_token_chunks_run_their_own_exchanges(results):
    """Two token chunks: each its own capacity (entries dropped) and its own int32 counts' all-gather, no
    all-to-all."""
    got = results["ep4_chunks2_skew_capacity"]
    assert got["dropped"] > 0
    assert got["collectives"]["all_to_all"] == 0 and got["collectives"]["all_gather"] >= 2


def test_race_detector_sees_no_race_and_sees_a_planted_one(results):
    """With the interpreter's race detector on, both kernels of the 8-device layer run race-free; rows of four
    devices DMAed into one place are reported (the detector is live)."""
    assert results["ep8_f32_races"]["race_states"] == 2
    assert results["ep8_f32_races"]["races"] is False
    assert results["colliding_scatter"]["races"] is True


def test_fused_refused(results):
    assert results["refusals"]["fused"].startswith("fused=True runs the experts with the dispatch gather")
    assert "in_kernel strategy" in results["refusals"]["fused"]


def test_refused_on_gpu():
    """On GPU in_kernel is one UsageError line, by name or as a ShardingConfig; on TPU and CPU it is accepted."""
    config = ShardingConfig(strategy="in_kernel")
    assert "runs on TPU" in layer_config_error(config, tokens=8, platform="gpu")
    assert layer_config_error(config, tokens=8, platform="tpu") is None
    assert layer_config_error(config, tokens=8, platform="cpu") is None
    shape = dict(tokens=8, hidden=8, intermediate=8, experts=16, top_k=2, ep=4, tp=1, dtype="float32",
                 tokens_replicated=False, platform="gpu")
    for given in ("in_kernel", config):
        with pytest.raises(UsageError, match="strategy 'in_kernel' moves rows by remote DMA") as error:
            sharded.resolve_strategy(given, **shape)
        assert "\n" not in str(error.value)


def test_tuner_offers_in_kernel_only_on_tpu(monkeypatch):
    """The CPU sweep never times interpret-mode kernels: moe_sharding's candidates hold in_kernel on TPU only."""
    from moe_tune.core import devices

    from moe_tune.kernels import get_op

    problem = ShardingProblem(tokens=16, hidden=8, intermediate=8, experts=16, top_k=2, ep=4)
    op, backend = get_op("moe_sharding"), MeshChoice()

    def bench_variants():  # the variants `moe-tune bench` would time (built, not run)
        return set(op.bench_plan(problem, backend, backend.default_config(problem), {}, distribution="balanced",
                                 seed=0).variants)

    assert "in_kernel" not in backend.candidate_values(problem)["strategy"]
    assert bench_variants() == {"all_gather", "all_to_all"}
    monkeypatch.setattr(devices, "platform", lambda: "tpu")
    assert "in_kernel" in backend.candidate_values(problem)["strategy"]
    assert bench_variants() == {"all_gather", "all_to_all", "in_kernel"}


def test_metadata_past_smem_is_one_line():
    """The dispatch's per-entry source rows live in SMEM: past its budget the kernel is refused in one line that
    names token chunks, before anything is traced."""
    import jax
    import jax.numpy as jnp

    from moe_tune.layer import in_kernel_tpu

    entries = in_kernel_tpu.SMEM_METADATA_BYTES // 4 + 1
    segments = tuple(jax.ShapeDtypeStruct((8,), jnp.int32) for _ in range(4))
    with pytest.raises(UsageError, match="token_chunks") as error:
        jax.eval_shape(lambda x, rows, *seg: in_kernel_tpu.scatter_rows(
            x, seg, jnp.int32(0), 8, src_row=rows, axis="expert", devices=2, collective_id=in_kernel_tpu.DISPATCH_ID),
            jax.ShapeDtypeStruct((16, 128), jnp.float32), jax.ShapeDtypeStruct((entries,), jnp.int32), *segments)
    assert "\n" not in str(error.value)



@pytest.mark.parametrize("tn", [8, 4])
def test_return_words_round_trip(tn):
    """The return's packed words (bfloat16 columns c and c + tn / 2 of each n tile in one uint32) unpack to the
    output rounded once to bfloat16, bit for bit; float32 travels as itself."""
    import jax.numpy as jnp
    import numpy as np

    from moe_tune.layer.in_kernel_return import pack_words, unpack_words

    out = jnp.asarray(np.random.default_rng(0).normal(size=(16, 8)) * 1e3, jnp.float32)
    words = jnp.concatenate([pack_words(out[:, j:j + tn], True) for j in range(0, 8, tn)], axis=1)
    assert words.dtype == jnp.uint32 and words.shape == (16, 4)
    back = unpack_words(words, jnp.bfloat16, tn, True)
    assert back.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(back.view(jnp.uint16)), np.asarray(out.astype(jnp.bfloat16).view(jnp.uint16)))
    np.testing.assert_array_equal(np.asarray(unpack_words(pack_words(out, False), jnp.float32, 8, False)), out)
