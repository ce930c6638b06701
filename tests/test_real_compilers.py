"""Every Pallas kernel compiled by the real TPU and GPU compilers, on this CPU-only machine.

test_lowering.py stops at the Pallas -> Mosaic / Triton lowering; here the whole compiler runs (Mosaic TPU's
passes and VMEM allocation in libtpu, Triton and ptxas in the CUDA plugin) for compile-only devices of a TPU
v5e and an H100 (`moe_tune.targets`), which is where a config that does not fit the chip fails. The shapes
are those of one MoE layer of a model preset; each kernel is compiled in each mode (float, int8 per channel,
fp8 with 128-wide scale blocks) and direction for its default config and the largest config of its search
space as the chip's rules prune it (the one nearest the chip's limits).

The compilers come from the [tpu-compile] / [gpu-compile] wheels, which `make test` installs (apart, see
`targets/wheels.py`); without them these tests are skipped with the extra named. All compiles go through one
worker process per pytest process (`CompilePool`), which keeps its topologies between tests.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from moe_tune.core import devices
from moe_tune.kernels.ragged_dot.triton import TritonConfig
from moe_tune.layer.models import get_preset, kernel_problems
from moe_tune.targets import TARGETS, get_target, wheels
from moe_tune.targets.compile import CRASHED, OK, REJECTED
from moe_tune.targets.gpu_config import target_config_text
from moe_tune.targets.jobs import CompileJob, CompilePool, jobs_for, representative, search_space

PRESET, TOKENS = "qwen3-30b-a3b", 512  # m = 4096 rows, k = 2048, n = 768, 128 experts
MODES = {"bf16": None, "int8": {"rhs_quant": "int8"}, "fp8/128": {"rhs_quant": "float8_e4m3fn", "quant_block": 128}}

needs_tpu = pytest.mark.skipif(not wheels.available("tpu"),
                               reason="libtpu is missing: pip install 'moe-tune[tpu-compile]'")
needs_gpu = pytest.mark.skipif(not wheels.available("gpu"),
                               reason="the CUDA plugin is missing: pip install 'moe-tune[gpu-compile]'")


@pytest.fixture(scope="module")
def pool():
    with CompilePool(workers=1, timeout=300) as compile_pool:
        yield compile_pool


def layer_cases(mode: str):
    return kernel_problems(get_preset(PRESET), TOKENS, quant=MODES[mode])


def compile_all(pool: CompilePool, jobs: list[CompileJob]) -> None:
    """Compile every job; fail naming each one that did not compile, with the compiler's message."""
    assert jobs
    results = pool.compile(jobs)
    failed = [f"{j.target} {j.backend} {j.op} {j.problem.key_fields()} {j.config.label()}: {r.status} {r.message}"
              for j, r in zip(jobs, results) if not r.ok]
    assert not failed, "\n".join(failed)
    assert all(r.compile_s > 0 and r.memory for r in results)


def ragged_dot_jobs(target_name: str, backend: str, mode: str) -> list[CompileJob]:
    target = get_target(target_name)
    jobs = []
    for case in layer_cases(mode):
        if case.op == "ragged_dot" and case.role == "gate/up":
            space = search_space(target, case.op, backend, case.problem)
            # the default and the largest candidate (the one nearest the chip's limits)
            jobs += jobs_for(target, case.op, backend, case.problem, representative(space, extra=1))
    assert {j.problem.direction for j in jobs} == {"fwd", "dlhs", "drhs"}
    return jobs


@needs_tpu
@pytest.mark.parametrize("mode", list(MODES))
def test_megablox_compiles_for_tpu_v5e(pool, mode):
    compile_all(pool, ragged_dot_jobs("v5e", "megablox", mode))


@needs_gpu
@pytest.mark.parametrize("mode", list(MODES))
def test_triton_ragged_dot_compiles_for_h100(pool, mode):
    compile_all(pool, ragged_dot_jobs("h100", "triton", mode))


@needs_gpu
def test_triton_ragged_dot_compiles_for_h200_and_records_under_its_kind(pool, tmp_path):
    """`--target h200`: the H200's target config (sm_90, its memory) compiles a small triton ragged_dot, and
    the verdicts lie under the H200's device kind, apart from an H100's."""
    from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem
    from moe_tune.targets.compile_sweep import compile_candidates

    target = get_target("h200")
    problem = RaggedDotProblem(512, 512, 512, 4, lhs_dtype="bfloat16", rhs_dtype="bfloat16", out_dtype="bfloat16")
    configs = representative(search_space(target, "ragged_dot", "triton", problem))
    records = compile_candidates(target, "ragged_dot", "triton", problem, configs, profile_dir=tmp_path, pool=pool)
    assert [r.result.status for r in records] == [OK] * len(configs), [r.result for r in records]
    assert [p.name for p in tmp_path.iterdir()] == ["nvidia_h200"]


@pytest.mark.parametrize("backend,target", [
    pytest.param("pallas_tpu", "v5e", marks=needs_tpu), pytest.param("triton", "h100", marks=needs_gpu)])
