"""The config robust across routing distributions (`sweep --distribution all`).

After one campaign per distribution (each shape swept with group sizes drawn from `balanced`, `skewed`, ...),
each shape's winners are checked and timed side by side under every distribution (`tuner.crossover`), and the
table records, for the shape, the winner with the lowest worst-case slowdown against each distribution's
own winner (`profiles.intervals` describes the record). Lookup answers with it when a call asks for a
distribution the shape has no entry for.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable, Mapping
from typing import Any

from moe_tune.profiles.table import table_path, write_dir
from moe_tune.profiles import intervals as iv
from moe_tune.profiles.table import is_complete, table_entries, update_table

Timer = Callable[..., Any]  # tuner.crossover.time_side_by_side, or a stand-in in tests


def robust_record(op: str, backend: str, problem: Any, entries: Mapping[str, Mapping[str, Any]], *, seed: int,
                  timer: Timer) -> dict[str, Any] | None:
    """The robust record of one shape from its complete entries by distribution (`entries`, two or more):
    every distinct winner timed under every distribution; None when fewer than two distributions are tuned
    or no winner ran under every one of them."""
    if len(entries) < 2:
        return None
    configs: dict[str, dict[str, Any]] = {}
    winners: dict[str, str] = {}
    for distribution, entry in entries.items():
        ident = json.dumps(dict(entry["config"]), sort_keys=True)
        label = next((name for name, c in configs.items() if json.dumps(c, sort_keys=True) == ident), None)
        if label is None:
            label = f"winner of {distribution}"
            configs[label] = dict(entry["config"])
        winners[distribution] = label
    times: dict[str, dict[str, float]] = {}
    for distribution in entries:
        timed = timer(op, backend, problem, configs, distribution=distribution, seed=seed)
        times[distribution] = dict(timed.median_s)
    slowdowns: dict[str, dict[str, float]] = {}
    for label in configs:
        row = {}
        for distribution, measured in times.items():
            own = measured.get(winners[distribution])
            if own is None or label not in measured:  # it did not run there: it cannot be robust
                row = {}
                break
            row[distribution] = measured[label] / own
        if row:
            slowdowns[label] = row
    if not slowdowns:
        return None
    chosen = min(slowdowns, key=lambda label: (max(slowdowns[label].values()), label))
    distribution = next(d for d, label in winners.items() if label == chosen)
    entry = entries[distribution]
    return {"key": iv.robust_key(op, entry["fields"]), "op": op,
            "fields": {k: v for k, v in entry["fields"].items() if k != "distribution"},
            "config": configs[chosen], "distribution": distribution, "entry": entry["key"],
            "worst_slowdown": max(slowdowns[chosen].values()), "winners": winners, "configs": configs,
            "slowdowns": slowdowns, "times_s": times, "versions": dict(entry.get("versions") or {}),
            "tuned_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def measure_campaigns(campaigns: Mapping[str, Any], *, print_line: Callable[[str], None] = print,
                      timer: Timer | None = None) -> list[dict[str, Any]]:
    """The robust records of every shape the campaigns (`runner.Planned` by distribution) planned, written
    to the write table of each op. Only for whole plans run here (`request.Campaign.placed`)."""
    if timer is None:
        from moe_tune.tuner.crossover import time_side_by_side as timer
    first = next(iter(campaigns.values()))
    directory = write_dir(first.settings.profile_dir)
    written = []
    for sweep in first.planned:
        table = table_path(directory, first.device_kind, sweep.op)
        held = table_entries(table)
        entries = {}
        for distribution, campaign in campaigns.items():
            mine = next((s for s in campaign.planned if s.op == sweep.op and s.problem == sweep.problem), None)
            if mine is not None and is_complete(held.get(mine.key)):
                entries[distribution] = held[mine.key]
        record = robust_record(sweep.op, sweep.backend, sweep.problem, entries, seed=first.settings.seed,
                               timer=timer)
        if record is None:
            print_line(f"{sweep.label}: fewer than two distributions tuned and timed; no robust choice recorded")
            continue
        update_table(table, sweep.op, first.device_kind,
                     lambda t, r=record: t.setdefault(iv.ROBUST, {}).__setitem__(r["key"], r))
        print_line(f"{sweep.label}: robust: the {record['distribution']} winner, at worst "
                   f"{record['worst_slowdown']:.2f}x each distribution's winner")
        written.append(record)
    return written
