"""The quantization plan (`kernels/ragged_dot/quant_plan.py`): what it says for every direction x scale layout,
and that its readers agree with it: the plan built from a problem equals the one built from the arrays a
backend receives, `prepare_gmm` / `prepare_tgmm` carry out its folds, the config checks and memory estimates
follow it, and the tiled kernel (the CPU path, fast enough to run every layout here) matches the reference.
The Pallas kernels' numerics are covered per backend by tests/ragged_dot_base/.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_tune.core.quant import QArray, dequantize, quantize, split
from moe_tune.kernels.ragged_dot import BACKENDS, RaggedDotProblem
from moe_tune.kernels.ragged_dot.megablox import MegabloxConfig, block_bytes, compiler_bytes, vmem_bytes
from moe_tune.kernels.ragged_dot.quant_plan import Apply, gmm_plan, problem_plan, tgmm_plan
from moe_tune.kernels.ragged_dot.quantized import prepare_gmm, prepare_tgmm
from moe_tune.kernels.ragged_dot.definition import (ragged_dot_dlhs_reference, ragged_dot_drhs_reference,
                                                   ragged_dot_reference)
from moe_tune.kernels.ragged_dot.tiled import TiledConfig, tiled_ragged_dot
from moe_tune.kernels.ragged_dot.triton import TritonConfig

M, K, N, G = 40, 32, 24, 4
SIZES = [9, 0, 23, 3]
SUB = 8  # the sub-channel block along k
LAYOUTS = {"float": None, "channel": K, "sub": SUB}  # an operand's scale block along k (K: one per row / channel)
FLOAT = "bfloat16"  # the dtype of the float operands
CASES = [(d, lhs, rhs) for d in ("fwd", "dlhs", "drhs") for lhs, rhs in itertools.product(LAYOUTS, LAYOUTS)]
IDS = [f"{d}-lhs_{lhs}-rhs_{rhs}" for d, lhs, rhs in CASES]

# What each direction's plan says, by the layout of the operand its kernel reads quantized (fwd: both; dlhs:
# rhs; drhs: lhs), as (scale, block, dtype loaded) of that kernel operand. The other forward operand's
# quantization does not enter a gradient direction's plan.
FWD_OPERAND = {"float": (Apply.NONE, None, FLOAT), "channel": (Apply.OUTPUT, K, "int8"), "sub": (Apply.STEP, SUB, "int8")}
GRAD_OPERAND = {"float": (Apply.NONE, None, FLOAT), "channel": (Apply.FOLD, K, "int8"),
                "sub": (Apply.DEQUANTIZE, SUB, "int8")}
DOUT = (Apply.NONE, None, FLOAT)
DOUT_FOLDED_INTO = (Apply.NONE, None, "float32")  # dout with a per-channel / per-row scale folded into it


def expected(direction: str, lhs: str, rhs: str) -> dict:
    """The plan's operands `a`, `b` as (scale, block, dtype), `dequantizable` and `float32_dots`."""
    if direction == "fwd":
        a, b = FWD_OPERAND[lhs], FWD_OPERAND[rhs]
        return dict(a=a, b=b, dequantizable=lhs == "float" and rhs == "sub", float32_dots=False)
    quantized = rhs if direction == "dlhs" else lhs
    dout = DOUT_FOLDED_INTO if quantized == "channel" else DOUT
    a, b = (dout, GRAD_OPERAND[quantized]) if direction == "dlhs" else (GRAD_OPERAND[quantized], dout)
    return dict(a=a, b=b, dequantizable=False, float32_dots=quantized != "float")


def make_problem(direction: str, lhs: str, rhs: str) -> RaggedDotProblem:
    quant = {f"{side}_{field}": value for side, layout in (("lhs", lhs), ("rhs", rhs)) if layout != "float"
             for field, value in (("qdtype", "int8"), ("qblock", LAYOUTS[layout]))}
    return RaggedDotProblem(m=M, k=K, n=N, groups=G, lhs_dtype="float32" if lhs != "float" else FLOAT,
                            rhs_dtype="float32" if rhs != "float" else FLOAT, out_dtype=FLOAT, direction=direction,
                            **quant)


