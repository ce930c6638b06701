"""The README's quick start, end to end: `make demo` runs a real default sweep, prints the report, and a
fresh Python process picks the tuned entry up (lookup says exact). Tables go to a temporary dir."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.skipif(not (ROOT / ".venv" / ".installed").exists(), reason="run through `make test` (bootstraps .venv)")
def test_make_demo_end_to_end(tmp_path):
    env = {**os.environ, "MOE_TUNE_PROFILE_DIR": str(tmp_path / "profiles"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(["make", "--no-print-directory", "demo"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "Sweep result" in output and "speedup" in output  # the sweep's closing summary
    assert "Tuned configs" in output  # the report
    assert "lookup says: exact" in output  # the fresh process used the tuned entry
    assert (tmp_path / "profiles" / "cpu" / "ragged_dot.json").exists()
