"""`moe-tune merge OUT IN...`: one table from the tables of several machines of the same device kind.

For each key, the candidates are OUT's entry (when OUT already exists it is an input, read under its lock, and
wins ties) and every input's, in the order given. The kept entry is, in order of preference:

1. one tuned with the newest kernel revision (`versions.backend_revision`; timings of different kernel code
   are not comparable, and the newer kernel is the one that will run),
2. one with a measured time (`timing.median_s`; an entry without one loses to any timed entry),
3. the smallest median; on a tie, the earlier candidate (OUT, then the inputs in order).

The kept entry records `provenance`: one record per candidate seen, in this and earlier merges (earlier
merges' records are carried over, duplicates dropped) -
`{"source": absolute input path, "hostname": the entry's, "median_s", "tuned_at", "backend_revision", "won"}`,
exactly one with `won: true`. Entries only OUT had are left untouched. Token-count intervals and robust
records (`intervals.py`) are merged by key, the most recently measured kept; then those that stand on an entry
whose kept config is not the one they recorded are dropped (a note names each).

OUT is rewritten atomically under the same file lock sweeps take, so a sweep writing OUT at the same time
loses nothing, and neither does the merge.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from moe_tune.core.errors import TableError, UsageError, path_error
from moe_tune.profiles.entry import Entry
from moe_tune.profiles.intervals import INTERVALS, ROBUST, drop_contradicted
from moe_tune.profiles.table import read_table, update_table
from moe_tune.profiles.entry import recorded_revision


@dataclasses.dataclass(frozen=True)
class MergeDecision:
    key: str
    status: str  # "added" (new in OUT) | "replaced" (an input's entry beat OUT's) | "kept" (OUT's entry won)
    winner: str  # source of the kept entry
    median_s: float | None
    candidates: int
    reason: str

    def __str__(self) -> str:
        return f"{self.status} {self.key}: {self.reason}"


@dataclasses.dataclass
class MergeReport:
    out: Path
    op: str
    device_kind: str
    inputs: list[Path]  # every table read, OUT first when it existed
    decisions: list[MergeDecision]  # one per key found in an input (keys only OUT had are not listed)
    notes: list[str]

    def count(self, status: str) -> int:
        return sum(d.status == status for d in self.decisions)

    def lines(self) -> list[str]:
        """A summary line, the notes, then one line per key more than one table had."""
        head = (f"{self.out}: {self.count('added')} added, {self.count('replaced')} replaced, "
                f"{self.count('kept')} kept, from {len(self.inputs)} table{'s' if len(self.inputs) != 1 else ''} "
                f"({self.op}, {self.device_kind})")
        return [head, *self.notes, *(f"  {d}" for d in self.decisions if d.candidates > 1)]


def _median(entry: Entry) -> float | None:
    return entry.median_s  # a positive number of seconds, or None (`Entry.median_s`)


_IDENT = ("source", "hostname", "median_s", "tuned_at")


def _ident(record: dict[str, Any]) -> tuple:
    return tuple(str(record.get(name)) for name in _IDENT)


def _own_record(entry: Entry, source: str) -> dict[str, Any]:
    """Where `entry` came from: its winning provenance record if an earlier merge kept it, else `source`."""
    for record in entry.provenance or []:
        if isinstance(record, dict) and record.get("won"):
            return {k: v for k, v in record.items() if k != "won"}
    return {"source": source, "hostname": entry.hostname, "median_s": _median(entry),
            "tuned_at": entry.tuned_at, "backend_revision": recorded_revision(entry)}


def _rank(entry: Entry, order: int) -> tuple:
    median = _median(entry)
    return (-recorded_revision(entry), median is None, median if median is not None else 0.0, order)


def _pick(key: str, candidates: list[tuple[str, Entry]]) -> tuple[Entry, int, str]:
    """(kept entry with provenance, index of the winning candidate, why it won)."""
    ranked = sorted(range(len(candidates)), key=lambda i: _rank(candidates[i][1], i))
    win = ranked[0]
    source, winner = candidates[win]
    records: dict[tuple, dict[str, Any]] = {}
    for src, entry in candidates:
        for record in entry.provenance or []:
            if isinstance(record, dict):
                records.setdefault(_ident(record), {k: v for k, v in record.items() if k != "won"})
        own = _own_record(entry, src)
        records.setdefault(_ident(own), own)
    won = _ident(_own_record(winner, source))
    provenance = [{**record, "won": ident == won} for ident, record in records.items()]
    kept = winner.replace(key=key, provenance=provenance)

    median = _median(winner)
    if len(candidates) == 1:
        why = "only candidate"
    else:
        revisions = {recorded_revision(e) for _, e in candidates}
        timed = [_median(e) for _, e in candidates if _median(e) is not None]
        if len(revisions) > 1:
            why = f"newest kernel revision ({recorded_revision(winner)}) of {len(candidates)} candidates"
        elif median is None:
            why = f"none of {len(candidates)} candidates was timed; kept the first"
        elif len(timed) == 1:
            why = f"the only timed of {len(candidates)} candidates"
        else:
            others = sorted(t for i, (_, e) in enumerate(candidates) if i != win and (t := _median(e)) is not None)
            why = f"fastest of {len(candidates)} ({median * 1e3:.4g} ms vs {others[0] * 1e3:.4g} ms)"
    return kept, win, f"{why}, from {source}"


def merge_tables(out_path: str | os.PathLike, in_paths: Iterable[str | os.PathLike]) -> MergeReport:
    """Merge the tables at `in_paths` into `out_path` (created if missing; when it exists, it is an input too).

    All tables must be for the same op and device kind; TableError names the first file that is not, or that
    cannot be read (nothing is written then). UsageError when no input is given.
    """
    out = Path(out_path)
    given = [Path(p) for p in in_paths]
    if not given:
        raise UsageError("merge needs at least one input table")
    out_real = os.path.realpath(out)
    inputs: list[tuple[Path, dict[str, Any]]] = []
    seen = {out_real}
    for path in given:
        real = os.path.realpath(path)
        if real in seen:  # OUT itself (read under the lock below) or a repeated input
            continue
        seen.add(real)
        inputs.append((path, read_table(path)))

    first = inputs[0] if inputs else (out, read_table(out))
    expected = {}
    for name in ("op", "device_kind"):
        if not isinstance(first[1].get(name), str):
            raise TableError(f"{first[0]}: no '{name}' at the top level; cannot tell what it may be merged with")
        expected[name] = first[1][name]
    for path, table in inputs:
        for name, value in expected.items():
            if table.get(name) != value:
                raise TableError(f"{path}: table is for {name} {table.get(name)!r}, but {first[0]} is for "
                                 f"{value!r}; merge only tables of one op and one device kind")

    out_existed: list[bool] = []
    dropped: list[str] = []

    def merge(table: dict[str, Any]) -> list[MergeDecision]:
        # `table` is OUT as it is now, under its lock (empty when OUT does not exist).
        out_existed.append(out.exists())
        by_key: dict[str, list[tuple[str, Entry]]] = {}
        for path, other in inputs:
            for key, entry in other["entries"].items():
                by_key.setdefault(key, []).append((os.path.abspath(path), Entry.from_json(entry, key)))
        decisions = []
        for key, candidates in by_key.items():
            current = table["entries"].get(key)
            if current is not None:
                candidates = [(os.path.abspath(out), Entry.from_json(current, key)), *candidates]
            kept, win, why = _pick(key, candidates)
            status = "added" if current is None else ("kept" if win == 0 else "replaced")
            table["entries"][key] = kept.to_json()
            decisions.append(MergeDecision(key, status, candidates[win][0], _median(kept), len(candidates), why))
        for _, other in inputs:  # intervals and robust records: per key, the most recently measured
            for section in (INTERVALS, ROBUST):
                held = table.setdefault(section, {})
                for key, record in (other.get(section) or {}).items():
                    mine = held.get(key)
                    if not isinstance(mine, dict) or str(record.get("tuned_at")) > str(mine.get("tuned_at")):
                        held[key] = record
        dropped[:] = drop_contradicted(table)
        return decisions

    try:
        decisions = update_table(out, expected["op"], expected["device_kind"], merge)
    except OSError as e:  # an unwritable dir or file, a parent that is a file: nothing was written
        raise path_error("cannot write the merged table", out, e, TableError) from None
    notes = [f"note: {line}" for line in dropped]
    if out.parent.name != expected["device_kind"] or out.name != f"{expected['op']}.json":
        notes.append(f"note: lookup reads <profile dir>/{expected['device_kind']}/{expected['op']}.json; "
                     f"{out} is not at such a path")
    read = ([out] if out_existed and out_existed[0] else []) + [p for p, _ in inputs]
    return MergeReport(out, expected["op"], expected["device_kind"], read, decisions, notes)