def make_operands(direction: str, lhs: str, rhs: str, seed: int = 0) -> tuple:
    """(a, b): the direction's kernel operands as the op passes them (QArrays for quantized ones)."""
    rng = np.random.default_rng(seed)
    operand = lambda shape, layout: (jnp.asarray(rng.standard_normal(shape, np.float32), FLOAT) if layout == "float"
                                     else quantize(jnp.asarray(rng.standard_normal(shape, np.float32)), "int8",
                                                   axis=1, block_size=LAYOUTS[layout]))
    x, w, dout = operand((M, K), lhs), operand((G, K, N), rhs), operand((M, N), "float")
    return {"fwd": (x, w), "dlhs": (dout, w), "drhs": (x, dout)}[direction]


def described(op) -> tuple:
    return op.scale, op.block, op.dtype


@pytest.mark.parametrize("direction, lhs, rhs", CASES, ids=IDS)
def test_the_plan_of_every_direction_and_layout(direction, lhs, rhs):
    plan = problem_plan(make_problem(direction, lhs, rhs))
    want = expected(direction, lhs, rhs)
    assert (described(plan.a), described(plan.b)) == (want["a"], want["b"])
    assert (plan.dequantizable, plan.float32_dots) == (want["dequantizable"], want["float32_dots"])
    assert plan.quantized == ("int8" in (plan.a.dtype, plan.b.dtype))
    in_loop = [op.block for op in plan.operands if op.scale is Apply.STEP]
    assert plan.step_blocks == tuple(in_loop)
    assert plan.sub_channel_blocks == tuple(op.block for op in plan.operands
                                            if op.scale in (Apply.STEP, Apply.DEQUANTIZE))


@pytest.mark.parametrize("direction, lhs, rhs", CASES, ids=IDS)
def test_the_plan_from_arrays_is_the_plan_from_the_problem(direction, lhs, rhs):
    """A backend plans from its operands (before the folds: `prepare_gmm` / `prepare_tgmm`), the config checks
    from the problem: the same function, the same plan."""
    a, b = make_operands(direction, lhs, rhs)
    (av, ascale), (bv, bscale) = split(a), split(b)
    from_arrays = tgmm_plan(av, ascale, bv) if direction == "drhs" else gmm_plan(
        av, ascale, bv, bscale, transpose_rhs=direction == "dlhs")
    assert from_arrays == problem_plan(make_problem(direction, lhs, rhs))


def _prepared_plan(direction: str, a, b):
    """The plan a kernel derives from the operands `prepare_gmm` / `prepare_tgmm` hand it, and those operands."""
    sizes = jnp.asarray(SIZES, jnp.int32)
    if direction == "drhs":
        x, scale, dout = prepare_tgmm(a, b)
        return tgmm_plan(x, scale, dout), (x, scale, dout)
    ops = prepare_gmm(a, b, sizes, None, direction == "dlhs")
    return ops.plan(direction == "dlhs"), ops


@pytest.mark.parametrize("direction, lhs, rhs", CASES, ids=IDS)
def test_prepare_carries_out_the_folds(direction, lhs, rhs):
    """After the steps before the kernel, no FOLD is left: the folded scale is gone, the operand it went into
    is float32 and equals the exact product; the kernel's plan is the problem's with NONE for FOLD."""
    a, b = make_operands(direction, lhs, rhs)
    plan = problem_plan(make_problem(direction, lhs, rhs))
    kernel, operands = _prepared_plan(direction, a, b)
    assert kernel.kernel_plan() is kernel  # nothing it was handed applies before the kernel
    for before, after in zip(plan.operands, kernel.operands):
        if before.scale is Apply.FOLD:
            assert (after.scale, after.block) == (Apply.NONE, None)
        else:
            assert described(after) == described(before)
    folds = [op.scale for op in plan.operands].count(Apply.FOLD)
    assert folds == int((direction, lhs, rhs) in (("drhs", "channel", rhs), ("dlhs", lhs, "channel")))
    if folds and direction == "drhs":  # dout * the per-row lhs scale
        want = np.asarray(b, np.float32) * np.asarray(a.scale)
        np.testing.assert_array_equal(np.asarray(operands[2]), want)
    if folds and direction == "dlhs":  # dout rows * their group's per-channel scale
        gid = np.repeat(np.arange(G), SIZES)
        want = np.asarray(a, np.float32)[:len(gid)] * np.asarray(b.scale)[gid, 0, :]
        np.testing.assert_array_equal(np.asarray(operands.lhs)[:len(gid)], want)


