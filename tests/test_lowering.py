"""Every Pallas kernel of the package lowers for its chip, here on a CPU-only machine.

The kernel tests elsewhere in the suite run the Pallas kernels in interpret mode, which executes the kernel
body as ordinary JAX ops and skips the chip's lowering rules: the Mosaic TPU block-shape rule (the last two
dims of a block divisible by 8 and 128, or equal to the array's), the Triton rules (power-of-two arrays,
one operand type per `tl.dot`), memory-space checks and so on. A kernel can pass every interpret-mode test
and still fail to compile on the real chip. This file runs the real Pallas -> Mosaic / Triton lowering,
through `jax.export` with `platforms=["tpu"]` or `["cuda"]`, which needs no TPU or GPU and executes nothing
(all arguments are `jax.ShapeDtypeStruct`).

Kernels pick compiled vs interpret mode from `moe_tune.devices.platform()` at trace time; the `on_chip`
fixture patches that one function. Each backend is called through its public method (`gmm`, `tgmm`,
`gather`, `gather_reduce`) with its default config and the smallest and largest configs of its search
space. Each exported module must target the chip and hold exactly one call of the compiled kernel
(`tpu_custom_call` for Mosaic, `__gpu$xla.gpu.triton` for Triton), not the kernel inlined as plain HLO
(which is what the interpret-mode path lowers to).

Mixed operand dtypes are covered too: the Triton ragged_dot kernels once failed to lower for them (`tl.dot`
takes one operand type), which interpret mode, promoting like `jnp.dot`, never showed.

The negative tests (one per chip) pass a block shape that the chip's lowering rejects, by calling the kernel
below `config_error`: the lowering here rejects it while interpret mode takes it, so these tests prove the
lowering checks are really exercised.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import pytest

from moe_tune import devices
from moe_tune.kernels.gather.pallas_tpu import (
    PallasTpuGather,
    PallasTpuGatherConfig,
    PallasTpuGatherReduce,
    pallas_tpu_gather,
)
from moe_tune.kernels.gather.problem import GatherProblem
from moe_tune.kernels.gather.triton import TritonGather, TritonGatherConfig, TritonGatherReduce
from moe_tune.kernels.ragged_dot.megablox import MegabloxRaggedDot
from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem
from moe_tune.kernels.ragged_dot.triton import TritonRaggedDot

S = jax.ShapeDtypeStruct
TRITON_CALL = "__gpu$xla.gpu.triton"
MOSAIC_CALL = "tpu_custom_call"
# devices.platform() name -> (jax.export platform, the compiled kernel's custom call, checks to disable).
# The Triton call is not on jax.export's list of custom calls with stable compatibility guarantees.
CHIPS = {
    "tpu": ("tpu", MOSAIC_CALL, ()),
    "gpu": ("cuda", TRITON_CALL, (jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL),)),
}

# ragged_dot shapes: m not a multiple of any tile (row padding), n = 3 * 128 (a ragged last column tile).
M, K, N, GROUPS = 500, 256, 384, 4
# gather shapes: rows = 384 (the largest blocks leave a partial last block), hidden = 256.
TOKENS, TOP_K, HIDDEN = 96, 4, 256


@pytest.fixture
def on_chip(monkeypatch):
    """`on_chip("tpu")` / `on_chip("gpu")`: kernels traced afterwards take their compiled path."""
    return lambda platform: monkeypatch.setattr(devices, "platform", lambda: platform)


def export_for(platform: str, fn, *args) -> jax.export.Exported:
    """Lower `fn` for `platform` (a devices.platform() name). `fn` must be a fresh function: jit's trace
    cache is keyed on it, not on the patched platform."""
    target, _, disabled = CHIPS[platform]
    return jax.export.export(jax.jit(fn), platforms=[target], disabled_checks=disabled)(*args)


def assert_one_kernel_call(exported: jax.export.Exported, platform: str, what: str) -> str:
    """The module targets the chip and holds one compiled-kernel call (and no other chip's); returns the
    text of that call's line."""
    target, call, _ = CHIPS[platform]
    assert exported.platforms == (target,), what
    text = exported.mlir_module()
    calls = [line for line in text.splitlines() if f"stablehlo.custom_call @{call}(" in line]
    assert len(calls) == 1, f"{what}: {len(calls)} calls of {call}, want 1 (inlined as plain HLO?)"
    other = MOSAIC_CALL if call == TRITON_CALL else TRITON_CALL
    assert other not in text, what
    return calls[0]


def assert_triton_params(call: str, config, name: str, what: str) -> None:
    """The config's launch parameters reached the Triton call."""
    assert f'name = "{name}"' in call, what
    assert f"num_warps = {config.num_warps} : i32" in call, what
    if hasattr(config, "num_stages"):
        assert f"num_stages = {config.num_stages} : i32" in call, what


def configs_to_lower(backend, problem) -> list:
    """The default config, then the smallest and the largest of the search space (by product of fields)."""
    space = backend.search_space(problem)
    rest = sorted(space[1:], key=lambda c: (math.prod(dataclasses.astuple(c)), dataclasses.astuple(c)))
    picked = list(dict.fromkeys([space[0], *rest[:1], *rest[-1:]]))
    for config in picked:
        assert backend.config_error(config, problem) is None, config
    return picked


# --------------------------------------------------------------------------------------------------------
# ragged_dot: megablox (Mosaic TPU) and triton


RAGGED_DOT = {
    "megablox": (MegabloxRaggedDot(), "tpu", ("float32", "bfloat16")),
    "triton": (TritonRaggedDot(), "gpu", ("float32", "bfloat16", "float16")),
}
DIRECTIONS = ("fwd", "dlhs", "drhs")  # gmm, gmm(transpose_rhs=True), tgmm


def ragged_dot_call(backend, problem: RaggedDotProblem, config, with_offset: bool):
    """A fresh function running `problem.direction` through the backend's gmm / tgmm, and its arguments."""
    a_dtype, b_dtype, out_dtype = (jnp.dtype(d) for d in problem.operand_dtypes())
    m, k, n, g = problem.m, problem.k, problem.n, problem.groups
    sizes = [S((problem.num_group_sizes,), jnp.int32)] + ([S((), jnp.int32)] if with_offset else [])
    if problem.direction == "drhs":
        args = [S((m, k), a_dtype), S((m, n), b_dtype), *sizes]

        def fn(lhs, dout, group_sizes, group_offset=None):
            return backend.tgmm(lhs, dout, group_sizes, config=config, out_dtype=out_dtype, num_groups=g,
                                group_offset=group_offset)

        return fn, args
    transpose = problem.direction == "dlhs"
    args = [S((m, n) if transpose else (m, k), a_dtype), S((g, k, n), b_dtype), *sizes]

    def fn(lhs, rhs, group_sizes, group_offset=None):
        return backend.gmm(lhs, rhs, group_sizes, config=config, out_dtype=out_dtype, group_offset=group_offset,
                           transpose_rhs=transpose)

    return fn, args


def lower_ragged_dot(on_chip, name, problem, *, with_offset=False, configs=None):
    backend, platform, _ = RAGGED_DOT[name]
    on_chip(platform)
    out_shape = (problem.groups, problem.k, problem.n) if problem.direction == "drhs" else (
        (problem.m, problem.k) if problem.direction == "dlhs" else (problem.m, problem.n))
    for config in configs or configs_to_lower(backend, problem):
        what = f"{name} {problem.key_fields()} {config.label()}"
        fn, args = ragged_dot_call(backend, problem, config, with_offset)
        exported = export_for(platform, fn, *args)
        call = assert_one_kernel_call(exported, platform, what)
        assert [(a.shape, a.dtype) for a in exported.out_avals] == [
            (out_shape, jnp.dtype(problem.operand_dtypes()[2]))], what
        if platform == "gpu":
            assert_triton_params(call, config, "moe_tune_tgmm" if problem.direction == "drhs" else "moe_tune_gmm",
                                 what)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("name,dtype", [(n, d) for n, (_, _, dtypes) in RAGGED_DOT.items() for d in dtypes])
def test_ragged_dot_lowers(on_chip, name, dtype, direction):
    problem = RaggedDotProblem(M, K, N, GROUPS, dtype, dtype, dtype, direction=direction)
    lower_ragged_dot(on_chip, name, problem)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("name", list(RAGGED_DOT))
def test_ragged_dot_lowers_with_group_offset(on_chip, name, direction):
    """An expert-parallel shard: group_sizes covers 2 * GROUPS groups, the call computes GROUPS of them."""
    for dtype in RAGGED_DOT[name][2][:2]:
        problem = RaggedDotProblem(M, K, N, GROUPS, dtype, dtype, dtype, direction=direction,
                                   total_groups=2 * GROUPS)
        lower_ragged_dot(on_chip, name, problem, with_offset=True,
                         configs=[RAGGED_DOT[name][0].default_config(problem)])


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("name", list(RAGGED_DOT))
def test_ragged_dot_lowers_with_mixed_dtypes(on_chip, name, direction):
    """Low-precision inputs with a float32 output (the usual training setup) and the reverse: the gradients'
    matmuls then multiply operands of two dtypes (e.g. dlhs = float32 dout @ bfloat16 rhs)."""
    for low in RAGGED_DOT[name][2][1:]:
        for lhs_rhs, out in ((low, "float32"), ("float32", low)):
            problem = RaggedDotProblem(M, K, N, GROUPS, lhs_rhs, lhs_rhs, out, direction=direction)
            lower_ragged_dot(on_chip, name, problem, configs=[RAGGED_DOT[name][0].default_config(problem)])


# --------------------------------------------------------------------------------------------------------
# gather (dispatch) and gather_reduce (combine): pallas_tpu (Mosaic TPU) and triton


GATHER = {"pallas_tpu": (PallasTpuGather(), "tpu"), "triton": (TritonGather(), "gpu")}
GATHER_REDUCE = {"pallas_tpu": (PallasTpuGatherReduce(), "tpu"), "triton": (TritonGatherReduce(), "gpu")}
GATHER_DTYPES = ("float32", "bfloat16", "float16")


def assert_gather_kernel(exported, platform, config, name, out_shape, dtype, what):
    call = assert_one_kernel_call(exported, platform, what)
    assert [(a.shape, a.dtype) for a in exported.out_avals] == [(out_shape, jnp.dtype(dtype))], what
    if platform == "gpu":
        assert_triton_params(call, config, name, what)
    else:
        assert f'kernel_name = "{name}"' in call, what


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "unweighted"])
@pytest.mark.parametrize("dtype", GATHER_DTYPES)
@pytest.mark.parametrize("name", list(GATHER))
def test_gather_lowers(on_chip, name, dtype, weighted):
    backend, platform = GATHER[name]
    on_chip(platform)
    rows = TOKENS * TOP_K
    problem = GatherProblem(tokens=TOKENS, rows=rows, hidden=HIDDEN, dtype=dtype, weighted=weighted)
    args = [S((TOKENS, HIDDEN), dtype), S((rows,), jnp.int32), S((), jnp.int32), S((), jnp.int32)]
    # Weights of another dtype than x: kernels weight in float32 whatever they get.
    args += [S((rows,), jnp.bfloat16 if dtype == "float32" else jnp.float32)] if weighted else []
    for config in configs_to_lower(backend, problem):
        def fn(x, indices, start, end, weights=None):
            return backend.gather(x, indices, start, end, weights, config=config)

        what = f"{name} gather {problem.key_fields()} {config.label()}"
        kernel = "moe_tune_ragged_gather" if platform == "tpu" else "moe_tune_gather"
        assert_gather_kernel(export_for(platform, fn, *args), platform, config, kernel, (rows, HIDDEN), dtype, what)


