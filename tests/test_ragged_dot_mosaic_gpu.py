"""The `mosaic_gpu` ragged_dot backend: its kernels run in Mosaic GPU's interpreter on this CPU against the
float64 references (fwd and dlhs; the interpreter cannot run the tgmm kernel, so drhs falls back there:
`mosaic_gpu.chip_error`), its rules per chip, and `moe_mlp` on it. The sm_100 drhs kernel
(`mosaic_gpu_tgmm_sm100`) cannot run here at all (the interpreter has no TMEM): the rows it is given are
checked with the kernel replaced by a plain-JAX statement of what it computes. The real compilers for H100 and
B200 are in tests/test_real_compilers_mosaic_gpu.py.

The shared backend tests (`TestMosaicGpu`, ~100 tests) run only with MOE_TUNE_MOSAIC_GPU_SUITE=1: the
interpreter simulates the Hopper kernel's 132 SMs, 1-3 s a call on an idle 2-core machine (and XLA:CPU compiles
each new shape), far past this file's share of `make test`; the cases below are the ones that matter most."""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ragged_dot_base import RaggedDotBackendTests
from ragged_dot_base.helpers import DIRECTIONS, GRAD_TOLERANCE, assert_matches_reference, make_operands
from test_moe import TOP_K, dense_moe_float64, relative

import moe_tune
from moe_tune.core import devices
from moe_tune.core.errors import UsageError
from moe_tune.kernels.ragged_dot import RaggedDotProblem, mosaic_gpu_tgmm_sm100
from moe_tune.kernels.ragged_dot.mosaic_gpu import MosaicGpuConfig, MosaicGpuRaggedDot
from moe_tune.targets import get_target
from moe_tune.targets.compile import acting_as

MOSAIC_GPU_CALL = "mosaic_gpu_v2"  # the custom call a compiled Mosaic GPU kernel lowers to


@pytest.mark.skipif(os.environ.get("MOE_TUNE_MOSAIC_GPU_SUITE") != "1",
                    reason="the interpreted suite takes many minutes: MOE_TUNE_MOSAIC_GPU_SUITE=1 runs it")
class TestMosaicGpu(RaggedDotBackendTests):
    backend = "mosaic_gpu"
    # float32 operands and mixed dtypes go to the fallback (tensor cores take float32 as tf32; the kernels write
    # their operands' dtype): the parametrized tests run the two 16-bit dtypes the kernels take
    dtypes = ("bfloat16", "float16")
    kernel_calls = {"gpu": MOSAIC_GPU_CALL}
    # The interpreter simulates the Hopper gmm's 132 SMs (1-3 s a call at these shapes): few configs and draws.
    sampled_configs = 0
    fixed_case_extras = 0
    max_examples = 3

    @pytest.fixture
    def on_chip(self, monkeypatch):
        """As conftest's, and on `gpu` an H100's device kind: the backend picks its kernel by the GPU's compute
        capability (an unknown GPU has none)."""
        def patch(platform: str) -> None:
            monkeypatch.setattr(devices, "platform", lambda: platform)
            if platform == "gpu":
                monkeypatch.setattr(devices, "device_kind", lambda: get_target("h100").device_kind)
        return patch

    def invalid_configs(self, problem):
        return [{"block_m": 96}, {"block_n": 32}, {"max_concurrent_steps": 1}, {"collective": True},
                {"block_n": 256, "block_k": 256, "max_concurrent_steps": 8}]

    def operands(self, dtype: str = "bfloat16"):
        """The bad-input tests' operands, bfloat16 (float32 ones go to the fallback, which ignores the config)."""
        return super().operands(dtype)

    @pytest.mark.parametrize("direction", DIRECTIONS)
    def test_lowers_for_its_chip_with_mixed_dtypes(self, on_chip, direction):
        pytest.skip("mixed dtypes run on the fallback: the Mosaic GPU kernels take one 16-bit dtype")

    @pytest.mark.parametrize("direction", DIRECTIONS)
    def test_default_config_is_valid_for_model_sized_quantized_problems(self, direction):
        pytest.skip("quantized problems run on the fallback (chip_error: the kernels apply no scales)")

    def test_per_direction_configs_are_the_ones_that_run(self, caplog):
        pytest.skip("the base traces float32 operands, which go to the fallback (tf32 tensor cores); and drhs "
                    "falls back off a GPU")


PROBLEM = RaggedDotProblem(2048, 2048, 768, 16, "bfloat16", "bfloat16", "bfloat16")


@pytest.mark.parametrize("chip", ["h100", "b200"])
def test_every_candidate_fits_the_chips_shared_memory(chip):
    """The space's configs, counted as Mosaic GPU counts shared memory, fit the chip's 227 KiB; the Blackwell
    gmm space is all 2-CTA (`collective`), the Hopper one and Blackwell's drhs (one CTA per tile) have none."""
    impl = MosaicGpuRaggedDot()
    with acting_as(get_target(chip)):
        for direction in DIRECTIONS:
            problem = PROBLEM.with_direction(direction)
            space = impl.search_space(problem)
            assert len(space) > 20
            assert all(impl.shared_memory_bytes(c, problem) <= 227 * 1024 for c in space)
            pairs = chip == "b200" and direction != "drhs"
            assert {c.collective for c in space} == {pairs}


