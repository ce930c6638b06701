"""benchmarks/heldout_cpu.py end to end at toy size (a 2-count ladder, one held-out count): the sweeps, the
ladder's boundary, the side-by-side comparison, and the JSON it promises. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_heldout_benchmark_toy_run_writes_ratios_and_resumes(tmp_path):
    out = tmp_path / "o.json"
    args = [sys.executable, "benchmarks/heldout_cpu.py", "--small", "--profile-dir", str(tmp_path / "p"),
            "--workers", "1", "--samples", "2", "--sweep-samples", "1", "--json", str(out)]
    env = {**os.environ, "MOE_TUNE_PROFILE_DIR": str(tmp_path / "env")}
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    (result,) = data["results"]
    assert data["ladder"] == [8, 16] and 8 < result["m"] < 16 and result["ratio"]["best"] == 1.0
    assert result["lookup_source"].startswith("interval") and {"best", "lookup", "nearest", "default",
                                                              "sweep_best"} <= set(result["times_s"])
    # the full sweep covered the whole (small) space, and the best is one of the configs re-timed side by side
    assert len(result["sweep_median_s"]) + len(result["sweep_unusable"]) == result["space"]
    assert result["configs"]["best"] in [c for n, c in result["configs"].items() if n != "best"]
    assert [(i["lo"], i["hi"]) for i in data["intervals"]][-1][1] == 17
    again = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert again.returncode == 0 and "0 sweeps to run" in again.stdout and "0 boundaries measured" in again.stdout
    assert json.loads(out.read_text())["results"] == data["results"]  # nothing measured twice
