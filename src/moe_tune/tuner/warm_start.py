"""Warm start: a sweep of a new shape first measures the winners of the nearest shapes already tuned.

Neighbouring shapes (another token count, another hidden size, another direction of the same op, backend,
dtypes and quantization) are often won by the same or a nearby config. `find(plan)` reads the tables (every
profile dir, in lookup order, and the sweep's own), keeps the entries of the same op, backend and device kind
with the same dtypes and quantization (`same_numerics`: a bfloat16 winner says little about a float32 sweep,
whose tiles cost twice the bytes and whose dot runs another path) and the same key fields except sizes,
direction and distribution (and not this sweep's own key), ranks them by `distance`, and maps the winners of the nearest `limit` onto this sweep's space (`project`: the config of the
space nearest to each winner, so a seed is always a valid candidate here). The strategies measure those seeds
right after the default (`strategies.Strategy`'s `seeds`); `grid` and `coordinate` then run a warm local
search (the seeds, the configs between them, and a descent from the best; `WarmStart.local`) instead of
walking the whole space.

When every source kept its own default (its winner is its default: the heuristic held at each tuned
neighbour, `WarmStart.defaults_held`), their winners are evidence for the heuristic, not for those configs:
the seeds are cut to the nearest one (`find`), and with one seed the warm search stops after its first round
unless the seed beat the default there by the least gain a final round calls a win
(`strategies.CoordinateDescent`). On the strategies
ladder every neighbour kept its default and the two seeds (the neighbours' own defaults) never won (FINDINGS.md:
warm start).

The seeds depend on the tables when the sweep starts; a resumed sweep restores every candidate its log holds
whatever order they are proposed in. `--cold` (`SweepSettings.cold`) turns it off.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from moe_tune.core.errors import TableError
from moe_tune.kernels.base import KernelConfig
from moe_tune.profiles import read_table, search_dirs, table_path

LIMIT = 4  # winners of this many nearest entries are seeds
# What a difference of one non-size key field weighs, in units of |log(size ratio)| (a factor e in one size):
# a config tuned for the other direction of the same shape is a weaker guess than one tuned for 2x the tokens.
FIELD_WEIGHT = {"direction": 3.0, "distribution": 0.5}
OTHER_FIELD_WEIGHT = 1.0  # weighted, glu, ... (dtypes and quantization must match: `same_numerics`)


@dataclasses.dataclass(frozen=True)
class WarmStart:
    """The seeds (configs of the space, nearest source first, the default left out) and where they came from."""

    seeds: tuple[KernelConfig, ...] = ()
    # {"key", "distance", "config" (the winner), "seed" (its label), "kept_default" (its winner was its default)}
    sources: tuple[dict[str, Any], ...] = ()
    cold: bool = False  # turned off (`--cold`)
    local: bool = False  # the strategy searched only around the seeds (`strategies.Strategy.local`)

    @property
    def defaults_held(self) -> bool:
        """Whether every source kept its own default (the heuristic held at every tuned neighbour)."""
        return bool(self.sources) and all(s.get("kept_default") for s in self.sources)

    def describe(self) -> str:
        """One line for the sweep's output and log."""
        if self.cold:
            return "cold start (--cold)"
        if not self.sources:
            return "cold start (no tuned entry of this op and backend nearby)"
        said = (f"warm {'local search' if self.local else 'start'} from {len(self.sources)} tuned entr{'y' if len(self.sources) == 1 else 'ies'}: "
                + "; ".join(f"{s['key'].split('|', 1)[1]} -> {s['seed']}" for s in self.sources))
        if not self.seeds:
            return said + " (each the default here: no seed to add)"
        return said + (" (each kept its default: the nearest seed only)" if self.defaults_held else "")

    def to_json(self) -> dict[str, Any]:
        return {"cold": self.cold, "local": self.local, "seeds": [s.to_dict() for s in self.seeds], "sources": list(self.sources)}


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# Key fields of the numerics: the dtypes (`dtype`, `lhs_dtype`, `rhs_qdtype`, ...) and the quantization
# (`rhs_qblock`, `lhs_qdynamic`, ...). A seed comes only from an entry where all of them are the same.
_NUMERICS = re.compile(r"(^|_)(\w*dtype|q[a-z]+)$")


