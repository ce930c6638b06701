"""Kernels compiled by the real compilers (compile-only devices, see tests/test_real_compilers.py) at the dtypes
whose layouts the compilers are strict about: the pallas_tpu gathers on bfloat16 rows for a TPU v5e, both
ways they move them (uint32 halves at hidden 256 and 2048, float32 rows at hidden 128)."""

from __future__ import annotations

import pytest

from moe_tune.core.chips import get_target
from moe_tune.kernels.gather.pallas_tpu_rows import staging
from moe_tune.kernels.gather.problem import GatherProblem
from moe_tune.targets import wheels
from moe_tune.targets.jobs import CompilePool, config_error, jobs_for, representative, search_space

needs_tpu = pytest.mark.skipif(not wheels.available("tpu"),
                               reason="libtpu is missing: pip install 'moe-tune[tpu-compile]'")
GATHER_CASES = [(op, weighted) for op in ("ragged_gather", "ragged_gather_reduce", "dense_gather_reduce")
                for weighted in ((True, False) if op == "ragged_gather" else (True,))]


@pytest.fixture(scope="module")
def pool():
    with CompilePool(workers=1, timeout=300) as compile_pool:
        yield compile_pool


@needs_tpu
@pytest.mark.parametrize("hidden", [256, 128, 2048])
def test_bfloat16_gathers_compile_for_tpu_v5e(pool, hidden):
    """Dispatch (weighted or not) and both combines: the default, the smallest and the largest candidate."""
    chip = get_target("v5e")
    jobs = []
    for op, weighted in GATHER_CASES:
        problem = GatherProblem(tokens=64, rows=128, hidden=hidden, dtype="bfloat16", weighted=weighted)
        space = search_space(chip, op, "pallas_tpu", problem)
        assert all(config_error(chip, op, "pallas_tpu", c, problem) is None for c in space)
        jobs += jobs_for(chip, op, "pallas_tpu", problem, representative(space))
    results = pool.compile(jobs)
    failed = [f"{j.op} {j.problem.key_fields()} {j.config.label()}: {r.status} {r.message}"
              for j, r in zip(jobs, results) if not r.ok]
    assert not failed, "\n".join(failed)
    assert staging("bfloat16", hidden) == ("wide" if hidden == 128 else "halves")


def test_float16_gathers_are_refused_with_the_reason():
    """Mosaic fails to legalize float16 vector stores (v5e, v6e): the rules refuse float16 for every config,
    so the op runs its plain-JAX fallback."""
    chip = get_target("v5e")
    for op, weighted in GATHER_CASES:
        problem = GatherProblem(tokens=64, rows=128, hidden=256, dtype="float16", weighted=weighted)
        for config in search_space(chip, op, "pallas_tpu", problem):
            assert "cannot store float16 vectors" in config_error(chip, op, "pallas_tpu", config, problem)
