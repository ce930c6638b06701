"""Correctness of every ragged_dot backend against the float64 reference.

Each backend's class inherits the shared suite, `ragged_dot_base.RaggedDotBackendTests` (float and
quantized modes, every direction, group_offset, lowering for its chip), and only says which dtypes it takes,
how big its shapes may be, which configs to try and which configs it rejects; the backend-specific tests
follow it. Megablox and Triton run in Pallas interpret mode off their chips, so their shapes and example
counts are small.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ragged_dot_base import MOSAIC_CALL, TRITON_CALL, RaggedDotBackendTests

import moe_tune
from moe_tune.core import distributions
from moe_tune.core.errors import InvalidConfigError
from moe_tune.kernels.ragged_dot import BACKENDS, RaggedDotProblem
from moe_tune.kernels.ragged_dot.megablox import MegabloxConfig
from moe_tune.kernels.ragged_dot.definition import ragged_dot_drhs_reference
from moe_tune.kernels.ragged_dot.tiled import (MAX_BLOCKS_PER_VISIT, TiledConfig, drhs_window, tiled_ragged_dot,
                                               tiled_transposed_ragged_dot)
from moe_tune.kernels.ragged_dot.triton import TritonConfig
from moe_tune.kernels.ragged_dot.xla import XlaConfig

# --------------------------------------------------------------------------------------------------------
# One subclass per backend


class TestXla(RaggedDotBackendTests):
    backend = "xla"
    extra_dtypes = ("float16",)
    max_examples = 25

    def test_search_space_is_the_single_default(self):
        problem = self.problem(64, 32, 32, 4, "float32")
        assert self.impl.search_space(problem) == [XlaConfig()]


class TestTiled(RaggedDotBackendTests):
    backend = "tiled"
    extra_dtypes = ("float16",)
    max_examples = 20
    sampled_configs = 1

    def extra_configs(self, problem):
        """Tiles and tails that do not divide m, several contraction chunks and column blocks, tm > m
        (clamped), and tail == tm (no tail tiles smaller than the full ones)."""
        m, k, n = problem.m, problem.k, problem.n
        wanted = [
            TiledConfig(tm=7, tk=max(k // 3, 1), tn=max(n // 2, 1), tail=3),
            TiledConfig(tm=4 * m, tk=4 * k, tn=4 * n, tail=5),
            TiledConfig(tm=16, tk=max(k // 2, 1), tn=max(n // 3, 1), tail=16),
            TiledConfig(tm=1, tk=k, tn=n, tail=1),
        ]
        return [c for c in wanted if self.impl.config_error(c, problem) is None]

    def quantized_configs(self, problem):
        """The default; for drhs also its other schedule (`batched`), whose windows slice the lhs scales
        instead of gathering them, and elsewhere every `dequantize` value it searches (a dot per scale block,
        or dequantized weights)."""
        default = self.impl.default_config(problem)
        if problem.direction == "drhs":
            return [default, dataclasses.replace(default, batched=not default.batched)]
        values = self.impl.candidate_values(problem).get("dequantize", [default.dequantize])
        return [dataclasses.replace(default, dequantize=v) for v in values]

    def invalid_configs(self, problem):
        bad = [{"tm": 0}, {"tk": -8}, {"tn": 0}, {"tail": 0}, {"batched": 1}]
        if problem.direction != "drhs":  # drhs runs windows of tm rows and ignores tail, tk and tn
            bad += [{"tm": 8, "tail": 16}, {"tm": 1, "tk": 1, "tn": 1, "tail": 1}]  # the last: k*n dots > cap
        return bad

    def test_bfloat16_gradients_accumulate_in_float32(self):
        """bfloat16 gradients whose partial products span many chunks: dlhs contracts n=256 in tk=8 chunks
        (32 partial sums), drhs sums each 128-row group in windows of 8 rows (16 partial sums). Measured,
        as max error / max|ref|: float32 accumulation (correct) 0.0028 (dlhs) and 0.0026 (drhs); the same
        kernel accumulating in bfloat16 (`_acc_dtype` returning the output dtype) 0.0173 and 0.0113. The
        bound (GRAD_TOLERANCE, 5e-3) passes the first and fails the second; at the fixed cases' sizes the
        broken kernel errs only 0.002-0.008 (one or a few chunks), which a loose bound cannot tell apart."""
        m, k, n = 256, 128, 256
        configs = [{"dlhs": TiledConfig(tm=m, tk=8, tn=k, tail=8), "drhs": TiledConfig(tm=8, batched=batched)}
                   for batched in (True, False)]  # both drhs schedules
        problem = self.problem(m, k, n, 2, "bfloat16")
        for direction, config in configs[1].items():
            assert self.impl.config_error(config, problem.with_direction(direction)) is None, direction
        self.check_grads(m, [128, 128], None, "bfloat16", k=k, n=n, configs=configs)

    def test_extra_configs_are_used(self):
        problem = self.problem(45, self.k, self.n, 3, "float32")
        extras = self.extra_configs(problem)
        assert len(extras) == 4
        assert self.k * self.n > MAX_BLOCKS_PER_VISIT  # so that the 1x1x1 tile is really over the cap


@pytest.mark.parametrize("tm", [8, 48, 10_000])
@pytest.mark.parametrize("group_offset", [0, 1])
@pytest.mark.parametrize("batched", [True, False])
def test_tiled_drhs_windows_cover_long_groups_empty_groups_and_shards(tm, group_offset, batched):
    """tgmm's first windows (batched, or one group at a time) plus the extra windows of groups longer than
    the window: a group of 70 rows with windows of 8 or 48, empty groups (zeros), a shard of the groups;
    tm=10_000 is clamped to twice the average group (`drhs_window`)."""
    m, k, n, groups = 100, 24, 20, 3
    sizes = np.array([0, 70, 0, 3, 27], np.int32)
    rng = np.random.default_rng(tm + group_offset)
    lhs, dout = rng.standard_normal((m, k), np.float32), rng.standard_normal((m, n), np.float32)
    got = tiled_transposed_ragged_dot(jnp.asarray(lhs), jnp.asarray(dout), jnp.asarray(sizes), tm=tm,
                                      batched=batched, out_dtype=jnp.float32, num_groups=groups,
                                      group_offset=jnp.int32(group_offset))
    ref = ragged_dot_drhs_reference(lhs, dout, sizes, groups=groups, group_offset=group_offset)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-4)
    assert drhs_window(10_000, m=m, groups=groups) == 80  # 2 * ceil(100 / 3) = 68, rounded up to 16s


@pytest.mark.parametrize("groups", [1, 2, 3, 5])
def test_tiled_bfloat16_drhs_windows_read_lhs_transposed_into_the_bf16_dot(groups):
    """bf16 tgmm per group: every window's dot inside the loops is x^T [k, window] @ dout [window, n]
    (lhs_contracting_dims={1}, a `__ynn_fusion`: XLA CPU's bf16 dot; the rows-contracted form it runs in
    float32, 1.6-1.7x slower at deepseek-v2-lite's prefill drhs, FINDINGS.md: bf16 drhs transposed lhs); only
    group 0's first window, outside every loop, keeps that form. With 1 or 2 groups (the group loop inlined
    by XLA) every dot keeps it: there the transposed form compiled to a dot XLA CPU cannot run. Results
    against float64 at every group count."""
    m, k, n = 16 * groups + 5, 24, 40
    sizes = np.full(groups, 16, np.int32)
    sizes[-1] += 5
    rng = np.random.default_rng(groups)
    lhs = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
    dout = jnp.asarray(rng.standard_normal((m, n), np.float32), jnp.bfloat16)
    kernel = jax.jit(lambda x, d, s: tiled_transposed_ragged_dot(x, d, s, tm=8, batched=False,
                                                                 out_dtype=jnp.bfloat16, num_groups=groups))
    got = np.asarray(kernel(lhs, dout, jnp.asarray(sizes)), np.float32)
    ref = ragged_dot_drhs_reference(np.asarray(lhs, np.float32), np.asarray(dout, np.float32), sizes,
                                    groups=groups, group_offset=0)
    np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())
    hlo = kernel.lower(lhs, dout, jnp.asarray(sizes)).compile().as_text()
    dots = [line for line in hlo.splitlines() if " dot(" in line]
    assert (groups > 2) == ("__ynn_fusion" in hlo)
    rows_contracted = [line for line in dots if "lhs_contracting_dims={0}" in line]
    assert len(rows_contracted) == (len(dots) if groups <= 2 else 1), dots
    assert groups <= 2 or len(dots) >= 3  # group 0's first window, later windows, later groups' windows


@pytest.mark.parametrize("m, groups", [(4096, 8), (6144, 8), (8192, 16)])  # groups of 512-768 rows
def test_tiled_default_drhs_window_holds_balanced_groups_with_little_padding(m, groups):
    """The default drhs window holds the largest group of a typical draw of balanced routing whole (the
    median over 10 draws), and pads the average group by less than a fifth (a 5/4 window, kept within noise
    by sweeps, made bf16 drhs up to 20% slower than one that fits: FINDINGS.md: bf16 ragged_dot on CPU)."""
    problem = RaggedDotProblem(m=m, k=64, n=32, groups=groups, direction="drhs")
    window = BACKENDS.get("tiled").default_config(problem).tm
    largest = np.median([distributions.group_sizes("balanced", m, groups, seed).max() for seed in range(10)])
    assert largest <= window < 1.2 * m / groups


_S = jax.ShapeDtypeStruct
# name: (kernel, bf16 operands whose whole shape no op outside the loops may have); shapes differ from the outputs'
# (the per-group drhs does transpose its lhs whole, on purpose, into [k, m]: see
# test_tiled_bfloat16_drhs_windows_read_lhs_transposed_into_the_bf16_dot)
TILED_BF16_KERNELS = {
    "fwd": (lambda x, w, s: tiled_ragged_dot(x, w, s, tm=16, tk=48, tn=40, tail=8, out_dtype=jnp.bfloat16),
            (_S((64, 48), jnp.bfloat16), _S((4, 48, 40), jnp.bfloat16))),
    "dlhs": (lambda d, w, s: tiled_ragged_dot(d, w, s, tm=16, tk=48, tn=40, tail=8, out_dtype=jnp.bfloat16,
                                              transpose_rhs=True),
             (_S((64, 48), jnp.bfloat16), _S((4, 40, 48), jnp.bfloat16))),
    **{f"drhs batched={b}": (lambda x, d, s, b=b: tiled_transposed_ragged_dot(
        x, d, s, tm=16, batched=b, out_dtype=jnp.bfloat16, num_groups=4),
        (_S((64, 48), jnp.bfloat16), _S((64, 40), jnp.bfloat16))) for b in (True, False)},
}


@pytest.mark.parametrize("name", TILED_BF16_KERNELS)
def test_tiled_bfloat16_operands_are_viewed_per_block_not_copied_whole(name):
    """No op on a whole bf16 operand outside the loops: its uint16 view (`pallas_util.as_bits`) fuses into
    each block's slice. A view made before the loop was a copy of the whole operand per call, the size of
    all the expert weights at a decode shape (FINDINGS.md: bf16 ragged_dot on CPU)."""
    kernel, operands = TILED_BF16_KERNELS[name]
    hlo = jax.jit(kernel).lower(*operands, _S((4,), jnp.int32)).compile().as_text()
    entry = hlo[hlo.index("\nENTRY"):]
    for operand in operands:
        shape = "[" + ",".join(map(str, operand.shape)) + "]"
        whole = [line for line in entry.splitlines()
                 if "=" in line and shape in line.split("=")[1].split("(")[0] and "parameter(" not in line]
        assert whole == [], (name, shape)


class TestMegablox(RaggedDotBackendTests):
    backend = "megablox"
    k, n = 160, 136  # tk=128 leaves a ragged contraction chunk, tn=128 a ragged column block
    max_m, max_k, max_n, max_groups = 128, 256, 256, 6
    max_examples = 6
    fixed_draws = {"jit": True, "seed": 0}  # see `test_dimension_edge_cases` for the shapes 6 examples miss
    sampled_configs = 1
    quant_shard_directions = ("dlhs", "drhs")  # interpret mode is slow; fwd's shard code runs in the float cases
    kernel_calls = {"tpu": MOSAIC_CALL}

    def quantized_configs(self, problem):
        """The search space's config with the smallest row tile: several tiles and visits at these tiny shapes."""
        return [min(self.impl.search_space(problem), key=lambda c: c.tm)]

    def invalid_configs(self, problem):
        sub = 8 if problem.lhs_dtype == "float32" else 16
        bad = [
            {"tm": 12, "tk": 128, "tn": 128},  # not a multiple of the sublane count
            {"tm": 0, "tk": 128, "tn": 128},
            {"tm": sub, "tk": 100, "tn": 128},  # neither a multiple of 128 nor k
            {"tm": sub, "tk": 128, "tn": 256},  # tn > n
            {"tm": 64, "tk": 128, "tn": 128},  # tm past m rounded up to the sublane count (m=16)
        ]
        if problem.lhs_dtype == "bfloat16":
            bad.append({"tm": 8, "tk": 128, "tn": 128})  # bf16 packs 16 rows per tile
        return bad

    def test_float16_is_rejected(self):
        lhs, rhs = self.operands("float16")
        with pytest.raises(InvalidConfigError, match="float16"):
            moe_tune.ragged_dot(
                lhs, rhs, jnp.asarray([8, 8], jnp.int32), backend="megablox", config=MegabloxConfig(16, 128, 128)
            )


