"""Kernels compiled by the real compilers (compile-only devices, see tests/test_real_compilers.py) at the dtypes
whose layouts the compilers are strict about: the pallas_tpu gathers on bfloat16 rows for a TPU v5e, both
ways they move them (uint32 halves at hidden 256 and 2048, float32 rows at hidden 128), and the triton fused_moe
kernels on 4-bit weights (mxfp4, int4) for an H100, with their interpret-mode results against float64."""

from __future__ import annotations

import types

import jax
import pytest
from fused_moe_base import relative_error

from moe_tune.core.chips import get_target
from moe_tune.kernels import get_op
from moe_tune.kernels.gather.pallas_tpu_rows import staging
from moe_tune.kernels.gather.problem import GatherProblem
from moe_tune.layer.models import get_preset, kernel_problems
from moe_tune.targets import wheels
from moe_tune.targets.compile_sweep import compile_sweeps
from moe_tune.targets.jobs import CompilePool, config_error, jobs_for, representative, search_space

needs_tpu = pytest.mark.skipif(not wheels.available("tpu"),
                               reason="libtpu is missing: pip install 'moe-tune[tpu-compile]'")
needs_gpu = pytest.mark.skipif(not wheels.available("gpu"),
                               reason="the CUDA plugin is missing: pip install 'moe-tune[gpu-compile]'")
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


@needs_tpu
def test_bfloat16_gathers_compile_for_tpu_v5e_at_a_layer(pool):
    """Qwen3-30B-A3B at 512 tokens (hidden 2048, top-8): dispatch and combine on a shard of ep 4, the dense
    combine; the default and the extremes the VMEM rule leaves."""
    chip = get_target("v5e")
    layer = lambda ep: kernel_problems(get_preset("qwen3-30b-a3b"), 512, ep=ep, dtype="bfloat16")
    cases = [c for c in layer(4) if c.op != "ragged_dot"] + [c for c in layer(1) if c.role == "combine"]
    assert {c.op for c in cases} == {"ragged_gather", "ragged_gather_reduce", "dense_gather_reduce"}
    jobs = [job for c in cases for job in jobs_for(chip, c.op, "pallas_tpu", c.problem,
                                                   representative(search_space(chip, c.op, "pallas_tpu", c.problem)))]
    results = pool.compile(jobs)
    failed = [f"{j.op} {j.problem.key_fields()} {j.config.label()}: {r.status} {r.message}"
              for j, r in zip(jobs, results) if not r.ok]
    assert not failed, "\n".join(failed)


def test_float16_gathers_are_refused_with_the_reason():
    """Mosaic fails to legalize float16 vector stores (v5e, v6e): the rules refuse float16 for every config,
    so the op runs its plain-JAX fallback."""
    chip = get_target("v5e")
    for op, weighted in GATHER_CASES:
        problem = GatherProblem(tokens=64, rows=128, hidden=256, dtype="float16", weighted=weighted)
        for config in search_space(chip, op, "pallas_tpu", problem):
            assert "cannot store float16 vectors" in config_error(chip, op, "pallas_tpu", config, problem)


# --------------------------------------------------------------------------------------------------------
# The triton fused_moe kernels on 4-bit weights (mxfp4 codes travel as int4 bits, decoded in the kernel)

FUSED_CASES = [("dispatch", "fwd", "silu"), ("dispatch", "bwd", None), ("combine", "fwd", None),
               ("combine", "bwd", None)]
FOUR_BIT = [{"rhs_quant": "mxfp4"}, {"rhs_quant": "int4", "quant_block": 64}]


def _fused_problem(stage, direction, glu, dtype="float32", **quant):
    return get_op("fused_moe").problem(tokens=16, top_k=2, k=128, n=256, groups=4, stage=stage,
                                       direction=direction, glu=glu, dtype=dtype, **quant)


@pytest.mark.parametrize("quant", FOUR_BIT, ids=lambda q: q["rhs_quant"])
@pytest.mark.parametrize("stage,direction,glu", FUSED_CASES)
def test_triton_fused_moe_on_4_bit_weights_matches_float64(stage, direction, glu, quant):
    """Interpret mode off GPU, the default config: the same as the float64 reference on the dequantized
    weights."""
    op = get_op("fused_moe")
    backend = op.backends.get("triton")
    problem = _fused_problem(stage, direction, glu, **quant)
    config = backend.default_config(problem)
    assert backend.config_error(config, problem) is None
    inputs = op.make_inputs(problem, "balanced", 0)
    expected = op.reference(problem, inputs)
    out = jax.jit(lambda a: op.run(backend, config, problem, a))(jax.device_put(inputs))
    assert relative_error(out, expected) <= 1e-5


@needs_gpu
def test_triton_fused_moe_on_4_bit_weights_compiles_for_h100(pool):
    """Every stage and direction, bfloat16 activations, mxfp4 and int4 weights: the default and the largest
    candidate of the search space the H100's rules leave."""
    chip = get_target("h100")
    jobs = []
    for quant in FOUR_BIT:
        for stage, direction, glu in FUSED_CASES:
            problem = _fused_problem(stage, direction, glu, "bfloat16", **quant)
            space = search_space(chip, "fused_moe", "triton", problem)
            jobs += jobs_for(chip, "fused_moe", "triton", problem, representative(space, extra=1))
    results = pool.compile(jobs)
    failed = [f"{j.problem.key_fields()} {j.config.label()}: {r.status} {r.message}"
              for j, r in zip(jobs, results) if not r.ok]
    assert not failed, "\n".join(failed)


@needs_tpu
def test_a_sweep_the_rules_refuse_is_refused_with_their_reason_and_not_compiled(tmp_path):
    """`sweep --target`: float16 for the pallas_tpu gather, whose rules refuse every config (its default still
    leads the space), is one refusal naming the reason; nothing is compiled or stored."""
    sweep = types.SimpleNamespace(op="ragged_gather", backend="pallas_tpu",
                                  problem=GatherProblem(tokens=64, rows=128, hidden=256, dtype="float16"))
    (summary,) = compile_sweeps([sweep], get_target("v5e"), profile_dir=tmp_path, workers=1)
    assert (summary.candidates, summary.ok, summary.failed, summary.compile_s) == (1, 0, 1, 0.0)
    assert summary.first_failure.startswith("rejected: refused: dtype float16: Mosaic cannot store float16")
    assert not list(tmp_path.rglob("*.compile-records.jsonl"))
