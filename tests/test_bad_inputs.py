"""Every bad input gets one clear line and a non-zero exit (2 for usage, 1 for a runtime or table
problem), never a traceback, a hang or a silently wrong answer.

One table, `CASES`: each row is an issue item's CLI call (argv, environment, the files it needs) and what
the user must see (exit code, a fragment of the one line). Rows run in-process through click's CliRunner
(an exception escaping the command fails the test: that is the traceback a user would see), or in a real
subprocess where the traceback check needs the real process: warnings as printed, Ray, signals. The
Python API's items (1, 2, 15) are in test_bad_api_inputs.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import pytest
from click.testing import CliRunner

from moe_tune.cli import cli
from moe_tune.kernels import get_op

S = ("--m", "64", "--k", "64", "--n", "64", "--groups", "4", "--max-candidates", "2", "--samples", "1",
     "--workers", "1")
KEY = ("ragged_dot|direction=fwd|m=64|k=64|n=64|groups=4|lhs_dtype=float32|rhs_dtype=float32|out_dtype=float32|"
       "backend=tiled|distribution=balanced")
CONFIG = {"tm": 32, "tk": 64, "tn": 64, "tail": 16, "batched": True, "dequantize": False}
# What JAX, absl and XLA print on stderr whatever the command (not the command's own output).
NOISE = re.compile(r"^(WARNING: All log messages|[IWE]\d{4} |.*cudart_stub)")


def entry(**changes) -> dict:
    """A small, valid, fresh ragged_dot table entry (tiled, the shape of `S`), with `changes` applied to its
    records (`timing`: merged into the timing record; others replace)."""
    revision = get_op("ragged_dot").backends.get("tiled").revision
    record = {
        "key": KEY, "op": "ragged_dot", "config": dict(CONFIG),
        "fields": {"direction": "fwd", "m": 64, "k": 64, "n": 64, "groups": 4, "lhs_dtype": "float32",
                   "rhs_dtype": "float32", "out_dtype": "float32", "backend": "tiled", "distribution": "balanced"},
        "timing": {"median_s": 1e-4, "min_s": 9e-5, "max_s": 1.1e-4, "spread": 0.1, "samples": 2, "method": "trace"},
        "default": {"config": dict(CONFIG), "status": "ok", "median_s": 1e-4, "reason": None},
        "speedup_over_default": 1.0, "candidates": {"tried": 2, "ok": 2, "failed": 0, "wrong": 0, "compiles": 2},
        "results": [{"config": dict(CONFIG), "status": "ok", "is_default": True, "median_s": 1e-4, "spread": 0.1}],
        "distribution": {"name": "balanced", "seed": 0, "group_sizes": [17, 14, 12, 21]},
        "versions": {"jax": jax.__version__, "backend_revision": revision}, "device_kind": "cpu",
        "tuned_at": "2026-11-25T00:00:00+00:00",
    }
    record["timing"].update(changes.pop("timing", {}))
    return {**record, **changes}


def write_table(directory: Path, *entries: dict) -> Path:
    path = directory / "cpu" / "ragged_dot.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema_version": 2, "op": "ragged_dot", "device_kind": "cpu",
                                "entries": {e["key"]: e for e in entries}}))
    return path


def lock(path: Path) -> None:
    """Make the directory `path` unwritable, for root too (`chattr +i`); the test is skipped where that
    cannot be done. `unlock_all` (autouse) undoes it."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o555)
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(path)], capture_output=True)
    try:
        (path / ".probe").touch()
    except OSError:
        _locked.append(path)
        return
    (path / ".probe").unlink()
    pytest.skip("cannot make a directory unwritable here")


_locked: list[Path] = []


@pytest.fixture(autouse=True)
def unlock_all():
    yield
    while _locked:
        path = _locked.pop()
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(path)], capture_output=True)
        path.chmod(0o755)


# -- the files each row needs (`tmp` is the test's tmp_path; the profile dir is tmp/p) ------------------------

def good_table(tmp: Path) -> None:
    write_table(tmp / "p", entry())
    write_table(tmp / "in", entry())


def table_with_a_string_time(tmp: Path) -> None:
    write_table(tmp / "p", entry(timing={"median_s": "fast"}))


def table_with_a_bad_config(tmp: Path) -> None:
    write_table(tmp / "p", entry(config={**CONFIG, "tm": 16, "tail": 32}))


