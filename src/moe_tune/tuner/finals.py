"""The finals stage: the fastest few and the default re-timed together, and the evidence rules that decide
whether the fastest is a win.

One sweep round's medians of near-equal candidates are mostly noise on a shared machine; the finalists are
compared like for like, side by side, each with twice the sweep round's samples and never fewer than
`MIN_FINAL_SAMPLES` (a noise estimate needs them, whatever `--samples` says), and short calls with more: about
`final_time_s` seconds of calls each (`final_samples`). The final round runs the finalists interleaved, one
call each per round, and compares each with the default PAIRED (`profiles.verdict.paired`): per round the
default's time over the finalist's, so that load both calls of a round share cancels. The finalist with the
largest median per-round gain is the best; a gain no more than the noise (twice the ratios' relative median
absolute deviation, narrowed as a median's standard error for more than 6 rounds) is not a win: the default
is kept. Comparing two medians, each with its own MAD, kept the default against a 1.6x faster finalist under
load ("within noise +-68%", NOTES.md issue 32 session 14 (D)).

When every finalist was timed in one batch of this sweep with all its rounds (`candidate.same_rounds`: a warm
sweep's first round of the default and one or two seeds, or a last batch that holds them all), those rounds
are the final round's first ones: the final round times only the rounds still missing; and it stops once no
finalist can beat the default whatever the rounds left show (`settled`: a win needs more than half of the
rounds past the paired floor), which keeps the winner the whole round would give (issue 32, session 16). A sweep
that cannot apply the rule (interrupted before its final round) keeps the default too, and says `unverified`
and why. The outcome is a `Verdict`
(the rule applied, the threshold, the finalists' timings of both rounds), which the entry records.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from typing import Any

from moe_tune.profiles.verdict import (
    BEAT_DEFAULT, DEFAULT_FAILED, DEFAULT_FASTEST, MIN_FINAL_SAMPLES, ONLY_CANDIDATE, PAIRED_MIN_NOISE, UNVERIFIED,
    WITHIN_NOISE, Verdict, noise_threshold, paired, paired_ratios, too_few_samples,
)
from moe_tune.tuner import measure
from moe_tune.tuner.candidate import OK, Candidate, same_rounds
from moe_tune.tuner.result import Reporter, SweepError
from moe_tune.tuner.sweep_settings import SweepSettings
from moe_tune.tuner.state import SweepState
from moe_tune.tuner.step import Step
from moe_tune.tuner.timing import Timing, summarize, time_candidates

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
    kept the default against a measured 15% gain (benchmarks/finals_cpu.py, NOTES.md issue 32 session 14)."""
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
    reporter.stage("finalists", samples - _rounds(timed))
    first_stop = earliest_stop(samples)
    fallback, chunk = None, 0
    # each chunk adds a round or more; `chunk < samples` ends a round whose clock keeps switching (each switch
    # drops the other clock's rounds) after as many calls as the whole round would have made
    while chunk < samples and _rounds(timed) < samples and not (
            _rounds(timed) >= first_stop and settled(timed, default, chosen, samples)):
        final, why = time_candidates(
            {c.index: (lambda c=c: c.executable(inputs)) for c in chosen},
            samples=max(1, first_stop - _rounds(timed)), platform=platform, seed=settings.seed + 1 + 7919 * chunk,
            on_round=lambda r: reporter.advance("finalists"), warmup=0,  # `run_finals` ran each one already
        )
        chunk, fallback = chunk + 1, fallback or why
        if timed and {t.method for t in final.values()} != {t.method for t in timed.values()}:
            timed = {}  # one clock for all the samples compared: the other clock's rounds are dropped
        timed = {i: joined(timed[i], t) if i in timed else t for i, t in final.items()}
    for c in chosen:
        c.first_timing, c.timing = c.timing, timed[c.index]
    winner, verdict = decide(paired_best(chosen, default), default, chosen, pair=True)
    return winner, verdict, fallback


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
    of a 3-candidate warm sweep's 6 s, NOTES.md issue 32 session 15). Raises SweepError when no candidate
    survived."""
    survivors = [c for c in state.done if c.status == OK]
    default = state.default()
    ran_here = {c.index for c in survivors if c.executable is not None}  # restored ones have none yet
    while survivors:
        chosen = finalists(state.settings, survivors, default)
        need = [c for c in chosen if c.executable is None]
        if need:
            yield measure.recompile(state, need)
        else:
            cold = [c for c in chosen if c.index not in ran_here]
            if not cold:
                break
            ready, step = measure.warm_up(state, cold, logged=True)
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
