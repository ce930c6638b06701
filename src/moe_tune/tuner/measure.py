"""The measure and finals stages of a sweep.

Measure: compile a chunk of candidates in parallel (`tuner.compiling`), check each against the reference
(`candidate.check_all`), and time the correct ones batch by batch in interleaved trace rounds
(`tuner.timing`). Every candidate is logged the moment it is finished, so a kill loses at most the chunk in
flight.

Finals: the fastest few and the default are re-timed side by side, each with twice the sweep round's samples
and never fewer than `MIN_FINAL_SAMPLES`, short calls with more (about `final_time_s` seconds each). Each
finalist is compared with the default PAIRED (`profiles.verdict.paired`: per round the default's time over
the finalist's, so that load both share cancels); the largest median per-round gain is the best, and a gain
within the noise (twice the ratios' relative median absolute deviation, narrowed as a median's standard error
past 6 rounds) keeps the default. Rounds a batch already timed for every finalist count as the final round's
first ones, and the round stops once no finalist can still beat the default (`settled`). A sweep that cannot
apply the rule keeps the default and says `unverified` and why. The outcome is a `Verdict`.
"""

from __future__ import annotations

import functools

import math
from collections.abc import Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax

from moe_tune.profiles.verdict import (
    BEAT_DEFAULT,
    DEFAULT_FAILED,
    DEFAULT_FASTEST,
    MIN_FINAL_SAMPLES,
    ONLY_CANDIDATE,
    PAIRED_MIN_NOISE,
    UNVERIFIED,
    WITHIN_NOISE,
    Verdict,
    noise_threshold,
    paired,
    paired_ratios,
    too_few_samples,
)
from moe_tune.tuner.candidate import Candidate, check_all, failure_reason, same_rounds
from moe_tune.tuner.compiling import OK, compile_all
from moe_tune.tuner.request import SweepSettings
from moe_tune.tuner.state import Reporter, Step, SweepError, SweepState
from moe_tune.tuner.timing import Timing, first_call_is_warm, summarize, time_candidates


def measure_chunk(state: SweepState, chunk: list[Candidate]) -> Iterator[Step]:
    """Compile a chunk (in parallel), check it, time the correct ones batch by batch; log as they finish.
    Yields one step per batch timed."""
    settings, reporter = state.settings, state.reporter
    tolerance = functools.partial(state.plan.op.tolerance, state.plan.request.problem)  # of a config
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
    check_all([c for c in cands if c.status == OK], state.inputs, state.reference,
              functools.partial(state.plan.op.tolerance, problem))
    recompiled = 0
    for c in cands:
        recompiled += c.compiles
        compiles, compile_s = before[c.index]
        c.compiles += compiles
        c.compile_s = compile_s
    # a finalist that no longer compiles or checks is recorded as such (the last line of a config wins)
    state.finished([c for c in cands if c.status != OK], recompiled=True)
    return Step(recompiled=recompiled)


# The most samples a finalist gets from the time budget (`final_samples`): 40 rounds of the profiler cost
# ~20 ms here; the noise threshold stops narrowing at 24 (verdict.MIN_NOISE_SCALE), more steady the medians.
MAX_FINAL_SAMPLES = 40


def finalists(settings: SweepSettings, survivors: list[Candidate], default: Candidate) -> list[Candidate]:
    """The fastest `settings.finalists` survivors, and the default."""
    ranked = sorted(survivors, key=lambda c: c.timing.median_s)
    chosen = ranked[: settings.finalists]
    if default.status == OK and not any(c is default for c in chosen):
        chosen.append(default)
    return chosen


def final_samples(settings: SweepSettings, median_s: float | None = None) -> int:
    """Samples per finalist in the final round: twice the sweep round's, at least MIN_FINAL_SAMPLES, and for
    short calls about `settings.final_time_s` seconds of calls per finalist (`median_s`: the slowest
    finalist's sweep-round median), at most MAX_FINAL_SAMPLES: six samples of a 5 ms call on a shared machine
    kept the default against a measured 15% gain (FINDINGS.md: final round budget)."""
    return samples_for_time(max(2 * settings.samples, MIN_FINAL_SAMPLES), settings.final_time_s, median_s)


def samples_for_time(samples: int, time_s: float, call_s: float | None) -> int:
    """`samples`, or more for a call of about `call_s` seconds: enough for `time_s` seconds of calls, at most
    MAX_FINAL_SAMPLES (the finals' and the ladder's side-by-side timing of short calls). `call_s` None or not
    positive, or `time_s` 0: `samples`."""
    if call_s is None or not call_s > 0 or not time_s > 0:
        return samples
    return max(samples, min(MAX_FINAL_SAMPLES, math.ceil(time_s / call_s)))


