"""How a sweep chose its winner: the verdict an entry records, and the noise rule it applies.

A sweep times every candidate once (its sweep round), then re-times the fastest few and the default side by
side with twice the samples (the final round, `tuner.finals`). The winner is

- `fastest`: the fastest finalist, which beat the default by more than the noise (or the default failed);
- `within_noise`: the default, kept because the fastest finalist beat it by no more than the noise: twice
  the larger relative median absolute deviation (MAD) of the two finalists' samples;
- `only_candidate`: the one correct candidate (no final round).

New entries record it as `verdict` = {rule, noise, finalists: [{config, is_default, median_s, spread, min_s,
max_s, samples, first_median_s, first_spread}]}: the final round's timings (and each finalist's sweep-round
median and spread).
Entries written before the verdict was recorded get one derived from what they hold (`derived`): the rule
from `within_noise_of_default`, the default and the candidate counts; the noise from the kept default's
re-timed samples alone (the only samples such an entry kept: a lower bound of the threshold the sweep used,
which also counted the fastest finalist's samples); their finalists are the winner and the default, the two
whose re-timed medians the entry holds.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from moe_tune.profiles.entry import Entry

FASTEST, WITHIN_NOISE, ONLY_CANDIDATE = "fastest", "within_noise", "only_candidate"
RULES = (FASTEST, WITHIN_NOISE, ONLY_CANDIDATE)
# A win must exceed this many times the larger relative MAD of the two timings compared.
NOISE_FACTOR = 2


def relative_mad(samples: Sequence[float]) -> float:
    """Median absolute deviation of `samples` (seconds) over their median: a spread that ignores outliers."""
    if not samples:
        return 0.0
    med = statistics.median(samples)
    return statistics.median(abs(x - med) for x in samples) / med if med > 0 else 0.0


def noise_threshold(*samples: Sequence[float]) -> float:
    """The smallest relative gain that counts as a win between timings with these samples."""
    return NOISE_FACTOR * max(relative_mad(s) for s in samples)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """rule: one of RULES; noise: the threshold the default was held to (a fraction: 0.1 is 10%), None when
    it was not compared; finalists: one record per finalist (see the module doc), winner first; derived:
    reconstructed from an entry that did not record its verdict."""

    rule: str
    noise: float | None = None
    finalists: tuple[Mapping[str, Any], ...] = ()
    derived: bool = False

    @property
    def text(self) -> str:
        """`fastest`, `kept default: within noise (+-12%)` or `only candidate`."""
        if self.rule == WITHIN_NOISE:
            return "kept default: within noise" + ("" if self.noise is None else f" (+-{self.noise:.0%})")
        return self.rule.replace("_", " ")

    @property
    def label(self) -> str:
        """`text`, marked `(derived)` for a verdict derived from an entry that did not record one."""
        return self.text + (" (derived)" if self.derived else "")

    def to_json(self) -> dict[str, Any]:
        return {"rule": self.rule, "noise": self.noise, "finalists": [dict(f) for f in self.finalists]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Verdict:
        return cls(data.get("rule", FASTEST), data.get("noise"), tuple(data.get("finalists") or ()))


def verdict_of(entry: Entry) -> Verdict:
    """The entry's recorded verdict, else one derived from what it holds (see the module doc)."""
    if isinstance(entry.verdict, Mapping):
        return Verdict.from_json(entry.verdict)
    default = entry.default if isinstance(entry.default, Mapping) else {}
    default_ok = default.get("status") == "ok" and default.get("median_s") is not None
    samples = list((entry.timing or {}).get("samples_s") or ())
    finalists = [_finalist(entry.config, entry.config == entry.default_config, entry.timing or {})]
    if default_ok and entry.config != entry.default_config:
        finalists.append({"config": dict(default.get("config") or {}), "is_default": True,
                          "median_s": default["median_s"]})
    if entry.within_noise_of_default:
        return Verdict(WITHIN_NOISE, noise_threshold(samples) if samples else None, tuple(finalists), True)
    if entry.count("ok") == 1:
        return Verdict(ONLY_CANDIDATE, None, tuple(finalists), True)
    return Verdict(FASTEST, None, tuple(finalists), True)


def _finalist(config: Mapping[str, Any], is_default: bool, timing: Mapping[str, Any]) -> dict[str, Any]:
    return {"config": dict(config), "is_default": is_default, **{name: timing.get(name) for name in (
        "median_s", "spread", "min_s", "max_s", "samples")}}
