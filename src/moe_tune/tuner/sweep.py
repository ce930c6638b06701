"""One sweep: the candidates a search strategy picks from one backend's search space for one problem,
compiled in parallel, checked against the reference, timed from the profiler trace; the winner (and
everything about how it won) becomes a table entry.

Rules (the README's "How a sweep works"): a wrong candidate never wins; the default config is always a
candidate, so the speedup over it is always measured; a failing candidate is recorded with its reason and
the sweep goes on.

The stages, each a generator yielding what it did (`state.Step`) for `run` to add up:

- search (here): ask the strategy (`tuner.search`) for rounds of configs until it is done or the time
  budget is spent; a config an earlier run finished is restored from the sweep log, the others are measured
  chunk by chunk;
- measure and finals (`tuner.measure`): compile a chunk, check it, time the correct ones; re-time the fastest
  few with the default and apply the noise rule that picks the winner;
- record (`tuner.state`): the sweep log's header, run and final lines and the table entry.

Nothing is lost (`tuner.request`'s sweep log): every finished candidate is appended at once, and running the
same sweep again resumes it. A KeyboardInterrupt stops the sweep, keeps the log, still writes an entry
(marked `interrupted`) when the default and another candidate have finished, and is raised again as
`SweepInterrupted`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from moe_tune.core import settings as env
from moe_tune.core import settings as paths
from moe_tune.core.errors import warn_caller
from moe_tune.kernels.base import KernelConfig
from moe_tune.profiles.table import writable_dir
from moe_tune.tuner import compiling, measure
from moe_tune.tuner import state as record
from moe_tune.tuner.candidate import Candidate
from moe_tune.tuner.compiling import start_workers, uses_workers
from moe_tune.tuner.request import SweepLog, SweepPlan, SweepRequest, check_fits, config_key, parse_candidate
from moe_tune.tuner.search import Strategy, WarmStart, find, make
from moe_tune.tuner.state import Reporter, Step, SweepError, SweepInterrupted, SweepResult, SweepState, Tally

STAGES = ("compile", "check", "time")


def search(state: SweepState, strategy: Strategy) -> Iterator[Step]:
    """Measure the strategy's rounds, yielding what was done; the last step says why the search stopped."""
    settings = state.settings
    planned = strategy.planned()
    for stage in STAGES:
        state.reporter.stage(stage, planned)
    # a chunk is compiled in parallel: a whole number of timing batches, at least one per worker
    chunk = settings.batch_size * -(-settings.workers // settings.batch_size)
    while True:
        if state.out_of_time():
            yield Step(stopped="time budget")
            return
        configs = strategy.next_round(state.measured)
        if not configs:
            yield Step(stopped=strategy.stopped)
            return
        todo = []
        for config in configs:
            is_default = config == strategy.default
            index = next(state.indices)
            if restore(state, config, index, is_default):
                yield Step(resumed=1)
            else:
                todo.append(Candidate(index, config, is_default=is_default))
        for start in range(0, len(todo), chunk):
            if state.out_of_time():
                yield Step(stopped="time budget")
                return
            yield from measure.measure_chunk(state, todo[start:start + chunk])


def restore(state: SweepState, config: KernelConfig, index: int, is_default: bool) -> bool:
    """Whether an earlier run finished `config` (its line in the log is usable): then it is counted as done
    here, as candidate `index`, without being measured again."""
    line = state.log.restored.get(config_key(config.to_dict()))
    cand = None if line is None else parse_candidate(line, index, config, is_default)
    if cand is None:
        return False
    if isinstance(line.get("batch"), int):  # its rounds pair with its batch's (`candidate.same_rounds`)
        cand.batch = line["batch"]
    state.add(cand)
    for stage in STAGES:
        state.reporter.advance(stage)
    return True


def log_path_for(request: SweepRequest) -> Path:
    """Where the sweep log of `request` is (whether or not it exists yet)."""
    return SweepPlan(request).log_path


def preflight(request: SweepRequest) -> SweepPlan:
    """`request` resolved, once what would fail it late or as a traceback is ruled out: UsageError for a
    backend that cannot run here, a problem that cannot fit in memory (checked before anything is
    allocated) or a bad `$MOE_TUNE_WORKER_MEMORY_LIMIT`; MoeTuneError for a profile dir, its device kind's
    table dir, the compile cache dir or `--keep-trace` dir that cannot be created or written (checked before
    the sweep, not after). `run_sweep` calls it; a caller may call it first to fail before it prints anything."""
    plan = SweepPlan(request)
    plan.check_runs_here()
    workers = request.settings.workers
    check_fits(plan.op, request.problem, workers if uses_workers(workers) else 1)
    _check_environment(request.settings.workers)
    if request.settings.keep_trace_dir is not None:
        paths.writable_dir(request.settings.keep_trace_dir, "cannot write traces to")
    compiling.check_cache()
    writable_dir(plan.directory)
    paths.writable_dir(plan.table_path.parent, "cannot create or write the table dir")
    return plan


def _check_environment(workers: int) -> None:
    """The environment variables a sweep reads later, in its workers: a bad value is a UsageError naming the
    variable now, not a failure of every candidate later; a memory limit no worker will apply is said."""
    if env.worker_memory_limit() is not None and not uses_workers(workers):
        warn_caller(f"moe-tune: ${env.WORKER_MEMORY_LIMIT} applies to compile workers; with --workers {workers} "
                    "candidates compile in this process, without it (use --workers 2 or more to apply it)")


def run_sweep(request: SweepRequest, reporter: Reporter | None = None, *,
              on_log: Callable[[bytes], None] | None = None) -> SweepResult:
    """Tune one (op, backend, problem, distribution) and write the winning entry; returns everything.

    Resumes from the sweep log when there is one (`settings.fresh` deletes it first); `on_log` gets every
    append to the log (`SweepLog.on_append`). Raises what `preflight` raises, SweepError when no candidate
    is correct, and SweepInterrupted (a KeyboardInterrupt) when interrupted."""
    started = time.perf_counter()
    plan = preflight(request)
    settings = request.settings
    start = start_of(plan)
    strategy = make(settings.strategy, plan.space, backend=plan.backend, problem=request.problem,
                               budget=settings.budget, seed=settings.seed, seeds=start.seeds)
    start = dataclasses.replace(start, local=strategy.local)  # the entry says the search stayed near the seeds
    with SweepLog(plan.log_path, record.header(plan), fresh=settings.fresh, on_append=on_log) as log:
        state = SweepState(plan, log, reporter or Reporter(), started, start=start)
        return _run(state, strategy)


def start_of(plan: SweepPlan) -> WarmStart:
    """Where the search of `plan` starts: the nearest tuned shapes' winners (`warm_start`), unless `cold`."""
    if plan.request.settings.cold:
        return WarmStart(cold=True)
    return find(plan.request.op, plan.device_kind, plan.fields, plan.key, plan.space,
                           own_dir=plan.directory)


def _run(state: SweepState, strategy: Strategy) -> SweepResult:
    if state.log.restored or state.log.finals:
        state.log.append([record.run_line(state)])
        _say_restored_failures(state.log)
    interrupted = False
    best = verdict = None
    tally = Tally()  # what the stages did, kept up to an interrupt
    try:
        start_workers(state.settings.workers)  # they start while the inputs and the reference are computed
        state.prepare_inputs()
        tally.run(search(state, strategy))
        best, verdict = tally.run(measure.run_finals(state))
    except KeyboardInterrupt:
        interrupted = True
        best, verdict = measure.interrupted_winner(state)
    except SweepError as e:
        record.log_final(state, tally.total, None, None, interrupted=False, table=None, error=str(e))
        raise
    done = tally.total
    if best is None:  # interrupted before the default and one other candidate had finished
        record.log_final(state, done, None, None, interrupted=True, table=None)
        raise SweepInterrupted(record.interrupt_message(state, None, None), log_path=state.log.path,
                               kept=len(state.done), result=None)

    state.done.sort(key=lambda c: c.index)
    entry = record.build_entry(state, done, best, verdict, interrupted)
    table, kept_complete = record.write(state, entry, interrupted)
    record.log_final(state, done, best, verdict, interrupted=interrupted, table=None if kept_complete else table)
    result = SweepResult(state.plan.request, state.plan.key, entry, state.done, None if kept_complete else table,
                         state.elapsed_s(), state.log.path, done.resumed, interrupted)
    if interrupted:
        raise SweepInterrupted(record.interrupt_message(state, table, kept_complete), log_path=state.log.path,
                               kept=len(state.done), result=result)
    return result


def _say_restored_failures(log: SweepLog) -> None:
    """One warning when the log restores failed candidates: resuming does not retry them, and a failure the
    environment caused (a memory limit, a full disk) would otherwise stay a failure of the candidate."""
    failed = [line for line in log.restored.values() if line.get("status") == "failed"]
    if failed:
        warn_caller(f"moe-tune: {len(failed)} candidate(s) failed in an earlier run of this sweep and are not run "
                    f"again (e.g. {failed[0].get('reason') or 'no reason recorded'}); if the cause is fixed, "
                    "rerun with --fresh")
