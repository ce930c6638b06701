"""The sweep log: every finished candidate of a sweep, appended to a JSONL file the moment it is finished.

    <profile dir>/<device_kind>/sweeps/<op>/<name>.jsonl

`<name>` is derived from everything that decides which candidates a sweep has and how they are measured
(the entry key, which holds the problem, backend and distribution; the seed; the samples; the strategy, its
budget and max_candidates), so the same sweep always finds the same file and a different one never does.

Lines, each one JSON object with a `type`:

- `header`: the sweep's identity, key, versions, settings (under `spec`, the key log version 1 has) and
  start time (the first line);
- `run`: one per later run of the same sweep (a resume), with how many candidates it restored;
- `candidate`: one finished candidate: config, index, status, stage, reason, error, compile time and
  compiles, and its timing (samples and statistics) when it was timed (`candidate_line` writes it,
  `parse_candidate` reads it back; `recompiled: true` marks a finalist's later line);
- `final`: the winner (or why there is none), whether the sweep was interrupted.

Each append is one `os.write` followed by `os.fsync`. A process killed mid-write leaves at most a torn last
line; reading ignores it and opening the log again cuts it off before anything is appended. The log is
locked while a sweep writes it (`profiles.table.lock_path`: `.locks/<name>.jsonl.lock` beside it), so two
sweeps of the same thing cannot interleave their lines.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import filelock

from moe_tune.core.errors import MoeTuneError
from moe_tune.kernels.base import KernelConfig
from moe_tune.profiles.table import lock_path
from moe_tune.tuner.candidate import FAILED, OK, WRONG, Candidate
from moe_tune.tuner.timing import Timing

LOG_VERSION = 1
# The key of the sweep's settings in the header: `spec` since log version 1 (kept: logs written before the
# settings got their own type must still resume, and `report --sweep` reads it)
HEADER_SETTINGS = "spec"


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def config_key(config: Mapping[str, Any]) -> str:
    """A config dict as a canonical string (what the log matches candidates on)."""
    return json.dumps(dict(config), sort_keys=True)


def log_name(fields: Mapping[str, Any], identity: Mapping[str, Any]) -> str:
    """`fwd_m4096_k1024_n1024_groups8_float32_tiled_balanced_seed0_samples5_grid_<hash>.jsonl`: the key
    fields and search parameters for people, a hash of the whole identity for uniqueness."""
    parts = [v if isinstance(v, str) else f"{k}{v}" for k, v in fields.items()]
    parts += [v if isinstance(v, str) else f"{k}{v}" for k, v in identity.items()
              if k in ("seed", "samples", "strategy", "budget", "max_candidates") and v is not None]
    readable = re.sub(r"[^A-Za-z0-9._=-]+", "-", "_".join(dict.fromkeys(parts)))[:150]
    digest = hashlib.sha1(json.dumps(dict(identity), sort_keys=True).encode()).hexdigest()[:10]
    return f"{readable}_{digest}.jsonl"


def candidate_line(c: Candidate, batch: int | None, recompiled: bool = False) -> dict[str, Any]:
    """The `candidate` line of a finished candidate (`batch`: the timing batch it was timed in, if any)."""
    line = {"type": "candidate", "index": c.index, "config": c.config.to_dict(), "is_default": c.is_default,
            "status": c.status, "stage": c.stage, "reason": c.reason, "error": c.error, "compile_s": c.compile_s,
            "compiles": c.compiles, "batch": batch, "timing": None if c.timing is None else c.timing.to_dict(),
            "logged": now()}
    if recompiled:
        line["recompiled"] = True
    return line


def parse_candidate(line: Mapping[str, Any], index: int, config: KernelConfig, is_default: bool) -> Candidate | None:
    """The finished candidate a `candidate` line records (as candidate `index` of this run, for `config`), or
    None when the line is unusable (no known status, a timing that does not parse, an OK one untimed)."""
    if line.get("status") not in (OK, FAILED, WRONG):
        return None
    timing = None
    if line.get("timing"):
        try:
            timing = Timing(**{**line["timing"], "samples_s": tuple(line["timing"]["samples_s"])})
        except (TypeError, KeyError):
            return None
    if line["status"] == OK and timing is None:
        return None
    return Candidate(index, config, is_default=is_default, status=line["status"], stage=line.get("stage") or "",
                     reason=line.get("reason") or "", error=line.get("error"), compile_s=line.get("compile_s"),
                     compiles=line.get("compiles") or 0, timing=timing)


def log_path(profile_dir: Path, device_kind: str, op: str, name: str) -> Path:
    return Path(profile_dir) / device_kind / "sweeps" / op / name


def read_log(path: Path) -> tuple[list[dict[str, Any]], int]:
    """(the parsed lines, how many bytes of the file they span). A line that does not parse (a torn last
    line after a kill, or anything not a JSON object) is skipped; the byte count stops before a torn tail."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return [], 0
    lines, good_end, pos = [], 0, 0
    while pos < len(data):
        end = data.find(b"\n", pos)
        if end < 0:  # no newline: a torn last line
            break
        try:
            obj = json.loads(data[pos:end])
        except (json.JSONDecodeError, UnicodeDecodeError):
            obj = None
        if isinstance(obj, dict) and "type" in obj:
            lines.append(obj)
        pos = good_end = end + 1
    return lines, good_end


