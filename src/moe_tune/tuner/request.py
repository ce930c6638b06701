"""What a sweep is asked to do, and the plan resolved from it once.

`SweepSettings`: one typed, frozen record of every setting that is not the op, the problem or the backend
(the CLI builds one from its flags; a Ray task overrides what differs there with `dataclasses.replace`, which
validates again). `SweepRequest`: op, problem, backend, settings. `SweepPlan`: the op object, the backend, the
kernel bound from them, the key, the search space, the recorded settings, the sweep's identity, the log's and
the table's paths. `check_fits`: a sweep that would not fit this machine's memory is refused before it
starts, with what it needs and what is available.

The sweep log (`SweepLog`): every finished candidate of a sweep, appended to a JSONL file the moment it is finished.

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

import dataclasses
import datetime
import functools
import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import filelock

from moe_tune.core import devices, distributions
from moe_tune.core.errors import MoeTuneError, UsageError
from moe_tune.kernels import get_op
from moe_tune.kernels.base import Backend, KernelConfig
from moe_tune.kernels.kernel_op import KernelOp
from moe_tune.profiles import table as dirs
from moe_tune.profiles.entry import key_fields, key_from_fields
from moe_tune.profiles.table import lock_path
from moe_tune.targets.records import uncompilable
from moe_tune.tuner.candidate import FAILED, OK, WRONG, Candidate
from moe_tune.tuner.compiling import Kernel
from moe_tune.tuner.search import check_strategy, spread
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


@dataclasses.dataclass(frozen=True)
class SweepSettings:
    """Validated on construction: UsageError (one line) for a bad value."""

    distribution: str = distributions.DEFAULT  # of the rows (tokens) over groups (experts)
    seed: int = 0  # of the inputs, the group sizes and the random strategy
    # first-round samples per candidate: enough to rank them roughly; the finalists are re-timed side by side
    # with twice as many (at least profiles.verdict.MIN_FINAL_SAMPLES), which is where the winner is decided
    samples: int = 3
    # racing: after the first round, a candidate slower than this factor times the best known gets no more
    # samples, nor does one whose median can no longer make it a finalist (see timing.time_candidates);
    # None times every candidate `samples` times
    race: float | None = 1.5
    strategy: str = "grid"  # see tuner.search
    budget: int | None = None  # at most this many candidates
    time_budget_s: float | None = None  # start no new chunk of candidates after this many seconds
    max_candidates: int | None = None  # the default and a seeded sample spread across the space (spread)
    workers: int = dataclasses.field(default_factory=lambda: os.cpu_count() or 1)
    profile_dir: Path | None = None  # None: $MOE_TUNE_PROFILE_DIR, else the user cache dir
    keep_trace_dir: Path | None = None  # keep the profiler traces (xplane) here
    fresh: bool = False  # delete the sweep log first (no resume)
    finalists: int = 4  # the fastest N (and the default) are re-timed together before the winner is chosen
    # the final round gives each finalist about this many seconds of calls (short calls get more than the
    # samples above, up to tuner.measure.MAX_FINAL_SAMPLES); 0 for the samples alone
    final_time_s: float = 0.3
    batch_size: int = 8  # candidates timed together (interleaved); a kill loses at most one batch
    compile_timeout_s: float = 600.0  # per candidate, compile + first run in a worker (not its start-up)
    cold: bool = False  # no warm start: do not seed the search with the nearest tuned shapes' winners

    def __post_init__(self) -> None:
        distributions.check_name(self.distribution)
        for name in ("samples", "workers", "finalists", "batch_size"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:  # NumPy's seeds are unsigned 32-bit
            raise UsageError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        if not self.final_time_s >= 0:
            raise UsageError(f"final_time_s must be >= 0, got {self.final_time_s}")
        if self.race is not None and not self.race > 1:
            raise UsageError(f"race must be > 1 (or None, no racing), got {self.race}")
        check_strategy(self.strategy, self.budget, self.time_budget_s)


# The settings that decide which candidates a sweep has and how they are measured: two sweeps that differ in
# one of them are different sweeps (another log file; never resumed from each other's log).
IDENTITY_FIELDS = ("seed", "samples", "race", "strategy", "budget", "max_candidates")
# The settings an entry's `search` record repeats (with how the search went).
# (`space`: the candidates the strategy chose from, after --max-candidates; `full_space`: the backend's whole
# search space; `samples`: of the sweep round. `profiles.verdict` reads them as the entry's budget.)
SEARCH_FIELDS = ("strategy", "budget", "time_budget_s", "max_candidates", "space", "full_space", "samples",
                 "batch_size")


@dataclasses.dataclass(frozen=True)
class SweepRequest:
    """One sweep: `op` (its name), `problem` (the op's problem object), `backend` (its name; None: the
    platform's default backend for the op) and how to sweep (`settings`)."""

    op: str
    problem: Any
    backend: str | None = None
    settings: SweepSettings = dataclasses.field(default_factory=SweepSettings)

    @classmethod
    def make(cls, op: str, problem: Any, *, backend: str | None = None, **settings: Any) -> SweepRequest:
        """`SweepRequest(op, problem, backend, SweepSettings(**settings))`: for scripts and tests."""
        return cls(op, problem, backend, SweepSettings(**settings))


def as_json(value: Any) -> Any:
    """`value` as it reads back from JSON (so that a header compares equal to the one in the log)."""
    return json.loads(json.dumps(value, default=str))


class SweepPlan:
    """A `SweepRequest` resolved once on this machine: the op, backend, kernel, key and search space."""

    def __init__(self, request: SweepRequest):
        self.request = request
        self.op: KernelOp = get_op(request.op)
        self.platform = devices.platform()
        self.device_kind = devices.device_kind()
        self.backend: Backend = self.op.backends.resolve(request.backend, self.platform)
        self.kernel = Kernel(self.op, self.backend, request.problem)
        self.fields = key_fields(request.problem, self.backend.name, request.settings.distribution)
        self.key = key_from_fields(request.op, self.fields)
        self.directory = dirs.write_dir(request.settings.profile_dir)

    def check_runs_here(self) -> None:
        if not self.backend.runs_on(self.platform):
            raise UsageError(f"backend {self.backend.name!r} does not run on {self.platform}")

    @functools.cached_property
    def full_space(self) -> list[KernelConfig]:
        """The backend's search space for the problem (valid configs, default first), less the configs that
        compile records (`moe-tune sweep --target`, `targets/records.py`) say fail on this chip (the default
        stays: the sweep measures it whatever happens)."""
        space = self.backend.search_space(self.request.problem)
        failing = uncompilable(self.directory, self.device_kind, self.request.op, self.backend.name,
                               self.request.problem)
        if failing:
            space = space[:1] + [c for c in space[1:] if c.label() not in failing]
        return space

    @functools.cached_property
    def space(self) -> list[KernelConfig]:
        """`full_space`, or with max_candidates the default and a seeded sample spread across it
        (`spread`: the same candidates for the same seed, so a resumed sweep gets them again)."""
        limit = self.request.settings.max_candidates
        return self.full_space if limit is None else spread(self.full_space, limit,
                                                                     self.request.settings.seed)

    @functools.cached_property
    def settings_json(self) -> dict[str, Any]:
        """The sweep's settings as JSON reads them back: the one serialization of them (the log header's
        `spec`, the identity, the entry's `search`)."""
        s = self.request.settings
        return as_json({"op": self.request.op, "backend": self.backend.name, "distribution": s.distribution,
                        "seed": s.seed, "samples": s.samples, "race": s.race, "strategy": s.strategy,
                        "budget": s.budget, "time_budget_s": s.time_budget_s, "max_candidates": s.max_candidates,
                        "finalists": s.finalists, "batch_size": s.batch_size, "space": len(self.space),
                        "full_space": len(self.full_space)})

    @functools.cached_property
    def identity(self) -> dict[str, Any]:
        """What makes two sweeps the same sweep: the same candidates, measured the same way."""
        problem = self.request.problem
        optional = getattr(type(problem), "OPTIONAL_KEY_FIELDS", ())
        unset = getattr(type(problem), "UNSET_OMITTED", ())
        # an optional key field that is off (False: ragged_dot's lhs_qdynamic; None for one the problem names
        # in UNSET_OMITTED) is left out, as the key leaves it, so that the identity of every problem without
        # it hashes as it did before the field existed
        problem = ({k: v for k, v in dataclasses.asdict(problem).items()
                    if not (k in optional and (v is False or (v is None and k in unset)))}
                   if dataclasses.is_dataclass(problem) else repr(problem))
        return as_json({"key": self.key, "problem": problem, **{k: self.settings_json[k] for k in IDENTITY_FIELDS}})

    def search_settings(self) -> dict[str, Any]:
        return {k: self.settings_json[k] for k in SEARCH_FIELDS}

    @property
    def log_path(self) -> Path:
        return log_path(self.directory, self.device_kind, self.request.op,
                                  log_name(self.fields, self.identity))

    @property
    def table_path(self) -> Path:
        return dirs.table_path(self.directory, self.device_kind, self.request.op)


def available_bytes() -> int | None:
    """Memory available to a new allocation: /proc/meminfo's MemAvailable on Linux, else free physical pages
    (os.sysconf); None when neither can be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the value is in kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def check_fits(op: Any, problem: Any, workers: int = 1) -> None:
    """UsageError (one line) when `problem`'s inputs, reference and output, with `workers` compile worker
    processes (1: none), need more memory than is available (an op that cannot estimate its need says 0:
    not checked)."""
    need, have = op.sweep_memory(problem, workers), available_bytes()
    if have is not None and need > have:
        fewer = " (fewer --workers need less)" if workers > 1 and op.sweep_memory(problem, 1) < need else ""
        raise UsageError(f"{op.describe(problem)} needs about {_size(need)} of memory for its inputs, reference "
                         f"and output with --workers {workers}; this machine has {_size(have)} available{fewer}")