def decide(best: Candidate, default: Candidate, compared: Sequence[Candidate] = (), *,
           unverified: str | None = None, pair: bool = False) -> tuple[Candidate, Verdict]:
    """(winner, verdict). A candidate wins over the default only when it beat it by more than the noise and
    both had at least MIN_FINAL_SAMPLES samples; otherwise the default is kept (`within_noise`, or
    `unverified` when the samples were too few or `unverified` gives a reason the rule cannot apply, e.g. an
    interrupt before the final round). `pair`: the two timings' samples are in the same rounds (the final
    round), and the gain and noise are the paired rule's (`profiles.verdict.paired`); else their medians and
    MADs are compared. `compared`: the finalists of the final round, recorded in the verdict (for an
    interrupted sweep, the best and the default by their batch timings)."""
    noise, reason, paired_gain = None, None, None
    if default.status != OK:  # nothing to hold the best to
        winner, rule = best, DEFAULT_FAILED
    elif best is default:
        winner, rule = default, DEFAULT_FASTEST
    else:
        if pair:
            gain, noise = paired(default.timing.samples_s, best.timing.samples_s)
            paired_gain = gain
        else:
            gain = default.timing.median_s / best.timing.median_s - 1
            noise = noise_threshold(best.timing.samples_s, default.timing.samples_s)
        reason = unverified or too_few_samples(best.timing.samples_s, default.timing.samples_s)
        if reason is not None:
            winner, rule = default, UNVERIFIED
        elif gain <= noise:
            winner, rule = default, WITHIN_NOISE
        else:
            winner, rule = best, BEAT_DEFAULT
    ranked = sorted(compared, key=lambda c: c is not winner)  # the winner first
    return winner, Verdict(rule, noise, tuple(c.finalist_record() for c in ranked), reason=reason,
                           paired_gain=paired_gain)


def paired_best(chosen: Sequence[Candidate], default: Candidate) -> Candidate:
    """The finalist with the largest median per-round gain over the default (`paired`), or the default when
    none gained in the median round; by median when the default is no finalist (it failed)."""
    others = [c for c in chosen if c is not default]
    if default.status != OK or not any(c is default for c in chosen) or not others:
        return min(chosen, key=lambda c: c.timing.median_s)
    gain, best = max(((paired(default.timing.samples_s, c.timing.samples_s)[0], c) for c in others),
                     key=lambda item: item[0])
    return best if gain > 0 else default


def final_round(settings: SweepSettings, survivors: list[Candidate], default: Candidate, inputs: Any, platform: str,
                reporter: Reporter) -> tuple[Candidate, Verdict, str | None]:
    """Re-time the fastest few and the default together (`final_samples` each), and pick the winner there.
    Rounds of one batch that timed them all (`same_rounds`) are the first ones; the round stops early once no
    finalist can beat the default whatever the rounds left show (`settled`: the winner is the one the whole
    round would give). Returns (winner, verdict, timing fallback reason)."""
    chosen = finalists(settings, survivors, default)
    if len(chosen) < 2:
        return chosen[0], Verdict(ONLY_CANDIDATE), None
    samples = final_samples(settings, max(c.timing.median_s for c in chosen))
    timed = {c.index: c.timing for c in chosen} if same_rounds(chosen) else {}  # the batch's rounds come first
    bar = _RoundsBar(reporter, samples, _rounds(timed))
    first_stop = earliest_stop(samples)
    fallback, chunk = None, 0
    # each chunk adds a round or more. Once the trace failed the cross-check, the rest of the round is timed by
    # the wall clock (`wall_only`): the clock switches (dropping the other clock's rounds) at most once, and the
    # round still gets at least `first_stop` rounds of the clock it ends on. `2 * samples` chunks bound a timer
    # whose clock keeps switching all the same.
    while chunk < 2 * samples and _rounds(timed) < samples and not (
            _rounds(timed) >= first_stop and settled(timed, default, chosen, samples)):
        final, why = time_candidates(
            {c.index: (lambda c=c: c.executable(inputs)) for c in chosen},
            samples=max(1, first_stop - _rounds(timed)), platform=platform, seed=settings.seed + 1 + 7919 * chunk,
            on_round=lambda r: bar.tick(), warmup=0,  # `run_finals` ran each one already
            wall_only=fallback is not None,
        )
        chunk, fallback = chunk + 1, fallback or why
        if timed and {t.method for t in final.values()} != {t.method for t in timed.values()}:
            timed = {}  # one clock for all the samples compared: the other clock's rounds are dropped
        timed = {i: joined(timed[i], t) if i in timed else t for i, t in final.items()}
        bar.show(_rounds(timed))
    bar.finish()
    for c in chosen:
        c.first_timing, c.timing = c.timing, timed[c.index]
    winner, verdict = decide(paired_best(chosen, default), default, chosen, pair=True)
    return winner, verdict, fallback