def same_numerics(fields: Mapping[str, Any], other: Mapping[str, Any]) -> bool:
    """Whether two entries' key fields have the same dtypes and quantization (a field only one has differs)."""
    return all(fields.get(name) == other.get(name) for name in dict.fromkeys([*fields, *other])
               if _NUMERICS.search(name))


def distance(fields: Mapping[str, Any], other: Mapping[str, Any]) -> float | None:
    """How far a tuned entry's key fields are from this sweep's: the sum of |log ratio| of the positive integer
    fields (sizes, token counts), and a weight per other field that differs (`FIELD_WEIGHT`); None when the
    backend, a dtype or the quantization differs (`same_numerics`: such configs are no guess here)."""
    if other.get("backend") != fields.get("backend") or not same_numerics(fields, other):
        return None
    total = 0.0
    for name in dict.fromkeys([*fields, *other]):
        mine, theirs = fields.get(name), other.get(name)
        if mine == theirs:
            continue
        if _is_size(mine) and _is_size(theirs):
            total += abs(math.log(mine / theirs))
        else:
            total += FIELD_WEIGHT.get(name, OTHER_FIELD_WEIGHT)
    return total


def _config_distance(a: Mapping[str, Any], b: Mapping[str, Any]) -> float:
    """How far config `b` is from `a`: |log2 ratio| per positive numeric tunable, 1 per other differing one."""
    total = 0.0
    for name in dict.fromkeys([*a, *b]):
        x, y = a.get(name), b.get(name)
        if x == y:
            continue
        both = all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in (x, y))
        total += abs(math.log2(x / y)) if both else 1.0
    return total


def project(winner: Mapping[str, Any], space: Sequence[KernelConfig]) -> KernelConfig:
    """The config of `space` nearest to `winner` (a config's fields, possibly of another shape's space): itself
    when it is in the space; ties go to the earlier config."""
    return min(space, key=lambda c: _config_distance(winner, c.to_dict()))


def _tables(directories: Sequence[Path], device_kind: str, op: str) -> list[dict[str, Any]]:
    found, seen = [], set()
    for directory in directories:
        path = table_path(directory, device_kind, op)
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        try:
            found.append(read_table(path))
        except TableError:  # a broken table is lookup's and validate's to report; it just seeds nothing
            continue
    return found


def find(op: str, device_kind: str, fields: Mapping[str, Any], key: str, space: Sequence[KernelConfig], *,
         own_dir: Path | None = None, limit: int = LIMIT) -> WarmStart:
    """The seeds for a sweep of `key` (its key `fields`) over `space` (default first): the winners of the
    `limit` nearest tuned entries of the same op, backend and device kind (any profile dir, and `own_dir`,
    where the sweep writes), mapped onto the space. The entry of `key` itself is not used."""
    directories = ([own_dir] if own_dir is not None else []) + [d for _, d in search_dirs()]
    ranked: list[tuple[float, str, dict[str, Any]]] = []
    for table in _tables(directories, device_kind, op):
        for other_key, entry in table["entries"].items():
            if other_key == key or entry.get("interrupted") or not isinstance(entry.get("config"), dict):
                continue
            d = distance(fields, entry["fields"])
            if d is not None:
                ranked.append((d, other_key, entry))
    ranked.sort(key=lambda item: (item[0], item[1]))
    seeds: list[KernelConfig] = []
    sources: list[dict[str, Any]] = []
    for d, other_key, entry in ranked:
        if len(sources) >= limit:
            break
        if any(s["key"] == other_key for s in sources):  # the same key in two profile dirs: the first wins
            continue
        seed = project(entry["config"], space)
        sources.append({"key": other_key, "distance": round(d, 3), "config": entry["config"], "seed": seed.label(),
                        "kept_default": kept_default(entry)})
        if seed != space[0] and seed not in seeds:
            seeds.append(seed)
    start = WarmStart(tuple(seeds), tuple(sources))
    # every neighbour kept its default: the evidence is for the heuristic; one seed checks it (module doc)
    return dataclasses.replace(start, seeds=start.seeds[:1]) if start.defaults_held else start


def kept_default(entry: Mapping[str, Any]) -> bool:
    """Whether a table entry's winner is its own default config (the default was fastest, or the best did
    not beat it past the noise); False when the entry does not say what its default was."""
    default = entry.get("default")
    return isinstance(default, dict) and default.get("config") == entry.get("config")
