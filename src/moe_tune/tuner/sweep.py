"""One sweep: the candidates a search strategy picks from one backend's search space for one problem,
compiled in parallel, checked against the reference, timed from the profiler trace; the winner (and
everything about how it won) becomes a table entry.

Rules (DESIGN.md): a wrong candidate never wins; the default config is always a candidate, so the speedup
over it is always measured; a failing candidate is recorded with its reason and the sweep goes on. The
fastest few are re-timed together with the default before a winner is chosen (`_final_round`).

Nothing is lost (`tuner.log`): candidates are compiled and checked in chunks and timed in batches (each
batch in interleaved rounds), and every finished candidate is appended to the sweep log at once: a failed
or wrong one when it is checked, a correct one when its batch is timed. Running the same sweep again
resumes: candidates found in the log are restored, not compiled, checked or timed again (only finalists
restored from the log are compiled again, for the final round). A KeyboardInterrupt stops the sweep,
keeps the log, still writes an entry (marked `interrupted`) when the default and another candidate have
finished, and is raised again as `SweepInterrupted`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import jax

from moe_tune import devices, distributions
from moe_tune.errors import MoeTuneError, TableError, UsageError
from moe_tune.kernels import get_op
from moe_tune.profiles import dirs
from moe_tune.profiles.key import key_fields, key_from_fields
from moe_tune.profiles.table import read_table, write_entries
from moe_tune.profiles.versions import entry_versions
from moe_tune.tuner import log as sweep_log
from moe_tune.tuner import strategies
from moe_tune.tuner.candidates import (FAILED, OK, WRONG, Candidate, check_all, compile_all, failure_reason,
                                      start_workers)
from moe_tune.tuner.timing import Timing, first_call_is_warm, time_candidates


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
        if self.samples < 1:
            raise UsageError(f"samples must be >= 1, got {self.samples}")
        if self.workers < 1:
            raise UsageError(f"workers must be >= 1, got {self.workers}")
        if self.race is not None and not self.race > 1:
            raise UsageError(f"race must be > 1 (or None, no racing), got {self.race}")
        if self.finalists < 1:
            raise UsageError(f"finalists must be >= 1, got {self.finalists}")
        if self.batch_size < 1:
            raise UsageError(f"batch_size must be >= 1, got {self.batch_size}")
        strategies.check(self.strategy, self.budget, self.time_budget_s)


@dataclasses.dataclass
class SweepResult:
    spec: SweepSpec
    key: str
    entry: dict[str, Any]
    candidates: list[Candidate]
    table_path: Path | None
    wall_s: float
    log_path: Path | None = None
    resumed: int = 0  # candidates restored from the sweep log
    interrupted: bool = False

    @property
    def best(self) -> Candidate:
        return next(c for c in self.candidates if c.config.to_dict() == self.entry["config"] and c.status == OK)

    @property
    def default(self) -> Candidate:
        return next(c for c in self.candidates if c.is_default)


def _json(value: Any) -> Any:
    """`value` as it reads back from JSON (so that a header compares equal to the one in the log)."""
    return json.loads(json.dumps(value, default=str))


def sweep_identity(spec: SweepSpec, key: str) -> dict[str, Any]:
    """What makes two sweeps the same sweep: the same candidates, measured the same way."""
    problem = dataclasses.asdict(spec.problem) if dataclasses.is_dataclass(spec.problem) else repr(spec.problem)
    return _json({"key": key, "problem": problem, "seed": spec.seed, "samples": spec.samples, "race": spec.race,
                  "strategy": spec.strategy, "budget": spec.budget, "max_candidates": spec.max_candidates})


def log_path_for(spec: SweepSpec) -> Path:
    """Where the sweep log of `spec` is (whether or not it exists yet)."""
    backend = get_op(spec.op).backends.resolve(spec.backend, devices.platform())
    fields = key_fields(spec.problem, backend.name, spec.distribution)
    identity = sweep_identity(spec, key_from_fields(spec.op, fields))
    return sweep_log.log_path(dirs.write_dir(spec.profile_dir), devices.device_kind(), spec.op,
                              sweep_log.log_name(fields, identity))


def run_sweep(spec: SweepSpec, reporter: Reporter | None = None) -> SweepResult:
    """Tune one (op, backend, problem, distribution) and write the winning entry; returns everything.

    Resumes from the sweep log when there is one (`spec.fresh` deletes it first). Raises SweepError when no
    candidate is correct, and SweepInterrupted (a KeyboardInterrupt) when interrupted."""
    started = time.perf_counter()
    op = get_op(spec.op)
    platform = devices.platform()
    backend = op.backends.resolve(spec.backend, platform)
    if not backend.runs_on(platform):
        raise UsageError(f"backend {backend.name!r} does not run on {platform}")
    space = backend.search_space(spec.problem)
    if spec.max_candidates is not None:
        space = space[: max(1, spec.max_candidates)]
    strategy = strategies.make(spec.strategy, space, backend=backend, problem=spec.problem, budget=spec.budget,
                               seed=spec.seed)
    fields = key_fields(spec.problem, backend.name, spec.distribution)
    key = key_from_fields(spec.op, fields)
    directory = dirs.write_dir(spec.profile_dir)
    identity = sweep_identity(spec, key)
    path = sweep_log.log_path(directory, devices.device_kind(), spec.op, sweep_log.log_name(fields, identity))
    # a log measured with other versions (or another revision of the kernel) is not resumed
    header = {"identity": identity, "key": key, "versions": entry_versions(backend),
              "spec": _json({"op": spec.op, "backend": backend.name, "distribution": spec.distribution,
                             "seed": spec.seed, "samples": spec.samples, "race": spec.race, "strategy": spec.strategy,
                             "budget": spec.budget, "max_candidates": spec.max_candidates,
                             "finalists": spec.finalists, "batch_size": spec.batch_size, "space": len(space)})}
    with sweep_log.SweepLog(path, header, fresh=spec.fresh) as log:
        sweep = _Sweep(spec, op, backend, platform, strategy, log, reporter or Reporter(), started)
        return sweep.run(key, fields, directory)


class _Sweep:
    """The state of one run of a sweep: finished candidates (restored or measured), inputs, log."""

    def __init__(self, spec, op, backend, platform, strategy, log, reporter, started):
        self.spec, self.op, self.backend, self.platform = spec, op, backend, platform
        self.strategy, self.log, self.reporter, self.started = strategy, log, reporter, started
        self.problem = spec.problem
        self.done: list[Candidate] = []  # finished: restored from the log or measured in this run
        self.measured: dict[Any, Candidate] = {}  # config -> finished candidate (what strategies see)
        self.next_index = 0
        self.resumed = self.recompiled = self.batches = 0
        self.fallback: str | None = None
        self.stopped: str | None = None
        self.stage_s: dict[str, float] = {"compile": 0.0, "check": 0.0, "time": 0.0}  # wall time per stage

    @contextlib.contextmanager
    def _clock(self, stage: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stage_s[stage] += time.perf_counter() - start

    # -- search ----------------------------------------------------------------------------------------

    def run(self, key, fields, directory) -> SweepResult:
        spec = self.spec
        if self.log.restored or self.log.finals:
            self.log.append([{"type": "run", "started": sweep_log.now(), "pid": os.getpid(),
                              "restorable": len(self.log.restored), "workers": spec.workers,
                              "time_budget_s": spec.time_budget_s}])
        interrupted = False
        best = within_noise = None
        try:
            start_workers(spec.workers)  # they start while the inputs and the reference are computed
            self.host_inputs = self.op.make_inputs(self.problem, spec.distribution, spec.seed)
            self.expected = self.op.reference(self.problem, self.host_inputs)
            self.inputs = jax.device_put(self.host_inputs)
            self.search()
            best, within_noise, final_fallback = self.final()
            self.fallback = self.fallback or final_fallback
        except KeyboardInterrupt:
            interrupted = True
        except SweepError as e:
            self._log_final(None, None, interrupted=False, table=None, error=str(e))
            raise
        default = next((c for c in self.done if c.is_default), None)
        if interrupted:
            best, within_noise = self._interrupted_winner(default)
        if best is None:  # interrupted before the default and one other candidate had finished
            self._log_final(None, None, interrupted=True, table=None)
            raise SweepInterrupted(self._interrupt_message(None, None), log_path=self.log.path,
                                   kept=len(self.done), result=None)

        self.done.sort(key=lambda c: c.index)
        entry = _entry(spec, key, fields, self.problem, best, default, self.done, self.fallback, self.host_inputs)
        entry["within_noise_of_default"] = within_noise
        entry["interrupted"] = interrupted
        entry["search"] = {
            "strategy": spec.strategy, "budget": spec.budget, "time_budget_s": spec.time_budget_s,
            "max_candidates": spec.max_candidates, "space": len(self.strategy.space),
            "stopped": "interrupted" if interrupted else self.stopped, "batch_size": spec.batch_size,
            "batches": self.batches, "resumed": self.resumed, "recompiled_finalists": self.recompiled,
            "stage_s": {k: round(v, 3) for k, v in self.stage_s.items()},
            "log_restarted": self.log.restarted,
        }
        entry["sweep_wall_s"] = round(time.perf_counter() - self.started, 3)
        table = dirs.table_path(directory, devices.device_kind(), spec.op)
        kept_complete = interrupted and _has_complete_entry(table, key)
        if not kept_complete:
            table = write_entries(table, spec.op, devices.device_kind(), [entry])
        self._log_final(best, within_noise, interrupted=interrupted, table=None if kept_complete else table)
        result = SweepResult(spec, key, entry, self.done, None if kept_complete else table,
                             time.perf_counter() - self.started, self.log.path, self.resumed, interrupted)
        if interrupted:
            raise SweepInterrupted(self._interrupt_message(table, kept_complete), log_path=self.log.path,
                                   kept=len(self.done), result=result)
        return result

    def _out_of_time(self) -> bool:
        budget = self.spec.time_budget_s
        return bool(self.measured) and budget is not None and time.perf_counter() - self.started > budget

    def search(self) -> None:
        """Ask the strategy for rounds until it is done or the time budget is spent; measure each round."""
        planned = self.strategy.planned()
        for stage in ("compile", "check", "time"):
            self.reporter.stage(stage, planned)
        default = self.strategy.default
        chunk = self.spec.batch_size * -(-self.spec.workers // self.spec.batch_size)
        while True:
            if self._out_of_time():
                self.stopped = "time budget"
                return
            configs = self.strategy.next_round(self.measured)
            if not configs:
                self.stopped = self.strategy.stopped
                return
            todo = []
            for config in configs:
                cand = self._restore(config, is_default=config == default)
                if cand is None:
                    todo.append(Candidate(self.next_index, config, is_default=config == default))
                self.next_index += 1
            for start in range(0, len(todo), chunk):
                if self._out_of_time():
                    self.stopped = "time budget"
                    return
                self._measure(todo[start:start + chunk])

    def _restore(self, config, is_default: bool) -> Candidate | None:
        """The finished candidate for `config` from the log, or None when it has to be measured."""
        record = self.log.restored.get(sweep_log.config_key(config.to_dict()))
        if record is None or record.get("status") not in (OK, FAILED, WRONG):
            return None
        timing = None
        if record.get("timing"):
            try:
                timing = Timing(**{**record["timing"], "samples_s": tuple(record["timing"]["samples_s"])})
            except (TypeError, KeyError):
                return None
        if record["status"] == OK and timing is None:
            return None
        cand = Candidate(self.next_index, config, is_default=is_default, status=record["status"],
                         stage=record.get("stage") or "", reason=record.get("reason") or "",
                         error=record.get("error"), compile_s=record.get("compile_s"),
                         compiles=record.get("compiles") or 0, timing=timing)
        self.done.append(cand)
        self.measured[config] = cand
        self.resumed += 1
        for stage in ("compile", "check", "time"):
            self.reporter.advance(stage)
        return cand

    def _measure(self, chunk: list[Candidate]) -> None:
        """Compile a chunk (in parallel), check it, time the correct ones batch by batch; log as they finish."""
        spec, tolerance = self.spec, self.op.tolerance(self.problem)
        checked_ids: set[int] = set()

        def checked(cand: Candidate) -> None:
            checked_ids.add(cand.index)
            self.reporter.advance("check")
            if cand.status != OK:
                self._finished([cand])
                self.reporter.advance("time")

        def compiled(cand: Candidate) -> None:
            self.reporter.advance("compile")
            if cand.status == OK and cand.output is not None:
                # checked as it arrives, so that a chunk's outputs are never all held at once (a drhs
                # output can be gigabytes)
                check_all([cand], self.inputs, self.expected, tolerance, on_done=checked)

        with self._clock("compile"):  # with workers this also runs and checks each candidate once
            compile_all(self.op, self.backend, self.problem, chunk, self.inputs, workers=spec.workers,
                        on_done=compiled, timeout=spec.compile_timeout_s)
        failed = [c for c in chunk if c.status != OK and c.index not in checked_ids]
        self._finished(failed)
        self.reporter.advance("check", len(failed))
        self.reporter.advance("time", len(failed))
        with self._clock("check"):  # candidates compiled here: run once and checked now
            check_all([c for c in chunk if c.status == OK and c.index not in checked_ids], self.inputs,
                      self.expected, tolerance, on_done=checked)
        correct = [c for c in chunk if c.status == OK]
        for start in range(0, len(correct), spec.batch_size):
            with self._clock("time"):
                self._time_batch(correct[start:start + spec.batch_size])

    def _warm_up(self, cands: list[Candidate], *, logged: bool = False) -> list[Candidate]:
        """Run each candidate once here, untimed (its first call pays one-off costs); return those that ran.

        An executable compiled in a worker can fail to run in this process although it ran in the worker
        (seen on XLA CPU with the persistent compilation cache, when a sweep is resumed in a process that
        loaded the same programs before: `NOT_FOUND: Function wrapped_iota not found`): it is compiled again
        here and retried, and recorded as failed only if that fails too. `logged`: the candidates are
        already in the log (finalists); a failure is appended as a new line for the config."""
        ready = []
        for c in cands:
            try:
                jax.block_until_ready(c.executable(self.inputs))
            except Exception as first:  # noqa: BLE001 - recorded as the candidate's reason
                compiles = c.compiles
                compile_all(self.op, self.backend, self.problem, [c], self.inputs, workers=1)
                self.recompiled += c.compiles - compiles
                try:
                    if c.status != OK:
                        raise RuntimeError(c.reason)
                    jax.block_until_ready(c.executable(self.inputs))
                except Exception as again:  # noqa: BLE001
                    c.status, c.stage = FAILED, "run"
                    c.reason = f"{failure_reason(first)}; compiled again in this process: {failure_reason(again)}"
                    if logged:
                        self.log.append([_log_line(c, None, recompiled=True)])
                    else:
                        self._finished([c])
                        self.reporter.advance("time")
                    continue
            ready.append(c)
        return ready

    def _time_batch(self, batch: list[Candidate]) -> None:
        spec, number = self.spec, self.batches
        keep = None if spec.keep_trace_dir is None else Path(spec.keep_trace_dir) / f"batch_{number}"

        def time_batch():
            return time_candidates(
                {c.index: (lambda c=c: c.executable(self.inputs)) for c in batch},
                samples=spec.samples, platform=self.platform, seed=spec.seed + 1000 * (number + 1),
                keep_trace_dir=keep, on_round=lambda units: self.reporter.advance("time", units / spec.samples),
                warmup=0, race=spec.race, best_s=self._best_median(),
            )

        timings = None
        if first_call_is_warm(self.platform):  # the first timed round is the warm-up
            try:
                timings, fallback = time_batch()
            except Exception:  # noqa: BLE001 - a candidate that fails to run here: `_warm_up` sorts it out
                timings = None
        if timings is None:
            batch = self._warm_up(batch)
            if not batch:
                return
            timings, fallback = time_batch()
        for c in batch:
            c.timing = timings[c.index]
        if fallback and self.fallback is None:
            self.fallback = f"batch {number}: {fallback}"
        self.batches += 1
        self._finished(batch, batch=number)

    def _best_median(self) -> float | None:
        """The fastest median among the candidates timed so far (restored ones included), or None."""
        return min((c.timing.median_s for c in self.done if c.status == OK and c.timing is not None), default=None)

    def _finished(self, cands: list[Candidate], batch: int | None = None) -> None:
        """Log finished candidates (one write and fsync), then count them as measured."""
        if not cands:
            return
        self.log.append([_log_line(c, batch) for c in cands])
        for c in cands:
            self.done.append(c)
            self.measured[c.config] = c

    # -- final round -----------------------------------------------------------------------------------

    def final(self):
        """Compile the finalists restored from the log (they have no executable), run each once, then
        `_final_round`."""
        survivors = [c for c in self.done if c.status == OK]
        default = next(c for c in self.done if c.is_default)
        while survivors:
            finalists = _finalists(self.spec, survivors, default)
            need = [c for c in finalists if c.executable is None]
            if need:
                self._recompile(need)
            elif len(self._warm_up(finalists, logged=True)) == len(finalists):
                break
            survivors = [c for c in survivors if c.status == OK]
        if not survivors:
            reasons = "; ".join(f"{c.config.label()}: {c.reason}" for c in self.done[:3])
            raise SweepError(f"no candidate of {self.backend.name} compiled and passed the check ({reasons})")
        return _final_round(self.spec, survivors, default, self.inputs, self.platform, self.reporter)

    def _recompile(self, cands: list[Candidate]) -> None:
        before = {c.index: (c.compiles, c.compile_s) for c in cands}
        for c in cands:
            c.compiles = 0
        compile_all(self.op, self.backend, self.problem, cands, self.inputs, workers=self.spec.workers,
                    timeout=self.spec.compile_timeout_s)
        check_all([c for c in cands if c.status == OK], self.inputs, self.expected, self.op.tolerance(self.problem))
        for c in cands:
            self.recompiled += c.compiles
            compiles, compile_s = before[c.index]
            c.compiles += compiles
            c.compile_s = compile_s
        # a finalist that no longer compiles or checks is recorded as such (the last line of a config wins)
        self.log.append([_log_line(c, None, recompiled=True) for c in cands if c.status != OK])

    def _interrupted_winner(self, default: Candidate | None):
        """Among the finished candidates, by their batch timings: (winner, within noise), or (None, None)."""
        timed = [c for c in self.done if c.status == OK and c.timing is not None]
        if default is None or len(self.done) < 2 or not timed:
            return None, None
        return _decide(min(timed, key=lambda c: c.timing.median_s), default)

    def _interrupt_message(self, table: Path | None, kept_complete: bool | None) -> str:
        kept = f"{len(self.done)} finished candidate(s) kept in {self.log.path}"
        if table is None:
            what = "no table entry (the default and one other candidate had not finished)"
        elif kept_complete:
            what = f"the complete entry already in {table} was kept"
        else:
            what = f"an interrupted entry (best of those finished) was written to {table}"
        return f"{kept}; {what}; run the same sweep again to resume (--fresh to start over)"

    def _log_final(self, best, within_noise, *, interrupted: bool, table, error: str | None = None) -> None:
        finalists = [{"index": c.index, "config": c.config.to_dict(), "median_s": c.timing.median_s,
                      "samples": c.timing.samples} for c in self.done if c.status == OK and c.timing is not None
                     and c.timing.samples > self.spec.samples]
        self.log.append([{
            "type": "final", "finished": sweep_log.now(), "interrupted": interrupted,
            "winner": None if best is None else best.config.to_dict(),
            "within_noise_of_default": within_noise, "error": error,
            "stopped": "interrupted" if interrupted else self.stopped, "candidates": len(self.done),
            "resumed": self.resumed, "recompiled_finalists": self.recompiled, "finalists": finalists,
            "table": None if table is None else str(table),
        }])


def _log_line(c: Candidate, batch: int | None, recompiled: bool = False) -> dict[str, Any]:
    line = {"type": "candidate", "index": c.index, "config": c.config.to_dict(), "is_default": c.is_default,
            "status": c.status, "stage": c.stage, "reason": c.reason, "error": c.error, "compile_s": c.compile_s,
            "compiles": c.compiles, "batch": batch, "timing": None if c.timing is None else c.timing.to_dict(),
            "logged": sweep_log.now()}
    if recompiled:
        line["recompiled"] = True
    return line


def _has_complete_entry(table: Path, key: str) -> bool:
    try:
        entry = read_table(table)["entries"].get(key) if table.exists() else None
    except TableError:
        return False
    return entry is not None and not entry.get("interrupted")


def relative_noise(timing: Timing) -> float:
    """Median absolute deviation of the samples over their median: a spread that ignores outliers."""
    med = timing.median_s
    return statistics.median(abs(x - med) for x in timing.samples_s) / med if med > 0 else 0.0


def _finalists(spec: SweepSpec, survivors: list[Candidate], default: Candidate) -> list[Candidate]:
    """The fastest `spec.finalists` survivors, and the default."""
    ranked = sorted(survivors, key=lambda c: c.timing.median_s)
    finalists = ranked[: spec.finalists]
    if default.status == OK and not any(c is default for c in finalists):
        finalists.append(default)
    return finalists


def _decide(best: Candidate, default: Candidate) -> tuple[Candidate, bool]:
    """(winner, kept for being within noise): a win over the default by less than twice the larger relative
    MAD of the two is not a win."""
    if best is default or default.status != OK:
        return best, False
    noise = 2 * max(relative_noise(best.timing), relative_noise(default.timing))
    if default.timing.median_s / best.timing.median_s - 1 <= noise:
        return default, True
    return best, False


def _final_round(spec: SweepSpec, survivors: list[Candidate], default: Candidate, inputs, platform, reporter):
    """Re-time the fastest few and the default together, with twice the samples, and pick the winner there.

    One sweep round's medians of near-equal candidates are mostly noise on a shared machine; the finalists
    are compared like for like. A winner that beats the default by less than the noise (twice the larger
    relative MAD of the two) is not a win: the default is kept and the entry says so.
    Returns (winner, whether the default was kept for being within noise, timing fallback reason).
    """
    finalists = _finalists(spec, survivors, default)
    if len(finalists) < 2:
        return finalists[0], False, None
    reporter.stage("finalists", 2 * spec.samples)
    final, fallback = time_candidates(
        {c.index: (lambda c=c: c.executable(inputs)) for c in finalists},
        samples=2 * spec.samples, platform=platform, seed=spec.seed + 1,
        on_round=lambda r: reporter.advance("finalists"), warmup=0,  # `Sweep.final` ran each one already
    )
    for c in finalists:
        c.timing = final[c.index]
    best = min(finalists, key=lambda c: c.timing.median_s)
    winner, within_noise = _decide(best, default)
    return winner, within_noise, fallback


def _entry(spec, key, fields, problem, best, default, candidates, fallback, host_inputs) -> dict[str, Any]:
    counts = {s: sum(c.status == s for c in candidates) for s in (OK, FAILED, WRONG)}
    default_ok = default.status == OK
    return {
        "key": key,
        "op": spec.op,
        "fields": fields,
        "config": best.config.to_dict(),
        "timing": best.timing.to_dict(),
        "timing_fallback": fallback,
        "default": {
            "config": default.config.to_dict(),
            "status": default.status,
            "median_s": default.timing.median_s if default_ok else None,
            "reason": default.reason or None,
        },
        "speedup_over_default": default.timing.median_s / best.timing.median_s if default_ok else None,
        "candidates": {"tried": len(candidates), "ok": counts[OK], "failed": counts[FAILED], "wrong": counts[WRONG],
                       "compiles": sum(c.compiles for c in candidates)},
        "failures": [c.record() for c in candidates if c.status != OK],
        "results": [c.record() for c in candidates if c.status == OK],
        "distribution": {
            "name": spec.distribution,
            "seed": spec.seed,
            **get_op(spec.op).distribution_record(problem, spec.distribution, spec.seed, host_inputs),
        },
        "flops": get_op(spec.op).flops(problem),
        "versions": entry_versions(get_op(spec.op).backends.get(fields["backend"])),
        "hostname": socket.gethostname(),
        "platform": devices.platform(),
        "device_kind": devices.device_kind(),
        "tuned_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
