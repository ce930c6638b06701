"""Token-count intervals and robust routing choices: the two records a table holds besides its entries.

An interval says: for every token count in `[lo, hi)` of `field` (ragged_dot's `m`, the gathers' `tokens`),
with every other key field equal to `fields`, use `config`. A ladder sweep (`campaign.ladder`) writes them:
each interval's config is the winner of one or more tuned counts (`entries`), and its ends are the
crossovers it measured by timing the neighbouring winners at counts in between (`evidence`). The gathers'
other size field (`rows`) moves with the token count: `scale` records it per token (`{"rows": 8}`), and an
interval only answers a problem with that ratio.

A robust record says, for one shape (every key field but the distribution): of the winners of the tuned
distributions, `config` (the winner of `distribution`, entry `entry`) has the lowest worst-case slowdown
against each distribution's winner, all of them timed under every distribution (`slowdowns`, `times_s`).
Lookup uses it when no entry has the distribution asked for (`sweep --distribution all` writes it).

Table JSON (schema 3, `table.py`): `"intervals": {KEY: INTERVAL}`, `"robust": {KEY: ROBUST}`, keyed by
`interval_key` / `robust_key`. Pure data: nothing here imports the kernels package.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from moe_tune.profiles.entry import key_from_fields

JSON = dict[str, Any]
INTERVALS = "intervals"
ROBUST = "robust"


def family_fields(fields: Mapping[str, Any], sizes: Sequence[str]) -> JSON:
    """The key fields that every count of a ladder shares: all but the token counts (`sizes`)."""
    return {name: value for name, value in fields.items() if name not in sizes}


def scale_of(fields: Mapping[str, Any], sizes: Sequence[str]) -> dict[str, float] | None:
    """The other size fields per unit of the first (`{"rows": 8}` for a gather with top_k 8); None when a
    size is not a positive integer."""
    values = [fields.get(name) for name in sizes]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        return None
    return {name: value / values[0] for name, value in zip(sizes[1:], values[1:])}


def interval_key(op: str, family: Mapping[str, Any], field: str, lo: int, hi: int) -> str:
    """`ragged_dot|direction=fwd|k=768|...|distribution=balanced|m=[64,181)`."""
    return f"{key_from_fields(op, dict(family))}|{field}=[{lo},{hi})"


def robust_key(op: str, fields: Mapping[str, Any]) -> str:
    """The key of a shape's robust record: its entry key without the distribution."""
    return key_from_fields(op, {k: v for k, v in fields.items() if k != "distribution"})


def make_interval(op: str, family: Mapping[str, Any], field: str, lo: int, hi: int, *, config: Mapping[str, Any],
                  scale: Mapping[str, float], entries: Sequence[str], evidence: Mapping[str, Any],
                  versions: Mapping[str, Any], tuned_at: str) -> JSON:
    """One interval's JSON: `config` for `field` in [lo, hi), won at `entries` (keys), with `evidence`."""
    return {"key": interval_key(op, family, field, lo, hi), "op": op, "fields": dict(family), "field": field,
            "lo": int(lo), "hi": int(hi), "scale": dict(scale), "config": dict(config), "entries": list(entries),
            "evidence": dict(evidence), "versions": dict(versions), "tuned_at": tuned_at}


def interval_problems(record: Any) -> list[str]:
    """What is wrong with an interval's JSON (what lookup relies on); empty when nothing."""
    if not isinstance(record, Mapping):
        return [f"is {type(record).__name__}, not an object"]
    found = []
    for name in ("fields", "config", "scale"):
        if not isinstance(record.get(name), Mapping):
            found.append(f"lacks a '{name}' object")
    if not isinstance(record.get("field"), str):
        found.append("lacks its 'field' (the token count it spans)")
    lo, hi = record.get("lo"), record.get("hi")
    if not (_count(lo) and _count(hi) and lo < hi):
        found.append(f"lo={lo!r}, hi={hi!r} is not an interval of positive integers with lo < hi")
    if record.get("versions") is not None and not isinstance(record["versions"], Mapping):
        found.append("'versions' is not an object")
    return found


