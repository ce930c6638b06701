"""`QuantizedTests`: quantized operands (`moe_tune.QArray`) in every direction, at the kernel
(`Backend.run`) and through the public op with its gradients, against the float64 reference of the
dequantized operands; plus the quantized cases and reference tests/test_quant_kernels.py shares.

A mode whose problem the backend cannot run (its default config's `config_error`) is skipped with that
reason, as the op falls back."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_tune
from moe_tune.core.quant import DynamicQuant, QArray, dequantize_host, quantize
from moe_tune.kernels.ragged_dot import RaggedDotProblem
from moe_tune.kernels.ragged_dot.definition import ragged_dot_reference
from moe_tune.kernels.ragged_dot.definition import ragged_dot_dlhs_reference, ragged_dot_drhs_reference

from .helpers import DIRECTIONS, GRAD_TOLERANCE, local_rows
from .hooks import BackendHooks

# Each direction takes its quantized operand as the op passes it: fwd = gmm(lhs, rhs_q) (weight-only, or
# lhs_q x rhs_q), dlhs = gmm(dout, rhs_q, transpose_rhs=True), drhs = tgmm(lhs_q, dout).

# The integer (or float8) products are exact and accumulation is float32.
QUANT_TOLERANCE = 2e-6
QM, QK, QN = 40, 32, 24
QSIZES = [9, 0, 23, 3]  # an empty group; rows 35..39 are past sum(group_sizes)
Q_SHARD_SIZES, Q_SHARD = [6, 9, 0, 14, 8], (1, 3)  # groups [1, 4) of 5 (group_offset, local groups)


@dataclasses.dataclass(frozen=True)
class QuantMode:
    """A direction and how its operands are quantized: a block is None (float operand), "k" (one scale per
    row / channel) or the sub-channel block along k; `qdtype` is the stored dtype of both (of rhs only when
    `lhs_qdtype` is given). `dynamic`: the lhs is float and the kernel quantizes it (`DynamicQuant`, to
    `lhs_qdtype`, in `lhs_block`s). `k`: the contracting size (mxfp4's blocks are 32 long)."""

    direction: str
    lhs_block: int | str | None
    rhs_block: int | str | None
    qdtype: str = "int8"
    lhs_qdtype: str | None = None
    dynamic: bool = False
    k: int = QK


# float8_e4m3fn for weight-only sub-channel (a float lhs meets fp8 weights) and for per-row x sub-channel
# (fp8 x fp8, which meets in bfloat16); int8 elsewhere (int8 x int8 accumulates in int32). The conversions
# are the same code for every mode, so each dtype path runs once per backend.
QUANT_MODES = {
    "fwd_weight_per_channel": QuantMode("fwd", None, "k"),
    "fwd_weight_sub_channel_fp8": QuantMode("fwd", None, 8, "float8_e4m3fn"),
    "fwd_w8a8_rows_x_sub_channel_fp8": QuantMode("fwd", "k", 8, "float8_e4m3fn"),
    "fwd_w8a8_sub_channel": QuantMode("fwd", 8, 16),
    "dlhs_weight_per_channel": QuantMode("dlhs", None, "k"),
    "dlhs_weight_sub_channel": QuantMode("dlhs", None, 8),
    "drhs_lhs_per_row": QuantMode("drhs", "k", None),
    "drhs_lhs_sub_channel": QuantMode("drhs", 8, None),
    # 4-bit weights (weight-only; their dlhs runs through the op in the 4-bit test below): mxfp4 in its
    # blocks of 32 (two along k, so the scale steps inside k), int4 in blocks of 16
    "fwd_weight_mxfp4": QuantMode("fwd", None, 32, "float4_e2m1fn", k=64),
    "fwd_weight_int4_sub_channel": QuantMode("fwd", None, 16, "int4"),
    # activations quantized in the kernel (dynamic w8a8): per row with per-channel int8 weights (int8 x int8),
    # and in blocks of 16 with int4 weights in blocks of 16
    "fwd_dynamic_w8a8_per_row": QuantMode("fwd", "k", "k", "int8", "int8", dynamic=True),
    "fwd_dynamic_a8_int4_sub_channel": QuantMode("fwd", 16, 16, "int4", "int8", dynamic=True),
}


def quantized(x: Any, block: int | str | None, qdtype: str, dynamic: bool = False) -> jax.Array | QArray | DynamicQuant:
    """`x` as a float array (block None) or quantized along k (axis 1) in `block`s ("k": the whole axis);
    `dynamic`: a float `x` the kernel quantizes so (`DynamicQuant`)."""
    if block is None:
        return jnp.asarray(x)
    block_size = None if block == "k" else block
    if dynamic:
        return DynamicQuant(jnp.asarray(x), qdtype, block_size)
    return quantize(jnp.asarray(x), qdtype, axis=1, block_size=block_size)


def as_f64(x: Any) -> np.ndarray:
    """float64 values of an array or (exactly dequantized) QArray; of a `DynamicQuant`, the dequantized values
    of the QArray the kernel quantizes it to (the reference's operand)."""
    x = x.quantize() if isinstance(x, DynamicQuant) else x
    return dequantize_host(x) if isinstance(x, QArray) else np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def assert_quantized_vjp(a: Any, b: Any, dout: Any, sizes: list[int], out: Any, grads: tuple[Any, Any],
                         what: str, close: Any = None) -> None:
    """`out` = ragged_dot(a, b) and `grads` = its VJP at `dout`, with a and/or b QArrays, against the float64
    reference of the dequantized operands: out in float32; a float operand's gradient in its dtype; a QArray
    is a constant, so its cotangent is zero (float0 for integer values). `close(got, ref, what)`: the
    tolerance check (default `assert_quant_close`)."""
    close = close or assert_quant_close
    assert out.dtype == jnp.float32, what
    close(out, ragged_dot_reference(as_f64(a), as_f64(b), sizes), what)
    refs = (lambda: ragged_dot_dlhs_reference(as_f64(dout), as_f64(b), sizes),
            lambda: ragged_dot_drhs_reference(as_f64(a), as_f64(dout), sizes, groups=len(sizes)))
    for x, grad, ref in ((a, grads[0], refs[0]), (b, grads[1], refs[1])):
        if isinstance(x, QArray):
            for leaf in jax.tree.leaves(grad):
                assert leaf.dtype == jax.dtypes.float0 or not np.any(np.asarray(leaf, np.float32)), what
        else:
            assert grad.dtype == x.dtype, what
            close(grad, ref(), what)


def make_quant_case(mode: QuantMode, *, sizes: list[int] = QSIZES, groups: int | None = None, seed: int = 0
                    ) -> tuple[RaggedDotProblem, Any, Any]:
    """(problem, a, b): the direction's two operands, quantized as `mode` says, and its problem."""
    groups = len(sizes) if groups is None else groups
    rng = np.random.default_rng(seed)
    lhs = quantized(rng.standard_normal((QM, mode.k), np.float32), mode.lhs_block, mode.lhs_qdtype or mode.qdtype,
                    mode.dynamic)
    rhs = quantized(rng.standard_normal((groups, mode.k, QN), np.float32) / np.sqrt(mode.k), mode.rhs_block,
                    mode.qdtype)
    dout = jnp.asarray(rng.standard_normal((QM, QN), np.float32))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    offset = None if groups == len(sizes) else jnp.int32(0)
    problem = RaggedDotProblem.from_arrays(lhs, rhs, group_sizes, group_offset=offset, direction=mode.direction)
    a, b = {"fwd": (lhs, rhs), "dlhs": (dout, rhs), "drhs": (lhs, dout)}[mode.direction]
    return problem, a, b


def direction_reference(problem: RaggedDotProblem, a: Any, b: Any, sizes: Any, offset: int = 0) -> np.ndarray:
    """float64 result of `problem.direction` on its two operands (QArrays dequantized exactly)."""
    a, b, sizes = as_f64(a), as_f64(b), np.asarray(sizes)
    if problem.direction == "dlhs":
        return ragged_dot_dlhs_reference(a, b, sizes, group_offset=offset)
    if problem.direction == "drhs":
        return ragged_dot_drhs_reference(a, b, sizes, groups=problem.groups, group_offset=offset)
    return ragged_dot_reference(a, b, sizes, group_offset=offset)


def assert_quant_close(got: Any, ref: np.ndarray, what: str = "") -> None:
    """Within QUANT_TOLERANCE x max|ref| (float32 accumulation of exact products)."""
    got = np.asarray(got, np.float64)
    assert got.shape == ref.shape, what
    scale = max(np.abs(ref).max(), 1e-30)
    err = np.abs(got - ref).max() / scale
    assert err <= QUANT_TOLERANCE, f"max error {err:.3g} x max|ref| {what}"


class QuantizedTests(BackendHooks):
    """Quantized operands at the kernel and through the op; `quantized_configs` and
    `quant_shard_directions` tune what runs."""

    # ---- quantized operands (QArray): every direction at the kernel, then through the public op

    @pytest.mark.parametrize("mode", list(QUANT_MODES), ids=str)
    def test_quantized_kernel_matches_the_dequantized_reference(self, mode):
        """`Backend.run` of one direction with quantized operands (as the op passes them) against the float64
        reference of the dequantized operands: float32 out, the empty group's drhs and the rows past
        sum(group_sizes) exactly zero."""
        problem, a, b = make_quant_case(QUANT_MODES[mode])
        if (reason := self.unsupported(problem)) is not None:
            pytest.skip(f"{self.backend} cannot run {mode}: {reason}")
        ref = direction_reference(problem, a, b, QSIZES)
        for config in self.quantized_configs(problem):
            out = self.run_quantized(problem, config, a, b, QSIZES)
            what = f"[{self.backend} {mode} {config}]"
            assert out.dtype == jnp.float32, what
            assert_quant_close(out, ref, what)
            if problem.direction == "drhs":
                assert not np.any(np.asarray(out[1])), f"the empty group's result is not zero {what}"
            else:
                assert not np.any(np.asarray(out[sum(QSIZES):])), f"rows past sum(group_sizes) are not zero {what}"

    def test_quantized_expert_parallel_shard_with_weights_sliced_by_group(self):
        """group_offset: the shard's groups [1, 4) of 5; the QArray weights are the full ones sliced by group.
        dlhs folds the per-channel scale into dout by each row's (local) group, so the offset must reach it."""
        offset, groups = Q_SHARD
        rng = np.random.default_rng(3)
        lhs = jnp.asarray(rng.standard_normal((QM, QK), np.float32))
        dout = jnp.asarray(rng.standard_normal((QM, QN), np.float32))
        full = quantize(jnp.asarray(rng.standard_normal((len(Q_SHARD_SIZES), QK, QN), np.float32)), "int8", axis=1)
        shard = full[offset:offset + groups]
        lhs_q = quantize(lhs, "int8", axis=1, block_size=8)
        operands = {"fwd": (lhs, shard), "dlhs": (dout, shard), "drhs": (lhs_q, dout)}
        for direction in self.quant_shard_directions:
            a, b = operands[direction]
            problem = RaggedDotProblem.from_arrays(lhs_q if direction == "drhs" else lhs, shard,
                                                   jnp.asarray(Q_SHARD_SIZES, jnp.int32),
                                                   group_offset=jnp.int32(offset), direction=direction)
            if (reason := self.unsupported(problem)) is not None:
                pytest.skip(f"{self.backend} cannot run the quantized {direction} shard: {reason}")
            out = self.run_quantized(problem, self.impl.default_config(problem), a, b, Q_SHARD_SIZES,
                                     offset=jnp.int32(offset))
            what = f"[{self.backend} {direction}]"
            assert_quant_close(out, direction_reference(problem, a, b, Q_SHARD_SIZES, offset=offset), what)
            if direction != "drhs":  # rows of other shards' groups are zero
                mine = local_rows(Q_SHARD_SIZES, QM, groups, offset)
                assert not np.any(np.asarray(out)[~mine]), what

    def test_quantized_operands_through_the_op_and_its_vjp(self):
        """The public op with QArray weights (int8 per channel: fwd, and dlhs for the float activations) and
        with QArray activations (int8 in sub-channel blocks: fwd, and drhs for the float weights), each
        direction with the backend's default config; a QArray is an autodiff constant (zero cotangent)."""
        rng = np.random.default_rng(4)
        lhs = jnp.asarray(rng.standard_normal((QM, QK), np.float32))
        rhs = jnp.asarray(rng.standard_normal((len(QSIZES), QK, QN), np.float32) / np.sqrt(QK))
        dout = jnp.asarray(rng.standard_normal((QM, QN), np.float32))
        sizes = jnp.asarray(QSIZES, jnp.int32)
        ran = 0
        for a, b in ((lhs, quantize(rhs, "int8", axis=1)), (quantize(lhs, "int8", axis=1, block_size=8), rhs)):
            problem = RaggedDotProblem.from_arrays(a, b, sizes)
            if self.unsupported(problem) is not None:
                continue
            config = {d: self.impl.default_config(problem.with_direction(d)) for d in DIRECTIONS}
            f = jax.jit(lambda a, b: moe_tune.ragged_dot(a, b, sizes, backend=self.backend, config=config))
            out, vjp = jax.vjp(f, a, b)
            da, db = vjp(dout)
            what = f"[{self.backend} lhs {type(a).__name__}, rhs {type(b).__name__}]"
            assert_quantized_vjp(a, b, dout, QSIZES, out, (da, db), what)
            ran += 1
        if not ran:
            pytest.skip(f"{self.backend} runs no quantized operands")

    def test_4bit_weights_and_activations_quantized_in_the_kernel_through_the_op_and_its_vjp(self):
        """The public op with int4 weights in blocks of 16 and bfloat16 activations quantized in the kernel
        (`lhs_quant="int8"`, dynamic w8a8, in the weights' blocks), jitted with its VJP: out against the
        float64 reference of the quantized-then-dequantized operands, lhs's gradient the straight-through one
        (the int4 weight-only dlhs: dout times the dequantized weights) in lhs's dtype, the weights a
        constant. A backend that refuses them is skipped."""
        rng = np.random.default_rng(5)
        x = rng.standard_normal((QM, QK), np.float32)
        rhs = quantize(jnp.asarray(rng.standard_normal((len(QSIZES), QK, QN), np.float32) / np.sqrt(QK)), "int4",
                       axis=1, block_size=16)
        dout = jnp.asarray(rng.standard_normal((QM, QN), np.float32))
        sizes = jnp.asarray(QSIZES, jnp.int32)
        ran = 0
        for lhs_quant, dtype in (("int8", "bfloat16"),):
            lhs = jnp.asarray(x, dtype)
            a = lhs if lhs_quant is None else DynamicQuant(lhs, lhs_quant, 16)
            problem = RaggedDotProblem.from_arrays(a, rhs, sizes, preferred_element_type=jnp.float32)
            if self.unsupported(problem) is not None:
                continue
            config = {d: self.impl.default_config(problem.with_direction(d)) for d in ("fwd", "dlhs")}
            f = jax.jit(lambda x, w: moe_tune.ragged_dot(x, w, sizes, backend=self.backend, config=config,
                                                         preferred_element_type=jnp.float32, lhs_quant=lhs_quant))
            out, vjp = jax.vjp(f, lhs, rhs)
            dx, dw = vjp(dout)
            what = f"[{self.backend} int4/16 lhs_quant={lhs_quant}]"
            assert_quant_close(out, ragged_dot_reference(as_f64(a), as_f64(rhs), QSIZES), what)
            assert dx.dtype == lhs.dtype, what
            ref = ragged_dot_dlhs_reference(as_f64(dout), as_f64(rhs), QSIZES)
            err = np.abs(np.asarray(dx, np.float64) - ref).max() / np.abs(ref).max()
            assert err <= GRAD_TOLERANCE[dtype], f"dlhs error {err:.3g} {what}"
            assert all(leaf.dtype == jax.dtypes.float0 or not np.any(np.asarray(leaf, np.float32))
                       for leaf in jax.tree.leaves(dw)), what
            ran += 1
        if not ran:
            pytest.skip(f"{self.backend} runs no 4-bit weights")

    @pytest.mark.parametrize("direction", DIRECTIONS)
    def test_default_config_is_valid_for_model_sized_quantized_problems(self, direction):
        """DeepSeek-sized experts (k = 7168) with int8 weights in sub-channel blocks of 128, weight-only and
        w8a8 (fp8 per-row activations): the default config is valid. Nothing runs."""
        base = dict(m=4096, k=7168, n=2048, groups=32, lhs_dtype="bfloat16", out_dtype="bfloat16",
                    rhs_qdtype="int8", rhs_qblock=128, direction=direction)
        for problem in (RaggedDotProblem(**base), RaggedDotProblem(**{**base, "lhs_qdtype": "float8_e4m3fn"})):
            assert self.unsupported(problem) is None, problem
