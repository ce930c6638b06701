"""The `pallas_tpu` dispatch and combine kernels against the float64 references, in Pallas TPU interpret mode
off TPU (DMAs and semaphores simulated on the CPU; fresh VMEM is NaN, out-of-bounds DMAs raise)."""

from __future__ import annotations

import pytest
from gather_backend_tests import GatherBackendTests, GatherReduceBackendTests

from moe_tune.kernels.gather.pallas_tpu import (MAX_DMAS_IN_FLIGHT, PallasTpuGather, PallasTpuGatherConfig,
                                                PallasTpuGatherReduce, PallasTpuGatherReduceConfig)
from moe_tune.kernels.gather.problem import GatherProblem

# Interpret mode is slow, so small shapes: 96 rows / 24 tokens, and 21 rows / 7 tokens (a partial last block),
# each run with the default (one block spanning the array) and the smallest block (8 or 16 rows / tokens:
# several blocks, some wholly outside a range).
SHAPES = ((24, 4, 128), (7, 3, 256))
MAX_CONFIGS = 2
# bfloat16 rows travel as 32-bit words (pallas_tpu_rows.py): hidden 128 as float32 rows, 256 as uint32 halves.
# Mosaic cannot store float16 vectors: the rules refuse it.
DTYPES = ("float32", "bfloat16")


class TestPallasTpuGather(GatherBackendTests):
    backend = "pallas_tpu"
    shapes = SHAPES
    max_configs = MAX_CONFIGS
    dtypes = DTYPES

    def invalid_with_reasons(self, problem):
        too_tall = -(-problem.rows // 8) * 8 + 8
        return [({"block_rows": 0}, "block_rows must be a positive integer"),
                ({"block_rows": 12}, "block_rows=12 is not a multiple of 8"),
                ({"block_rows": too_tall}, f"block_rows={too_tall} exceeds {too_tall - 8}"),
                ({"block_rows": 8, "dmas_in_flight": 0}, "dmas_in_flight must be a positive integer"),
                ({"block_rows": 8, "dmas_in_flight": 16}, "exceeds the 8 row DMAs one grid step can issue"),
                ({"block_rows": too_tall - 8, "dmas_in_flight": MAX_DMAS_IN_FLIGHT + 1},
                 f"dmas_in_flight={MAX_DMAS_IN_FLIGHT + 1} exceeds {MAX_DMAS_IN_FLIGHT} (one DMA semaphore each)")]


class TestPallasTpuGatherReduce(GatherReduceBackendTests):
    backend = "pallas_tpu"
    shapes = SHAPES
    max_configs = MAX_CONFIGS
    dtypes = DTYPES

    def invalid_with_reasons(self, problem):
        too_tall = -(-problem.tokens // 8) * 8 + 8
        per_block = 8 * problem.top_k
        return [({"block_tokens": -8}, "block_tokens must be a positive integer"),
                ({"block_tokens": 4}, "block_tokens=4 is not a multiple of 8"),
                ({"block_tokens": too_tall}, f"block_tokens={too_tall} exceeds {too_tall - 8}"),
                ({"block_tokens": 8, "dmas_in_flight": 0}, "dmas_in_flight must be a positive integer"),
                ({"block_tokens": 8, "dmas_in_flight": per_block + 1},
                 f"exceeds the {per_block} row DMAs one grid step can issue"),
                ({"block_tokens": too_tall - 8, "dmas_in_flight": MAX_DMAS_IN_FLIGHT + 1},
                 f"dmas_in_flight={MAX_DMAS_IN_FLIGHT + 1} exceeds {MAX_DMAS_IN_FLIGHT} (one DMA semaphore each)")]


@pytest.mark.parametrize("impl", [PallasTpuGather(), PallasTpuGatherReduce()], ids=["gather", "gather_reduce"])
def test_unsupported_shapes_are_rejected_with_a_reason(impl):
    cfg = impl.default_config(GatherProblem(tokens=64, rows=512, hidden=128))
    assert "multiple of 128" in impl.config_error(cfg, GatherProblem(tokens=64, rows=512, hidden=200))
    assert "SMEM" in impl.config_error(cfg, GatherProblem(tokens=65536, rows=524288, hidden=128))
    assert "float16 vectors" in impl.config_error(cfg, GatherProblem(tokens=64, rows=512, hidden=128, dtype="float16"))


def test_vmem_budget_rejects_huge_blocks():
    problem = GatherProblem(tokens=4096, rows=32768, hidden=8192, dtype="float32")
    assert "VMEM" in PallasTpuGather().config_error(PallasTpuGatherConfig(1024, 16), problem)
    assert "VMEM" in PallasTpuGatherReduce().config_error(PallasTpuGatherReduceConfig(256, 16), problem)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,top_k,hidden", [(1, 1, 128), (5, 2, 128), (4096, 8, 7168), (16384, 8, 16384),
                                                 (256, 64, 2048), (32768, 1, 65536)])
def test_default_config_is_valid(dtype, tokens, top_k, hidden):
    problem = GatherProblem(tokens=tokens, rows=tokens * top_k, hidden=hidden, dtype=dtype)
    for impl in (PallasTpuGather(), PallasTpuGatherReduce()):
        assert impl.config_error(impl.default_config(problem), problem) is None, impl