class TestTriton(RaggedDotBackendTests):
    """Pallas Triton kernels; compiled on GPU, in interpret mode here."""

    backend = "triton"
    extra_dtypes = ("float16",)
    max_m, max_k, max_n, max_groups = 96, 64, 64, 5
    max_examples = 6
    fixed_draws = {"jit": True, "seed": 0}  # see `test_dimension_edge_cases` for the shapes 6 examples miss
    sampled_configs = 1
    quant_shard_directions = ("dlhs", "drhs")  # interpret mode is slow; fwd's shard code runs in the float cases
    kernel_calls = {"gpu": TRITON_CALL}

    def quantized_configs(self, problem):
        """The search space's config with the smallest row block (several blocks at these tiny shapes); for
        w8a8 with lhs scale blocks of 8 also blocks of 16, so that a 16-wide rhs scale block covers a whole k
        step (the raw-dot path) while the 8-wide lhs one does not (the in-kernel dequantization)."""
        smallest = min(self.impl.search_space(problem), key=lambda c: c.block_m)
        if problem.direction == "fwd" and problem.lhs_qblock == 8:
            return [smallest, TritonConfig(block_m=16, block_k=16, block_n=16)]
        return [smallest]

    def extra_configs(self, problem):
        """Small blocks, so that the fixed cases (k=24, n=40) span several blocks in every dimension."""
        return [TritonConfig(block_m=16, block_k=16, block_n=16, num_warps=4, num_stages=2)]

    def invalid_configs(self, problem):
        return [
            {"block_m": 24},  # not a power of two
            {"block_k": 8},  # below tl.dot's minimum
            {"num_warps": 3},
            {"num_stages": 0},
            {"block_m": 256, "block_k": 256, "block_n": 256, "num_stages": 6},  # over shared memory (and k, n)
        ]

    def test_search_space_is_pruned_by_shared_memory(self):
        problem = self.problem(4096, 4096, 4096, 8, "float32")
        impl = self.impl
        space = impl.search_space(problem)
        assert all(impl.shared_memory_bytes(c, problem) <= moe_tune.core.devices.gpu_shared_memory_bytes() for c in space)
        grid = impl.candidate_values(problem)
        assert len(space) < np.prod([len(v) for v in grid.values()])  # some were pruned
        big = TritonConfig(block_m=128, block_k=128, block_n=256, num_warps=8, num_stages=4)
        assert "shared memory" in impl.config_error(big, problem)
        assert moe_tune.core.devices.gpu_shared_memory_bytes("nvidia_h100_80gb_hbm3") > moe_tune.core.devices.gpu_shared_memory_bytes("cpu")


