"""What a sweep is asked to do, and the plan resolved from it once.

`SweepSettings`: one typed, frozen record of every setting that is not the op, the problem or the backend
(the CLI builds one from its flags; a Ray task overrides what differs there with `dataclasses.replace`, which
validates again). `SweepRequest`: op, problem, backend, settings. `SweepPlan`: the op object, the backend, the
kernel bound from them, the key, the search space, the recorded settings, the sweep's identity, the log's and
the table's paths. `check_fits`: a sweep that would not fit this machine's memory is refused before it
starts, with what it needs and what is available.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Any

from moe_tune.core import devices, distributions
from moe_tune.core.errors import UsageError
from moe_tune.kernels import get_op
from moe_tune.kernels.base import Backend, KernelConfig
from moe_tune.kernels.kernel_op import KernelOp
from moe_tune.profiles import dirs
from moe_tune.profiles.key import key_fields, key_from_fields
from moe_tune.targets.records import uncompilable
from moe_tune.tuner import log as sweep_log
from moe_tune.tuner import strategies
from moe_tune.tuner.compiling import Kernel


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
    strategy: str = "grid"  # see tuner.strategies
    budget: int | None = None  # at most this many candidates
    time_budget_s: float | None = None  # start no new chunk of candidates after this many seconds
    max_candidates: int | None = None  # the default and a seeded sample spread across the space (strategies.spread)
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
        strategies.check(self.strategy, self.budget, self.time_budget_s)


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
        (`strategies.spread`: the same candidates for the same seed, so a resumed sweep gets them again)."""
        limit = self.request.settings.max_candidates
        return self.full_space if limit is None else strategies.spread(self.full_space, limit,
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
        # an optional key field that is off (False: ragged_dot's lhs_qdynamic) is left out, as the key leaves it,
        # so that the identity of every problem without it hashes as it did before the field existed
        problem = ({k: v for k, v in dataclasses.asdict(problem).items() if not (k in optional and v is False)}
                   if dataclasses.is_dataclass(problem) else repr(problem))
        return as_json({"key": self.key, "problem": problem, **{k: self.settings_json[k] for k in IDENTITY_FIELDS}})

    def search_settings(self) -> dict[str, Any]:
        return {k: self.settings_json[k] for k in SEARCH_FIELDS}

    @property
    def log_path(self) -> Path:
        return sweep_log.log_path(self.directory, self.device_kind, self.request.op,
                                  sweep_log.log_name(self.fields, self.identity))

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