def stale_table(tmp: Path) -> None:
    write_table(tmp / "p", entry(versions={"jax": "0.4.1", "backend_revision": 1}))


def log_with_a_string_config(tmp: Path) -> None:
    candidate = {"type": "candidate", "status": "ok", "timing": {"median_s": 1e-3}}
    lines = [{"type": "header", "log_version": 1, "key": KEY}, {**candidate, "index": 0, "config": CONFIG},
             {**candidate, "index": 1, "config": "tm=32"}, {"type": "final", "winner": CONFIG, "finalists": []}]
    (tmp / "log.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def unwritable_out(tmp: Path) -> None:
    good_table(tmp)
    lock(tmp / "locked")


def immutable_out(tmp: Path) -> None:
    good_table(tmp)
    lock(tmp / "p" / "cpu")


def unwritable_device_dir(tmp: Path) -> None:
    lock(tmp / "p" / "cpu")


def locked_dir(tmp: Path) -> None:
    good_table(tmp)
    lock(tmp / "locked")


def a_file(tmp: Path) -> None:
    (tmp / "file").write_text("")


def symlink_loop(tmp: Path) -> None:
    (tmp / "loop").symlink_to(tmp / "loop")


@dataclasses.dataclass(frozen=True)
class Case:
    """One bad input: `argv` and `env` values may hold `{tmp}` (the test's tmp_path); `message` must appear
    in one line of the output; `absent`: paths (under tmp) that must not exist afterwards."""

    item: str
    argv: tuple[str, ...]
    code: int
    message: str
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    setup: Callable[[Path], None] | None = None
    subprocess: bool = False
    absent: tuple[str, ...] = ()
    slow: bool = False


CASES = [
    Case("3 unreachable ray address", ("sweep", *S, "--ray", "127.0.0.1:1"), 1,
         "cannot reach the Ray cluster at 127.0.0.1:1 within 3 s", {"MOE_TUNE_RAY_CONNECT_TIMEOUT": "3"},
         subprocess=True, slow=True),
    Case("3 --dry-run never connects", ("sweep", *S, "--ray", "127.0.0.1:1", "--dry-run"), 0,
         "--dry-run does not connect to Ray", {"MOE_TUNE_RAY_CONNECT_TIMEOUT": "3"}, subprocess=True, slow=True),
    Case("3 bad connect timeout", ("sweep", *S, "--ray", "127.0.0.1:1"), 2,
         "$MOE_TUNE_RAY_CONNECT_TIMEOUT='soon' is not a positive number of seconds",
         {"MOE_TUNE_RAY_CONNECT_TIMEOUT": "soon"}),
    Case("4 merge into an unwritable dir", ("merge", "{tmp}/locked/ragged_dot.json", "{tmp}/in/cpu/ragged_dot.json"),
         1, "cannot write the merged table {tmp}/locked/ragged_dot.json", setup=unwritable_out),
    Case("4 merge into an immutable table", ("merge", "{tmp}/p/cpu/ragged_dot.json", "{tmp}/in/cpu/ragged_dot.json"),
         1, "cannot write the merged table {tmp}/p/cpu/ragged_dot.json", setup=immutable_out),
    Case("4 merge below a file", ("merge", "{tmp}/file/cpu/ragged_dot.json", "{tmp}/in/cpu/ragged_dot.json"), 1,
         "{tmp}/file is a file, not a directory", setup=lambda tmp: (good_table(tmp), a_file(tmp))),
    Case("4 sweep into an unwritable device-kind dir", ("sweep", *S), 1, "{tmp}/p/cpu",
         setup=unwritable_device_dir, absent=("p/cpu/sweeps",)),
    Case("4 sweep --keep-trace unwritable", ("sweep", *S, "--keep-trace", "{tmp}/locked/t"), 1,
         "cannot write traces to {tmp}/locked/t", setup=locked_dir, absent=("p/cpu/sweeps",)),
    Case("4 breakdown --keep-trace unwritable", ("report", "--profile-dir", "{tmp}/p", "--breakdown", "--keep-trace",
                                                 "{tmp}/locked/t"), 1, "cannot write traces to {tmp}/locked/t",
         setup=locked_dir),
    Case("4 compile cache unwritable", ("sweep", *S), 1,
         "cannot create or write the compile cache dir {tmp}/locked/cache",
         {"MOE_TUNE_COMPILE_CACHE_DIR": "{tmp}/locked/cache"}, setup=locked_dir, absent=("p/cpu/sweeps",)),
    Case("4 plot to an unwritable dir", ("report", "--profile-dir", "{tmp}/p", "--plot", "{tmp}/locked/r.png"), 1,
         "cannot write the plot {tmp}/locked/r.png", setup=locked_dir),
    Case("4 plot format matplotlib cannot write", ("report", "--profile-dir", "{tmp}/p", "--plot", "{tmp}/r.xyz"), 2,
         "matplotlib writes no .xyz files", setup=good_table),
    Case("5 negative seed", ("sweep", *S, "--seed", "-1"), 2, "-1 is not in the range", absent=("p/cpu",)),
    Case("6 report skips an entry whose time is a string", ("report", "--profile-dir", "{tmp}/p"), 0,
         "timing.median_s 'fast' is not a positive number", setup=table_with_a_string_time, subprocess=True),
    Case("6 report --plot", ("report", "--profile-dir", "{tmp}/p", "--plot", "{tmp}/r.png"), 2, "nothing to plot",
         setup=table_with_a_string_time),
    Case("6 report --breakdown", ("report", "--profile-dir", "{tmp}/p", "--breakdown"), 2, "nothing to break down",
         setup=table_with_a_string_time),
    Case("6 lookup", ("lookup", "--m", "64", "--k", "64", "--n", "64", "--groups", "4"), 0,
         "warning: moe-tune: {tmp}/p/cpu/ragged_dot.json: entry", setup=table_with_a_string_time, subprocess=True),
    Case("7 sweep log with a string config", ("report", "--sweep", "{tmp}/log.jsonl"), 0,
         "skipping 1 candidate line(s) whose config is not an object", setup=log_with_a_string_config),
    Case("8 SLURM task past the array", ("sweep", *S, "--dry-run"), 2,
         "SLURM_ARRAY_TASK_ID=5 is outside the job array",
         {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "2"}),
    Case("9 worker memory limit not a number", ("sweep", *S[:-2], "--workers", "2"), 2,
         "$MOE_TUNE_WORKER_MEMORY_LIMIT='lots' is not a positive number of bytes",
         {"MOE_TUNE_WORKER_MEMORY_LIMIT": "lots"}, absent=("p/cpu",)),
    Case("9 ... with --workers 1", ("sweep", *S), 2, "$MOE_TUNE_WORKER_MEMORY_LIMIT='lots'",
         {"MOE_TUNE_WORKER_MEMORY_LIMIT": "lots"}, absent=("p/cpu",)),
    Case("9 ... a valid limit with --workers 1 is not silently ignored", ("sweep", *S), 0,
         "$MOE_TUNE_WORKER_MEMORY_LIMIT applies to compile workers",
         {"MOE_TUNE_WORKER_MEMORY_LIMIT": "8000000000"}, subprocess=True),
    Case("10 symlink-loop profile dir", ("sweep", *S), 1, "{tmp}/loop is a symlink loop",
         {"MOE_TUNE_PROFILE_DIR": "{tmp}/loop"}, setup=symlink_loop),
    Case("11 validate: profile dir is a file", ("validate",), 1, "is not a directory (a file)",
         {"MOE_TUNE_PROFILE_DIR": "{tmp}/file"}, setup=a_file),
    Case("11 validate: profile dir is a symlink loop", ("validate",), 1,
         "is not a directory (Too many levels of symbolic links)", {"MOE_TUNE_PROFILE_DIR": "{tmp}/loop"},
         setup=symlink_loop),
    Case("12 race below 1", ("sweep", *S, "--race", "0.5"), 2, "0.5 is not 0 (no racing) or a factor > 1"),
    Case("13 breakdown of an entry with a bad config", ("report", "--profile-dir", "{tmp}/p", "--breakdown", "--key",
                                                         KEY), 1, "cannot be re-run", setup=table_with_a_bad_config),
    Case("14 stale entry: one clean warning line", ("lookup", "--m", "64", "--k", "64", "--n", "64", "--groups", "4"),
         0, "warning: moe-tune: {tmp}/p/cpu/ragged_dot.json has entries tuned with", setup=stale_table,
         subprocess=True),
    Case("16 top-k above experts", ("sweep", "--op", "ragged_gather", "--tokens", "64", "--hidden", "64", "--top-k",
                                    "8", "--experts", "4", "--dry-run"), 2, "top_k (8) must not exceed experts (4)"),
    Case("18 empty item in a shape list", ("sweep", *S, "--m", "64,,128", "--dry-run"), 2,
         "'64,,128' has an empty item"),
]


def _fill(text: str, tmp: Path) -> str:
    return text.replace("{tmp}", str(tmp))


def _run(case: Case, tmp: Path) -> tuple[int, str]:
    """(exit code, output: stdout then stderr, without JAX's start-up noise)."""
    argv = [_fill(a, tmp) for a in case.argv]
    env = {"MOE_TUNE_PROFILE_DIR": str(tmp / "p"), "MOE_TUNE_COMPILE_CACHE_DIR": "off",
           **{k: _fill(v, tmp) for k, v in case.env.items()}}
    if not case.subprocess:
        result = CliRunner().invoke(cli, argv, env=env, catch_exceptions=False)  # an escaping exception fails
        return result.exit_code, result.stdout + result.stderr
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XDG_CACHE_HOME": str(tmp / "cache"), **env}
    proc = subprocess.run([sys.executable, "-m", "moe_tune.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=120)
    stderr = "\n".join(line for line in proc.stderr.splitlines() if not NOISE.match(line))
    return proc.returncode, proc.stdout + stderr


@pytest.mark.parametrize("case", [pytest.param(c, id=c.item, marks=[pytest.mark.slow] if c.slow else [])
                                  for c in CASES])
def test_bad_input_is_one_line(case: Case, tmp_path: Path):
    if case.setup is not None:
        case.setup(tmp_path)
    code, output = _run(case, tmp_path)
    message = _fill(case.message, tmp_path)
    assert "Traceback" not in output, output
    assert code == case.code, output
    assert any(message in line for line in output.splitlines()), output
    if code:  # the error is one line
        assert len([line for line in output.splitlines() if line.startswith(("error:", "Error:"))]) <= 1, output
    assert "return callback" not in output and "core.py" not in output, output  # no raw warning source lines
    for path in case.absent:
        assert not (tmp_path / path).exists(), f"{path} was written before the input was refused"


def test_race_help_and_error_agree():
    """The help and the error of `--race` state one rule."""
    result = CliRunner().invoke(cli, ["sweep", "--help"], terminal_width=200)
    assert "x>=0" not in result.output
    assert "0 (no racing) or a factor > 1" in " ".join(result.output.split())


def test_workers_1_says_that_candidates_run_in_this_process():
    """The help and the README say what `--workers 1` means: candidates compile and run once in the main
    process."""
    result = CliRunner().invoke(cli, ["sweep", "--help"], terminal_width=200)
    assert "1: candidates compile and run once in this process" in " ".join(result.output.split())
    readme = " ".join((Path(__file__).parents[1] / "README.md").read_text().split())
    assert "With `--workers 1` there is no worker: candidates compile and run once in the main process" in readme


@pytest.mark.slow
def test_a_resumed_sweep_says_how_to_retry_its_failed_candidates(tmp_path):
    """A resumed sweep replays its logged failures (say, a memory limit since raised) and says how to retry
    them (--fresh)."""
    argv = ["sweep", *S, "--profile-dir", str(tmp_path / "p")]
    assert CliRunner().invoke(cli, argv, catch_exceptions=False).exit_code == 0
    (log,) = (tmp_path / "p" / "cpu" / "sweeps" / "ragged_dot").glob("*.jsonl")
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    for line in lines:
        if line.get("type") == "candidate" and not line.get("is_default"):
            line.update(status="failed", stage="compile", reason="worker died (exit code 1) compiling the candidate")
            line.pop("timing", None)
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = CliRunner().invoke(cli, argv, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "warning: moe-tune: 1 candidate(s) failed in an earlier run of this sweep" in result.stderr
    assert "rerun with --fresh" in result.stderr


def test_the_ray_wait_applies_to_host_port_addresses_only():
    """`HOST:PORT` and `ray://HOST:PORT` are probed within the bounded wait; addresses Ray resolves
    itself (`auto`) are left to Ray."""
    from moe_tune.campaign.ray_address import host_port

    assert host_port("127.0.0.1:1") == ("127.0.0.1", 1)
    assert host_port("ray://head:10001") == ("head", 10001)
    assert host_port("[::1]:6379") == ("::1", 6379)
    assert host_port("auto") is None and host_port("head:") is None
