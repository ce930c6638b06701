"""The measure stage: compile a chunk of candidates (in parallel, tuner/compiling), check each against the
reference (tuner/gate), and time the correct ones batch by batch in interleaved trace rounds (tuner/timing).
Every candidate is logged the moment it is finished (`SweepState.finished`): a failed or wrong one when it is
checked, a correct one when its batch is timed, so a kill loses at most the chunk in flight.

An executable compiled in a worker can fail to run in this process; `warm_up` compiles it again here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import jax

from moe_tune.tuner.candidate import OK, Candidate, failure_reason
from moe_tune.tuner.compiling import compile_all
from moe_tune.tuner.gate import check_all
from moe_tune.tuner.state import SweepState
from moe_tune.tuner.step import Step
from moe_tune.tuner.timing import first_call_is_warm, time_candidates


def measure_chunk(state: SweepState, chunk: list[Candidate]) -> Iterator[Step]:
    """Compile a chunk (in parallel), check it, time the correct ones batch by batch; log as they finish.
    Yields one step per batch timed."""
    settings, reporter = state.settings, state.reporter
    tolerance = state.plan.op.tolerance(state.plan.request.problem)
    checked_ids: set[int] = set()

    def checked(cand: Candidate) -> None:
        checked_ids.add(cand.index)
        reporter.advance("check")
        if cand.status != OK:
            state.finished([cand])
            reporter.advance("time")

    def compiled(cand: Candidate) -> None:
        reporter.advance("compile")
        if cand.status == OK and cand.worker_error is not None:  # judged in its worker: recorded as it arrives
            check_all([cand], state.inputs, state.reference, tolerance, on_done=checked)

    with state.clock("compile"):  # with workers this also runs and checks each candidate once
        compile_all(state.kernel, chunk, state.prepared, workers=settings.workers, on_done=compiled,
                    timeout=settings.compile_timeout_s)
    failed = [c for c in chunk if c.status != OK and c.index not in checked_ids]
    state.finished(failed)
    reporter.advance("check", len(failed))
    reporter.advance("time", len(failed))
    with state.clock("check"):  # candidates compiled here: run once and checked now
        check_all([c for c in chunk if c.status == OK and c.index not in checked_ids], state.inputs,
                  state.reference, tolerance, on_done=checked)
    correct = [c for c in chunk if c.status == OK]
    for start in range(0, len(correct), settings.batch_size):
        with state.clock("time"):
            step = time_batch(state, correct[start:start + settings.batch_size])
        yield step


def time_batch(state: SweepState, batch: list[Candidate]) -> Step:
    """Time one batch in its own shuffled rounds (racing against the best median so far, and no more samples
    for a candidate that can no longer be a finalist), then log it."""
    settings, number = state.settings, next(state.batch_numbers)
    keep = None if settings.keep_trace_dir is None else Path(settings.keep_trace_dir) / f"batch_{number}"

    def time_them(cands: list[Candidate]):
        return time_candidates(
            {c.index: (lambda c=c: c.executable(state.inputs)) for c in cands},
            samples=settings.samples, platform=state.plan.platform, seed=settings.seed + 1000 * (number + 1),
            keep_trace_dir=keep, on_round=lambda units: state.reporter.advance("time", units / settings.samples),
            warmup=0, race=settings.race, best_s=state.best_median(),
            cutoff_s=None if settings.race is None else state.finalist_cutoff(),  # race=None: every sample
        )

    timings, recompiled = None, Step()
    if first_call_is_warm(state.plan.platform):  # the first timed round is the warm-up
        try:
            timings, fallback = time_them(batch)
        except Exception:  # noqa: BLE001 - a candidate that fails to run here: `warm_up` sorts it out
            timings = None
    if timings is None:
        batch, recompiled = warm_up(state, batch)
        if not batch:
            return recompiled
        timings, fallback = time_them(batch)
    for c in batch:
        c.timing = timings[c.index]
    state.finished(batch, batch=number)
    return recompiled + Step(batches=1, fallback=f"batch {number}: {fallback}" if fallback else None)


def warm_up(state: SweepState, cands: list[Candidate], *, logged: bool = False) -> tuple[list[Candidate], Step]:
    """Run each candidate once here, untimed (its first call pays one-off costs); returns those that ran,
    and the compilations spent again.

    An executable compiled in a worker can fail to run in this process although it ran in the worker
    (seen on XLA CPU with the persistent compilation cache, when a sweep is resumed in a process that
    loaded the same programs before: `NOT_FOUND: Function wrapped_iota not found`): it is compiled again
    here and retried, and recorded as failed only if that fails too. `logged`: the candidates are
    already in the log (finalists); a failure is appended as a new line for the config."""
    ready, recompiled = [], 0
    for c in cands:
        try:
            jax.block_until_ready(c.executable(state.inputs))
        except Exception as first:  # noqa: BLE001 - recorded as the candidate's reason
            compiles = c.compiles
            compile_all(state.kernel, [c], state.inputs, state.reference, workers=1)
            recompiled += c.compiles - compiles
            try:
                if c.status != OK:
                    raise RuntimeError(c.reason)
                jax.block_until_ready(c.executable(state.inputs))
            except Exception as again:  # noqa: BLE001
                c.fail("run", f"{failure_reason(first)}; compiled again in this process: {failure_reason(again)}")
                state.finished([c], recompiled=logged)
                if not logged:
                    state.reporter.advance("time")
                continue
        ready.append(c)
    return ready, Step(recompiled=recompiled)


def recompile(state: SweepState, cands: list[Candidate]) -> Step:
    """Compile and check again candidates restored from the log (they have no executable): the finalists.
    Their compile count and time stay those of their first compile; the new compiles count as recompiled."""
    settings, problem = state.settings, state.plan.request.problem
    before = {c.index: (c.compiles, c.compile_s) for c in cands}
    for c in cands:
        c.compiles = 0
    compile_all(state.kernel, cands, state.prepared, workers=settings.workers, timeout=settings.compile_timeout_s)
    check_all([c for c in cands if c.status == OK], state.inputs, state.reference, state.plan.op.tolerance(problem))
    recompiled = 0
    for c in cands:
        recompiled += c.compiles
        compiles, compile_s = before[c.index]
        c.compiles += compiles
        c.compile_s = compile_s
    # a finalist that no longer compiles or checks is recorded as such (the last line of a config wins)
    state.finished([c for c in cands if c.status != OK], recompiled=True)
    return Step(recompiled=recompiled)