def robust_problems(record: Any) -> list[str]:
    """What is wrong with a robust record's JSON; empty when nothing."""
    if not isinstance(record, Mapping):
        return [f"is {type(record).__name__}, not an object"]
    found = [f"lacks a '{name}' object" for name in ("fields", "config") if not isinstance(record.get(name), Mapping)]
    if not isinstance(record.get("distribution"), str):
        found.append("lacks the 'distribution' whose winner it chose")
    return found


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def matching_interval(table: Mapping[str, Any], fields: Mapping[str, Any], sizes: Sequence[str]) -> JSON | None:
    """The interval of `table` that holds the problem of `fields` (same family, same scale, its first size
    field in [lo, hi)); of several (overlapping ladders), the most recently tuned. None when none does."""
    family, field, scale = family_fields(fields, sizes), sizes[0], scale_of(fields, sizes)
    value = fields.get(field)
    if scale is None:
        return None
    found = [r for r in (table.get(INTERVALS) or {}).values()
             if not interval_problems(r) and r["field"] == field and r["lo"] <= value < r["hi"]
             and dict(r["fields"]) == family and _same_scale(r["scale"], scale)]
    return max(found, key=lambda r: str(r.get("tuned_at") or "")) if found else None


def _same_scale(recorded: Mapping[str, Any], scale: Mapping[str, float]) -> bool:
    return recorded.keys() == scale.keys() and all(
        isinstance(recorded[k], (int, float)) and math.isclose(recorded[k], scale[k]) for k in scale)


def interval_of_entry(table: Mapping[str, Any], key: str) -> JSON | None:
    """The interval whose config was won at the entry `key` (the report's `interval` column), or None."""
    found = [r for r in (table.get(INTERVALS) or {}).values()
             if isinstance(r, Mapping) and key in (r.get("entries") or [])]
    return max(found, key=lambda r: str(r.get("tuned_at") or "")) if found else None


def describe_interval(record: Mapping[str, Any]) -> str:
    """`m in [64, 181)`."""
    return f"{record['field']} in [{record['lo']}, {record['hi']})"


def replace_intervals(table: dict[str, Any], new: Sequence[JSON]) -> None:
    """Add `new` (one ladder's intervals, one family) to `table` in place, first removing the intervals of the
    same family and scale that overlap the span they cover: a newer ladder replaces what it re-measured."""
    if not new:
        return
    held = table.setdefault(INTERVALS, {})
    lo, hi = min(r["lo"] for r in new), max(r["hi"] for r in new)
    first = new[0]
    for key in [k for k, r in held.items()
                if isinstance(r, Mapping) and r.get("field") == first["field"] and r.get("fields") == first["fields"]
                and r.get("scale") == first["scale"] and _count(r.get("lo")) and _count(r.get("hi"))
                and r["lo"] < hi and lo < r["hi"]]:
        del held[key]
    for record in new:
        held[record["key"]] = record



def _boundary_claims(record: Mapping[str, Any]) -> list[tuple[Any, Any]]:
    """(entry key, config) of the two winners an interval's lower end was measured between."""
    below = (record.get("evidence") or {}).get("below")
    if not isinstance(below, Mapping):
        return []
    return [(side.get("entry"), side.get("config")) for side in (below.get("lower"), below.get("upper"))
            if isinstance(side, Mapping)]


def _claims(section: str, record: Mapping[str, Any], held: Mapping[str, Any]) -> list[tuple[Any, Any]]:
    """(entry key, the config the record says that entry won with) for every entry `record` stands on: an
    interval's `entries` and the winners each of its ends was measured between (its upper end is the lower
    end of the family's next interval); a robust record's `entry`."""
    if section == ROBUST:
        return [(record.get("entry"), record.get("config"))]
    claims = [(key, record.get("config")) for key in record.get("entries") or []] + _boundary_claims(record)
    for other in held.values():
        if isinstance(other, Mapping) and other.get("lo") == record.get("hi") and all(
                other.get(name) == record.get(name) for name in ("field", "fields", "scale")):
            claims += _boundary_claims(other)
    return claims


def drop_contradicted(table: dict[str, Any]) -> list[str]:
    """Remove from `table`, in place, the intervals and robust records that stand on an entry whose config is
    no longer the one they recorded (a merge kept another machine's faster entry for that key): their ends
    or choice were measured against a winner the table does not hold. One line per record removed."""
    dropped = []
    for section in (INTERVALS, ROBUST):
        held = table.get(section) or {}
        claims = {key: _claims(section, record, held) for key, record in held.items() if isinstance(record, Mapping)}
        for key, found in claims.items():
            for entry_key, config in found:
                entry = table["entries"].get(entry_key) if isinstance(entry_key, str) else None
                if isinstance(entry, Mapping) and isinstance(config, Mapping) and \
                        dict(entry.get("config") or {}) != dict(config):
                    del held[key]
                    kind = "interval" if section == INTERVALS else "robust record"
                    dropped.append(f"dropped {kind} {key}: it stands on {entry_key}, whose entry now has another "
                                   "config (re-run its ladder or `--distribution all` sweep to measure it again)")
                    break
    return dropped
