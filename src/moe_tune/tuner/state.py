"""What one run of a sweep holds while its stages run, what a stage yields, and how a sweep ends.

`SweepState`: the plan, the log, the inputs and the reference, the finished candidates (restored from the log
or measured now), and the wall time per stage; `finished` is the one way a candidate becomes finished (its line
is appended to the sweep log first, so nothing finished is lost). `Step`: what a stage did (a batch timed, a
timing fallback, compilations spent again, candidates restored, why the search stopped), yielded by the
search, measure and finals generators and summed by `Tally`, so that what they did up to a KeyboardInterrupt
is still known. `Reporter` receives progress; `SweepResult`, `SweepError` (no winner) and `SweepInterrupted`
(with what was kept) are how a sweep ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any, TypeVar

from moe_tune.core.errors import MoeTuneError
from moe_tune.kernels.base import KernelConfig
from moe_tune.profiles.entry import Entry
from moe_tune.tuner.candidate import Candidate, Reference
from moe_tune.tuner.compiling import OK, Kernel
from moe_tune.tuner.inputs import SweepInputs
from moe_tune.tuner.log import SweepLog, candidate_line
from moe_tune.tuner.request import SweepPlan, SweepRequest, SweepSettings
from moe_tune.tuner.warm_start import WarmStart


class SweepError(MoeTuneError):
    """The sweep could not produce a winner (every candidate failed or was wrong)."""


class Reporter:
    """Progress callbacks; the CLI draws them with rich, the library default ignores them."""

    def stage(self, name: str, total: int) -> None:
        pass

    def advance(self, name: str, amount: float = 1) -> None:
        pass


@dataclasses.dataclass
class SweepResult:
    request: SweepRequest
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


class SweepInterrupted(KeyboardInterrupt):
    """A KeyboardInterrupt stopped a sweep. The finished candidates are in the log (`log_path`); `result` is
    the entry written from them, or None when too little had finished. str() says what was kept."""

    def __init__(self, message: str, *, log_path: Path, kept: int, result: SweepResult | None):
        super().__init__(message)
        self.log_path, self.kept, self.result = log_path, kept, result

    def __str__(self) -> str:
        return self.args[0]


@dataclasses.dataclass
class SweepState:
    plan: SweepPlan
    log: SweepLog
    reporter: Reporter
    started: float  # perf_counter() when the sweep started
    prepared: SweepInputs | None = None  # the inputs and their reference (`prepare_inputs`)
    done: list[Candidate] = dataclasses.field(default_factory=list)  # finished: restored or measured
    measured: dict[KernelConfig, Candidate] = dataclasses.field(default_factory=dict)  # what strategies see
    indices: Iterator[int] = dataclasses.field(default_factory=itertools.count)  # of the candidates, in order
    batch_numbers: Iterator[int] = dataclasses.field(default_factory=itertools.count)  # of the timing batches
    stage_s: dict[str, float] = dataclasses.field(
        default_factory=lambda: {"compile": 0.0, "check": 0.0, "time": 0.0})  # wall time per stage
    start: WarmStart = dataclasses.field(default_factory=WarmStart)  # where the search started

    def __post_init__(self) -> None:
        # a resumed run numbers its batches after the log's: a batch number names one batch of one run of this
        # sweep, and a restored candidate keeps its (`search.restore`), so that restored rounds pair correctly
        logged = [line.get("batch") for line in self.log.restored.values() if isinstance(line.get("batch"), int)]
        self.batch_numbers = itertools.count(max(logged, default=-1) + 1)

    @property
    def settings(self) -> SweepSettings:
        return self.plan.request.settings

    @property
    def kernel(self) -> Kernel:
        return self.plan.kernel

    def prepare_inputs(self) -> None:
        """The seeded inputs; their reference output and device copy are made on a thread meanwhile
        (`tuner/inputs.py`): `inputs`, `reference` and `host_inputs` wait for them."""
        s = self.settings
        self.prepared = SweepInputs.prepare(self.plan.op, self.plan.request.problem, s.distribution, s.seed)

    @property
    def inputs(self) -> Any:
        """The inputs on the device."""
        return self.prepared.device

    @property
    def reference(self) -> Reference:
        """The reference output."""
        return self.prepared.reference

    @property
    def host_inputs(self) -> Any:
        """The inputs on the host (views of the device copy on CPU)."""
        return self.prepared.host

    @contextlib.contextmanager
    def clock(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stage_s[stage] += time.perf_counter() - start

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def out_of_time(self) -> bool:
        budget = self.settings.time_budget_s
        return bool(self.measured) and budget is not None and self.elapsed_s() > budget

    def add(self, cand: Candidate) -> None:
        """Count a finished candidate (one restored from the log: it is there already)."""
        self.done.append(cand)
        self.measured[cand.config] = cand

    def finished(self, cands: list[Candidate], batch: int | None = None, *, recompiled: bool = False) -> None:
        """Log finished candidates (one write and fsync), then count them as measured. `recompiled`: a
        finalist restored from the log, compiled again, that failed now (its new line supersedes the old;
        it is counted already)."""
        if not cands:
            return
        self.log.append([candidate_line(c, batch, recompiled) for c in cands])
        if batch is not None:
            for c in cands:
                c.batch = batch
        if not recompiled:
            for c in cands:
                self.add(c)

    def default(self) -> Candidate | None:
        return next((c for c in self.done if c.is_default), None)

    def finalist_cutoff(self) -> float | None:
        """The median a candidate has to beat to be among the finalists (`settings.finalists` fastest) of
        the candidates timed so far, restored ones included; None while fewer are timed."""
        medians = sorted(c.timing.median_s for c in self.done if c.status == OK and c.timing is not None)
        n = self.settings.finalists
        return medians[n - 1] if len(medians) >= n else None

    def best_median(self) -> float | None:
        """The fastest median among the candidates timed so far (restored ones included), or None."""
        return min((c.timing.median_s for c in self.done if c.status == OK and c.timing is not None), default=None)


T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Step:
    batches: int = 0  # timing batches timed
    fallback: str | None = None  # why a batch was timed by the wall clock, if one was
    recompiled: int = 0  # XLA compilations spent again (finalists restored from the log, warm-up failures)
    resumed: int = 0  # candidates restored from the sweep log
    stopped: str | None = None  # why the search stopped

    def __add__(self, other: Step) -> Step:
        """Counts add up; the first fallback and the last stop reason are kept."""
        return Step(self.batches + other.batches, self.fallback or other.fallback,
                    self.recompiled + other.recompiled, self.resumed + other.resumed,
                    other.stopped or self.stopped)


class Tally:
    """The runner's sum of the steps its stages yielded."""

    def __init__(self) -> None:
        self.total = Step()

    def run(self, stage: Generator[Step, None, T]) -> T:
        """Run a stage to its end, adding up its steps; returns what the stage returns."""
        while True:
            try:
                step = next(stage)
            except StopIteration as done:
                return done.value
            self.total += step