def test_gathers_compile(pool, backend, target):
    """Dispatch and both combines (masked for expert parallelism, dense), default and extremes, float32."""
    chip = get_target(target)
    layer = lambda ep: kernel_problems(get_preset(PRESET), TOKENS, ep=ep, dtype="float32")
    cases = [c for c in layer(4) if c.op != "ragged_dot"] + [c for c in layer(1) if c.role == "combine"]
    assert {c.op for c in cases} == {"ragged_gather", "ragged_gather_reduce", "dense_gather_reduce"}
    jobs = [job for c in cases for job in jobs_for(chip, c.op, backend, c.problem,
                                                   representative(search_space(chip, c.op, backend, c.problem)))]
    compile_all(pool, jobs)


# --------------------------------------------------------------------------------------------------------
# The target table agrees with the compilers


@needs_gpu
@pytest.mark.parametrize("target", ["h100", "a100"])
def test_the_shared_memory_limit_is_the_compilers(pool, target):
    """A block far over any chip's shared memory fails with the limit the compiler uses: the table's."""
    problem = next(c.problem for c in layer_cases("bf16") if c.op == "ragged_dot")
    job = CompileJob(target, "ragged_dot", "triton", problem, TritonConfig(256, 256, 256, 4, 4))
    (result,) = pool.compile([job])
    assert result.status == REJECTED and "Shared memory size limit exceeded" in result.message, result
    available = int(re.search(r"available: (\d+)", result.message).group(1))
    assert available == get_target(target).shared_memory_per_block == devices.gpu_shared_memory_bytes(
        get_target(target).device_kind)


@needs_gpu
def test_a_job_that_kills_the_compiler_is_a_crash_and_the_pool_goes_on(pool):
    """Triton's fp8 conversion for an sm_80 target aborts the compiling process (an LLVM fatal error, not an
    exception; the triton backend's rules refuse fp8 below sm_89 for this reason): the pool reports it with
    the compiler's own words and compiles the next job in a new worker."""
    problem = next(c.problem for c in layer_cases("fp8/128") if c.op == "ragged_dot")
    crash = CompileJob("a100", "ragged_dot", "triton", problem, TritonConfig())
    after = CompileJob("a100", "ragged_dot", "triton", next(c.problem for c in layer_cases("bf16")), TritonConfig())
    results = pool.compile([crash, after])
    assert results[0].status == CRASHED, results[0]
    assert "only supported on compute capability >= 89" in results[0].message, results[0]
    assert results[1].status == OK, results[1]


# --------------------------------------------------------------------------------------------------------
# No compiler needed


def test_the_devices_budgets_are_the_target_tables():
    assert devices.TPU_SCOPED_VMEM_BYTES == min(t.scoped_vmem_bytes for t in TARGETS.values() if t.platform == "tpu")
    for target in TARGETS.values():
        if target.platform == "tpu":
            assert devices.tpu_scoped_vmem_bytes(target.device_kind) == target.scoped_vmem_bytes
        else:
            assert devices.gpu_shared_memory_bytes(target.device_kind) == target.gpu.shared_memory_per_block_optin
            assert devices.gpu_compute_capability(target.device_kind) == target.gpu.compute_capability
    assert devices.gpu_shared_memory_bytes("cpu") == devices.DEFAULT_GPU_SHARED_MEMORY_BYTES
    assert devices.gpu_compute_capability("cpu") is None


def test_gpu_target_config_text_holds_the_facts():
    text = target_config_text(get_target("h100"))
    assert "cuda_compute_capability { major: 9 minor: 0 }" in text
    assert "core_count: 132" in text and "shared_memory_per_block_optin: 232448" in text
    assert 'device_description_str: "NVIDIA H100 80GB HBM3"' in text
    with pytest.raises(ValueError, match="not a GPU target"):
        target_config_text(get_target("v5e"))


def test_the_extras_pin_the_wheels_the_workers_use():
    """The wheels follow the installed jax (its own libtpu pin, its version of the CUDA plugin); the extras
    list them for the jax the repo develops with."""
    import importlib.metadata

    pins = wheels.compile_wheels()
    jax_version = importlib.metadata.version("jax")
    assert pins["gpu"] == (f"jax-cuda12-plugin=={jax_version}", f"jax-cuda12-pjrt=={jax_version}")
    assert pins["tpu"][0].startswith("libtpu==")
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    extras = {p: tuple(pyproject["project"]["optional-dependencies"][f"{p}-compile"]) for p in ("tpu", "gpu")}
    if extras["gpu"][0] != pins["gpu"][0]:
        pytest.skip(f"the extras are written for another jax than the installed {jax_version}")
    assert extras == pins


