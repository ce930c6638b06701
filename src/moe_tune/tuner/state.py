"""What one run of a sweep holds while its stages run, what a stage yields, how a sweep ends, and what it writes.

`SweepState`: the plan, the log, the inputs and the reference, the finished candidates (restored from the log
or measured now), and the wall time per stage; `finished` is the one way a candidate becomes finished (its line
is appended to the sweep log first, so nothing finished is lost). `Step`: what a stage did (a batch timed, a
timing fallback, compilations spent again, candidates restored, why the search stopped), yielded by the
search, measure and finals generators and summed by `Tally`, so that what they did up to a KeyboardInterrupt
is still known. `Reporter` receives progress; `SweepResult`, `SweepError` (no winner) and `SweepInterrupted`
(with what was kept) are how a sweep ends.

The record stage: the sweep log's header, run and final lines (candidate lines are written as candidates
finish), the table entry (profiles' typed `Entry`) and its write to the table, and the message an interrupted
sweep ends with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import os
import socket
import time
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any, TypeVar

from moe_tune.core.errors import MoeTuneError
from moe_tune.kernels.base import KernelConfig
from moe_tune.profiles.entry import Entry, entry_versions
from moe_tune.profiles.table import has_complete_entry, write_entries
from moe_tune.profiles.verdict import WITHIN_NOISE, Verdict
from moe_tune.tuner.candidate import FAILED, OK, WRONG, Candidate, Reference, SweepInputs
from moe_tune.tuner.compiling import Kernel
from moe_tune.tuner.request import (
    HEADER_SETTINGS,
    SweepLog,
    SweepPlan,
    SweepRequest,
    SweepSettings,
    candidate_line,
    config_key,
    now,
)
from moe_tune.tuner.search import WarmStart


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
        (`tuner/candidate.py`): `inputs`, `reference` and `host_inputs` wait for them."""
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


def header(plan: SweepPlan) -> dict[str, Any]:
    """The log's first line (without its type and start time). A log whose identity or versions differ (a
    sweep measured another way, with other versions or another revision of the kernel) is not resumed."""
    return {"identity": plan.identity, "key": plan.key, "versions": entry_versions(plan.backend),
            HEADER_SETTINGS: plan.settings_json}


def run_line(state: SweepState) -> dict[str, Any]:
    """One line per later run of the same sweep (a resume)."""
    return {"type": "run", "started": now(), "pid": os.getpid(), "restorable": len(state.log.restored),
            "workers": state.settings.workers, "time_budget_s": state.settings.time_budget_s}


def log_final(state: SweepState, done: Step, best: Candidate | None, verdict: Verdict | None, *,
              interrupted: bool, table: Path | None, error: str | None = None) -> None:
    """The last line of a run: the winner (or why there is none), the verdict, and the finalists' timings of
    both rounds (`Candidate.finalist_record`, with their index). `done`: what the stages did."""
    index = {config_key(c.config.to_dict()): c.index for c in state.done}
    finalists = [{"index": index.get(config_key(f["config"])), **f}
                 for f in (verdict.finalists if verdict else ())]
    state.log.append([{
        "type": "final", "finished": now(), "interrupted": interrupted,
        "winner": None if best is None else best.config.to_dict(),
        "within_noise_of_default": None if verdict is None else verdict.rule == WITHIN_NOISE,
        "verdict": None if verdict is None else verdict.text, "noise": None if verdict is None else verdict.noise,
        "error": error,
        "stopped": _stopped(done, interrupted), "candidates": len(state.done),
        "resumed": done.resumed, "recompiled_finalists": done.recompiled, "finalists": finalists,
        "table": None if table is None else str(table),
        # where this run's search started (`warm_start`): the seeds and the tuned entries they came from
        "start": state.start.describe(), **state.start.to_json(),
    }])


def _stopped(done: Step, interrupted: bool) -> str | None:
    return "interrupted" if interrupted else done.stopped


# -- the table entry -------------------------------------------------------------------------------------------

def build_entry(state: SweepState, done: Step, best: Candidate, verdict: Verdict, interrupted: bool) -> Entry:
    """The table entry of a sweep: the winner, the default, every candidate's record, and how it was found."""
    plan, settings, problem = state.plan, state.settings, state.plan.request.problem
    candidates, default = state.done, state.default()
    counts = {s: sum(c.status == s for c in candidates) for s in (OK, FAILED, WRONG)}
    default_ok = default.status == OK
    return Entry(
        key=plan.key,
        op=plan.request.op,
        fields=plan.fields,
        config=best.config.to_dict(),
        timing=best.timing.to_dict(),
        timing_fallback=done.fallback,
        default={"config": default.config.to_dict(), "status": default.status,
                 "median_s": default.timing.median_s if default_ok else None, "reason": default.reason or None},
        speedup_over_default=default.timing.median_s / best.timing.median_s if default_ok else None,
        candidates={"tried": len(candidates), "ok": counts[OK], "failed": counts[FAILED], "wrong": counts[WRONG],
                    "compiles": sum(c.compiles for c in candidates)},
        failures=[c.record() for c in candidates if c.status != OK],
        results=[c.record() for c in candidates if c.status == OK],
        distribution={"name": settings.distribution, "seed": settings.seed,
                      **plan.op.distribution_record(problem, settings.distribution, settings.seed, state.host_inputs)},
        flops=plan.op.flops(problem),
        versions=entry_versions(plan.backend),
        hostname=socket.gethostname(),
        platform=plan.platform,
        device_kind=plan.device_kind,
        tuned_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        within_noise_of_default=verdict.rule == WITHIN_NOISE,
        verdict=verdict.to_json(),
        interrupted=interrupted,
        search={**plan.search_settings(), "stopped": _stopped(done, interrupted), "batches": done.batches,
                "resumed": done.resumed, "recompiled_finalists": done.recompiled,
                "stage_s": {k: round(v, 3) for k, v in state.stage_s.items()}, "log_restarted": state.log.restarted,
                "start": state.start.describe(), "seeds": [c.to_dict() for c in state.start.seeds],
                "local": state.start.local},
        sweep_wall_s=round(state.elapsed_s(), 3),
    )


def write(state: SweepState, entry: Entry, interrupted: bool) -> tuple[Path, bool]:
    """Write `entry` to the table; returns (table, whether a complete entry already there was kept instead:
    an interrupted sweep never replaces a complete one)."""
    table = state.plan.table_path
    if interrupted and has_complete_entry(table, entry.key):
        return table, True
    return write_entries(table, state.plan.request.op, state.plan.device_kind, [entry]), False


def interrupt_message(state: SweepState, table: Path | None, kept_complete: bool | None) -> str:
    kept = f"{len(state.done)} finished candidate(s) kept in {state.log.path}"
    if table is None:
        what = "no table entry (the default and one other candidate had not finished)"
    elif kept_complete:
        what = f"the complete entry already in {table} was kept"
    else:
        what = f"an interrupted entry (best of those finished) was written to {table}"
    return f"{kept}; {what}; run the same sweep again to resume (--fresh to start over)"