def test_a_kernel_handed_a_scale_to_fold_refuses_it():
    """A kernel called directly (without `prepare_gmm`) with a scale its plan folds before the kernel says
    so, rather than applying it in a place the plan does not name."""
    dout, w = make_operands("dlhs", "float", "channel")
    with pytest.raises(ValueError, match="applies before the kernel"):
        tiled_ragged_dot(dout, w.qvalue, jnp.asarray(SIZES, jnp.int32), tm=16, tk=N, tn=K, tail=8,
                         out_dtype=jnp.float32, transpose_rhs=True, rhs_scale=w.scale)


@pytest.mark.parametrize("direction, lhs, rhs", CASES, ids=IDS)
def test_config_checks_follow_the_plan(direction, lhs, rhs):
    """tiled: `dequantize` is valid exactly where the plan says it applies, and `tk` must respect exactly the
    plan's STEP blocks; megablox: its quantized kernels' rules bind exactly where the plan runs them; triton:
    int8 x int8 dots (block_k >= 32) exactly where the plan loads two int8 operands and scales whole steps."""
    problem = make_problem(direction, lhs, rhs)
    plan = problem_plan(problem)
    tiled, megablox, triton = (BACKENDS.get(name) for name in ("tiled", "megablox", "triton"))
    rejected = tiled.config_error(TiledConfig(tm=16, tail=8, tk=K, tn=N, dequantize=True), problem)
    assert (rejected is None) == plan.dequantizable
    assert ("dequantize" in tiled.candidate_values(problem)) == plan.dequantizable
    assert tiled.default_config(problem).dequantize == plan.dequantizable
    straddling = tiled.config_error(TiledConfig(tm=16, tail=8, tk=12, tn=N), problem)  # 12: not with blocks of 8
    assert (straddling is not None) == (SUB in plan.step_blocks), straddling
    ragged = RaggedDotProblem(**{**problem.key_fields(), "m": 256, "k": 384, "n": 384})
    ragged_plan = problem_plan(ragged)
    megablox_rule = megablox.config_error(MegabloxConfig(32, 256, 128), ragged)  # tk=256 does not divide 384
    assert ("must divide" in (megablox_rule or "")) == (ragged_plan.quantized and direction != "drhs")
    # block_k=16: int8 dots need 32; a step of 16 straddles blocks of 8, which dequantizes it (no int8 dot)
    int8_rule = triton.config_error(TritonConfig(block_m=32, block_k=16, block_n=32), problem)
    int8_dots = plan.a.dtype == plan.b.dtype == "int8" and SUB not in plan.step_blocks
    assert ("int8 x int8" in (int8_rule or "")) == int8_dots


def _kernel_reads_1_byte_values(direction: str, lhs: str, rhs: str) -> bool:
    return {"fwd": lhs != "float" or rhs != "float", "dlhs": rhs != "float", "drhs": lhs != "float"}[direction]