def test_float32_mixed_and_quantized_problems_are_refused_with_the_reason():
    impl = MosaicGpuRaggedDot()
    f32 = RaggedDotProblem(64, 64, 64, 2, "float32", "float32", "float32")
    mixed = RaggedDotProblem(64, 64, 64, 2, "bfloat16", "bfloat16", "float32")
    quant = RaggedDotProblem(64, 128, 64, 2, "bfloat16", "float32", "bfloat16", rhs_qdtype="float8_e4m3fn",
                             rhs_qblock=128)
    assert "tf32" in impl.chip_error(f32)
    assert "write their operands' dtype" in impl.chip_error(mixed)
    assert "quantized operands are not supported" in impl.chip_error(quant)


def test_the_chips_kernel_and_their_refusals():
    impl = MosaicGpuRaggedDot()
    drhs = PROBLEM.with_direction("drhs")
    with acting_as(get_target("b200")):
        assert impl.chip_error(drhs) is None  # this project's tcgen05 kernel
        assert impl.config_error(impl.default_config(drhs), drhs) is None
        assert "no 2-CTA pairs" in impl.config_error(MosaicGpuConfig(collective=True), drhs)
        assert "tcgen05 M is 128" in impl.config_error(MosaicGpuConfig(block_m=64), drhs)
        over = MosaicGpuConfig(block_n=128, block_k=128, max_concurrent_steps=4)  # the compiler refuses it too
        assert "bytes of shared memory" in impl.config_error(over, drhs)
        assert "2-CTA" in impl.config_error(MosaicGpuConfig(), PROBLEM)
    with acting_as(get_target("h100")):
        assert impl.chip_error(drhs) is None
        assert "Blackwell's" in impl.config_error(MosaicGpuConfig(collective=True), PROBLEM)
    with acting_as(get_target("a100")):
        assert "sm_90" in impl.chip_error(PROBLEM)


@pytest.mark.parametrize("m,sizes,shard", [(37, [3, 20, 1, 13], None), (40, [6, 9, 0, 12, 10], (3, 2)),
                                            (29, [29], None)], ids=["uneven", "shard_with_rows_past_the_sum",
                                                                    "one_group"])
def test_forward_in_the_interpreter(m, sizes, shard):
    """The Hopper gmm in Mosaic GPU's interpreter through the public op: uneven groups with an empty one, an
    expert-parallel shard (rows rolled to row 0 and back) whose rows past the local groups must be zero, and
    a single group."""
    groups = len(sizes) if shard is None else shard[1]
    lhs, rhs = make_operands(m, 24, 40, groups, "bfloat16", 0)
    offset = None if shard is None else jnp.int32(shard[0])
    out = moe_tune.ragged_dot(lhs, rhs, jnp.asarray(sizes, jnp.int32), group_offset=offset, backend="mosaic_gpu",
                              config=MosaicGpuConfig(block_m=64, block_n=64, block_k=64, max_concurrent_steps=2))
    assert_matches_reference(out, lhs, rhs, sizes, offset=None if shard is None else shard[0], out_dtype="bfloat16")


def test_dlhs_in_the_interpreter():
    """dlhs = dout @ rhs^T per group (rhs transposed by XLA in the interpreter), against float64."""
    sizes = [10, 0, 17, 9]
    dout, rhs = make_operands(40, 40, 24, 4, "bfloat16", 1)  # dout [m, n]; rhs^T [g, n, k] read as [g, k, n]
    impl = MosaicGpuRaggedDot()
    problem = RaggedDotProblem(40, 24, 40, 4, "bfloat16", "bfloat16", "bfloat16", direction="dlhs")
    weights = jnp.swapaxes(rhs, 1, 2)  # the forward's rhs [g, k=24, n=40]
    out = impl.run(problem, impl.default_config(problem), dout, weights, jnp.asarray(sizes, jnp.int32))
    assert_matches_reference(out, dout, rhs, sizes, offset=None, out_dtype="bfloat16")


@pytest.fixture
def layer():
    rng = np.random.default_rng(0)
    tokens, hidden, inner, experts = 8, 16, 16, 2
    f32 = lambda *shape, scale=1.0: jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)
    return (f32(tokens, hidden), f32(tokens, experts), f32(experts, hidden, inner, scale=hidden ** -0.5),
            f32(experts, hidden, inner, scale=hidden ** -0.5), f32(experts, inner, hidden, scale=inner ** -0.5))