class _RoundsBar:
    """The final round's progress stage (`finalists`): the rounds still to time of the `samples` compared, so
    that it never runs past its total. Rounds a clock switch drops start it over (with every round to time
    again); a round that stops early (`settled`) ends it complete."""

    def __init__(self, reporter: Reporter, samples: int, timed: int):
        self.reporter, self.samples, self.base = reporter, samples, timed
        self.total, self.shown = samples - timed, 0
        reporter.stage("finalists", self.total)

    def tick(self) -> None:
        """One more round timed."""
        if self.shown < self.total:
            self.shown += 1
            self.reporter.advance("finalists")

    def show(self, rounds: int) -> None:
        """`rounds` of the samples are timed now (fewer than shown: a clock switch dropped some)."""
        if rounds < self.base + self.shown:
            self.base, self.total, self.shown = 0, self.samples, 0
            self.reporter.stage("finalists", self.total)
        self._advance(min(self.total, rounds - self.base))

    def finish(self) -> None:
        self._advance(self.total)

    def _advance(self, to: int) -> None:
        if to > self.shown:
            self.reporter.advance("finalists", to - self.shown)
            self.shown = to


def earliest_stop(samples: int) -> int:
    """The fewest rounds a final round of `samples` rounds stops after (`settled`): a paired win needs more than
    half of the rounds past the floor, and a verdict needs MIN_FINAL_SAMPLES."""
    return max(MIN_FINAL_SAMPLES, samples // 2 + 1)


def _rounds(timed: dict[int, Timing]) -> int:
    return min((t.samples for t in timed.values()), default=0)


def settled(timed: dict[int, Timing], default: Candidate, chosen: Sequence[Candidate], rounds: int) -> bool:
    """Whether no finalist can beat the default after `rounds` paired rounds in all, whatever the rounds not
    yet timed show: a win needs a median per-round ratio above 1 + PAIRED_MIN_NOISE (the least noise), so more
    than half of the `rounds` ratios above it; a finalist with more than half of them at or below it already
    cannot win. (Its median over the rounds timed is then at or below it too: `decide` keeps the default.)"""
    if default.status != OK or default.index not in timed:
        return False
    base = timed[default.index].samples_s
    return all(sum(r <= 1 + PAIRED_MIN_NOISE for r in paired_ratios(base, timed[c.index].samples_s)) > rounds // 2
               for c in chosen if c is not default)


def joined(first: Timing, then: Timing) -> Timing:
    """One timing of `first`'s rounds followed by `then`'s (the same candidates, paired round by round); its
    wall-clock median is `then`'s (the wall samples of `first` are not kept)."""
    return summarize([*first.samples_s, *then.samples_s], then.method, [then.wall_median_s])


def run_finals(state: SweepState) -> Generator[Step, None, tuple[Candidate, Verdict]]:
    """Compile the finalists restored from the log (they have no executable), run each of those once, then
    `final_round`; yields the compilations spent again and the timing fallback, returns (winner, verdict).
    A finalist timed in this process ran here already (its sweep round): it gets no untimed run (0.2-0.3 s
    of a 3-candidate warm sweep's 6 s; FINDINGS.md: warm start). Raises SweepError when no candidate
    survived."""
    survivors = [c for c in state.done if c.status == OK]
    default = state.default()
    ran_here = {c.index for c in survivors if c.executable is not None}  # restored ones have none yet
    while survivors:
        chosen = finalists(state.settings, survivors, default)
        need = [c for c in chosen if c.executable is None]
        if need:
            yield recompile(state, need)
        else:
            cold = [c for c in chosen if c.index not in ran_here]
            if not cold:
                break
            ready, step = warm_up(state, cold, logged=True)
            yield step
            if len(ready) == len(cold):
                break
        survivors = [c for c in survivors if c.status == OK]
    if not survivors:
        reasons = "; ".join(f"{c.config.label()}: {c.reason}" for c in state.done[:3])
        raise SweepError(f"no candidate of {state.plan.backend.name} compiled and passed the check ({reasons})")
    winner, verdict, fallback = final_round(state.settings, survivors, default, state.inputs, state.plan.platform,
                                            state.reporter)
    yield Step(fallback=fallback)
    return winner, verdict


def interrupted_winner(state: SweepState) -> tuple[Candidate | None, Verdict | None]:
    """Among the finished candidates, by their batch timings (no final round): (winner, verdict), or
    (None, None) when the default and one other candidate have not both finished. Without the final round
    the rule cannot apply: a candidate faster than the default is recorded, and the default kept
    (`unverified`)."""
    default = state.default()
    timed = [c for c in state.done if c.status == OK and c.timing is not None]
    if default is None or len(state.done) < 2 or not timed:
        return None, None
    best = min(timed, key=lambda c: c.timing.median_s)
    compared = [best] if best is default or default.status != OK else [best, default]
    return decide(best, default, compared, unverified="interrupted before the final round")
