"""What an entry's claim rests on: the marks a reader needs beside its verdict (`unverified`, a win on weak
evidence, a low budget), and the search budget it was tuned with, compared with the budget a campaign asks
for (`weaker_than`: an entry tuned with less is swept again).

A search's budget is read from the entry's `search` record (`tuner.request.SEARCH_FIELDS`: strategy, budget,
time_budget_s, max_candidates, space, full_space, samples, and why it stopped).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from moe_tune.profiles.entry import Entry
from moe_tune.profiles.verdict import SHORT, UNVERIFIED, verdict_of

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
