"""The benchmark scripts run end to end (at toy sizes) and write the JSON they promise. No timing is
asserted: these only keep the scripts runnable for whoever has a machine to measure on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from run_once import check_env

ROOT = Path(__file__).resolve().parents[1]


def _run(args, tmp_path):
    # check_env: the scripts on the CPU, compiled fast (their timings are not asserted)
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=check_env(MOE_TUNE_PROFILE_DIR=str(tmp_path / "p")))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.slow
def test_targets_benchmark_prints_every_target(tmp_path):
    """The issue's one command, at toy sizes: every ragged_dot direction, every dispatch/combine fraction and
    the tuner each land in the summary and the JSON."""
    # two dtypes, not the default three: each adds a sweep per case, and float16 runs the same code paths
    out = _run(["benchmarks/targets_cpu.py", "--small", "--samples", "1", "--dtypes", "float32,bfloat16",
                "--json", str(tmp_path / "t.json")], tmp_path)
    summary, results = json.loads((tmp_path / "t.json").read_text())["results"]
    targets = [row["target"] for row in summary["summary"]]
    for direction in ("fwd", "dlhs", "drhs"):
        for ratio in ("tuned/roofline", "xla/tuned", "skewed/balanced"):
            assert f"ragged_dot {ratio} toy g=8 {direction}" in targets
    assert [r["shape"]["direction"] for r in results["ragged_dot"]] == ["fwd", "dlhs", "drhs"]
    for r in results["ragged_dot"]:
        assert set(r["times_s"]) == {"tuned", "default", "xla", "dense", "skewed", "copy"}
        assert all(t > 0 for t in r["times_s"].values()) and r["roofline_s"] >= r["times_s"]["dense"]
    gather = [(r["op"], r["ep"]) for r in results["gather"]]
    assert gather == [("ragged_gather", 1), ("ragged_gather", 4), ("ragged_gather", 16), ("ragged_gather_reduce", 1),
                      ("ragged_gather_reduce", 4), ("ragged_gather_reduce", 16), ("dense_gather_reduce", 1)]
    for r in results["gather"]:
        assert set(r["times_s"]) == {"tuned", "default", "fallback", "copy", "output_write"} and r["copy_gbps"] > 0
    assert results["gather"][0]["valid_fraction"] == 1.0 and 0.1 < results["gather"][1]["valid_fraction"] < 0.4
    assert sum("time/(fraction x full time)" in t for t in targets) == 4
    assert results["tuner"]["compiles_per_candidate"] == 1.0 and "tuner: 2-candidate sweep wall (s)" in targets
    assert f"of {len(targets)} met" in out and out.count("time ratios:") == 3


@pytest.mark.slow
def test_gpu_check_smoke(tmp_path):
    # triton only: mosaic_gpu's cases on CPU are its interpreter (tests/test_ragged_dot_mosaic_gpu.py)
    out = _run(["benchmarks/gpu_check.py", "--small", "--directions", "fwd,drhs", "--max-candidates", "2",
                "--samples", "1", "--backends", "triton", "--quant", "int8,int4", "--layers", "toy:16:2",
                "--layer-candidates", "2", "--out", str(tmp_path)], tmp_path)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["meta"]["device_kind"]
    layer, *kernels = report["cases"]  # the layer first: fused (triton, plain JAX) vs unfused, fwd and fwd+bwd
    assert layer["op"] == "moe_layer" and "error" not in layer, layer.get("traceback")
    assert {s["op"] for s in layer["sweeps"]} == {"ragged_dot", "ragged_gather", "ragged_gather_reduce", "fused_moe"}
    assert all(error < 0.02 for error in layer["rel_error"].values()) and set(layer["rel_error"]) == {
        "unfused", "fused_jax", "fused_triton"}
    assert all(r["ratios"]["unfused_vs_fused_triton"] > 0 for r in layer["modes"].values())
    report["cases"] = kernels
    ops = [(case.get("op", "ragged_dot"), case.get("quant")) for case in report["cases"]]
    assert ops == [("ragged_dot", None), ("ragged_dot", None), ("ragged_dot", "int8"), ("ragged_dot", "int4"),
                   ("ragged_gather", None), ("ragged_gather_reduce", None), ("dense_gather_reduce", None)]
    for case in report["cases"]:
        assert "error" not in case, case.get("traceback")
        assert case["default_error"] < 0.05 and case["sweep"]["candidates"]["tried"] == 2
    for case in report["cases"][:4]:  # each ragged_dot case: where its winner's time goes, per HLO op
        (winner, *_) = case["breakdown"]["breakdowns"]
        assert winner["label"] == "winner" and winner["ops"] and winner["total_s"] > 0
        assert sum(op["share"] for op in winner["ops"]) == pytest.approx(1.0)
    for case in report["cases"][2:4]:  # the quantized weights: fwd only (drhs reads no weights)
        assert case["shape"]["rhs_qdtype"] in ("int8", "int4") and case["shape"]["direction"] == "fwd"
        assert 0 < case["quantization_error"] < 0.1 and case["vs_bf16"] > 0
    tables = {path.name for path in (tmp_path / "tables").glob("*/*.json")}  # kept, to ship from a lent GPU
    assert {"ragged_dot.json", "ragged_gather.json", "dense_gather_reduce.json", "fused_moe.json"} <= tables
    assert "wrote" in out


def test_gpu_check_lists_its_default_plan(tmp_path):
    """What one lent GPU's call runs by default, in order: the qwen3 layer first, then DeepSeek-V3's (prefill and
    decode) and Mixtral's ragged_dot on triton (float, then quantized: 4-bit too), mosaic_gpu and
    mosaic_gpu_quant, then dispatch and combine."""
    labels = _run(["benchmarks/gpu_check.py", "--list"], tmp_path).splitlines()
    assert labels[0] == "layer qwen3-30b-a3b:4096:1"
    assert labels[1:4] == [f"deepseek-v3 (ep=8) triton {d}" for d in ("fwd", "dlhs", "drhs")]
    assert {"deepseek-v3 (ep=8) triton int4 fwd", "deepseek-v3 (ep=8) triton mxfp4 dlhs",
            "mixtral-8x7b mosaic_gpu drhs", "deepseek-v3 (ep=8) mosaic_gpu_quant int8 fwd",
            "deepseek-v3 decode (ep=8) mosaic_gpu_quant int4 fwd", "deepseek-v3 decode (ep=8) triton int4 fwd"
            } <= set(labels)
    # 3 ragged_dot shapes x 3 backends x (3 float directions + 4 weight formats x fwd, dlhs)
    assert labels[-1] == "mixtral-8x7b dense_gather_reduce" and len(labels) == 1 + 3 * 3 * (3 + 4 * 2) + 3


@pytest.mark.slow
def test_gpu_check_starts_no_case_after_its_time_limit(tmp_path):
    """A device lease ends: the first case runs, the rest are listed as not run, and the JSON still comes back."""
    out = _run(["benchmarks/gpu_check.py", "--small", "--layers", "", "--ops", "ragged_dot,ragged_gather",
                "--directions", "fwd", "--backends", "triton", "--quant", "int8", "--max-candidates", "1",
                "--samples", "1", "--time-limit", "0.001", "--out", str(tmp_path)], tmp_path)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [case["shape"]["direction"] for case in report["cases"]] == ["fwd"]
    assert report["not_run"] == ["toy triton int8 fwd", "toy (ep=2) ragged_gather"] and "not run:" in out


@pytest.mark.slow
def test_strategies_benchmark_compares_with_grid(tmp_path):
    out = _run(["benchmarks/strategies_cpu.py", "--m", "128", "--k", "64", "--n", "64", "--groups", "4",
                "--samples", "1", "--workers", "1", "--random-budgets", "3", "--coordinate-budgets", "none",
                "--seeds", "0", "--compare-samples", "1", "--json", str(tmp_path / "s.json")], tmp_path)
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["meta"]["device_kind"] and "grid" in out and "coordinate" in out and "random" in out


@pytest.mark.slow
def test_sweep_benchmark_reports_stages_and_compiles(tmp_path):
    out = _run(["benchmarks/sweep_cpu.py", "--candidates", "2", "--samples", "1", "--workers", "1,2",
                "--json", str(tmp_path / "w.json")], tmp_path)
    runs = json.loads((tmp_path / "w.json").read_text())["results"]
    assert [r["workers"] for r in runs] == [1, 2] and all(r["compiles_per_candidate"] == 1.0 for r in runs)
    assert runs[1]["main_process_compiles"] == 0 and "compile stage" in out


@pytest.mark.slow
def test_quant_benchmark_times_every_mode(tmp_path):
    """quant_cpu.py at toy sizes: every mode tuned and timed beside the float baselines, dequantize-then-f32
    for the quantized ones, the bytes and both errors recorded, and the int8 target printed."""
    out = _run(["benchmarks/quant_cpu.py", "--small", "--json", str(tmp_path / "q.json")], tmp_path)
    summary, results = json.loads((tmp_path / "q.json").read_text())["results"]
    [case] = results["cases"]
    modes = case["modes"]
    assert list(modes) == ["float32", "bfloat16", "int8", "int8/128", "fp8/128", "w8a8", "int8 a16", "fp8 a16",
                           "int4/128", "mxfp4", "w8a8 dynamic", "int4 a16", "mxfp4 a16"]
    assert {"dense", "copy", "deq+f32:int8", "deq+f32:w8a8"} <= set(case["times_s"])
    assert modes["int8"]["weight_bytes"] < modes["bfloat16"]["weight_bytes"] < modes["float32"]["weight_bytes"]
    for mode, r in modes.items():
        assert r["time_s"] > 0 and r["error_vs_dequantized"] < 1e-2 and r["tuned_config"]
        assert (r["deq_f32_time_s"] is None) == (mode in ("float32", "bfloat16"))
    assert 0 < modes["int8"]["error_vs_unquantized"] < 0.1 and not modes["float32"]["differs_from_f32"]
    assert [s["target"] for s in summary["summary"]] == [
        *(f"{mode} weight-only vs tuned f32, toy m=256 g=4" for mode in ("int8", "int8 a16")),
        *(f"{mode} vs tuned {base}, toy m=256 g=4" for mode, base in (("int4/128", "int8"), ("int4 a16", "int8 a16"),
                                                                      ("mxfp4", "fp8/128"), ("mxfp4 a16", "fp8 a16")))]
    assert modes["int4/128"]["weight_bytes"] < modes["int8"]["weight_bytes"]  # two values a byte
    assert case["bound"] in ("memory", "compute") and all(t > 0 for t in case["f32_floors_s"].values())
    assert all(s["bound"] == case["bound"] for s in summary["summary"]) and f"{case['bound']}-bound on this machine" in out
    assert "tuned tiles differ from float32's" in out
    # --print re-prints the saved run: the same case and summary lines, nothing measured again
    again = _run(["benchmarks/quant_cpu.py", "--print", str(tmp_path / "q.json")], tmp_path)
    measured_lines = [line for line in out.splitlines() if line.startswith("  ") and "[" in line]
    assert measured_lines and all(line in again.splitlines() for line in measured_lines)
    assert "re-printed from" in again and "tuned tiles differ from float32's" in again
