"""The measure stage: compile a chunk of candidates (in parallel, tuner/candidates), check each against the
reference, and time the correct ones batch by batch in interleaved trace rounds (tuner/timing). Every
candidate is logged the moment it is finished (`SweepState.finished`): a failed or wrong one when it is
checked, a correct one when its batch is timed, so a kill loses at most the chunk in flight.

An executable compiled in a worker can fail to run in this process; `warm_up` compiles it again here.
"""

from __future__ import annotations

from pathlib import Path

import jax

from moe_tune.tuner import record
from moe_tune.tuner.candidates import FAILED, OK, Candidate, check_all, compile_all, failure_reason
from moe_tune.tuner.state import SweepState
from moe_tune.tuner.timing import first_call_is_warm, time_candidates


def measure_chunk(state: SweepState, chunk: list[Candidate]) -> None:
    """Compile a chunk (in parallel), check it, time the correct ones batch by batch; log as they finish."""
    plan, spec, reporter = state.plan, state.spec, state.reporter
    tolerance = plan.op.tolerance(spec.problem)
    checked_ids: set[int] = set()

    def checked(cand: Candidate) -> None:
        checked_ids.add(cand.index)
        reporter.advance("check")
        if cand.status != OK:
            state.finished([cand])
            reporter.advance("time")

    def compiled(cand: Candidate) -> None:
        reporter.advance("compile")
        if cand.status == OK and cand.output is not None:
            # checked as it arrives, so that a chunk's outputs are never all held at once (a drhs
            # output can be gigabytes)
            check_all([cand], state.inputs, state.expected, tolerance, on_done=checked)

    with state.clock("compile"):  # with workers this also runs and checks each candidate once
        compile_all(plan.op, plan.backend, spec.problem, chunk, state.inputs, workers=spec.workers,
                    on_done=compiled, timeout=spec.compile_timeout_s)
    failed = [c for c in chunk if c.status != OK and c.index not in checked_ids]
    state.finished(failed)
    reporter.advance("check", len(failed))
    reporter.advance("time", len(failed))
    with state.clock("check"):  # candidates compiled here: run once and checked now
        check_all([c for c in chunk if c.status == OK and c.index not in checked_ids], state.inputs,
                  state.expected, tolerance, on_done=checked)
    correct = [c for c in chunk if c.status == OK]
    for start in range(0, len(correct), spec.batch_size):
        with state.clock("time"):
            time_batch(state, correct[start:start + spec.batch_size])


def time_batch(state: SweepState, batch: list[Candidate]) -> None:
    """Time one batch in its own shuffled rounds (racing against the best median so far), then log it."""
    spec, number = state.spec, state.batches
    keep = None if spec.keep_trace_dir is None else Path(spec.keep_trace_dir) / f"batch_{number}"

    def time_them(cands: list[Candidate]):
        return time_candidates(
            {c.index: (lambda c=c: c.executable(state.inputs)) for c in cands},
            samples=spec.samples, platform=state.plan.platform, seed=spec.seed + 1000 * (number + 1),
            keep_trace_dir=keep, on_round=lambda units: state.reporter.advance("time", units / spec.samples),
            warmup=0, race=spec.race, best_s=state.best_median(),
        )

    timings = None
    if first_call_is_warm(state.plan.platform):  # the first timed round is the warm-up
        try:
            timings, fallback = time_them(batch)
        except Exception:  # noqa: BLE001 - a candidate that fails to run here: `warm_up` sorts it out
            timings = None
    if timings is None:
        batch = warm_up(state, batch)
        if not batch:
            return
        timings, fallback = time_them(batch)
    for c in batch:
        c.timing = timings[c.index]
    if fallback and state.fallback is None:
        state.fallback = f"batch {number}: {fallback}"
    state.batches += 1
    state.finished(batch, batch=number)


def warm_up(state: SweepState, cands: list[Candidate], *, logged: bool = False) -> list[Candidate]:
    """Run each candidate once here, untimed (its first call pays one-off costs); return those that ran.

    An executable compiled in a worker can fail to run in this process although it ran in the worker
    (seen on XLA CPU with the persistent compilation cache, when a sweep is resumed in a process that
    loaded the same programs before: `NOT_FOUND: Function wrapped_iota not found`): it is compiled again
    here and retried, and recorded as failed only if that fails too. `logged`: the candidates are
    already in the log (finalists); a failure is appended as a new line for the config."""
    plan, ready = state.plan, []
    for c in cands:
        try:
            jax.block_until_ready(c.executable(state.inputs))
        except Exception as first:  # noqa: BLE001 - recorded as the candidate's reason
            compiles = c.compiles
            compile_all(plan.op, plan.backend, state.spec.problem, [c], state.inputs, workers=1)
            state.recompiled += c.compiles - compiles
            try:
                if c.status != OK:
                    raise RuntimeError(c.reason)
                jax.block_until_ready(c.executable(state.inputs))
            except Exception as again:  # noqa: BLE001
                c.status, c.stage = FAILED, "run"
                c.reason = f"{failure_reason(first)}; compiled again in this process: {failure_reason(again)}"
                if logged:
                    state.log.append([record.candidate_line(c, None, recompiled=True)])
                else:
                    state.finished([c])
                    state.reporter.advance("time")
                continue
        ready.append(c)
    return ready


def recompile(state: SweepState, cands: list[Candidate]) -> None:
    """Compile and check again candidates restored from the log (they have no executable): the finalists.
    Their compile count and time stay those of their first compile; the new compiles count as recompiled."""
    plan, spec = state.plan, state.spec
    before = {c.index: (c.compiles, c.compile_s) for c in cands}
    for c in cands:
        c.compiles = 0
    compile_all(plan.op, plan.backend, spec.problem, cands, state.inputs, workers=spec.workers,
                timeout=spec.compile_timeout_s)
    check_all([c for c in cands if c.status == OK], state.inputs, state.expected, plan.op.tolerance(spec.problem))
    for c in cands:
        state.recompiled += c.compiles
        compiles, compile_s = before[c.index]
        c.compiles += compiles
        c.compile_s = compile_s
    # a finalist that no longer compiles or checks is recorded as such (the last line of a config wins)
    state.log.append([record.candidate_line(c, None, recompiled=True) for c in cands if c.status != OK])
