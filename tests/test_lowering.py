"""Every Pallas gather kernel of the package lowers for its chip, here on a CPU-only machine.

The kernel tests elsewhere in the suite run the Pallas kernels in interpret mode, which executes the kernel
body as ordinary JAX ops and skips the chip's lowering rules: the Mosaic TPU block-shape rule (the last two
dims of a block divisible by 8 and 128, or equal to the array's), the Triton rules (power-of-two arrays,
one operand type per `tl.dot`), memory-space checks and so on. A kernel can pass every interpret-mode test
and still fail to compile on the real chip. This file runs the real Pallas -> Mosaic / Triton lowering,
through `jax.export` with `platforms=["tpu"]` or `["cuda"]`, which needs no TPU or GPU and executes nothing
(all arguments are `jax.ShapeDtypeStruct`).

The ragged_dot backends' lowering (float, mixed-dtype, group_offset and quantized problems, every direction)
is a test each backend inherits from `ragged_dot_base.RaggedDotBackendTests`, with the helpers used
here.

Kernels pick compiled vs interpret mode from `moe_tune.core.devices.platform()` at trace time; the `on_chip`
fixture (conftest) patches that one function. Each backend is called through its public method (`gather`,
`gather_reduce`) with its default config and the smallest and largest configs of its search space. Each
exported module must target the chip and hold exactly one call of the compiled kernel (`tpu_custom_call` for
Mosaic, `__gpu$xla.gpu.triton` for Triton), not the kernel inlined as plain HLO (which is what the
interpret-mode path lowers to).

The negative tests (one per chip) pass a block shape that the chip's lowering rejects, by calling the kernel
below `config_error`: the lowering here rejects it while interpret mode takes it, so these tests prove the
lowering checks are really exercised.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from ragged_dot_base.lowering import (MOSAIC_CALL, TRITON_CALL, S, assert_one_kernel_call, assert_triton_params,
                                      configs_to_lower, export_for)

from moe_tune.kernels.gather.pallas_tpu import (PallasTpuGather, PallasTpuGatherConfig, PallasTpuGatherReduce,
                                                pallas_tpu_gather)
from moe_tune.kernels.gather.problem import GatherProblem
from moe_tune.kernels.gather.triton import TritonGather, TritonGatherConfig, TritonGatherReduce

# gather shapes: rows = 384 (the largest blocks leave a partial last block), hidden = 256.
TOKENS, TOP_K, HIDDEN = 96, 4, 256


# --------------------------------------------------------------------------------------------------------
# gather (dispatch) and gather_reduce (combine): pallas_tpu (Mosaic TPU) and triton


GATHER = {"pallas_tpu": (PallasTpuGather(), "tpu"), "triton": (TritonGather(), "gpu")}
GATHER_REDUCE = {"pallas_tpu": (PallasTpuGatherReduce(), "tpu"), "triton": (TritonGatherReduce(), "gpu")}
GATHER_DTYPES = ("float32", "bfloat16", "float16")
# pallas_tpu refuses 16-bit dtypes: the real Mosaic compiler rejects its one-row DMAs of packed arrays
# (tests/test_real_compilers.py), though the lowering here takes them.
GATHER_CASES = [(name, dtype) for name in GATHER for dtype in GATHER_DTYPES
                if name != "pallas_tpu" or dtype == "float32"]


def assert_gather_kernel(exported, platform, config, name, out_shape, dtype, what):
    call = assert_one_kernel_call(exported, platform, what)
    assert [(a.shape, a.dtype) for a in exported.out_avals] == [(out_shape, jnp.dtype(dtype))], what
    if platform == "gpu":
        assert_triton_params(call, config, name, what)
    else:
        assert f'kernel_name = "{name}"' in call, what


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "unweighted"])
@pytest.mark.parametrize("name,dtype", GATHER_CASES)
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
@pytest.mark.parametrize("name,dtype", GATHER_CASES)
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