def test_a_missing_compiler_is_a_one_line_error_naming_its_extra(monkeypatch, tmp_path):
    monkeypatch.setenv(wheels.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(wheels.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(wheels.MissingCompilerError) as error:
        CompilePool(workers=1).compile([CompileJob("v5e", "ragged_dot", "megablox", None, None)])
    assert "pip install 'moe-tune[tpu-compile]'" in str(error.value) and "\n" not in str(error.value)


def test_unknown_target_names_the_known_ones():
    with pytest.raises(ValueError, match="known targets: v4, v5e, v5p, v6e, h100, h200, a100, b200"):
        get_target("v7")


@needs_tpu
def test_compile_records_are_stored_with_the_tables_and_reused(pool, tmp_path):
    """A config that compiles and one over VMEM: both recorded under the target's device kind; a second run
    compiles nothing and the failing one is what a sweep on the chip skips."""
    from moe_tune.kernels.ragged_dot.megablox import MegabloxConfig
    from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem
    from moe_tune.targets.compile_sweep import compile_candidates
    from moe_tune.targets.records import records_path, uncompilable

    target = get_target("v5e")
    problem = RaggedDotProblem(1024, 2048, 2048, 4)
    configs = [MegabloxConfig(128, 512, 512), MegabloxConfig(1024, 2048, 1024)]
    fresh = []
    first = compile_candidates(target, "ragged_dot", "megablox", problem, configs, profile_dir=tmp_path, pool=pool,
                               on_record=lambda record, compiled: fresh.append(compiled))
    assert [r.result.status for r in first] == [OK, REJECTED] and fresh == [True, True]
    assert first[0].result.memory and "VMEM" in first[1].result.message.upper()
    path = records_path(tmp_path, target.device_kind, "ragged_dot")
    assert path == tmp_path / "tpu_v5_lite" / "ragged_dot.compile-records.jsonl"
    again = compile_candidates(target, "ragged_dot", "megablox", problem, configs, profile_dir=tmp_path, pool=pool,
                               on_record=lambda record, compiled: fresh.append(compiled))
    assert [r.result for r in again] == [r.result for r in first] and fresh == [True, True, False, False]
    assert list(uncompilable(tmp_path, target.device_kind, "ragged_dot", "megablox", problem)) == [configs[1].label()]


def test_a_sweep_skips_the_configs_its_chips_compile_records_refuse(tmp_path):
    """Records of this machine's device kind (as `--target` writes them for a chip): the sweep's search
    space drops the configs they say fail, and keeps the default, which a sweep always measures."""
    from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem
    from moe_tune.targets.compile import CompileResult
    from moe_tune.targets.records import CompileRecord, append_records, record_key, record_versions, records_path
    from moe_tune.tuner.request import SweepPlan, SweepRequest

    problem = RaggedDotProblem(256, 256, 256, 2)
    request = SweepRequest.make("ragged_dot", problem, backend="tiled", profile_dir=str(tmp_path))
    full = SweepPlan(request).space
    refused = [full[0], full[2]]
    append_records(records_path(tmp_path, devices.device_kind(), "ragged_dot"), [
        CompileRecord(record_key("ragged_dot", problem, "tiled"), c.to_dict(),
                      CompileResult("here", REJECTED, "too big"), record_versions("ragged_dot", "tiled"))
        for c in refused])
    assert SweepPlan(request).space == [full[0], full[1], *full[3:]]


@needs_tpu
def test_sweep_target_compiles_every_candidate_and_resumes(tmp_path):
    from click.testing import CliRunner

    from moe_tune.cli import cli

    args = ["sweep", "--op", "ragged_dot", "--m", "512", "--k", "512", "--n", "512", "--groups", "4", "--target",
            "v5e", "--profile-dir", str(tmp_path), "--workers", "1", "--max-candidates", "3"]
    first = CliRunner().invoke(cli, args)
    assert first.exit_code == 0, first.output
    assert "[megablox]: 3 of 3 compile" in first.output
    lines = (tmp_path / "tpu_v5_lite" / "ragged_dot.compile-records.jsonl").read_text().splitlines()
    assert len(lines) == 3
    again = CliRunner().invoke(cli, args)
    assert again.exit_code == 0 and "3 from earlier runs" in again.output, again.output


def test_a_backend_the_chip_cannot_run_goes_to_the_fallback_with_one_warning(monkeypatch):
    """`Backend.chip_error` (the triton fp8 kernels below sm_89): the op takes its fallback, with its default
    config even when the caller gave one (a config of the other backend), and warns once."""
    from moe_tune.kernels.ragged_dot.definition import RAGGED_DOT
    from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem

    tiled = RAGGED_DOT.backends.get("tiled")
    monkeypatch.setattr(type(tiled), "chip_error", lambda self, problem: "the test's missing instruction")
    problem = RaggedDotProblem(64, 128, 128, 2)
    with pytest.warns(RuntimeWarning, match="cannot run here: the test's missing instruction") as warned:
        first = RAGGED_DOT.resolve_config("tiled", problem)
        second = RAGGED_DOT.resolve_config("tiled", problem, tiled.default_config(problem))
    assert first.backend.name == second.backend.name == RAGGED_DOT.fallback
    assert len([w for w in warned if "missing instruction" in str(w.message)]) == 1
