"""The triton fused_moe backend reads gate and up as two arrays (`split_weights`, kernels/fused_moe/triton.py):
the gradients through the op's custom VJPs on a shard against float64 (the forward without glu keeps [m, 2f],
its backward's dx contracts over both parts), the combine kernel given parts (column blocks in either part,
and parts no block fits, which it concatenates), the rule that a block never straddles gate and up, and the
program lowered for a GPU holding no concatenated copy of the weights. The base's
test_weight_parts_stand_for_their_concatenation runs each kernel direction on parts (int8 / float8 too)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from fused_moe_base import assert_lowered_without_concatenated_weights, assert_parts_vjp_matches_float64
from test_fused_moe_pallas import TOTAL, F, K, M, T, routing, shard

from moe_tune.kernels.fused_moe.problem import FusedMoeProblem
from moe_tune.kernels.fused_moe.reference import gmm_combine_reference
from moe_tune.kernels.fused_moe.triton import FusedTritonConfig, TritonFusedMoe

CONFIG = FusedTritonConfig(block_m=16, block_k=32, block_n=32)
LOCAL = 2  # local groups 1..2 of TOTAL


def _shard_inputs(seed: int):
    rows, sizes = routing(seed, experts=(0, 1, 2))  # group 3 (local) empty
    norm, offset, start, end = shard(sizes, 1, LOCAL)
    rows[:start], rows[end:] = T + 7, -3  # never read
    rng = np.random.default_rng(seed + 1)
    x = rng.standard_normal((T, K)).astype(np.float32)
    gate, up = (rng.standard_normal((LOCAL, K, F)).astype(np.float32) / 16 for _ in range(2))
    cot = rng.standard_normal((M, F)).astype(np.float32)
    return rows, sizes, x, gate, up, cot


def test_gradients_through_the_custom_vjp_on_parts_match_float64():
    """d/d(x, gate, up) of sum(cot * gather_gmm(x, rows, (gate, up), glu=silu)) on a shard (group_offset 1):
    the forward runs the dispatch without glu on the two parts (column blocks in each), the backward's dx
    the combine over [gate | up]^T (the contraction over both parts), the weights' gradient per part."""
    assert_parts_vjp_matches_float64("triton", CONFIG, *_shard_inputs(11), local=LOCAL)


@pytest.mark.parametrize("widths", [(96, 160), (80, 176)])
def test_combine_on_parts(widths):
    """h @ [a | b] combined into the tokens: column blocks of 32 in either of two unequal parts (a branch per
    part); parts of 80 / 176 columns no block of 32 fits are concatenated by the backend (still correct)."""
    rows, sizes = routing(13)
    rng = np.random.default_rng(14)
    h = rng.standard_normal((M, F)).astype(np.float32)
    weights = rng.random(M).astype(np.float32)
    w = (rng.standard_normal((TOTAL, F, sum(widths))) / 16).astype(np.float32)
    parts = (jnp.asarray(w[:, :, :widths[0]]), jnp.asarray(w[:, :, widths[0]:]))
    out = TritonFusedMoe().gmm_combine(jnp.asarray(h), parts, jnp.asarray(sizes), jnp.asarray(rows),
                                       jnp.asarray(weights), tokens=T, config=CONFIG, out_dtype=jnp.float32)
    ref = gmm_combine_reference(h, w, sizes, rows, weights, tokens=T)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=2e-5 * np.abs(ref).max(), rtol=2e-5)


def test_a_block_never_straddles_gate_and_up():
    """The dispatch's n = 160 is gate | up of 80 each: a block of 32 divides 160 but not 80, so it is refused
    for the output columns of the forward without glu and for the backward's contraction; the defaults fit."""
    backend = TritonFusedMoe()
    for direction, field in (("fwd", "block_n"), ("bwd", "block_k")):
        problem = FusedMoeProblem(tokens=16, m=32, k=128, n=160, groups=4, dtype="float32", stage="dispatch",
                                  direction=direction)
        bad = FusedTritonConfig(block_m=16, **{field: 32})
        assert f"{field}=32 must divide" in backend.config_error(bad, problem) and "gate and up" in \
            backend.config_error(bad, problem)
        assert backend.config_error(backend.default_config(problem), problem) is None
    glu = FusedMoeProblem(tokens=16, m=32, k=128, n=160, groups=4, dtype="float32", stage="dispatch", glu="silu")
    assert backend.config_error(FusedTritonConfig(block_m=16, block_n=16), glu) is None


def test_the_gpu_program_holds_no_concatenated_weights(on_chip):
    """Forward and backward of the dispatch on (gate, up), lowered for a GPU (the Triton kernels, not interpret
    mode): no [groups, k, 2f] concatenate, and the parts go to the kernels as they are."""
    on_chip("gpu")
    assert_lowered_without_concatenated_weights("gpu", "triton", CONFIG, "__gpu$xla.gpu.triton", f=F, local=LOCAL, tokens=T,
                                                m=M, total=TOTAL, k=K)
