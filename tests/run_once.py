"""`once_per_run`: a module fixture's expensive result (a multi-device subprocess's JSON) made once per test
run, however many pytest-xdist workers run a test of the module, and shared between them through files.

Without it every worker that takes one of a module's tests runs the module's subprocess again. Split into
parts (one per worker), the workers that arrive together each make one part side by side instead of one
making it all while the others wait idle.

The protocol, per part `i` of `n` (files in the run's temp dir, shared by its workers):
- `<name>.<i>of<n>.lock` is held by whoever makes part i, for as long as it makes it; the part's result,
  `<name>.<i>of<n>.json`, is written (atomically) before that lock is released, and read only under it.
- A worker first takes every part whose lock is free (reading it if made, else making it), then waits on
  the locks of the parts others hold. A maker that dies releases its lock (the OS drops the flock): the
  waiter finds no result and makes the part itself, so a waiter never hangs on a dead maker.
- A part that fails is written as its error (or skip): its maker's test fails with the exception itself,
  every other worker's with the same text (the subprocess's stderr included), so no worker makes it again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import filelock
import pytest

# XLA:CPU without its backend optimization passes: the suite's programs compile about a third faster and compute
# the same results (tests/conftest.py says why the suite's own process runs so, and where the flags stop).
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"

WAIT_S = 1800.0  # longer than any fixture's own subprocess timeout: those end a hung maker first

Make = Callable[[int, int], dict[str, Any]]  # (part, parts) -> that part's results, JSON


def workers() -> int:
    """The run's xdist worker count (1 outside xdist)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The temp dir every worker of this run shares: an xdist worker's basetemp is `<run's>/<worker id>`."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


def once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str, make: Make, *, split: bool = False,
                 wait_s: float = WAIT_S) -> dict[str, Any]:
    """The union of `make(part, parts)` over parts 0..parts-1 (dicts; later parts win a clashing key), each
    made once per run. `split`: one part per xdist worker (`make` must then cover, over the parts, what
    `make(0, 1)` covers); else one part. `name` must be unique in the run (a module's fixture: its name)."""
    return gather(shared_dir(tmp_path_factory), name, make, workers() if split else 1, wait_s=wait_s)


def gather(root: Path, name: str, make: Make, parts: int, *, wait_s: float = WAIT_S) -> dict[str, Any]:
    """`once_per_run` on the files under `root` (the protocol of the module docstring)."""
    records: dict[int, dict[str, Any]] = {}
    held_by_others = []
    for part in range(parts):
        lock = _lock(root, name, part, parts)
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            held_by_others.append(part)
            continue
        try:
            records[part] = _read_or_make(root, name, make, part, parts)
        finally:
            lock.release()
    for part in held_by_others:
        lock = _lock(root, name, part, parts)
        try:
            lock.acquire(timeout=wait_s)
        except filelock.Timeout:
            pytest.fail(f"{name}: waited {wait_s:.0f} s for part {part + 1} of {parts}, made by another worker",
                        pytrace=False)
        try:
            records[part] = _read_or_make(root, name, make, part, parts)
        finally:
            lock.release()
    merged: dict[str, Any] = {}
    for part in range(parts):
        record = records[part]
        if "skip" in record:
            pytest.skip(record["skip"])
        if "error" in record:
            pytest.fail(f"{name} (part {part + 1} of {parts}, made by another worker): {record['error']}",
                        pytrace=False)
        merged.update(record["value"])
    return merged


def _lock(root: Path, name: str, part: int, parts: int) -> filelock.FileLock:
    return filelock.FileLock(str(_path(root, name, part, parts).with_suffix(".lock")))


def _path(root: Path, name: str, part: int, parts: int) -> Path:
    return root / f"{name}.{part}of{parts}.json"


def _read_or_make(root: Path, name: str, make: Make, part: int, parts: int) -> dict[str, Any]:
    """The part's record (`value`, `error` or `skip`), made now if nobody made it; call under its lock. An
    exception of `make` is recorded, then raised here (the maker's test shows it whole)."""
    path = _path(root, name, part, parts)
    if path.is_file():
        return json.loads(path.read_text())
    try:
        # the round trip through JSON: the maker sees exactly what the readers see
        record = {"value": json.loads(json.dumps(make(part, parts)))}
    except pytest.skip.Exception as e:
        _write(path, {"skip": str(e.msg)})
        raise
    except (Exception, pytest.fail.Exception) as e:
        _write(path, {"error": f"{type(e).__name__}: {e}"})
        raise
    _write(path, record)
    return record


def _write(path: Path, record: dict[str, Any]) -> None:
    scratch = path.with_suffix(f".{os.getpid()}.tmp")
    scratch.write_text(json.dumps(record))
    os.replace(scratch, path)  # whole or absent, even if this worker is killed while writing


def check_env(xla_flags: str = "", **extra: str) -> dict[str, str]:
    """The environment of one of the suite's check scripts: this one's, JAX on the CPU, XLA_FLAGS = `xla_flags`
    (e.g. the host device count) and `FAST_COMPILE_FLAGS` (the scripts compute results, never timings), and
    `extra`."""
    return dict(os.environ, XLA_FLAGS=f"{xla_flags} {FAST_COMPILE_FLAGS}".strip(), JAX_PLATFORMS="cpu", **extra)


def script_json(script: Path, *args: str, profiles: Path | None = None, cwd: Path | None = None,
                timeout: float = 900) -> dict[str, Any]:
    """The JSON object a checks script prints on its last line, run as `python script *args` in `check_env`
    (its own JAX: the host devices it asks for in its first lines, appended to XLA_FLAGS), the compile cache off, the distribution
    unset, and `$MOE_TUNE_PROFILE_DIR` at `profiles` when given. A non-zero exit fails with its stderr."""
    env = check_env(MOE_TUNE_COMPILE_CACHE_DIR="off")
    env.pop("MOE_TUNE_DISTRIBUTION", None)
    if profiles is not None:
        env["MOE_TUNE_PROFILE_DIR"] = str(profiles)
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