class SweepLog:
    """One sweep's log, opened for appending (use as a context manager: it holds the log's lock).

    `restored` maps config_key -> the candidate line of every candidate already finished by an earlier run
    (the last one wins, should a config appear twice). `restarted` says why an existing log was set aside
    (its header did not match this sweep), or is None. `on_append`, when given, gets the bytes of every
    append (whole JSON lines) once they are on disk: a distributed sweep sends them on to its driver.
    """

    def __init__(self, path: Path, header: dict[str, Any], *, fresh: bool = False,
                 on_append: Callable[[bytes], None] | None = None):
        self.path = Path(path)
        self.header = header
        self.fresh = fresh
        self.on_append = on_append
        self.restored: dict[str, dict[str, Any]] = {}
        self.restarted: str | None = None
        self.finals: list[dict[str, Any]] = []
        self._lock = filelock.FileLock(str(lock_path(self.path)), timeout=0)
        self._fd: int | None = None

    def __enter__(self) -> SweepLog:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire()
        except filelock.Timeout:
            raise MoeTuneError(f"another sweep is writing {self.path} (wait for it, or stop it)") from None
        try:
            self._open()
        except BaseException:
            self._lock.release()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._lock.is_locked:
            self._lock.release()

    def _open(self) -> None:
        if self.fresh:
            self.path.unlink(missing_ok=True)
        lines, good_end = read_log(self.path)
        old_header = lines[0] if lines and lines[0].get("type") == "header" else None
        if lines and not _same_sweep(old_header, self.header):
            self.restarted = _mismatch(old_header, self.header)
            self.path.replace(self.path.with_suffix(".stale.jsonl"))  # kept for reference, never resumed
            lines, good_end = [], 0
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.ftruncate(self._fd, good_end)  # drop a torn last line before appending after it
        os.lseek(self._fd, 0, os.SEEK_END)
        for line in lines:
            if line.get("type") == "candidate" and isinstance(line.get("config"), dict):
                self.restored[config_key(line["config"])] = line
            elif line.get("type") == "final":
                self.finals.append(line)
        if not lines:
            self.append([{"type": "header", "log_version": LOG_VERSION, **self.header, "started": now()}])

    def append(self, lines: list[dict[str, Any]]) -> None:
        """Append whole lines with one write, then fsync: they survive any kill once this returns."""
        if not lines:
            return
        data = "".join(json.dumps(line, default=_jsonable) + "\n" for line in lines).encode()
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        os.fsync(self._fd)
        if self.on_append is not None:
            self.on_append(data)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):  # NumPy scalars
        return value.item()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def _same_sweep(old: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    return old is not None and old.get("log_version") == LOG_VERSION and old.get("identity") == new.get(
        "identity") and old.get("versions") == new.get("versions")


def _mismatch(old: dict[str, Any] | None, new: dict[str, Any]) -> str:
    if old is None:
        return "the old log had no header"
    if old.get("log_version") != LOG_VERSION:
        return f"log version {old.get('log_version')} != {LOG_VERSION}"
    if old.get("identity") != new.get("identity"):
        return "the old log is of another sweep"
    return f"versions changed: {old.get('versions')} -> {new.get('versions')}"