def test_moe_mlp_runs_its_ragged_dots_on_the_backend_a_use_backend_block_names(layer, caplog):
    """`moe_mlp` passes no backend to its three ragged dots: inside `use_backend` they run on mosaic_gpu (here
    in Mosaic GPU's interpreter), and the layer still equals the float64 dense one. Unfused: the fused layer
    runs the `fused_moe` op's kernels, which have no mosaic_gpu backend."""
    caplog.set_level(logging.INFO, logger="moe_tune")
    with moe_tune.use_backend("ragged_dot", "mosaic_gpu"):
        out = jax.jit(lambda *a: moe_tune.moe_mlp(*a, TOP_K, fused=False))(*layer)
    calls = [m for m in caplog.messages if m.startswith("ragged_dot ")]
    assert len(calls) == 3 and all("backend mosaic_gpu," in m for m in calls), calls
    assert relative(out, dense_moe_float64(*layer)) < 3e-2
    with pytest.raises(UsageError, match="unknown backend"), moe_tune.use_backend("ragged_dot", "nope"):
        pass


def _tgmm_sm100_as_plain_jax(lhs, dout, block_starts, *, groups, block_m, block_n, block_k, steps,
                             epilogue_tile_n):
    """What `mosaic_gpu_tgmm_sm100._kernel` computes, in plain JAX: each row block's lhs^T @ dout (float32)
    summed into the group whose blocks [block_starts[i], block_starts[i + 1]) hold it."""
    blocks = lhs.shape[0] // block_k
    owner = jnp.searchsorted(block_starts[1:], jnp.arange(blocks), side="right")
    tiles = jnp.einsum("bik,bin->bkn", lhs.reshape(blocks, block_k, -1).astype(jnp.float32),
                       dout.reshape(blocks, block_k, -1).astype(jnp.float32))
    return jax.ops.segment_sum(tiles, owner, num_segments=groups + 1)[:groups].astype(lhs.dtype)


@pytest.mark.parametrize("m,sizes,shard", [(150, [3, 70, 0, 66], None), (160, [6, 65, 0, 12, 10], (1, 3))],
                         ids=["uneven", "shard_with_rows_past_the_sum"])
def test_blackwell_drhs_rows_group_by_group(monkeypatch, m, sizes, shard):
    """sm_100 drhs through the backend (acting as a B200), with the Pallas kernel replaced by the plain-JAX
    statement of what it computes: the rows gathered group by group (`_padded_rows`), an expert-parallel
    shard's local groups only, rows past sum(group_sizes) ignored, an empty group zero, k and n padded and
    sliced back. Against float64. The kernel itself only compiles here (the interpreter has no TMEM)."""
    monkeypatch.setattr(mosaic_gpu_tgmm_sm100, "_kernel", _tgmm_sm100_as_plain_jax)
    offset, groups = (0, len(sizes)) if shard is None else shard
    rng = np.random.default_rng(3)
    lhs = jnp.asarray(rng.standard_normal((m, 72)), jnp.bfloat16)
    dout = jnp.asarray(rng.standard_normal((m, 40)), jnp.bfloat16)
    impl = MosaicGpuRaggedDot()
    problem = RaggedDotProblem(m, 72, 40, groups, "bfloat16", "bfloat16", "bfloat16", direction="drhs")
    with acting_as(get_target("b200")):
        config = impl.default_config(problem)
        out = impl.tgmm(lhs, dout, jnp.asarray(sizes, jnp.int32), config=config, out_dtype=jnp.bfloat16,
                        num_groups=groups, group_offset=None if shard is None else jnp.int32(offset))
    ends = np.minimum(np.cumsum(sizes), m)
    starts = np.concatenate([[0], ends[:-1]])
    a, b = (np.asarray(x.astype(jnp.float32), np.float64) for x in (lhs, dout))
    ref = np.stack([a[starts[g]:ends[g]].T @ b[starts[g]:ends[g]] for g in range(offset, offset + groups)])
    got = np.asarray(out.astype(jnp.float32), np.float64)
    assert out.shape == (groups, 72, 40) and out.dtype == jnp.bfloat16
    assert np.all(got[[i for i in range(groups) if sizes[offset + i] == 0]] == 0)
    assert np.abs(got - ref).max() <= GRAD_TOLERANCE["bfloat16"] * np.abs(ref).max()


def test_blackwell_drhs_exports_for_cuda():
    """sm_100 drhs of an expert-parallel shard lowers through `jax.export` for cuda to one Mosaic GPU call (the
    tcgen05 kernel; the compile tests run it through the B200 compiler)."""
    impl = MosaicGpuRaggedDot()
    problem = RaggedDotProblem(512, 256, 192, 4, "bfloat16", "bfloat16", "bfloat16", direction="drhs")
    spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
    with acting_as(get_target("b200")):
        config = impl.default_config(problem)
        run = lambda lhs, dout, sizes, offset: impl.tgmm(lhs, dout, sizes, config=config, out_dtype=jnp.bfloat16,
                                                         num_groups=4, group_offset=offset)
        exported = jax.export.export(jax.jit(run), platforms=["cuda"])(
            spec(512, 256), spec(512, 192), spec(8, dtype=jnp.int32), spec(dtype=jnp.int32))
    assert exported.out_avals[0].shape == (4, 256, 192)
    assert exported.mlir_module().count(MOSAIC_GPU_CALL) == 1
