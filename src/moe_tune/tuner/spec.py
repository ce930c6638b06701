"""What one sweep is: its parameters (`SweepSpec`), the plan resolved from them once (backend, search space,
key, the sweep's settings and identity, the log's path), how it reports progress, and how it ends
(`SweepResult`, `SweepError`, `SweepInterrupted`).

The settings are serialized in one place (`SweepPlan.settings`): the sweep log's header, the log's name
(through `identity`) and the entry's `search` record all take their fields from it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Any

from moe_tune import devices, distributions
from moe_tune.errors import MoeTuneError, UsageError
from moe_tune.kernels import get_op
from moe_tune.kernels.base import Backend, KernelConfig
from moe_tune.kernels.kernel_op import KernelOp
from moe_tune.profiles import dirs
from moe_tune.profiles.entry import Entry
from moe_tune.profiles.key import key_fields, key_from_fields
from moe_tune.tuner import log as sweep_log
from moe_tune.tuner import strategies
from moe_tune.tuner.candidates import OK, Candidate

# The settings that decide which candidates a sweep has and how they are measured: two sweeps that differ in
# one of them are different sweeps (another log file; never resumed from each other's log).
IDENTITY_FIELDS = ("seed", "samples", "race", "strategy", "budget", "max_candidates")
# The settings an entry's `search` record repeats (with how the search went).
SEARCH_FIELDS = ("strategy", "budget", "time_budget_s", "max_candidates", "space", "batch_size")


class SweepError(MoeTuneError):
    """The sweep could not produce a winner (every candidate failed or was wrong)."""


class SweepInterrupted(KeyboardInterrupt):
    """A KeyboardInterrupt stopped a sweep. The finished candidates are in the log (`log_path`); `result` is
    the entry written from them, or None when too little had finished. str() says what was kept."""

    def __init__(self, message: str, *, log_path: Path, kept: int, result: SweepResult | None):
        super().__init__(message)
        self.log_path, self.kept, self.result = log_path, kept, result

    def __str__(self) -> str:
        return self.args[0]


class Reporter:
    """Progress callbacks; the CLI draws them with rich, the library default ignores them."""

    def stage(self, name: str, total: int) -> None:
        pass

    def advance(self, name: str, amount: float = 1) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class SweepSpec:
    op: str
    problem: Any
    backend: str | None = None  # None: the platform's default backend
    distribution: str = distributions.DEFAULT
    seed: int = 0  # of the inputs, the group sizes and the random strategy
    # first-round samples per candidate: enough to rank them roughly; the finalists are re-timed side by side
    # with twice as many, which is where the winner is decided
    samples: int = 3
    # racing: after the first round, a candidate slower than this factor times the best known gets no more
    # samples (see timing.time_candidates); None times every candidate `samples` times
    race: float | None = 1.5
    workers: int = dataclasses.field(default_factory=lambda: os.cpu_count() or 1)
    profile_dir: Path | None = None  # None: $MOE_TUNE_PROFILE_DIR, else the user cache dir
    max_candidates: int | None = None  # keep the first N of the search space (default first)
    finalists: int = 4  # the fastest N (and the default) are re-timed together before the winner is chosen
    compile_timeout_s: float = 600.0  # per candidate, compile + first run in a worker (not its start-up)
    keep_trace_dir: Path | None = None
    strategy: str = "grid"  # see tuner.strategies
    budget: int | None = None  # at most this many candidates
    time_budget_s: float | None = None  # start no new chunk of candidates after this many seconds
    fresh: bool = False  # delete the sweep log first (no resume)
    batch_size: int = 8  # candidates timed together (interleaved); a kill loses at most one batch

    def __post_init__(self) -> None:
        distributions.check_name(self.distribution)
        for name in ("samples", "workers", "finalists", "batch_size"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.race is not None and not self.race > 1:
            raise UsageError(f"race must be > 1 (or None, no racing), got {self.race}")
        strategies.check(self.strategy, self.budget, self.time_budget_s)


@dataclasses.dataclass
class SweepResult:
    spec: SweepSpec
    key: str
    entry: Entry  # the table entry, as written
    candidates: list[Candidate]
    table_path: Path | None
    wall_s: float
    log_path: Path | None = None
    resumed: int = 0  # candidates restored from the sweep log
    interrupted: bool = False

    @property
    def best(self) -> Candidate:
        return next(c for c in self.candidates if c.config.to_dict() == self.entry.config and c.status == OK)

    @property
    def default(self) -> Candidate:
        return next(c for c in self.candidates if c.is_default)


def as_json(value: Any) -> Any:
    """`value` as it reads back from JSON (so that a header compares equal to the one in the log)."""
    return json.loads(json.dumps(value, default=str))


class SweepPlan:
    """`SweepSpec` resolved once: the op, backend, key, search space and the sweep's settings."""

    def __init__(self, spec: SweepSpec):
        self.spec = spec
        self.op: KernelOp = get_op(spec.op)
        self.platform = devices.platform()
        self.device_kind = devices.device_kind()
        self.backend: Backend = self.op.backends.resolve(spec.backend, self.platform)
        self.fields = key_fields(spec.problem, self.backend.name, spec.distribution)
        self.key = key_from_fields(spec.op, self.fields)
        self.directory = dirs.write_dir(spec.profile_dir)

    def check_runs_here(self) -> None:
        if not self.backend.runs_on(self.platform):
            raise UsageError(f"backend {self.backend.name!r} does not run on {self.platform}")

    @functools.cached_property
    def space(self) -> list[KernelConfig]:
        """The backend's search space for the problem (valid configs, default first), cut to max_candidates."""
        space = self.backend.search_space(self.spec.problem)
        if self.spec.max_candidates is not None:
            space = space[: max(1, self.spec.max_candidates)]
        return space

    @functools.cached_property
    def settings(self) -> dict[str, Any]:
        """The sweep's parameters as JSON reads them back: the one serialization of them."""
        s = self.spec
        return as_json({"op": s.op, "backend": self.backend.name, "distribution": s.distribution, "seed": s.seed,
                        "samples": s.samples, "race": s.race, "strategy": s.strategy, "budget": s.budget,
                        "time_budget_s": s.time_budget_s, "max_candidates": s.max_candidates,
                        "finalists": s.finalists, "batch_size": s.batch_size, "space": len(self.space)})

    @functools.cached_property
    def identity(self) -> dict[str, Any]:
        """What makes two sweeps the same sweep: the same candidates, measured the same way."""
        problem = self.spec.problem
        problem = dataclasses.asdict(problem) if dataclasses.is_dataclass(problem) else repr(problem)
        return as_json({"key": self.key, "problem": problem, **{k: self.settings[k] for k in IDENTITY_FIELDS}})

    def search_settings(self) -> dict[str, Any]:
        return {k: self.settings[k] for k in SEARCH_FIELDS}

    @property
    def log_path(self) -> Path:
        return sweep_log.log_path(self.directory, self.device_kind, self.spec.op,
                                  sweep_log.log_name(self.fields, self.identity))

    @property
    def table_path(self) -> Path:
        return dirs.table_path(self.directory, self.device_kind, self.spec.op)

