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


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_the_demo_sweep_measures_its_whole_grid_every_time(isolated_profiles):
    """`make demo`'s own sweep command (read from `make -n demo`; a small shape appended, the last value of an
    option wins): a second run, with a float32 entry tuned nearby and the first run's log in place, still
    measures every candidate of its grid: no warm start, nothing resumed."""
    import shlex

    from click.testing import CliRunner

    from moe_tune.cli import cli
    from moe_tune.profiles.table import read_table

    planned = subprocess.run(["make", "-n", "--no-print-directory", "demo"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.splitlines()
    (line,) = [line for line in planned if "moe-tune sweep" in line]
    argv = shlex.split(line)[1:] + ["--m", "64", "--k", "64", "--n", "64", "--groups", "4", "--samples", "1",
                                    "--workers", "1"]
    first = CliRunner().invoke(cli, argv, catch_exceptions=False)
    assert first.exit_code == 0, first.output
    table = isolated_profiles / "cpu" / "ragged_dot.json"
    (entry,) = read_table(table)["entries"].values()
    neighbour = {**entry, "key": entry["key"].replace("|m=64|", "|m=128|"), "fields": {**entry["fields"], "m": 128}}
    from moe_tune.profiles.table import write_entries

    write_entries(table, "ragged_dot", "cpu", [neighbour])
    again = CliRunner().invoke(cli, argv, catch_exceptions=False)
    assert again.exit_code == 0, again.output
    tried = entry["candidates"]["tried"]
    assert f"grid: {tried} of {tried} candidates" in again.output
    assert "cold start (--cold)" in again.output and "0 candidates from the sweep log" in again.output