@pytest.mark.parametrize("masked", [True, False], ids=["valid_mask", "all_valid"])
@pytest.mark.parametrize("dtype", GATHER_DTYPES)
@pytest.mark.parametrize("name", list(GATHER_REDUCE))
def test_gather_reduce_lowers(on_chip, name, dtype, masked):
    backend, platform = GATHER_REDUCE[name]
    on_chip(platform)
    rows = TOKENS * TOP_K
    problem = GatherProblem(tokens=TOKENS, rows=rows, hidden=HIDDEN, dtype=dtype)
    args = [S((rows, HIDDEN), dtype), S((rows,), jnp.int32), S((rows,), jnp.float32)]
    args += [S((rows,), jnp.bool_)] if masked else []
    for config in configs_to_lower(backend, problem):
        def fn(x, indices, weights, valid=None):
            return backend.gather_reduce(x, indices, weights, valid, TOP_K, config=config)

        what = f"{name} gather_reduce {problem.key_fields()} {config.label()}"
        assert_gather_kernel(export_for(platform, fn, *args), platform, config, "moe_tune_gather_reduce",
                             (TOKENS, HIDDEN), dtype, what)


# --------------------------------------------------------------------------------------------------------
# The lowering rules are really applied: block shapes interpret mode takes and the chip's lowering rejects