QUANTIZED_KERNEL_CASES = [case for case in CASES if _kernel_reads_1_byte_values(*case)]
TM, TK, TN = 128, 256, 512
# The f32 scale blocks a Megablox kernel step holds, by (direction, forward operand, layout): whole along the
# k / bs scales, beside the tile they scale; a folded scale (dlhs per channel, drhs per row) has none.
SCALE_BLOCKS = {("fwd", "lhs", "channel"): (TM, 1), ("fwd", "lhs", "sub"): (TM, K // SUB),
                ("fwd", "rhs", "channel"): (1, TN), ("fwd", "rhs", "sub"): (K // SUB, TN),
                ("dlhs", "rhs", "sub"): (K // SUB, TK), ("drhs", "lhs", "sub"): (K // SUB, TM)}


@pytest.mark.parametrize("direction, lhs, rhs", QUANTIZED_KERNEL_CASES,
                         ids=[f"{d}-lhs_{lhs}-rhs_{rhs}" for d, lhs, rhs in QUANTIZED_KERNEL_CASES])
def test_megablox_vmem_holds_what_the_plan_loads(direction, lhs, rhs):
    """The quantized kernels' VMEM: double-buffered blocks of the dtypes the plan loads, the f32 accumulator,
    and the plan's scale blocks padded to (8, 128) tiles; none for a folded scale."""
    problem = make_problem(direction, lhs, rhs)
    plan = problem_plan(problem)
    assert plan.quantized
    size = lambda op: jnp.dtype(op.dtype).itemsize
    out = jnp.dtype(problem.operand_dtypes()[2]).itemsize
    if direction == "drhs":
        blocks, acc = TK * TM * size(plan.a) + TM * TN * size(plan.b) + TK * TN * out, TK * TN * 4
    else:
        blocks, acc = TM * TK * size(plan.a) + TK * TN * size(plan.b) + TM * TN * out, TM * TN * 4
    shapes = [SCALE_BLOCKS[key] for key in ((direction, "lhs", lhs), (direction, "rhs", rhs)) if key in SCALE_BLOCKS]
    assert sorted(plan.scale_blocks(TM, TK, TN)) == sorted(shapes)
    padded = sum(-(-r // 8) * 8 * -(-c // 128) * 128 for r, c in shapes)
    config = MegabloxConfig(TM, TK, TN)
    assert block_bytes(config, problem) == 2 * blocks + 2 * 4 * padded + acc
    assert vmem_bytes(config, problem) == block_bytes(config, problem) + compiler_bytes(config, problem)


def _reference(direction: str, a, b) -> np.ndarray:
    a, b = (np.asarray(dequantize(x) if isinstance(x, QArray) else x, np.float64) for x in (a, b))
    sizes = np.asarray(SIZES)
    if direction == "dlhs":
        return ragged_dot_dlhs_reference(a, b, sizes)
    if direction == "drhs":
        return ragged_dot_drhs_reference(a, b, sizes, groups=G)
    return ragged_dot_reference(a, b, sizes)


@pytest.mark.parametrize("direction, lhs, rhs", CASES, ids=IDS)
def test_the_tiled_kernel_applies_the_plan(direction, lhs, rhs):
    """Every layout through the tiled kernel (each `dequantize` the plan allows) against the float64
    reference of the dequantized operands (bf16 output: bf16's rounding), and `dequantize` asked for where
    the plan says it does not apply changes nothing: the kernel's own guard is the plan's."""
    problem = make_problem(direction, lhs, rhs)
    a, b = make_operands(direction, lhs, rhs)
    tiled, sizes = BACKENDS.get("tiled"), jnp.asarray(SIZES, jnp.int32)
    ref = _reference(direction, a, b)
    for dequantize in (False, True) if problem_plan(problem).dequantizable else (False,):
        config = TiledConfig(tm=16, tail=8, tk=16, tn=16, dequantize=dequantize)
        assert tiled.config_error(config, problem) is None
        out = np.asarray(jax.jit(lambda a, b, c=config: tiled.run(problem, c, a, b, sizes))(a, b), np.float64)
        assert np.abs(out - ref).max() <= 2 ** -7 * np.abs(ref).max(), f"dequantize={dequantize}"
    if direction != "drhs" and not problem_plan(problem).dequantizable:
        run = lambda dequantize: str(jax.make_jaxpr(lambda a, b: tiled.gmm(
            a, b, sizes, config=TiledConfig(tm=16, tail=8, tk=16, tn=16, dequantize=dequantize),
            out_dtype=jnp.float32, transpose_rhs=direction == "dlhs"))(a, b))
        assert run(True) == run(False)


def test_scaled_after_and_with_dequantize():
    """A STEP scale multiplies a step's raw dot only when its block holds the whole step (triton's k steps);
    `with_dequantize` moves sub-channel weights to DEQUANTIZE only where the plan allows it."""
    plan = problem_plan(make_problem("fwd", "float", "sub"))
    assert [plan.b.scaled_after(step) for step in (4, 8, 16)] == [True, True, False]
    assert not plan.a.scaled_after(4)  # no scale
    deq = plan.with_dequantize(True)
    assert deq.b.scale is Apply.DEQUANTIZE and deq.step_blocks == () and plan.with_dequantize(False) is plan
    w8a8 = problem_plan(make_problem("fwd", "sub", "sub"))
    assert w8a8.with_dequantize(True) is w8a8
