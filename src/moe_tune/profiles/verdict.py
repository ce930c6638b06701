"""How a sweep chose its winner: the verdict an entry records, the noise rule it applies, and the evidence a
win needs.

A sweep times every candidate once (its sweep round), then re-times the fastest few and the default side by
side (the final round, `tuner.measure`), each with at least `MIN_FINAL_SAMPLES` samples whatever `--samples`
says: fewer cannot estimate the noise. The verdict is one of

- `beat_default`: the fastest finalist beat the default by more than the noise, every finalist with at least
  `MIN_FINAL_SAMPLES` samples (the only rule under which the winner is not the default);
- `default_fastest`: the default was the fastest finalist;
- `within_noise`: the default, kept because the fastest finalist beat it by no more than the noise: twice
  the larger relative median absolute deviation (MAD) of the two finalists' samples, scaled down as
  sqrt(NOISE_SAMPLES / n) when both have n > NOISE_SAMPLES samples (the noise of a median of n samples), to
  no less than one MAD. The final round's finalists run interleaved, one call each per round, so it compares
  them PAIRED (`paired`): per round, the default's time over the finalist's; the gain is the median of these
  ratios less 1 and the noise the same rule applied to the ratios (their relative MAD), never below
  PAIRED_MIN_NOISE (two compiles of one config differ by up to that), so that load which both calls of a
  round share cancels instead of widening both timings' MADs;
- `unverified`: the default, kept because the rule could not be applied (`reason`: an interrupt before the
  final round, too few samples); the fastest finalist is recorded but does not win;
- `default_failed`: the default failed (compile, run or check), so the fastest correct candidate won with
  nothing to hold it to;
- `only_candidate`: the one correct candidate (no final round).

New entries record it as `verdict` = {rule, noise, reason, paired_gain, finalists: [{config, is_default, median_s,
spread, min_s, max_s, samples, first_median_s, first_spread}]}: the final round's timings (and each finalist's
sweep-round median and spread), the winner first; `paired_gain` (FINDINGS.md: paired finals): the median
per-round gain of the fastest finalist over the default that the paired rule held to `noise` (absent: the
two medians were compared).

Older entries stay readable. Older entries recorded `fastest` for any winner: it is read as
`default_fastest` when the winner was the default, `default_failed` when the default was no finalist, and
`beat_default` otherwise, with the evidence it holds (`evidence_problem` says when its finalists had fewer
than `MIN_FINAL_SAMPLES` samples or no noise estimate). Entries written before the verdict was recorded get
one derived from what they hold (`derived`): the rule from `within_noise_of_default`, the default and the
candidate counts; the noise from the kept default's re-timed samples alone (the only samples such an entry
kept: a lower bound of the threshold the sweep used); their finalists are the winner and the default.

What an entry's claim rests on: the marks a reader needs beside its verdict (`unverified`, a win on weak
evidence, a low budget), and the search budget it was tuned with, compared with the budget a campaign asks
for (`weaker_than`: an entry tuned with less is swept again).

A search's budget is read from the entry's `search` record (`tuner.request.SEARCH_FIELDS`: strategy, budget,
time_budget_s, max_candidates, space, full_space, samples, and why it stopped).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from moe_tune.profiles.entry import Entry

BEAT_DEFAULT, DEFAULT_FASTEST, WITHIN_NOISE = "beat_default", "default_fastest", "within_noise"
UNVERIFIED, DEFAULT_FAILED, ONLY_CANDIDATE = "unverified", "default_failed", "only_candidate"
FASTEST = "fastest"  # what older entries recorded for any winner; read as one of the three rules it stood for
RULES = (BEAT_DEFAULT, DEFAULT_FASTEST, WITHIN_NOISE, UNVERIFIED, DEFAULT_FAILED, ONLY_CANDIDATE)
SHORT = {BEAT_DEFAULT: "beat default", DEFAULT_FASTEST: "default fastest", WITHIN_NOISE: "default (noise)",
         UNVERIFIED: "unverified", DEFAULT_FAILED: "default failed", ONLY_CANDIDATE: "only candidate"}
# A win must exceed this many times the larger relative MAD of the two timings compared.
NOISE_FACTOR = 2
# Samples every finalist gets in the final round (at least): a MAD of fewer says nothing about the noise.
MIN_FINAL_SAMPLES = 5
# Up to this many samples per timing the threshold is NOISE_FACTOR relative MADs; beyond, it shrinks as the
# standard error of a median does (`noise_threshold`): a finalist of a short call gets many more samples
# (`tuner.measure.final_samples`), and a gap its median resolves is then not "noise" for want of samples.
NOISE_SAMPLES = 6
# ... but never below this fraction of it (one MAD, from 24 samples on): a shared machine's samples are not
# independent, and a copy of the default, 41 samples each side by side, timed 8.7% faster than the default
# where sqrt(6 / 41) would have set 7.3% (FINDINGS.md: final round budget).
MIN_NOISE_SCALE = 0.5
# The paired rule's threshold never falls below this gain: a copy of the default compiled apart, timed with
# it in the same rounds, was 5% and 8% faster in 2 of 32 final rounds with per-round ratios as tight as 4-5%
# (FINDINGS.md: paired finals; with 41 samples each apart: 8.7%, FINDINGS.md: final round budget). Two
# executables of one config differ by that much: a smaller gain is not a config's.
PAIRED_MIN_NOISE = 0.10


def relative_mad(samples: Sequence[float]) -> float:
    """Median absolute deviation of `samples` (seconds) over their median: a spread that ignores outliers."""
    if not samples:
        return 0.0
    med = statistics.median(samples)
    return statistics.median(abs(x - med) for x in samples) / med if med > 0 else 0.0


def noise_threshold(*samples: Sequence[float]) -> float:
    """The smallest relative gain that counts as a win between the medians of timings with these samples:
    NOISE_FACTOR times the larger relative MAD, and where every timing has n > NOISE_SAMPLES samples, that
    times sqrt(NOISE_SAMPLES / n) (n: the fewest): the MAD is the noise of one sample, and the standard error
    of a median of n samples falls as 1 / sqrt(n); never below MIN_NOISE_SCALE of the 6-sample threshold (one
    MAD). Up to NOISE_SAMPLES samples (the final round's usual 6) it is NOISE_FACTOR relative MADs."""
    fewest = min(len(s) for s in samples)
    scale = max(MIN_NOISE_SCALE, math.sqrt(NOISE_SAMPLES / fewest)) if fewest > NOISE_SAMPLES else 1.0
    return NOISE_FACTOR * scale * max(relative_mad(s) for s in samples)


def paired_ratios(default: Sequence[float], other: Sequence[float]) -> list[float]:
    """Per round, the default's time over the other's (> 1: the other was faster in that round); the samples
    of both are in round order, one per round (the final round times every finalist once per round)."""
    if len(default) != len(other):
        raise ValueError(f"paired timings need one sample per round each, got {len(default)} and {len(other)}")
    return [d / o for d, o in zip(default, other)]


def paired(default: Sequence[float], other: Sequence[float]) -> tuple[float, float]:
    """(gain, noise) of `other` over `default` from their per-round ratios (`paired_ratios`): the median ratio
    less 1, and `noise_threshold` of the ratios (twice their relative MAD, narrowed for many rounds as for a
    median), at least PAIRED_MIN_NOISE. Load that slows both calls of a round leaves their ratio alone; two
    medians compared apart carry it twice."""
    ratios = paired_ratios(default, other)
    return statistics.median(ratios) - 1, max(PAIRED_MIN_NOISE, noise_threshold(ratios))


def too_few_samples(*samples: Sequence[float]) -> str | None:
    """Why timings with these samples cannot decide a win (fewer than MIN_FINAL_SAMPLES each), else None."""
    fewest = min(len(s) for s in samples)
    return f"{fewest} samples per finalist, fewer than {MIN_FINAL_SAMPLES}" if fewest < MIN_FINAL_SAMPLES else None


@dataclasses.dataclass(frozen=True)
class Verdict:
    """rule: one of RULES; noise: the threshold the default was held to (a fraction: 0.1 is 10%), None when
    it was not compared; finalists: one record per finalist (see the module doc), winner first; reason: why
    an `unverified` entry could not be decided; derived: reconstructed from an entry that did not record
    its verdict."""

    rule: str
    noise: float | None = None
    finalists: tuple[Mapping[str, Any], ...] = ()
    derived: bool = False
    reason: str | None = None
    paired_gain: float | None = None  # the paired rule's gain (module doc); None: medians were compared

    @property
    def kept_default(self) -> bool:
        """Whether the winner is the default because the candidate that beat it did not count."""
        return self.rule in (WITHIN_NOISE, UNVERIFIED)

    @property
    def gain(self) -> float | None:
        """The winner's (or, for a kept default, the fastest finalist's) relative gain over the default in the
        final round: the paired rule's median per-round gain when it applied, else default median / its
        median - 1; None when not both were timed."""
        if self.paired_gain is not None:
            return self.paired_gain
        default = next((f for f in self.finalists if f.get("is_default")), None)
        others = [f for f in self.finalists if not f.get("is_default") and f.get("median_s")]
        if default is None or not default.get("median_s") or not others:
            return None
        return default["median_s"] / min(f["median_s"] for f in others) - 1

    @property
    def evidence_problem(self) -> str | None:
        """For a win (`beat_default`): why its evidence falls short of the rule (finalists with fewer than
        MIN_FINAL_SAMPLES samples, no noise estimate: entries of older sweeps), else None."""
        if self.rule != BEAT_DEFAULT:
            return None
        counts = [f.get("samples") for f in self.finalists if isinstance(f.get("samples"), int)]
        if counts and min(counts) < MIN_FINAL_SAMPLES:
            return f"{min(counts)} samples per finalist, fewer than {MIN_FINAL_SAMPLES}"
        if self.noise is None:
            return "no noise estimate"
        return None

    @property
    def text(self) -> str:
        """`beat default by 23% (noise +-4%)`, `default fastest`, `kept default: within noise (+-12%)`,
        `unverified: <reason>; kept default`, `default failed`, `only candidate`."""
        noise = "" if self.noise is None else f"+-{self.noise:.0%}"
        if self.rule == WITHIN_NOISE:
            return "kept default: within noise" + (f" ({noise})" if noise else "")
        if self.rule == UNVERIFIED:
            return f"unverified: {self.reason or 'not decided'}; kept default"
        if self.rule == BEAT_DEFAULT:
            gain = self.gain
            text = "beat default" + (f" by {gain:.0%}" if gain is not None else "") + (f" (noise {noise})" if noise
                                                                                       else "")
            problem = self.evidence_problem
            return text + (f"; weak evidence: {problem}" if problem else "")
        return self.rule.replace("_", " ")

    @property
    def label(self) -> str:
        """`text`, marked `(derived)` for a verdict derived from an entry that did not record one."""
        return self.text + (" (derived)" if self.derived else "")

    @property
    def short(self) -> str:
        """A few words for narrow tables (`SHORT`); `beat default?` for a win with weak evidence."""
        return SHORT[self.rule] + ("?" if self.evidence_problem else "")

    def to_json(self) -> dict[str, Any]:
        out = {"rule": self.rule, "noise": self.noise, "finalists": [dict(f) for f in self.finalists]}
        if self.paired_gain is not None:
            out["paired_gain"] = self.paired_gain
        return out if self.reason is None else {**out, "reason": self.reason}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Verdict:
        finalists = tuple(data.get("finalists") or ())
        rule = data.get("rule", FASTEST)
        if rule == FASTEST:
            rule = _fastest_meant(finalists)
        return cls(rule, data.get("noise"), finalists, reason=data.get("reason"), paired_gain=data.get("paired_gain"))


def _fastest_meant(finalists: Sequence[Mapping[str, Any]]) -> str:
    """What a recorded `fastest` stood for: the winner (first finalist) was the default, the default was no
    finalist (it failed), or a candidate beat it."""
    if finalists and finalists[0].get("is_default"):
        return DEFAULT_FASTEST
    if finalists and not any(f.get("is_default") for f in finalists):
        return DEFAULT_FAILED
    return BEAT_DEFAULT


def verdict_of(entry: Entry) -> Verdict:
    """The entry's recorded verdict, else one derived from what it holds (see the module doc)."""
    if isinstance(entry.verdict, Mapping):
        return Verdict.from_json(entry.verdict)
    default = entry.default if isinstance(entry.default, Mapping) else {}
    default_ok = default.get("status") == "ok" and default.get("median_s") is not None
    samples = list((entry.timing or {}).get("samples_s") or ())
    is_default = entry.config == entry.default_config
    finalists = [_finalist(entry.config, is_default, entry.timing or {})]
    if default_ok and not is_default:
        finalists.append({"config": dict(default.get("config") or {}), "is_default": True,
                          "median_s": default["median_s"]})
    if entry.within_noise_of_default:
        return Verdict(WITHIN_NOISE, noise_threshold(samples) if samples else None, tuple(finalists), True)
    if entry.count("ok") == 1:
        return Verdict(ONLY_CANDIDATE, None, tuple(finalists), True)
    if is_default:
        return Verdict(DEFAULT_FASTEST, None, tuple(finalists), True)
    return Verdict(BEAT_DEFAULT if default_ok else DEFAULT_FAILED, None, tuple(finalists), True)


def _finalist(config: Mapping[str, Any], is_default: bool, timing: Mapping[str, Any]) -> dict[str, Any]:
    return {"config": dict(config), "is_default": is_default, **{name: timing.get(name) for name in (
        "median_s", "spread", "min_s", "max_s", "samples")}}


# Why a search stopped before it covered what its strategy would cover without a limit.
_CUT_SHORT = ("budget", "time budget", "interrupted")


def coverage(search: Mapping[str, Any] | None, tried: int | None = None) -> float:
    """How many candidates a search covered: `inf` for a whole search (a grid over the whole space, or a
    coordinate descent that converged), else the candidates it tried (or its cap when `tried` is unknown)."""
    search = search or {}
    full = search.get("full_space") or search.get("space")
    capped = search.get("max_candidates") is not None and full is not None and search["max_candidates"] < full
    if search.get("stopped") in _CUT_SHORT or capped:
        return float(tried if tried is not None else min(x for x in (search.get("max_candidates"),
                                                                      search.get("budget"), full) if x is not None))
    if search.get("strategy") == "random":
        return float(tried if tried is not None else search.get("budget") or math.inf)
    return math.inf


def asked_coverage(settings: Mapping[str, Any]) -> float:
    """The coverage a sweep with these settings (strategy, budget, time_budget_s, max_candidates) promises:
    `inf` for a grid or coordinate search without limits, else its count cap (0 for a time budget alone:
    it promises no count)."""
    caps = [settings.get(name) for name in ("budget", "max_candidates") if settings.get(name) is not None]
    if caps:
        return float(min(caps))
    if settings.get("time_budget_s") is not None or settings.get("strategy") == "random":
        return 0.0
    return math.inf


def weaker_than(entry: Entry, asked: Mapping[str, Any]) -> str | None:
    """Why `entry` was tuned with less than a sweep with the settings `asked` (strategy, budget,
    time_budget_s, max_candidates, samples) would spend, in words (`tuned with --max-candidates 2 of 68
    candidates`), else None. An entry that does not record its search counts as tuned with enough."""
    search = entry.search if isinstance(entry.search, Mapping) else None
    if search is None:
        return None
    tried = entry.count("tried")
    have, want = coverage(search, tried), asked_coverage(asked)
    if asked.get("strategy") == "grid" and search.get("strategy") != "grid" and tried is not None:
        have = min(have, float(tried))  # a converged descent is whole by its own rule, not by a grid's
    if have < want:
        return f"tuned with {budget_text(search, tried)}"
    samples = search.get("samples")
    if samples is not None and asked.get("samples") is not None and samples < asked["samples"]:
        return f"tuned with --samples {samples} (asked {asked['samples']})"
    return None


def budget_text(search: Mapping[str, Any], tried: int | None) -> str:
    """`grid, 3 of 68 candidates (--max-candidates 3)`: a search's budget in words."""
    limits = [f"--{name.replace('_', '-')} {search[name]}" for name in ("max_candidates", "budget")
              if search.get(name) is not None]
    if search.get("time_budget_s") is not None:
        limits.append(f"--time-budget {search['time_budget_s']:g}")
    full = search.get("full_space") or search.get("space")
    count = f", {tried} of {full} candidates" if tried is not None and full is not None else ""
    stopped = f", stopped: {search['stopped']}" if search.get("stopped") in _CUT_SHORT else ""
    local = ", warm local search" if search.get("local") else ""  # around the nearest tuned shapes' winners
    return (f"{search.get('strategy', 'grid')}{count}" + (f" ({', '.join(limits)})" if limits else "") + stopped
            + local)


def low_budget(entry: Entry) -> str | None:
    """`low budget: grid, 3 of 68 candidates (--max-candidates 3)` for an entry whose search was cut short
    (a count cap below the space, a budget or time budget spent, an interrupt), else None."""
    search = entry.search if isinstance(entry.search, Mapping) else None
    if search is None or coverage(search, entry.count("tried")) == math.inf:
        return None
    return f"low budget: {budget_text(search, entry.count('tried'))}"


def marks(entry: Entry) -> list[str]:
    """What a reader should know before trusting the entry: `unverified`, `weak evidence` (a win whose
    finalists had too few samples or no noise estimate), `low budget`, `interrupted`."""
    verdict = verdict_of(entry)
    found = []
    if verdict.rule == UNVERIFIED:
        found.append("unverified")
    if verdict.evidence_problem:
        found.append("weak evidence")
    if low_budget(entry):
        found.append("low budget")
    if entry.interrupted:
        found.append("interrupted")
    return found


def verdict_words(entry: Entry) -> str:
    """`beat default`, `default fastest, low budget`, `unverified`: the verdict in a few words, with the
    marks a reader should see (`marks`; `weak evidence` among them, so no `?` as well)."""
    rule = verdict_of(entry).rule
    return ", ".join([SHORT[rule], *(m for m in marks(entry) if m != rule)])