GATHER_ARGS = (S((TOKENS, HIDDEN), jnp.float32), S((TOKENS * TOP_K,), jnp.int32), S((), jnp.int32),
               S((), jnp.int32))


def test_mosaic_lowering_rejects_a_block_off_the_8_by_128_tiling(on_chip):
    """4 float32 rows per block: neither a multiple of 8 sublanes nor the whole array. config_error rejects
    it; past config_error, interpret mode lowers it, the Mosaic lowering does not."""
    problem = GatherProblem(tokens=TOKENS, rows=TOKENS * TOP_K, hidden=HIDDEN, dtype="float32", weighted=False)
    assert "multiple of 8" in PallasTpuGather().config_error(PallasTpuGatherConfig(4, 4), problem)

    def gather(x, indices, start, end):
        return pallas_tpu_gather(x, indices, start, end, None, block_rows=4, dmas_in_flight=4)

    # Interpret mode (the kernel tests' path): lowers for the CPU, as plain HLO with no Mosaic call.
    on_chip("cpu")
    assert MOSAIC_CALL not in jax.jit(gather).lower(*GATHER_ARGS).as_text()
    on_chip("tpu")
    with pytest.raises(ValueError, match=r"block shape are divisible by 8 and 128"):
        export_for("tpu", lambda *a: gather(*a), *GATHER_ARGS)  # a fresh function: not the cached trace


def test_triton_lowering_rejects_a_block_that_is_not_a_power_of_two(on_chip):
    """24 rows per program: Triton arrays must have a power-of-two size. config_error rejects it; past
    config_error (the backend's `gather` does not check), interpret mode lowers it for the GPU as plain HLO,
    the Triton lowering does not."""
    backend = TritonGather()
    config = TritonGatherConfig(block_rows=24, block_cols=256, num_warps=4)
    problem = GatherProblem(tokens=TOKENS, rows=TOKENS * TOP_K, hidden=HIDDEN, dtype="float32", weighted=False)
    assert "power of two" in backend.config_error(config, problem)

    def gather(x, indices, start, end):
        return backend.gather(x, indices, start, end, None, config=config)

    on_chip("cpu")
    assert TRITON_CALL not in export_for("gpu", gather, *GATHER_ARGS).mlir_module()
    on_chip("gpu")
    with pytest.raises(ValueError, match=r"size is a power of 2"):
        export_for("gpu", lambda *a: gather(*a), *GATHER_ARGS)