def test_min_bytes_counts_each_array_once_in_its_dtype():
    """The memory roof of every direction: lhs [m,k], the groups' [g,k,n] and the [m,n] side, once each."""
    problem = RaggedDotProblem(m=8, k=4, n=2, groups=3, lhs_dtype="bfloat16", rhs_dtype="float32",
                               out_dtype="float16")
    expected = 8 * 4 * 2 + 3 * 4 * 2 * 4 + 8 * 2 * 2
    assert [problem.with_direction(d).min_bytes for d in ("fwd", "dlhs", "drhs")] == [expected] * 3


@pytest.mark.parametrize("direction", ["fwd", "dlhs", "drhs"])
def test_reference_paths_agree_and_cpu_always_uses_the_host_one(direction, monkeypatch):
    """The tuner's two references (float64 NumPy; XLA in float32 at highest precision, for big problems on
    an accelerator) agree, and on CPU a problem past the FLOPs limit still gets the NumPy one."""
    from moe_tune.kernels.kernel_op import relative_error
    from moe_tune.kernels.ragged_dot import definition as definition_module

    op = definition_module.RAGGED_DOT
    problem = op.problem(m=96, k=24, n=40, groups=5, dtype="float32", direction=direction)
    inputs = op.make_inputs(problem, "skewed", 3)
    host = op.reference(problem, inputs)
    assert host.dtype == np.float64
    assert relative_error(op._device_reference(problem, inputs), host) < 1e-5
    monkeypatch.setattr(definition_module, "HOST_REFERENCE_MAX_FLOPS", 0)
    monkeypatch.setattr(op, "_device_reference", lambda *a: pytest.fail("device reference used on CPU"))
    np.testing.assert_array_equal(op.reference(problem, inputs), host)


def test_relative_error_in_blocks_matches_the_whole_array_formula(monkeypatch):
    from moe_tune.kernels import kernel_op as kernel_op_module

    monkeypatch.setattr(kernel_op_module, "_ERROR_BLOCK", 7)  # many blocks, the last one partial
    rng = np.random.default_rng(0)
    expected = rng.standard_normal((5, 6, 4))
    out = (expected + rng.standard_normal(expected.shape) * 1e-3).astype(np.float32)
    whole = np.max(np.abs(out.astype(np.float64) - expected)) / np.max(np.abs(expected))
    assert kernel_op_module.relative_error(out, expected) == pytest.approx(whole, rel=1e-12)
    out[4, 5, 3] = np.nan  # in the last block
    assert kernel_op_module.relative_error(out, expected) == float("inf")
    assert kernel_op_module.relative_error(out[:4], expected) == float("inf")  # shape mismatch
    assert kernel_op_module.relative_error(np.zeros((0, 3)), np.zeros((0, 3))) == 0.0
