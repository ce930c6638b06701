"""The fused MoE Pallas kernels (`fused_moe` backends `pallas_tpu` and `triton`) in interpret mode against the
float64 references, at small shapes. Each inherits the backend base (tests/fused_moe_base.py: both kernels in
both directions, the glu epilogue, expert-parallel shards with NaN rows outside, bfloat16, int8 weights, the
zero-weight rules); beside it: a shard at group_offset 1 with an empty local group, float8 weights in blocks
along the transposed output, the lowering for the chip (one kernel call), the validity rules.

Routing is a real top-k routing (distinct experts per token): Triton's interpret mode emulates atomics with a
scatter that keeps one of several adds to one address inside a program (see kernels/fused_moe/triton.py).
The compilers' verdicts on the rules are tests/test_fused_moe_compile.py.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fused_moe_base import FusedMoeBackendTests
from ragged_dot_base.lowering import assert_one_kernel_call, export_for

from moe_tune.core.quant import dequantize_host, quantize
from moe_tune.kernels.fused_moe.pallas_tpu import FusedPallasTpuConfig, PallasTpuFusedMoe
from moe_tune.kernels.fused_moe.problem import FusedMoeProblem
from moe_tune.kernels.fused_moe.reference import gather_gmm_reference, gmm_combine_reference
from moe_tune.kernels.fused_moe.triton import FusedTritonConfig, TritonFusedMoe
from moe_tune.kernels.ragged_dot.metadata import select_shard

T, TOP_K, TOTAL = 16, 2, 4  # tokens, experts per token, experts
M = T * TOP_K
K, F = 256, 128  # hidden, expert width (glu weights: [g, K, 2F])
# (backend, small config, its native chip)
BACKENDS = {
    "pallas_tpu": (PallasTpuFusedMoe(), FusedPallasTpuConfig(tm=16, tk=128, tn=128, dmas_in_flight=4), "tpu"),
    "triton": (TritonFusedMoe(), FusedTritonConfig(block_m=16, block_k=32, block_n=32), "gpu"),
}
TOL = {"float32": 2e-5, "bfloat16": 2e-2}


class TestPallasTpuFused(FusedMoeBackendTests):
    """The base's cases (both kernels, both directions, glu, shards, bfloat16, int8 weights) in interpret mode."""

    backend = "pallas_tpu"
    max_configs = 1  # interpret mode compiles slowly; the search space's rules are test_rules' and the compilers'

    def invalid_configs(self, problem):
        return [FusedPallasTpuConfig(tm=12), FusedPallasTpuConfig(tm=32, tk=96), FusedPallasTpuConfig(tm=32, tn=256),
                FusedPallasTpuConfig(tm=32, tk=128, tn=128, dmas_in_flight=0)]


class TestTritonFused(FusedMoeBackendTests):
    backend = "triton"
    max_configs = 1
    dtypes = ()  # bfloat16 runs in test_float8_block_weights_transposed_bfloat16 (time budget)

    def invalid_configs(self, problem):
        return [FusedTritonConfig(block_m=48), FusedTritonConfig(block_m=16, block_k=256),
                FusedTritonConfig(block_m=16, num_warps=3), FusedTritonConfig(block_m=16, num_stages=0)]


def routing(seed: int, *, experts=range(TOTAL), dropped: int = 0):
    """rows int32 [M] (token of each expert-ordered row) and group sizes [TOTAL] of a top-k routing over
    `experts` (the others stay empty); the last `dropped` rows belong to no group."""
    rng = np.random.default_rng(seed)
    experts = np.asarray(list(experts))
    chosen = np.stack([rng.permutation(experts)[:TOP_K] for _ in range(T)]).reshape(-1)
    order = np.argsort(chosen, kind="stable")
    sizes = np.bincount(chosen, minlength=TOTAL).astype(np.int32)
    sizes[np.flatnonzero(sizes)[-1]] -= dropped
    return (order // TOP_K).astype(np.int32), sizes


def shard(sizes, offset, groups):
    """(normalized group sizes, offset) as the op hands them to a backend, and the local row range."""
    norm, off = select_shard(jnp.asarray(sizes), offset, m=M, groups=groups)
    ends = np.cumsum(np.asarray(norm))
    start = int(ends[offset - 1]) if offset else 0
    return norm, (None if offset == 0 and groups == TOTAL else off), start, int(ends[offset + groups - 1])


def close(out, ref, dtype):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    scale = max(1.0, float(np.nanmax(np.abs(ref))))
    np.testing.assert_allclose(out, ref, atol=TOL[dtype] * scale, rtol=TOL[dtype])


def rounded(x, dtype):
    """x in `dtype` (what the kernel gets) and its float64 value (what the reference gets)."""
    x = jnp.asarray(x, dtype)
    return x, np.asarray(x.astype(jnp.float32), np.float64)


@pytest.mark.parametrize("name", BACKENDS)
def test_gather_gmm_shard_glu_bfloat16(name):
    """Local groups 1..2 of 4, group 1 empty; rows outside the shard index past the tokens (never read);
    bfloat16 x with k = 2 x 128, which pallas_tpu gathers as uint32 pairs of its halves, over two k steps."""
    backend, config, _ = BACKENDS[name]
    rows, sizes = routing(0, experts=(0, 2, 3))
    norm, offset, start, end = shard(sizes, 1, 2)
    rows[:start], rows[end:] = T + 7, -3
    rng = np.random.default_rng(1)
    x, x64 = rounded(rng.standard_normal((T, K)), "bfloat16")
    w, w64 = rounded(rng.standard_normal((2, K, 2 * F)) / 16, "bfloat16")
    ref = gather_gmm_reference(x64, np.clip(rows, 0, T - 1), w64, sizes, group_offset=1, glu="silu")
    # pallas_tpu: a half of k per step, and (tk = k) both halves in one step
    configs = [config, dataclasses.replace(config, tk=K)] if name == "pallas_tpu" else [config]
    for cfg in configs:
        out = backend.gather_gmm(x, jnp.asarray(rows), w, norm, config=cfg, out_dtype=jnp.bfloat16,
                                 group_offset=offset, glu="silu")
        assert out.shape == (M, F) and out.dtype == jnp.bfloat16
        close(out, ref, "bfloat16")
        out = np.asarray(out, np.float32)
        assert np.all(out[:start] == 0) and np.all(out[end:] == 0)


@pytest.mark.parametrize("name", BACKENDS)
def test_gmm_combine_shard_nan_and_zero_weights_float32(name):
    """Local groups 1..2 of 4, group 2 empty: h rows outside the shard are NaN and never read; a local row of
    weight 0 whose h is NaN is dropped by skip_zero_weights (the base checks the 0 x NaN = NaN side)."""
    backend, config, _ = BACKENDS[name]
    rows, sizes = routing(4, experts=(0, 1, 3))
    norm, offset, start, end = shard(sizes, 1, 2)
    rng = np.random.default_rng(5)
    h = rng.standard_normal((M, F))
    h[:start] = h[end:] = np.nan
    h[start + 1] = np.nan
    weights = rng.random(M).astype(np.float32)
    weights[start + 1] = 0.0
    h, h64 = rounded(h, "float32")
    w, w64 = rounded(rng.standard_normal((2, F, K)) / 16, "float32")
    out = backend.gmm_combine(h, w, norm, jnp.asarray(rows), jnp.asarray(weights), tokens=T, config=config,
                              out_dtype=jnp.float32, group_offset=offset, skip_zero_weights=True)
    ref = gmm_combine_reference(h64, w64, sizes, rows, weights, tokens=T, group_offset=1, skip_zero_weights=True)
    assert out.shape == (T, K) and np.isfinite(ref).all()
    close(out, ref, "float32")


@pytest.mark.parametrize("name", BACKENDS)
def test_float8_block_weights_transposed_bfloat16(name):
    """float8_e4m3fn weights in 128-row blocks into the transposed combine (dispatch's backward, bfloat16,
    scale blocks along its output): the dequantized weights' result (the base runs int8 per channel)."""
    backend, config, _ = BACKENDS[name]
    rows, sizes = routing(8)
    norm, offset, _, _ = shard(sizes, 0, TOTAL)
    rng = np.random.default_rng(9)
    w = rng.standard_normal((TOTAL, K, 2 * F)) / 16
    q = quantize(jnp.asarray(w, jnp.float32), "float8_e4m3fn", axis=1, block_size=128)
    h, h64 = rounded(rng.standard_normal((M, 2 * F)), "bfloat16")
    weights = rng.random(M).astype(np.float32)
    out = backend.gmm_combine(h, q, norm, jnp.asarray(rows), jnp.asarray(weights), tokens=T, config=config,
                              out_dtype=jnp.bfloat16, group_offset=offset, transpose_rhs=True)
    ref = gmm_combine_reference(h64, dequantize_host(q), sizes, rows, weights, tokens=T, transpose_rhs=True)
    close(out, ref, "bfloat16")


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("kernel", ["gather_gmm", "gmm_combine"])
def test_lowers_to_one_kernel_call_for_its_chip(name, kernel, on_chip):
    backend, config, chip = BACKENDS[name]
    on_chip(chip)
    S = jax.ShapeDtypeStruct
    rows, sizes, offset = S((M,), jnp.int32), S((TOTAL,), jnp.int32), S((), jnp.int32)
    w = S((2, K, 2 * F), jnp.bfloat16)
    if kernel == "gather_gmm":
        fn = lambda x, r, w, g, o: backend.gather_gmm(x, r, w, g, config=config, out_dtype=jnp.bfloat16,
                                                      group_offset=o, glu="gelu")
        args = (S((T, K), jnp.bfloat16), rows, w, sizes, offset)
    else:
        fn = lambda h, r, w, g, o, wt: backend.gmm_combine(h, w, g, r, wt, tokens=T, config=config,
                                                           out_dtype=jnp.bfloat16, group_offset=o)
        args = (S((M, K), jnp.bfloat16), rows, w, sizes, offset, S((M,), jnp.float32))
    assert_one_kernel_call(export_for(chip, fn, *args), chip, f"{name} {kernel}")


def _problem(stage: str, direction: str, **kw) -> FusedMoeProblem:
    shape = dict(tokens=512, m=4096, k=2048, n=1536, groups=128, glu="silu") if stage == "dispatch" else \
        dict(tokens=512, m=4096, k=768, n=2048, groups=128)
    return FusedMoeProblem(**{**shape, "dtype": "bfloat16", "stage": stage, "direction": direction, **kw})


@pytest.mark.parametrize("name", BACKENDS)
def test_rules(name):
    """Defaults are valid and lead their search spaces, int8 / fp8 weights included (4-bit ones too on
    triton, refused on pallas_tpu); bad tiles are refused."""
    backend = BACKENDS[name][0]
    for stage in ("dispatch", "combine"):
        for direction in ("fwd", "bwd"):
            problem = _problem(stage, direction)
            space = backend.search_space(problem)
            assert space[0] == backend.default_config(problem) and len(space) > 10
            assert backend.config_error(space[0], problem) is None
            for qdtype, qblock in (("int8", None), ("float8_e4m3fn", 128)):
                quantized = _problem(stage, direction, rhs_qdtype=qdtype, rhs_qblock=qblock)
                assert backend.config_error(backend.default_config(quantized), quantized) is None
            four_bit = _problem(stage, direction, rhs_qdtype="int4", rhs_qblock=128)
            error = backend.config_error(backend.default_config(four_bit), four_bit)
            assert error is None if name == "triton" else "jax backend" in error
    dispatch = _problem("dispatch", "fwd")
    if name == "pallas_tpu":
        bad = {"tm": FusedPallasTpuConfig(tm=12), "tk": FusedPallasTpuConfig(tk=640),
               "tn": FusedPallasTpuConfig(tn=640), "VMEM": FusedPallasTpuConfig(tm=1024, tk=2048, tn=768)}
    else:
        bad = {"block_m": FusedTritonConfig(block_m=48), "block_n": FusedTritonConfig(block_n=256 + 256),
               "shared memory": FusedTritonConfig(block_m=128, block_k=128, block_n=128, num_stages=4)}
    for word, config in bad.items():
        assert word in (backend.config_error(config, dispatch) or ""), (word, config)
